#!/bin/bash
# usage: ab.sh TAG PAIRS NEWTREE [ROWS MEM STEPS] -> alternates base (/tmp/wt_h44base, b23ed7f) and new
tag=$1; pairs=$2; newtree=$3; rows=${4:-1000000}; mem=${5:-40MiB}; steps=${6:-800}
. /work/main/.venv/bin/activate
mkdir -p /tmp/h44e/ab
for i in $(seq 1 $pairs); do
  for tree in base new; do
    root=$newtree; [ $tree = base ] && root=/tmp/wt_h44base
    load=$(cut -d' ' -f1 /proc/loadavg)
    (cd $root && flock /tmp/bench.lock env PYTHONPATH=$root python $root/bench/bench_tier_push.py --rows $rows --table-memory $mem --steps $steps --variants memory,tiered-log --out /tmp/h44e/ab/${tag}_${tree}_$i > /dev/null 2>&1)
    echo "$tag $tree $i load=$load $(python -c "import json;d=json.load(open('/tmp/h44e/ab/${tag}_${tree}_$i.json'));c=d['cells'];print(' '.join(f\"{x['variant']}={x['cpu_ms_per_step']}\" for x in c), 'ratio', round(c[1]['cpu_ms_per_step']/c[0]['cpu_ms_per_step'],2), 'filled', c[1]['filled'], 'spilled', c[1]['spilled'])")"
  done
done
