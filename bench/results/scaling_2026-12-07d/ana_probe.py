"""probe.py's samples: TCP counters by role, the links' queues, ss: python ana_probe.py RUN.probe.json."""

import json
import re
import sys
from pathlib import Path

d = json.loads(Path(sys.argv[1]).read_text())
c = d["counters"]
print(len(c), "counter samples, span %.0f s" % (c[-1]["t"] - c[0]["t"]))
a, b = c[1], c[-1]
for role, rng in (("shard", range(32)), ("worker", range(32, 64))):
    s = {}
    for i in rng:
        for k, v in b["hosts"][str(i)].items():
            s[k] = s.get(k, 0) + v - a["hosts"][str(i)].get(k, 0)
    print(role, "dt=%.0f" % (b["t"] - a["t"]), {k: v for k, v in sorted(s.items()) if v})


def q(xs):
    xs = sorted(xs)
    return [xs[int(p * (len(xs) - 1))] for p in (0.1, 0.5, 0.9, 1.0)] if xs else []


for host in sorted(set(e["host"] for e in d["tc"])):
    bl = [sum(b for b, p in e["backlog"]) for e in d["tc"] if e["host"] == host]
    print(
        "host",
        host,
        "downlink (bridge side) backlog KB p10/50/90/max",
        [round(x / 1e3) for x in q(bl)],
        "drops",
        d["tc"][-1]["drops"][:1],
    )
rows = []
for e in d["ss"]:
    lines = e["text"].splitlines()
    for i in range(len(lines) - 1):
        if lines[i].startswith("ESTAB"):
            info = lines[i + 1]
            m = dict(re.findall(r"\b(rtt|rto|cwnd|unacked|backoff|lost)[: ]([\d.]+)", info))
            rows.append((e["host"], m))
for host in sorted(set(r[0] for r in rows)):
    R = [m for h, m in rows if h == host and "unacked" in m and "rto" in m]
    print(
        "host",
        host,
        "busy conn samples",
        len(R),
        "per sample avg %.1f" % (len(R) / max(1, len([e for e in d["ss"] if e["host"] == host]))),
        "rtt",
        [round(float(x)) for x in q([float(m["rtt"]) for m in R])],
        "rto",
        [round(float(x)) for x in q([float(m["rto"]) for m in R])],
        "cwnd",
        q([int(m["cwnd"]) for m in R]),
        "backoff>0 share %.2f" % (sum("backoff" in m for m in R) / max(1, len(R))),
        "cwnd<=2 share %.2f" % (sum(int(m["cwnd"]) <= 2 for m in R) / max(1, len(R))),
    )
