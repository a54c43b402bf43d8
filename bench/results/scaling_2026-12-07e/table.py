"""The runs' rows (ratio, CPU, load, TCP timeouts, rounds a worker, shard links' use):
python table.py runs/*.json."""

import json
import os
import sys
from pathlib import Path

print(
    "| run | n | k | Mbit/s | s | achieved / bound | cell cores | cell share | machine CPU % "
    "| load before / after | TCP timeouts | rounds a worker min-max | shard down use min/mean/max |"
)
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for f in sys.argv[1:]:
    try:
        d = json.loads(Path(f).read_text())
    except (OSError, ValueError):
        continue
    secs = d.get("seconds", "")
    for c in d["cells"]:
        use = "/".join(map(str, c["link_use"].get("shard down") or []))
        print(
            f"| {os.path.basename(f)[:-5]} | {c['n']} | {c['k']} | {c['rate_mbit']:g} | {secs} "
            f"| **{c['ratio']:.2f}** | {c['cell_cores']} | {c.get('cpu_share')} | {c['machine_cpu_pct']} "
            f"| {d['machine']['loadavg_1_5_15'][0]} / {d.get('loadavg_after', [None])[0]} "
            f"| {c.get('tcp_timeouts')} | {min(c['rounds'])}-{max(c['rounds'])} | {use} |"
        )
