#!/bin/bash
cd /tmp/i45
while kill -0 $(cat /tmp/i45/ab.pid) 2>/dev/null; do sleep 5; done
for i in 4 5; do
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_new ab_n32k32_new_$i 32 32 8 48
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_base ab_n32k32_base_$i 32 32 8 48
done
echo ALLDONE3
