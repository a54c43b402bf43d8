#!/bin/bash
# usage: cell.sh NAME ARGS... : one n=k=16 cell under the bench lock with the backlog sampler beside
cd "$(dirname "$0")/../../.."; . .venv/bin/activate
name=$1; shift
D=${OUT:-bench/results/scaling_2026-12-07b_nk16}; mkdir -p $D
echo "== $name $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
flock /tmp/bench.lock bash -c "python $D/sample_backlog.py 75 $D/$name.backlog & python bench/bench_scaling.py --ring '' --systems ps --workers 16 --shards 16 --inflight 2 --rate-mbit 30 --size-mib 4 --seconds 12 $* --out $D/$name 2>&1 | grep -E '^ps |FAILED|Error' ; wait" >> $D/log.txt 2>&1
echo "   after $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
