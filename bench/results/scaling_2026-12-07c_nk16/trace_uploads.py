import collections
import glob
import json
import re
import sys

d = sys.argv[1]
ev = []
for f in glob.glob(f"{d}/ps-n*-w*.json"):
    w = int(re.search(r"-w(\d+)\.json", f).group(1))
    with open(f) as fh:
        events = json.load(fh)
    for e in events:
        e["w"] = w
        ev.append(e)
t0 = min(e["up"] for e in ev if "up" in e)
shards = sorted({e["shard"] for e in ev})
sid = {s: i for i, s in enumerate(shards)}
print("events", len(ev), "shards", len(shards))
# timeline sample every 10 ms: for each shard, set of workers uploading (up..sent)
T = max(e["end"] for e in ev) - t0
step = 0.01
nb = int(T / step)
conc = [[set() for _ in range(len(shards))] for _ in range(nb)]
for e in ev:
    if "up" not in e:
        continue
    a = int((e["up"] - t0) / step)
    b = int((e["sent"] - t0) / step)
    for i in range(a, min(b + 1, nb)):
        conc[i][sid[e["shard"]]].add(e["w"])
hist = collections.Counter()
for row in conc[50:-50]:
    for s in row:
        hist[len(s)] += 1
tot = sum(hist.values())
print("shard upload concurrency histogram:", {k: round(v / tot, 3) for k, v in sorted(hist.items())})
# per worker order of shards
by_w = collections.defaultdict(list)
for e in ev:
    if "up" in e:
        by_w[e["w"]].append(e)
for w in sorted(by_w)[:4]:
    es = sorted(by_w[w], key=lambda e: e["up"])
    print(w, [sid[e["shard"]] for e in es[:40]])
    print("   dur ms", [round((e["sent"] - e["up"]) * 1000) for e in es[:40]])
# pairs co-located: for each pair of workers, fraction of time they share a shard
pair = collections.Counter()
for row in conc[50:-50]:
    for s in row:
        ws = sorted(s)
        for i in range(len(ws)):
            for j in range(i + 1, len(ws)):
                pair[(ws[i], ws[j])] += 1
print(
    "top co-located pairs (fraction of samples):",
    [(p, round(c / (nb - 100), 2)) for p, c in pair.most_common(12)],
)


# per worker: phase = shard index - worker - parts done
def pct(xs, p):
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))]


lat = [e["answer"] - e["sent"] for e in ev if "answer" in e and "sent" in e]
dn = [e["end"] - e["answer"] for e in ev if "answer" in e]
wt = [e["up"] - e["asked"] for e in ev if "up" in e]
for name, xs in (("sent->answer", lat), ("answer->end", dn), ("asked->up (turn wait)", wt)):
    print(name, "ms p10/50/90/99:", [round(pct(xs, p) * 1000) for p in (0.1, 0.5, 0.9, 0.99)])
