#!/bin/bash
# usage: cell.sh TREE NAME N K RATE SECONDS [extra]; one bench_scaling cell from TREE (no probe)
tree=$1; name=$2; n=$3; k=$4; rate=$5; secs=$6; shift 6
out=/tmp/i45/runs; mkdir -p $out
cd $tree
echo "$(date -u +%T) $name tree=$tree U=${PS_SCRATCH_U:-} load: $(cat /proc/loadavg)" >> $out/log.txt
PYTHONPATH=$tree timeout 500 /work/main/.venv/bin/python bench/bench_scaling.py --ring '' --systems ps --workers $n --shards $k --vars $k --inflight 2 --rate-mbit $rate --size-mib 4 --seconds $secs --out $out/$name "$@" > $out/$name.log 2>&1
rc=$?
echo "$(date -u +%T) $name rc=$rc load after: $(cat /proc/loadavg)" >> $out/log.txt
echo "$name: $(grep -h "n=$n k=$k" $out/$name.log | tail -1 | cut -c1-330)"
