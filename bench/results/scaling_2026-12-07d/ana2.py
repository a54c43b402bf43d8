"""Shares of the time a worker had parts queued or uploading, and a shard 0, 1, 2... uploaders (up
to delivered): python ana2.py TRACE_DIR."""

import glob
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, "/work/main/bench")
tr = sys.argv[1]
W = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(tr + "/*.json"))]


def busy(iv, t0, t1):
    ed = sorted(
        [(max(a, t0), 1) for a, b in iv if b > t0 and a < t1]
        + [(min(b, t1), -1) for a, b in iv if b > t0 and a < t1]
    )
    sp = [0.0] * 200
    d = 0
    at = t0
    for t, s in ed:
        sp[d] += t - at
        d += s
        at = t
    sp[d] += t1 - at
    return sp


t0 = max(min(e["asked"] for e in w) for w in W) + 2
t1 = min(max(e["end"] for e in w) for w in W)
S = t1 - t0
acc = {"queued>0": 0, "uploading>0": 0, "queued>0&uploading0": 0, "queued0&uploading0": 0, "answers>0": 0}
upk = [0.0] * 8
for w in W:
    q = [(e["asked"], e["up"]) for e in w if "up" in e]
    u = [(e["up"], e.get("delivered", e["sent"])) for e in w if "up" in e]
    a = [(e["answer"], e["end"]) for e in w if "answer" in e]
    # sweep over combined state
    pts = sorted(set([t0, t1] + [x for iv in q + u for x in iv if t0 < x < t1]))
    for x, y in itertools.pairwise(pts):
        m = (x + y) / 2
        nq = sum(a0 <= m < b0 for a0, b0 in q)
        nu = sum(a0 <= m < b0 for a0, b0 in u)
        dt = y - x
        acc["queued>0"] += dt * (nq > 0)
        acc["uploading>0"] += dt * (nu > 0)
        acc["queued>0&uploading0"] += dt * (nq > 0 and nu == 0)
        acc["queued0&uploading0"] += dt * (nq == 0 and nu == 0)
        upk[min(nu, 7)] += dt
print("span", round(S, 1), {k: round(v / len(W) / S, 3) for k, v in acc.items()})
print("uploads in progress (up..delivered) 0..7+ share", [round(x / len(W) / S, 3) for x in upk])
# shard side: concurrent uploaders per shard by up..delivered
by = {}
for w in W:
    for e in w:
        if "up" in e:
            by.setdefault(e["shard"], []).append((e["up"], e.get("delivered", e["sent"])))
tab = [busy(iv, t0, t1) for iv in by.values()]
print(
    "shard concurrent uploaders (up..delivered) 0..8",
    [round(sum(r[i] for r in tab) / len(tab) / S, 3) for i in range(9)],
)
