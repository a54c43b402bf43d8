"""Every 20 ms: the state of every thread of every psserver process; for threads in D, their kernel stack."""
import collections, glob, os, signal, sys, time
stop = [False]
signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__(0, True))
out = open(sys.argv[1], "w")
states = collections.Counter(); stacks = collections.Counter(); n = 0
t_end = time.time() + float(sys.argv[2])
while time.time() < t_end and not stop[0]:
    pids = []
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            c = open(p, "rb").read()
        except OSError:
            continue
        if b"psserver" in c and b"python" in c:
            pids.append(p.split("/")[2])
    n += 1
    for pid in pids:
        for t in glob.glob(f"/proc/{pid}/task/*"):
            try:
                st = open(t + "/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            states[st] += 1
            if st == "D":
                try:
                    stk = open(t + "/stack").read().strip().splitlines()[:8]
                except OSError:
                    stk = ["?"]
                stacks[" <- ".join(l.split("] ", 1)[-1] for l in stk)] += 1
    if n % 500 == 0:
        out.write(f"{time.time():.0f} samples={n} states={dict(states)}\n"); out.flush()
    time.sleep(0.02)
out.write(f"END samples={n} states={dict(states)}\n")
for s, c in stacks.most_common(15):
    out.write(f"{c} {s}\n")
out.close()
