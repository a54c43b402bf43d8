#!/bin/bash
# Settle the cells with main's tree (b7d5578 = 5e1b155's client): the four cells interleaved, each run under the bench lock on its own.
# n = k = 16 and n = 16, k = 8 at 30 Mbit/s, 24 s; n = 32, k = 16 at 25 Mbit/s, 24 s; sync n = 8, k = 4, 8 parts, 50 Mbit/s, 24 s
cd /tmp/i45e
T=/tmp/wt_i45e_main
for i in $(seq ${FIRST:-1} ${LAST:-3}); do
  flock /tmp/bench.lock ./cell.sh $T n16k16_$i 16 16 30 24
  flock /tmp/bench.lock ./cell.sh $T n32k16_$i 32 16 25 24
  flock /tmp/bench.lock ./cell.sh $T n16k8_$i 16 8 30 24
  SYNC=1 flock /tmp/bench.lock ./cell.sh $T sync_n8k4_$i 8 4 50 24
done
echo ALLDONE
