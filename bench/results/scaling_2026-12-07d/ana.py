"""Per-upload timings of a --trace directory (ms, p10/p50/p90/p99): python ana.py TRACE_DIR."""

import glob
import json
import sys
from pathlib import Path

tr = sys.argv[1]
W = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(tr + "/*.json"))]
ev = [e for w in W for e in w]
print(
    "events",
    len(ev),
    "missing up",
    sum("up" not in e for e in ev),
    "missing answer",
    sum("answer" not in e for e in ev),
)


def q(xs, ps=(10, 50, 90, 99)):
    xs = sorted(xs)
    return [round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1e3) for p in ps] if xs else []


E = [e for e in ev if {"asked", "up", "sent", "answer", "end"} <= e.keys()]
print("turn wait asked->up ms", q([e["up"] - e["asked"] for e in E]))
print("handover up->sent ms", q([e["sent"] - e["up"] for e in E]))
D = [e for e in E if "delivered" in e]
print(
    "n with deliver", len(D), "sent->delivered(end of deliver) ms", q([e["delivered"] - e["sent"] for e in D])
)
print(
    "left unacked at end of deliver >64K share",
    sum(e["left"] > 65536 for e in D) / max(1, len(D)),
    "left q",
    q([e["left"] / 1e3 for e in D]),
)
print("delivered->answer ms", q([e["answer"] - e["delivered"] for e in D]))
print("sent->answer ms", q([e["answer"] - e["sent"] for e in E]))
print("answer first->end ms", q([e["end"] - e["answer"] for e in E]))
print("asked->end ms", q([e["end"] - e["asked"] for e in E]))
