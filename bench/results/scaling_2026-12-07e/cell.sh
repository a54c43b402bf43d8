#!/bin/bash
# usage: cell.sh TREE NAME N K RATE SECONDS [extra]; one bench_scaling cell from TREE (async, 2 in flight, 4 MiB, k vars)
# SYNC=1: the sync cell's arguments instead (--mode sync --parts 8 --size-mib 8 --vars 32)
tree=$1; name=$2; n=$3; k=$4; rate=$5; secs=$6; shift 6
out=/tmp/i45e/runs; mkdir -p $out
cd $tree
if [ -n "$SYNC" ]; then args="--mode sync --parts 8 --size-mib 8 --vars 32"; else args="--inflight 2 --size-mib 4 --vars $k"; fi
echo "$(date -u +%T) $name tree=$tree load: $(cat /proc/loadavg)" >> $out/log.txt
PYTHONPATH=$tree timeout 280 /work/main/.venv/bin/python bench/bench_scaling.py --ring '' --systems ps --workers $n --shards $k $args --rate-mbit $rate --seconds $secs --out $out/$name "$@" > $out/$name.log 2>&1
rc=$?
echo "$(date -u +%T) $name rc=$rc load after: $(cat /proc/loadavg)" >> $out/log.txt
echo "$name: $(grep -h "n=$n k=$k" $out/$name.log | tail -1 | cut -c1-330)"
