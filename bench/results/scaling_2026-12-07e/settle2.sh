#!/bin/bash
# Runs 4 and 5 of the two cells not settled before (n = k = 16, n = 32 k = 16), then one traced n = 32, k = 16 run; main's tree.
cd /tmp/i45e
T=/tmp/wt_i45e_main
while kill -0 $(cat settle.pid) 2>/dev/null; do sleep 5; done
for i in 4 5; do
  flock /tmp/bench.lock ./cell.sh $T n32k16_$i 32 16 25 24
  flock /tmp/bench.lock ./cell.sh $T n16k16_$i 16 16 30 24
done
flock /tmp/bench.lock ./cell.sh $T n32k16_trace1 32 16 25 24 --trace /tmp/i45e/runs/n32k16_trace1.trace
echo ALLDONE
