#!/bin/bash
cd /work/main; . .venv/bin/activate
for i in 1 2; do
flock /tmp/bench.lock bash -c "
  python /tmp/t50/procs.py /tmp/t50/procs_$i.log 900 & P=\$!
  date +%s > /tmp/t50/start3_$i
  python bench/bench_embedding.py --rows 50000000 --dim 32 --table-memory 1GiB --prefill --steps 3000 --variants psk-tiered --table-tier-store log --out /tmp/t50/r3_50m_$i > /tmp/t50/log3_$i.txt 2>&1
  kill \$P"
done
