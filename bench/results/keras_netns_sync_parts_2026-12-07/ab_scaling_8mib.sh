#!/bin/bash
# A/B the sync cell: n=8 k=4, 8 MiB in 32 variables, 8 parts, 50 Mbit/s, 24 s
. /work/main/.venv/bin/activate
for rep in 1 2; do
for side in base new; do
  if [ $side = base ]; then cd /tmp/wt_base; export PYTHONPATH=/tmp/wt_base; else cd /work/main; unset PYTHONPATH; fi
  echo "== $side rep=$rep $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  flock /tmp/bench.lock python bench/bench_scaling.py --ring '' --systems ps --workers 8 --shards 4 --mode sync --parts 8 --rate-mbit 50 --size-mib 8 --vars 32 --seconds 24 2>&1 | grep "^ps "
done; done
