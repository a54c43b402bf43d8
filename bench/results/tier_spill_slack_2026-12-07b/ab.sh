#!/bin/bash
# usage: ab.sh tag pairs steps  -> alternates base (/tmp/wt44_base) and new (/work/main), under the bench lock per run
tag=$1; pairs=$2; steps=${3:-800}
. /work/main/.venv/bin/activate
for i in $(seq 1 $pairs); do
  for tree in base new; do
    root=/work/main; [ $tree = base ] && root=/tmp/wt44_base
    load=$(cut -d' ' -f1 /proc/loadavg)
    flock /tmp/bench.lock env PYTHONPATH=$root python $root/bench/bench_tier_push.py --steps $steps --variants memory,tiered-log --out /tmp/h44d/${tag}_${tree}_$i > /dev/null 2>&1
    echo "$tag $tree $i load=$load $(python -c "import json;d=json.load(open('/tmp/h44d/${tag}_${tree}_$i.json'));c=d['cells'];print(' '.join(f\"{x['variant']}={x['cpu_ms_per_step']}\" for x in c))")"
  done
done
