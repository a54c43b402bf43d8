#!/bin/bash
# usage: ab.sh NAME RUNS -- bench_scaling args ; alternates /tmp/wt_base and /tmp/wt_new
name=$1; runs=$2; shift 3
. /work/main/.venv/bin/activate
for i in $(seq 1 $runs); do
  for tree in base new; do
    cd /tmp/wt_$tree
    l=$(cut -d' ' -f1 /proc/loadavg)
    PYTHONPATH=/tmp/wt_$tree flock /tmp/bench.lock python bench/bench_scaling.py "$@" --out /tmp/w45/ab/${name}_${tree}_$i >/dev/null 2>&1
    echo "$name run $i $tree load $l: $(tail -n 1 /tmp/w45/ab/${name}_${tree}_$i.md | cut -c1-110)"
  done
done
