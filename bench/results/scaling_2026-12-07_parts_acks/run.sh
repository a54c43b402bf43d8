#!/bin/bash
# issue 45, 2026-12-07: sync in parts and ACKs first, alternated; every run under the bench lock.
# Run from the repository root: bash bench/results/scaling_2026-12-07_parts_acks/run.sh
set -u
D=bench/results/scaling_2026-12-07_parts_acks
B=".venv/bin/python bench/bench_scaling.py"
run() {  # name, args...
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
  flock /tmp/bench.lock timeout 580 $B "$@" --out $D/$name 2>&1 | grep -E "^(ps|ring) " | cut -c1-400 | tee -a $D/log.txt
}
# The order the runs took (the machine's lock was shared with others' benchmarks; the list was cut to fit):
# rep 1: sync p1 queued, p8 queued, p1 first (run above), then:
run sync_n8k4_p8_first_1 --workers 8 --shards 4 --ring '' --systems ps --mode sync --parts 8 \
  --rate-mbit 50 --size-mib 8 --vars 32 --seconds 24 --acks first
for a in queued first; do
  run ps_ring_n8_${a}_1 --workers 8 --shards 8 --ring 8 --systems ps --inflight 2 --rate-mbit 50 \
    --size-mib 4 --seconds 12 --acks $a
done
for a in first queued; do
  for p in 8 1; do
    run sync_n8k4_p${p}_${a}_2 --workers 8 --shards 4 --ring '' --systems ps --mode sync --parts $p \
      --rate-mbit 50 --size-mib 8 --vars 32 --seconds 24 --acks $a
  done
done
for a in first queued; do
  run ps_ring_n8_${a}_2 --workers 8 --shards 8 --ring 8 --systems ps --inflight 2 --rate-mbit 50 \
    --size-mib 4 --seconds 12 --acks $a
done
for a in first queued; do
  run ps_ring_n16_${a} --workers 16 --shards 16 --ring 16 --systems ps --inflight 2 --rate-mbit 30 \
    --size-mib 4 --seconds 12 --acks $a
done
echo "== done $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
# afterwards: one more n = 16 pair, and a sync step of 64 variables in 16 parts
for a in first queued; do
  run ps_ring_n16_${a}_2 --workers 16 --shards 16 --ring 16 --systems ps --inflight 2 --rate-mbit 30 \
    --size-mib 4 --seconds 12 --acks $a
done
run sync_n8k4_v64_p16_first --workers 8 --shards 4 --ring '' --systems ps --mode sync --parts 16 \
  --rate-mbit 50 --size-mib 8 --vars 64 --seconds 24 --acks first
echo "== done $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
