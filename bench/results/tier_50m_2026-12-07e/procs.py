"""Every 2 s: per process (psserver shards, bench_embedding processes): minflt, majflt, utime, stime (ticks),
voluntary and nonvoluntary context switches; plus MemFree and Cached from /proc/meminfo."""

import glob
import signal
import sys
import time
from pathlib import Path

stop = [False]
signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__(0, True))
OUT = Path(sys.argv[1])
OUT.write_text("")


def emit(line: str) -> None:
    with OUT.open("a") as out:
        out.write(line)


t_end = time.time() + float(sys.argv[2])
while time.time() < t_end and not stop[0]:
    rows = []
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            c = Path(p).read_bytes()
        except OSError:
            continue
        if b"python" not in c or not (b"psserver" in c or b"bench_embedding" in c):
            continue
        pid = p.split("/")[2]
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            st = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        vol = int(st.split("voluntary_ctxt_switches:")[1].split()[0])
        nvol = int(st.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        kind = "shard" if b"psserver" in c else "bench"
        rows.append(f"{kind}:{pid}:minflt={f[7]}:majflt={f[9]}:ut={f[11]}:st={f[12]}:vcs={vol}:ncs={nvol}")
    mi = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    emit(
        f"{time.time():.1f} free={mi['MemFree'].split()[0]} cached={mi['Cached'].split()[0]} "
        + " ".join(rows)
        + "\n"
    )
    time.sleep(2)
