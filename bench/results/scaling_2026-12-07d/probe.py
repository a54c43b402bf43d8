"""Samples a running bench_scaling cluster: TCP counters of every namespace (latest), ss -tin of a few hosts,
the htb classes' backlog on the shards' downlinks (bridge side). Scratch for issue 45."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

out = sys.argv[1]
shards_watch = [0, 1, 5]
workers_watch = [32, 33]
KEYS = (
    "TCPTimeouts",
    "TCPSpuriousRTOs",
    "TCPLossProbes",
    "RetransSegs",
    "TCPDSACKRecv",
    "TCPDSACKOldSent",
    "TCPLostRetransmit",
    "TCPSackRecovery",
    "TCPFastRetrans",
    "TCPSlowStartRetrans",
    "TCPLossProbeRecovery",
    "TCPDSACKUndo",
    "TCPSackFailures",
    "TCPLossUndo",
    "TCPFullUndo",
    "TCPPartialUndo",
    "TCPRcvQDrop",
    "TCPBacklogDrop",
    "TCPOFOQueue",
    "TCPSpuriousRtxHostQueues",
    "TCPZeroWindowDrop",
    "TCPFromZeroWindowAdv",
    "TCPToZeroWindowAdv",
    "TCPWantZeroWindowAdv",
    "TCPDelivered",
    "TCPAutoCorking",
    "InSegs",
    "OutSegs",
    "TCPRenoRecovery",
    "TCPTimeoutRecovery" if False else "TCPRetransFail",
)


def sh(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout


def counters(ns):
    lines = sh(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat"]).splitlines()
    d = {}
    for a, b in zip(lines[::2], lines[1::2], strict=False):
        for k, v in zip(a.split()[1:], b.split()[1:], strict=False):
            if k in KEYS and v.lstrip("-").isdigit():
                d[k] = d.get(k, 0) + int(v)
    return d


suffix = None
t_start = time.time()
while suffix is None and time.time() - t_start < 600:
    names = [x.split()[0] for x in sh(["ip", "netns", "list"]).splitlines() if x.startswith("ps")]
    full = [n for n in names if re.fullmatch(r"ps[0-9a-f]{6}-\d+", n)]
    if len(full) >= 64:
        suffix = full[0].split("-")[0][2:]
    else:
        time.sleep(1)
print("suffix", suffix, flush=True)
data = {"ss": [], "tc": [], "counters": []}
last_cnt = 0
while True:
    names = {x.split()[0] for x in sh(["ip", "netns", "list"]).splitlines()}
    if f"ps{suffix}-0" not in names:
        break
    t = time.monotonic()
    try:
        for i in shards_watch + workers_watch:
            data["ss"].append(
                {"t": t, "host": i, "text": sh(["ip", "netns", "exec", f"ps{suffix}-{i}", "ss", "-tinH"])}
            )
        for i in shards_watch + workers_watch:
            j = sh(["tc", "-s", "class", "show", "dev", f"psv{suffix}-{i}"])
            back = [(int(a), int(b)) for a, b in re.findall(r"backlog (\d+)b (\d+)p", j)]
            drops = [int(a) for a in re.findall(r"dropped (\d+)", j)]
            data["tc"].append({"t": t, "host": i, "backlog": back, "drops": drops})
        if t - last_cnt > 5:
            last_cnt = t
            data["counters"].append({"t": t, "hosts": {i: counters(f"ps{suffix}-{i}") for i in range(64)}})
    except Exception as e:
        print("err", e, flush=True)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
Path(out).write_text(json.dumps(data))
print("done", len(data["ss"]), flush=True)
