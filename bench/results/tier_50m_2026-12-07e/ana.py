import json
import sys
from pathlib import Path

i = sys.argv[1]
lines = Path(f"procs_{i}.log").read_text().splitlines()
s = int(Path(f"/tmp/t50/start3_{i}").read_text())  # the run's start (not kept)
for ln in lines[::5]:
    parts = ln.split()
    t = float(parts[0]) - s
    procs = {}
    for p in parts[3:]:
        f = p.split(":")
        d = dict(x.split("=") for x in f[2:])
        procs[f[0] + f[1]] = {k: int(v) for k, v in d.items()}
    print(
        f"{t:5.0f} free={int(parts[1].split('=')[1]) // 1024}M cached={int(parts[2].split('=')[1]) // 1024}M",
        " ".join(
            f"{k}:mf={v['minflt']},mj={v['majflt']},ut={v['ut']},st={v['st']},ncs={v['ncs']}"
            for k, v in procs.items()
            if v["ut"] > 100
        ),
    )
try:
    d = json.loads(Path(f"r3_50m_{i}.json").read_text())["results"]
    r = d[0] if isinstance(d, list) else d
    print({k: v for k, v in r.items() if "cpu" in k.lower() or k in ("steps_per_s", "prefill_s")})
except Exception as e:
    print(e)
