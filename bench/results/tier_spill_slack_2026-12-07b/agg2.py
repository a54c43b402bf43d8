"""Aggregates a ``py-spy record --format raw`` profile of ``bench_tier_push.py`` (``spy.sh``): the main
thread's samples (the compaction thread's left out), scaled so they add up to ``STEP_US`` (the run's CPU
us a step); inclusive per psserver/pscore function, then own per line.

Usage: python agg2.py PROFILE STEP_US
"""

import collections
import sys

own: collections.Counter[str] = collections.Counter()
incl: collections.Counter[str] = collections.Counter()
total = 0
with open(sys.argv[1]) as f:
    for line in f:
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        frames = stack.split(";")
        if "Thread._bootstrap" in frames[0]:
            continue
        total += n
        ours = [fr for fr in frames if "psserver/" in fr or "pscore/" in fr]
        own[ours[-1] if ours else frames[-1]] += n
        seen = set()
        for fr in ours:
            fn = fr.split(" (")[0]
            if fn not in seen:
                incl[fn] += n
                seen.add(fn)
scale = float(sys.argv[2]) / total
print("samples", total)
for name, n in incl.most_common(60):
    print(f"{n * scale:7.1f} us {name}")
print("--- own lines")
for name, n in own.most_common(80):
    print(f"{n * scale:7.1f} us {name}")
