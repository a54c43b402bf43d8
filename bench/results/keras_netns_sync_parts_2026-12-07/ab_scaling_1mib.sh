#!/bin/bash
# A/B: parts' turn until on the wire (base, /tmp/wt_base) against until delivered (/work/main), bench_scaling sync n=8 k=4 1 MiB
. /work/main/.venv/bin/activate
for rep in 1 2; do
for p in 8 4; do
for side in base new; do
  if [ $side = base ]; then cd /tmp/wt_base; export PYTHONPATH=/tmp/wt_base; else cd /work/main; unset PYTHONPATH; fi
  echo "== $side parts=$p rep=$rep $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  flock /tmp/bench.lock python bench/bench_scaling.py --workers 8 --shards 4 --ring '' --systems ps --size-mib 1 --vars 16 --rate-mbit 50 --seconds 12 --mode sync --parts $p 2>&1 | grep "^ps "
done; done; done
