#!/bin/bash
cd /tmp/i45e
T=/tmp/wt_i45e_main
while kill -0 $(cat settle2.pid) 2>/dev/null; do sleep 5; done
flock /tmp/bench.lock ./cell.sh $T n16k16_trace1 16 16 30 24 --trace /tmp/i45e/runs/n16k16_trace1.trace
flock /tmp/bench.lock ./cell.sh $T n16k16_trace2 16 16 30 24 --trace /tmp/i45e/runs/n16k16_trace2.trace
echo ALLDONE
