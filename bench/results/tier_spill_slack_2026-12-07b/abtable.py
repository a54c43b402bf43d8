"""Prints the alternated runs of one tag (``runs/<tag>_{base,new}_<i>.json``): each run's CPU ms a step,
memory and tiered, their ratio, the load when it started, and the medians."""

import json
import statistics
import sys
from pathlib import Path

tag = sys.argv[1]
here = Path(__file__).parent / "runs"
rows = {"base": [], "new": []}
for tree in rows:
    for f in sorted(here.glob(f"{tag}_{tree}_*.json")):
        d = json.loads(f.read_text())
        cells = {c["variant"]: c for c in d["cells"]}
        m, t = cells["memory"]["cpu_ms_per_step"], cells["tiered-log"]["cpu_ms_per_step"]
        load = d.get("machine", d.get("note", {})).get("loadavg_1_5_15", ["?"])[0]
        rows[tree].append((m, t, t / m))
        tier = cells["tiered-log"]
        print(
            f"{f.stem}: memory {m:.3f} tiered {t:.3f} ratio {t / m:.2f}x filled {tier['filled']} "
            f"spilled {tier['spilled']} load {load}"
        )
for tree, r in rows.items():
    if r:
        print(
            f"{tree}: median memory {statistics.median(x[0] for x in r):.3f}, tiered "
            f"{statistics.median(x[1] for x in r):.3f}, ratio {statistics.median(x[2] for x in r):.2f}x "
            f"(ratios {min(x[2] for x in r):.2f}-{max(x[2] for x in r):.2f})"
        )
