#!/usr/bin/env bash
# Keras sync at n = 8, k = 4 on 50 Mbit/s links: whole steps against steps in parts (PSWorker(sync_parts=N)).
# Each run under the bench lock; alternated. Run from the repository root.
set -euo pipefail
out=bench/results/keras_netns_sync_parts_2026-12-07
run() {  # name, extra flags
  local name=$1; shift
  flock /tmp/bench.lock python bench/bench_keras_netns.py --workers 8 --shards 4 --modes sync --ring '' \
    --rate-mbit 50 --epochs 6 --no-local "$@" --out "$out/$name" 2>&1 | tail -3
}
run p1_256k --partition-bytes 262144
run p4_64k --partition-bytes 65536 --sync-parts 4
run p1_64k --partition-bytes 65536
run p8_64k --partition-bytes 65536 --sync-parts 8
run p4_64k_2 --partition-bytes 65536 --sync-parts 4
run p1_256k_2 --partition-bytes 262144
