#!/bin/bash
# A/B alternated, each run under the bench lock on its own. base = /tmp/wt_i45_base (main 66fb1ae), new = /tmp/wt_i45_new (+ change)
cd /tmp/i45
for i in 1 2 3; do
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_base ab_n32k32_base_$i 32 32 8 48
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_new ab_n32k32_new_$i 32 32 8 48
done
for i in 1 2 3; do
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_new ab_n32k16_new_$i 32 16 25 24
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_base ab_n32k16_base_$i 32 16 25 24
done
for i in 1 2; do
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_base ab_n16k16_base_$i 16 16 30 12
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_new ab_n16k16_new_$i 16 16 30 12
done
echo ALLDONE
