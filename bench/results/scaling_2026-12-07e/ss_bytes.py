"""Bytes each worker sent to each shard (its data connections, from the ss -tin each traced worker wrote at
the end): the model's placement as each worker routes it. python ss_bytes.py TRACE_DIR."""

import collections
import glob
import re
import sys
from pathlib import Path

tab = collections.defaultdict(dict)
for f in sorted(glob.glob(sys.argv[1] + "/*.ss")):
    w = int(f.split("-w")[-1].split(".")[0])
    txt = Path(f).read_text().split("\n")
    for i, line in enumerate(txt):
        m = re.search(r"\s(\S+):(\d+)\s+(10\.\S+):(\d+)\s*$", line)
        if m and i + 1 < len(txt):
            b = re.search(r"bytes_sent:(\d+)", txt[i + 1])
            s = int(m.group(3).split(".")[-1])
            tab[w][s] = tab[w].get(s, 0) + (int(b.group(1)) if b else 0)
shards = sorted({s for row in tab.values() for s in row})
print("worker \\ shard (host .N), MiB sent:", " ".join(f"{s:5d}" for s in shards))
for w in sorted(tab):
    print(f"{w:3d}", " ".join(f"{tab[w].get(s, 0) / 2**20:5.1f}" for s in shards))
tot = [sum(tab[w].get(s, 0) for w in tab) / 2**20 for s in shards]
mean = sum(tot) / len(tot)
print("sum", " ".join(f"{t:5.0f}" for t in tot))
print(f"max / mean {max(tot) / mean:.2f}, min / mean {min(tot) / mean:.2f}")
