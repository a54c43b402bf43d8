"""Every 2 s: per process (psserver shards, bench_embedding processes): minflt, majflt, utime, stime (ticks),
voluntary and nonvoluntary context switches; plus MemFree and Cached from /proc/meminfo."""
import glob, signal, sys, time
stop = [False]
signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__(0, True))
out = open(sys.argv[1], "w")
t_end = time.time() + float(sys.argv[2])
while time.time() < t_end and not stop[0]:
    rows = []
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            c = open(p, "rb").read()
        except OSError:
            continue
        if b"python" not in c or not (b"psserver" in c or b"bench_embedding" in c):
            continue
        pid = p.split("/")[2]
        try:
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            st = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        vol = int(st.split("voluntary_ctxt_switches:")[1].split()[0])
        nvol = int(st.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        kind = "shard" if b"psserver" in c else "bench"
        rows.append(f"{kind}:{pid}:minflt={f[7]}:majflt={f[9]}:ut={f[11]}:st={f[12]}:vcs={vol}:ncs={nvol}")
    mi = dict(l.split(":", 1) for l in open("/proc/meminfo").read().splitlines())
    out.write(f"{time.time():.1f} free={mi['MemFree'].split()[0]} cached={mi['Cached'].split()[0]} " + " ".join(rows) + "\n")
    out.flush()
    time.sleep(2)
