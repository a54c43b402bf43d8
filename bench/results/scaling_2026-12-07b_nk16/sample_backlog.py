"""Samples every qdisc's backlog in the root namespace (the bridge-side veth ends) for T seconds."""

import collections
import json
import subprocess
import sys
import time

T = float(sys.argv[1])
out = sys.argv[2]
mx = collections.defaultdict(lambda: [0, 0, 0, 0])  # dev/handle -> max bytes, max packets, drops, samples>0
hist = collections.Counter()
end = time.monotonic() + T
n = 0
while time.monotonic() < end:
    try:
        qs = json.loads(
            subprocess.run(
                ["tc", "-s", "-j", "qdisc", "show"], capture_output=True, text=True, timeout=5
            ).stdout
            or "[]"
        )
    except Exception:
        continue
    n += 1
    for q in qs:
        dev = q.get("dev", "")
        if not dev.startswith("v") and "ps" not in dev:
            pass
        key = f"{dev} {q.get('kind')} {q.get('handle')} {q.get('parent', 'root')}"
        b, p = q.get("backlog", 0), q.get("qlen", 0)
        m = mx[key]
        m[0] = max(m[0], b)
        m[1] = max(m[1], p)
        m[2] = q.get("drops", 0)
        if q.get("kind") != "htb" and b:
            m[3] += 1
            hist[min(b // 100000, 50)] += 1
    time.sleep(0.05)
rows = sorted(mx.items(), key=lambda kv: -kv[1][0])
with open(out, "w") as f:
    f.write(f"samples {n}\n")
    for k, (b, p, d, s) in rows[:40]:
        f.write(f"{k:60s} max_backlog {b:>9d} B {p:>5d} pkts drops {d} nonempty_samples {s}\n")
    f.write("leaf backlog histogram (100 KB buckets): " + str(sorted(hist.items())) + "\n")
