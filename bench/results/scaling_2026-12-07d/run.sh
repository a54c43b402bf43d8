#!/bin/bash
# usage: run.sh TREE NAME [extra args]; runs the n=k=32 8 Mbit/s cell from TREE with probe
tree=$1; name=$2; shift 2
out=/tmp/i45/runs; mkdir -p $out
cd $tree
echo "$(date -u +%T) $name tree=$tree load: $(cat /proc/loadavg)" | tee -a $out/log.txt
python /tmp/i45/probe.py $out/$name.probe.json > $out/$name.probe.log 2>&1 &
ppid=$!
PYTHONPATH=$tree timeout 400 /work/main/.venv/bin/python bench/bench_scaling.py --ring '' --systems ps --workers 32 --shards 32 --vars 32 --inflight 2 --rate-mbit 8 --size-mib 4 --seconds 48 --out $out/$name "$@" > $out/$name.log 2>&1
rc=$?
for i in $(seq 30); do kill -0 $ppid 2>/dev/null || break; sleep 1; done; kill $ppid 2>/dev/null; wait $ppid
echo "$(date -u +%T) $name rc=$rc load after: $(cat /proc/loadavg)" | tee -a $out/log.txt
grep -h "n=32" $out/$name.log | tail -2
