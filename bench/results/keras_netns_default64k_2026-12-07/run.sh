#!/usr/bin/env bash
# Keras MLP at n = 8 on 50 Mbit/s links with the client's new default partition_bytes (64 KiB):
# PS async and sync (k = 4) against the ring, as docs/benchmarks/scaling.md's "Keras at n = 8" row
# (0.98 / 0.39 / 2.07 steps/s a worker with the 8 MiB default). Run from the repository root.
set -euo pipefail
out=bench/results/keras_netns_default64k_2026-12-07
. .venv/bin/activate
for i in 1 2; do
  uptime
  flock /tmp/bench.lock python bench/bench_keras_netns.py --workers 8 --shards 4 --modes async,sync --ring 8 \
    --rate-mbit 50 --epochs 6 --no-local --out "$out/run$i" 2>&1 | tail -15
done
