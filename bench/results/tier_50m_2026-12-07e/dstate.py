"""Every 20 ms: the state of every thread of every psserver process; for threads in D, their kernel stack."""

import collections
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


states = collections.Counter()
stacks = collections.Counter()
n = 0
t_end = time.time() + float(sys.argv[2])
while time.time() < t_end and not stop[0]:
    pids = []
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            c = Path(p).read_bytes()
        except OSError:
            continue
        if b"psserver" in c and b"python" in c:
            pids.append(p.split("/")[2])
    n += 1
    for pid in pids:
        for t in glob.glob(f"/proc/{pid}/task/*"):
            try:
                st = Path(t, "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            states[st] += 1
            if st == "D":
                try:
                    stk = Path(t, "stack").read_text().strip().splitlines()[:8]
                except OSError:
                    stk = ["?"]
                stacks[" <- ".join(frame.split("] ", 1)[-1] for frame in stk)] += 1
    if n % 500 == 0:
        emit(f"{time.time():.0f} samples={n} states={dict(states)}\n")
    time.sleep(0.02)
emit(f"END samples={n} states={dict(states)}\n")
for s, c in stacks.most_common(15):
    emit(f"{c} {s}\n")
