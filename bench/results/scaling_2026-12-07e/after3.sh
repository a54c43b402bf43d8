#!/bin/bash
# A third n = k = 32 run of the new tree.
cd /tmp/i45e
flock /tmp/bench.lock ./cell.sh /tmp/wt_i45e_new new_n32k32_3 32 32 8 48
echo ALLDONE
