#!/bin/bash
# One more n = k = 32 run of the new tree, after after.sh.
cd /tmp/i45e
while kill -0 $(cat after.pid) 2>/dev/null; do sleep 5; done
flock /tmp/bench.lock ./cell.sh /tmp/wt_i45e_new new_n32k32_2 32 32 8 48
echo ALLDONE
