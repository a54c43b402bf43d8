"""Per shard: the share of the time with no upload on the way to it (up..delivered) and the mean number on
the way; then, second by second, the uploads on the way to each shard: python ana_shard.py TRACE_DIR."""

import glob
import itertools
import json
import sys
from pathlib import Path

W = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(sys.argv[1] + "/*.json"))]
ev = [e for w in W for e in w if "up" in e]
t0 = max(min(e["up"] for e in w if "up" in e) for w in W) + 1
t1 = min(max(e["end"] for e in w) for w in W)
by: dict[str, list[tuple[float, float]]] = {}
for e in ev:
    by.setdefault(e["shard"], []).append((e["up"], e.get("delivered", e["sent"])))
print("span", round(t1 - t0, 1))
print("shard, share of the time with no upload on the way, mean uploads on the way")
for s, iv in sorted(by.items()):
    pts = sorted({t0, t1, *[x for a, b in iv for x in (a, b) if t0 < x < t1]})
    idle = load = 0.0
    for x, y in itertools.pairwise(pts):
        m = (x + y) / 2
        c = sum(a <= m < b for a, b in iv)
        idle += (y - x) * (c == 0)
        load += (y - x) * c
    print(s.split(":")[0], round(idle / (t1 - t0), 3), round(load / (t1 - t0), 1))
print("uploads on the way to each shard, second by second (rows: shards by host .N, columns: seconds)")
for s, iv in sorted(by.items(), key=lambda x: int(x[0].split(":")[0].split(".")[-1])):
    line = [sum(a <= t0 + i + 0.5 < b for a, b in iv) for i in range(int(t1 - t0))]
    print(s.split(":")[0].split(".")[-1].rjust(3), " ".join(f"{c:2d}" for c in line))
