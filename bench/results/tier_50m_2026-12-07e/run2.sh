#!/bin/bash
cd /work/main; . .venv/bin/activate
flock /tmp/bench.lock bash -c '
  /tmp/t50/sample.sh > /tmp/t50/vm2.log & S=$!
  python /tmp/t50/dstate.py /tmp/t50/dstate.log 600 & D=$!
  date +%s > /tmp/t50/start2
  python bench/bench_embedding.py --rows 50000000 --dim 32 --table-memory 1GiB --prefill --steps 3000 --variants psk-tiered --table-tier-store log --out /tmp/t50/r2_50m > /tmp/t50/log2.txt 2>&1
  kill $S $D'
