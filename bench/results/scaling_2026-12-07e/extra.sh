#!/bin/bash
# The fixed tree (main 18bffc3) on the cells not rerun: n, k in 2, 4, 8 at 50 Mbit/s with the ring at 8 (the third
# session's small/ command), and n = k = 32 at 15 Mbit/s, 24 s. Each run under the bench lock on its own.
cd /tmp/wt_i45e_fix
out=/tmp/i45e/runs
run() { name=$1; shift
  echo "$(date -u +%T) $name tree=/tmp/wt_i45e_fix load: $(cat /proc/loadavg)" >> $out/log.txt
  PYTHONPATH=/tmp/wt_i45e_fix timeout 280 /work/main/.venv/bin/python bench/bench_scaling.py "$@" --out $out/$name > $out/$name.log 2>&1
  echo "$(date -u +%T) $name rc=$? load after: $(cat /proc/loadavg)" >> $out/log.txt; }
flock /tmp/bench.lock bash -c "$(declare -f run); out=$out; run fix_small --systems ps --workers 2,4,8 --shards 2,4,8 --ring 8 --inflight 2 --rate-mbit 50 --size-mib 4 --seconds 8"
flock /tmp/bench.lock bash -c "$(declare -f run); out=$out; run fix_n32k32_15mbit --ring '' --systems ps --workers 32 --shards 32 --vars 32 --inflight 2 --rate-mbit 15 --size-mib 4 --seconds 24"
echo ALLDONE
