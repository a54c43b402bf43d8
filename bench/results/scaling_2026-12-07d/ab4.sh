#!/bin/bash
# the final tree (main 5e1b155) against base (66fb1ae), alternated
cd /tmp/i45
for i in 1 2; do
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_final final_n32k32_$i 32 32 8 48
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_base ab_n32k32_base_$((5+i)) 32 32 8 48
done
flock /tmp/bench.lock ./cell.sh /tmp/wt_i45_final final_n32k16_1 32 16 25 24
echo ALLDONE4
