#!/bin/bash
# Issue 45: the slow worker of n = 16, k = 8 (async, two rounds in flight) and the hosts' queue.
# Every run under flock /tmp/bench.lock; log.txt: each run's time, load before/after and its line.
# usage: bench/results/scaling_2026-12-07_host_qdisc/run.sh PART
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
D=bench/results/scaling_2026-12-07_host_qdisc
cell() {  # NAME ARGS...
  name=$1; shift
  echo "== $name $(date -u +%T) before: $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
  flock /tmp/bench.lock python bench/bench_scaling.py --ring '' --systems ps "$@" --out $D/$name 2>&1 \
    | grep -E '^ps |FAILED' >> $D/log.txt
  echo "   after: $(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
}
n16k8() { cell "$@" --workers 16 --shards 8 --inflight 2 --rate-mbit 30 --size-mib 4 --seconds 24; }
case "$1" in
  ab)  # 32 queues by peer on the hosts' side against one FIFO, alternated
    for i in 1 2; do
      n16k8 n16k8_peerq32_$i --peer-queues 32
      n16k8 n16k8_fifo_$i --peer-queues 0
    done ;;
  n16k8)  # the cell three more times with bench_scaling's defaults (ACKs first, 32 queues by peer)
    for i in 1 2 3; do n16k8 n16k8_default_$i; done ;;
  others)  # the cells that met their goals before, with the queues by peer
    cell n16k16_default_1 --workers 16 --shards 16 --inflight 2 --rate-mbit 30 --size-mib 4 --seconds 12
    cell sync_n8k4_p8_default_1 --workers 8 --shards 4 --mode sync --parts 8 --rate-mbit 50 --size-mib 8 \
      --vars 32 --seconds 24 ;;
  many)  # 64 simulated workers on 4 and 8 shards, 60 s, rate auto (the CPU rule), ACKs first, queues by peer
    for k in 4 8; do
      echo "== many_workers_k$k $(date -u +%T) before: $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
      flock /tmp/bench.lock python bench/bench_many_workers.py --cases async --shards $k --rate-mbit auto \
        --seconds 60 --out $D/many_workers_k$k 2>&1 | tail -3 >> $D/log.txt
      echo "   after: $(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
    done ;;
  keras)  # Keras n = 8 on 4 shards, async and sync, against the ring, 50 Mbit/s
    echo "== keras_n8 $(date -u +%T) before: $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
    flock /tmp/bench.lock python bench/bench_keras_netns.py --workers 8 --shards 4 --modes async,sync --ring 8 \
      --rate-mbit 50 --epochs 6 --no-local --out $D/keras_n8 2>&1 | tail -3 >> $D/log.txt
    echo "   after: $(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt ;;
  n32)  # n = 32 with the queues by peer, as the cells before (15 Mbit/s, 24 s)
    cell n32k16_default_1 --workers 32 --shards 16 --inflight 2 --rate-mbit 15 --size-mib 4 --seconds 24
    cell n32k32_v32_default_1 --workers 32 --shards 32 --inflight 2 --rate-mbit 15 --size-mib 4 --vars 32 \
      --seconds 24 ;;
  ab16)  # n = k = 16 (30 Mbit/s, 12 s): one FIFO against 32 queues by peer, alternated
    for i in 1 2; do
      cell n16k16_fifo_$i --workers 16 --shards 16 --inflight 2 --rate-mbit 30 --size-mib 4 --seconds 12 \
        --peer-queues 0
      cell n16k16_peerq32_$i --workers 16 --shards 16 --inflight 2 --rate-mbit 30 --size-mib 4 --seconds 12
    done ;;
  if3)  # n = k = 16 with three rounds in flight: does a third round hide the later answers? (one each)
    cell n16k16_if3_peerq32 --workers 16 --shards 16 --inflight 3 --rate-mbit 30 --size-mib 4 --seconds 12
    cell n16k16_if3_fifo --workers 16 --shards 16 --inflight 3 --rate-mbit 30 --size-mib 4 --seconds 12 \
      --peer-queues 0 ;;
esac
