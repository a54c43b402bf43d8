"""The runs' rows (ratio, CPU, load, TCP timeouts, shard links' use): python table.py runs/*.json."""

import json
import os
import sys
from pathlib import Path

rows = []
for f in sys.argv[1:]:
    try:
        d = json.loads(Path(f).read_text())
    except Exception:
        continue
    for c in d["cells"]:
        rows.append(
            (
                os.path.basename(f)[:-5],
                c["n"],
                c["k"],
                c["rate_mbit"],
                round(c["ratio"], 2),
                c["cell_cores"],
                c.get("cpu_share"),
                c["machine_cpu_pct"],
                d["machine"]["loadavg_1_5_15"][0],
                d.get("loadavg_after", [None])[0],
                c.get("tcp_timeouts"),
                c.get("tcp_retrans_segs"),
                c["link_use"].get("shard down"),
            )
        )
print(
    "| run | n | k | Mbit/s | achieved / bound | cell cores | cell share | machine CPU % "
    "| load before / after | TCP timeouts | retrans segs | shard down use min/mean/max |"
)
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    use = "/".join(map(str, r[12] or []))
    print(
        f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:g} | **{r[4]:.2f}** | {r[5]} | {r[6]} | {r[7]} "
        f"| {r[8]} / {r[9]} | {r[10]} | {r[11]} | {use} |"
    )
