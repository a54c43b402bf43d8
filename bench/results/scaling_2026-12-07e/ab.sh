#!/bin/bash
# A/B alternated, each run under the bench lock on its own: main = /tmp/wt_i45e_main (b7d5578),
# new = /tmp/wt_i45e_new (b7d5578 + create_many placing the new variables by the whole batch's plan).
cd /tmp/i45e
for i in 1 2 3; do
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45e_new ab_n32k16_new_$i 32 16 25 24
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45e_main ab_n32k16_main_$i 32 16 25 24
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45e_main ab_n16k16_main_$i 16 16 30 24
  flock /tmp/bench.lock ./cell.sh /tmp/wt_i45e_new ab_n16k16_new_$i 16 16 30 24
done
echo ALLDONE
