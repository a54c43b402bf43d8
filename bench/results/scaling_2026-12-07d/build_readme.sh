#!/bin/bash
D=/work/main/bench/results/scaling_2026-12-07d
cd /tmp/i45/runs
for f in *.json; do case $f in *.probe.json) ;; *) cp $f $D/runs/;; esac; done
for f in *.md; do cp $f $D/runs/; done
cp log.txt $D/runs/log.txt
cd $D/runs
AB=$(python3 ../table.py ab_n32k32_*.json ab_n32k16_*.json ab_n16k16_*.json final_*.json 2>/dev/null)
POLL=$(python3 ../table.py poll_*.json)
OTHER=$(python3 ../table.py base_trace1.json new_trace1.json new_u5.json new5_n32k16_1.json new5_n16k16_1.json)
python3 - "$AB" "$POLL" "$OTHER" <<'PY'
import sys
head=open('/tmp/i45/results/README_head.md').read()
tail=open('/tmp/i45/results/README_tail.md').read()
tail=tail.replace('AB_TABLE',sys.argv[1]).replace('POLL_TABLE',sys.argv[2])
tail=tail.replace('SUMMARY_ROWS',open('/tmp/i45/results/summary_rows.md').read().rstrip('\n'))
other='\n\nThe traced and scratch runs (sections 1-3; `run.sh` with `--trace`, the sampler beside them):\n\n'+sys.argv[3]+'\n'
open('/work/main/bench/results/scaling_2026-12-07d/README.md','w').write(head+other+tail)
PY
