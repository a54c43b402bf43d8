#!/bin/bash
# issue 45, 2026-12-07: the async cells k >= n/2 with ACKs first (the default), 2 rounds in flight, and one
# more sync n = 8, k = 4 in 8 parts; the same commands and rates as ../run.sh (50 Mbit/s, 30 at n = 16).
# Every run under the bench lock. Run from the repository root: bash bench/results/scaling_2026-12-07_parts_acks/cells/run.sh [part]
set -u
D=bench/results/scaling_2026-12-07_parts_acks/cells
B=".venv/bin/python bench/bench_scaling.py"
run() {  # name, args...
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S) before: $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
  flock /tmp/bench.lock timeout 580 $B "$@" --out $D/$name 2>&1 | grep -E "^(ps|ring) " | cut -c1-400 | tee -a $D/log.txt
  echo "   after: $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
}
async() {  # name, n, k, rate
  run $1 --workers $2 --shards $3 --ring '' --systems ps --inflight 2 --rate-mbit $4 --size-mib 4 \
    --seconds 12 --acks first
}
part=${1:-main}
if [ "$part" = main ]; then
  # (1) n = k = 4 and n = 8, k = 4, two runs each, alternated
  for r in 1 2; do
    async async_n4k4_$r 4 4 50
    async async_n8k4_$r 8 4 50
  done
  # (2) n = k = 16 and n = 16, k = 8 at 30 Mbit/s, one run each
  async async_n16k16_1 16 16 30
  async async_n16k8_1 16 8 30
  # (3) one more sync n = 8, k = 4 in 8 parts
  run sync_n8k4_p8_first_3 --workers 8 --shards 4 --ring '' --systems ps --mode sync --parts 8 \
    --rate-mbit 50 --size-mib 8 --vars 32 --seconds 24 --acks first
fi
if [ "$part" = n32 ]; then
  # (4) n = 32 at 15 Mbit/s (the cell's bytes a second of n = 16 at 30). As run first; but 16 variables
  # leave 16 of 32 shards empty (async_n32k32_1: 0.44, half the shards' links idle) and 12 s gave only the
  # minimum 3 rounds a worker: see part n32v32
  async async_n32k32_1 32 32 15
  async async_n32k16_1 32 16 15
fi
if [ "$part" = more ]; then
  # time was left: one more run of each cell of (1) and (2)
  async async_n16k8_2 16 8 30
  async async_n16k16_2 16 16 30
  async async_n4k4_3 4 4 50
  async async_n8k4_3 8 4 50
fi
if [ "$part" = n32v32 ]; then
  # n = 32 with 32 variables (one a shard at k = 32, as the 2026-12-06 n = 32 runs) and 24 s
  for k in 32 16; do
    run async_n32k${k}_v32_1 --workers 32 --shards $k --ring '' --systems ps --inflight 2 --rate-mbit 15 \
      --size-mib 4 --vars 32 --seconds 24 --acks first
  done
fi
if [ "$part" = last ]; then
  # n = 16, k = 8 came out low and uneven (3-7 rounds a worker): two more at 24 s; n = 32 once more; and
  # n = 32, k = 16 with 16 variables at 24 s (its 12 s run had only the minimum 3 rounds a worker)
  for r in 1 2; do
    run async_n16k8_s24_$r --workers 16 --shards 8 --ring '' --systems ps --inflight 2 --rate-mbit 30 \
      --size-mib 4 --seconds 24 --acks first
  done
  for k in 32 16; do
    run async_n32k${k}_v32_2 --workers 32 --shards $k --ring '' --systems ps --inflight 2 --rate-mbit 15 \
      --size-mib 4 --vars 32 --seconds 24 --acks first
  done
  run async_n32k16_s24_1 --workers 32 --shards 16 --ring '' --systems ps --inflight 2 --rate-mbit 15 \
    --size-mib 4 --seconds 24 --acks first
fi
if [ "$part" = rate ]; then
  # a check off the rate rule: is n = 16, k = 8 low for its n or for its 30 Mbit/s? (its cell used 0.10-0.15
  # of the cores at 30)
  async async_n16k8_r50 16 8 50
  async async_n8k4_r30 8 4 30
fi
if [ "$part" = rate2 ]; then
  # n = 16, k = 8 at 50 once more (0.30 of the cores at 50: within the rule); n = 32, k = 16 at 25
  async async_n16k8_r50_2 16 8 50
  run async_n32k16_r25_s24 --workers 32 --shards 16 --ring '' --systems ps --inflight 2 --rate-mbit 25 \
    --size-mib 4 --seconds 24 --acks first
fi
if [ "$part" = third ]; then
  # time was left: a third n = k = 16 (0.89, 0.84) and a third n = 16, k = 8 at 50
  async async_n16k16_3 16 16 30
  async async_n16k8_r50_3 16 8 50
fi
if [ "$part" = r50s24 ]; then
  # n = 16, k = 8 at 50 came out 0.85, 0.83, 0.73: two at 24 s
  for r in 1 2; do
    run async_n16k8_r50_s24_$r --workers 16 --shards 8 --ring '' --systems ps --inflight 2 --rate-mbit 50 \
      --size-mib 4 --seconds 24 --acks first
  done
fi
if [ "$part" = rate3 ]; then
  run async_n32k16_r25_s24_2 --workers 32 --shards 16 --ring '' --systems ps --inflight 2 --rate-mbit 25 \
    --size-mib 4 --seconds 24 --acks first
fi
echo "== done $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
