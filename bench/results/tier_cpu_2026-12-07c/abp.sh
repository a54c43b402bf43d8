#!/bin/bash
# usage: abp.sh TAG PAIRS NEWTREE [K] -> alternates base (/tmp/wt_h44base: b23ed7f + this bench) and NEWTREE, each run --paired K
tag=$1; pairs=$2; newtree=$3; k=${4:-50}
. /work/main/.venv/bin/activate
mkdir -p /tmp/h44e/abp
for i in $(seq 1 $pairs); do
  for tree in base new; do
    root=$newtree; [ $tree = base ] && root=/tmp/wt_h44base
    load=$(cut -d' ' -f1 /proc/loadavg)
    (cd $root && flock /tmp/bench.lock env PYTHONPATH=$root python $root/bench/bench_tier_push.py --variants memory,tiered-log --paired $k --out /tmp/h44e/abp/${tag}_${tree}_$i > /dev/null 2>&1)
    echo "$tag $tree $i load=$load $(python -c "import json;d=json.load(open('/tmp/h44e/abp/${tag}_${tree}_$i.json'));c=d['cells'];print(' '.join(f\"{x['variant']}={x['cpu_ms_per_step']}\" for x in c), 'paired', c[1]['paired_ratio'], 'filled', c[1]['filled'])")"
  done
done
