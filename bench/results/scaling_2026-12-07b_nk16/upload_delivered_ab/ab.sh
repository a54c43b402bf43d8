#!/bin/bash
# usage: ab.sh NAME TREE ARGS...  (TREE: new | base)
name=$1; tree=$2; shift 2
D=/tmp/w45/ab; mkdir -p $D
if [ $tree = base ]; then R=/tmp/wt45_base; else R=/work/main; fi
cd $R; . /work/main/.venv/bin/activate
echo "== $name $tree $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $D/log.txt
PYTHONPATH=$R flock /tmp/bench.lock python bench/bench_scaling.py --ring '' --systems ps "$@" --out $D/${name}_$tree 2>&1 | grep -E '^ps |FAILED|Error' >> $D/log.txt
