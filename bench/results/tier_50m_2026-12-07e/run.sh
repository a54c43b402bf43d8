#!/bin/bash
cd /work/main; . .venv/bin/activate
for v in 50m 5m 50m; do
  flock /tmp/bench.lock bash -c "
    /tmp/t50/sample.sh > /tmp/t50/vm_$v_\$\$.log & S=\$!
    date +%s > /tmp/t50/start_${v}_\$\$
    if [ $v = 50m ]; then
      python bench/bench_embedding.py --rows 50000000 --dim 32 --table-memory 1GiB --prefill --steps 3000 --variants psk-tiered --table-tier-store log --out /tmp/t50/r_${v}_\$\$ > /tmp/t50/log_${v}_\$\$.txt 2>&1
    else
      python bench/bench_embedding.py --rows 5000000 --dim 32 --table-memory 1GiB --prefill --steps 3000 --variants psk-dynamic --out /tmp/t50/r_${v}_\$\$ > /tmp/t50/log_${v}_\$\$.txt 2>&1
    fi
    kill \$S"
done
