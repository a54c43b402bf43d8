#!/bin/bash
# After the A/B: the new tree (create_many by the batch's plan) on the other cells (as time allows).
cd /tmp/i45e
N=/tmp/wt_i45e_new
while kill -0 $(cat ab.pid) 2>/dev/null; do sleep 5; done
SYNC=1 flock /tmp/bench.lock ./cell.sh $N new_sync_n8k4_1 8 4 50 24
flock /tmp/bench.lock ./cell.sh $N new_n16k8_1 16 8 30 24
flock /tmp/bench.lock ./cell.sh $N new_n32k32_1 32 32 8 48
SYNC=1 flock /tmp/bench.lock ./cell.sh $N new_sync_n8k4_2 8 4 50 24
flock /tmp/bench.lock ./cell.sh $N new_n16k8_2 16 8 30 24
echo ALLDONE
