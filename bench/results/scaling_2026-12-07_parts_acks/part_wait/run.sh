set -u
cd /work/main
D=bench/results/scaling_2026-12-07_parts_acks/part_wait
mkdir -p $D
B=".venv/bin/python bench/bench_scaling.py"
run() {
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
  flock /tmp/bench.lock timeout 580 $B "$@" --out $D/$name 2>&1 | grep -E "^(ps|ring) " | cut -c1-400 | tee -a $D/log.txt
}
for r in 1 2; do
  for w in deadline stagger; do
    PS_PART_WAIT=$w run sync_n8k4_p8_first_wait_${w}_$r --workers 8 --shards 4 --ring '' --systems ps --mode sync \
      --parts 8 --rate-mbit 50 --size-mib 8 --vars 32 --seconds 24 --acks first
  done
done
echo "== done $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')" | tee -a $D/log.txt
