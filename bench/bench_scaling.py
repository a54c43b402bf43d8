"""Scaling benchmark: push_pull with n workers on k shards, and the ring, on hosts whose links are the limit.

Every shard and every worker runs in a host of its own: a network namespace of a
``trainer.netns.NetnsCluster`` whose link is shaped to ``--rate-mbit`` each way. Each cell runs
push_pull rounds (async mode, ``--size-mib`` of float32 variables in ``--vars`` equal variables, 16 by
default) from n workers at once for ``--seconds`` and reports

    achieved / bound = bound time of a round / measured time of a round

where a push_pull round's bound is ``max(M / B, n M / (k B))``: M through a worker's link each way,
or n M / k through a shard's link each way (full duplex, both directions at once). The ring
(``psclient.collective.Ring``, one rank per worker host) is bounded by ``2 (n-1) / n x M / B`` per
all-reduce. ``ps`` uploads a push's parts to its shards one at a time (``stagger_uploads``, the
client's default), ``ps-together`` all at once. Peers in the same run: plain TCP sockets doing the
same rounds, ``raw`` (send the whole
push, then read the whole answer) and ``raw-stream`` (the answer streamed back in 256 KiB chunks
while the push arrives: what the link can carry). Beside each cell: the machine's CPU (busy % of all
cores, from /proc/stat) and the busiest process of the cell (cores), to show the links were the limit.
Each link's htb class serves pure ACKs first (``--acks first``, the default since 2026-12-07; ``--acks
queued``: one queue, as the results before); each host sends its data through a queue per peer, served in
turn (``--peer-queues 32``, the default since 2026-12-07; 0: one FIFO, as the results before).
``--mode sync --parts P``: a sync step pushed in P parts.

    sudo python bench/bench_scaling.py --quick                       # n in 1,2; k in 1,2; ring n=2
    sudo python bench/bench_scaling.py --workers 16,32 --shards 8,16,32 --ring 16 --rate-mbit auto
    sudo python bench/bench_scaling.py --workers 1,2,4 --shards 1,2,4 --ring 2,4,8 \\
        --size-mib 8 --rate-mbit 200 --out bench/results/scaling

``--rate-mbit auto`` picks each cell's rate (at most ``--max-rate-mbit``) so that the cell's own
processes use at most ``--cpu-share`` of the machine's cores: what is measured is achieved / bound,
and a link's bound scales with its rate, so a cell of 32 hosts at 25 Mbit/s asks of the CPU what a
cell of 4 asks at 200 Mbit/s and its ratio is the network's, not the cores'. The cost of a Mbit/s
(cores per Mbit/s sent) is learnt from the cells run so far; a cell that used more than its share is
run again at a lower rate (at most twice), and every row names its rate and its share.

Needs root, iproute2 and nftables (``trainer.netns.netns_available``). Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm

from trainer.cluster import cpu_seconds
from trainer.netns import Host, NetnsCluster

ROLES = str(Path(__file__).with_name("_scaling_roles.py"))
MIB = 1 << 20
SYSTEMS = ("ps", "ps-together", "raw", "raw-stream")  # ps-together: uploads to the shards at once
_RING_PORT = 7000  # inside a namespace this run made: nothing else can hold it
_START_TIMEOUT_S = (
    120.0  # every worker of a cell connected and warmed up (8 workers import psclient on 2 cores)
)


class Cell:
    """One measured point: starts the servers and workers of a system on the cluster's hosts."""

    def __init__(self, net: NetnsCluster, args: argparse.Namespace, name: str) -> None:
        self.net = net
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=net.workdir))
        self.size = getattr(args, "size_bytes", None) or args.size_mib * MIB
        self.workers: list[subprocess.Popen[bytes]] = []
        self.servers: list[subprocess.Popen[bytes]] = []
        self.roles: dict[str, list[Host]] = {}  # "worker"/"shard" -> its hosts, for the links' use

    def spawn(self, host: Host, role: str, cfg: dict[str, Any]) -> subprocess.Popen[bytes]:
        return self.net.popen(
            host,
            [sys.executable, ROLES, role, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def start_workers(self, hosts: list[Host], role: str, cfgs: list[dict[str, Any]]) -> None:
        for i, (host, cfg) in enumerate(zip(hosts, cfgs, strict=True)):
            cfg = {
                **cfg,
                "seconds": self.args.seconds,
                "min_rounds": self.args.min_rounds,
                "size_bytes": self.size,
            }
            cfg.update(ready_file=str(self.dir / f"ready{i}"), go_file=str(self.dir / "go"))
            self.workers.append(self.spawn(host, role, cfg))

    def run(self) -> dict[str, Any]:
        """Waits until every worker is ready, lets them go, returns their mean round time and the CPU."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        for i, proc in enumerate(self.workers):
            ready = self.dir / f"ready{i}"
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {i} not ready: {self._tail(proc)}")
                time.sleep(0.01)
        drops0, tcp0, bytes0 = self._link_drops(), self._tcp_counters(), self._link_bytes()
        cpu0 = [cpu_seconds(p.pid) for p in self.servers]
        busy0, total0 = cm.machine_cpu()
        (self.dir / "go").write_text("go")
        results = []
        for proc in self.workers:
            out, err = proc.communicate(timeout=self.args.seconds * 10 + self.args.min_rounds * 60 + 60)
            line = next((x for x in out.decode().splitlines() if x.startswith(cm.RESULT_PREFIX)), None)
            if proc.returncode != 0 or line is None:
                raise RuntimeError(f"worker exited {proc.returncode}: {err.decode()[-2000:]}")
            results.append(json.loads(line[len(cm.RESULT_PREFIX) :]))
        busy1, total1 = cm.machine_cpu()
        bytes1 = self._link_bytes()
        drops = self._link_drops() - drops0
        tcp = {k: v - tcp0.get(k, 0) for k, v in self._tcp_counters().items()}
        window = max(r["seconds"] for r in results)
        # workers report their own CPU time; servers are read from /proc (NaN once one has exited)
        cores = [r["cpu_s"] / r["seconds"] for r in results]
        cores += [(cpu_seconds(p.pid) - c) / window for p, c in zip(self.servers, cpu0, strict=True)]
        cores = [c for c in cores if c == c]
        return {
            "round_s": sum(r["seconds"] / r["rounds"] for r in results) / len(results),
            "rounds": [r["rounds"] for r in results],
            "machine_cpu_pct": round(100 * (busy1 - busy0) / max(1, total1 - total0), 1),
            "cell_cores": round(sum(cores), 2),
            "busiest_proc_cores": round(max(cores, default=float("nan")), 2),
            "link_drops": drops,
            "link_use": self._link_use(bytes0, bytes1, window),
            **tcp,
        }

    def _link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each host of the cell's roles has sent ("egress") and received ("ingress") so far."""
        return {
            h.name: {end: c["bytes"] for end, c in self.net.link_stats(h).items()}
            for hosts in self.roles.values()
            for h in hosts
        }

    def _link_use(
        self, before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], window: float
    ) -> dict[str, list[float]]:
        """What share of its rate each role's links carried during the cell, each way: ``{"worker up":
        [min, mean, max], ...}`` (up: what the host sent). Shows which links idled while a round was
        short of its bound."""
        use: dict[str, list[float]] = {}
        for role, hosts in self.roles.items():
            for end, way in (("egress", "up"), ("ingress", "down")):
                shares = [
                    (after[h.name][end] - before[h.name][end]) * 8 / (h.rate_mbit * 1e6 * window)
                    for h in hosts
                    if h.rate_mbit
                ]
                if shares:
                    use[f"{role} {way}"] = [
                        round(min(shares), 2), round(sum(shares) / len(shares), 2), round(max(shares), 2)
                    ]  # fmt: skip
        return use

    def _tcp_counters(self) -> dict[str, int]:
        """The kernel's TCP loss recovery so far, summed over every host of the cluster: retransmitted
        segments, retransmission timeouts (each at least 200 ms of a stalled flow) and tail loss probes."""
        wanted = {
            "RetransSegs": "tcp_retrans_segs",
            "TCPTimeouts": "tcp_timeouts",
            "TCPLossProbes": "tcp_loss_probes",
        }
        total = dict.fromkeys(wanted.values(), 0)
        for host in self.net.hosts:
            text = subprocess.run(
                [*host.launcher, "cat", "/proc/net/snmp", "/proc/net/netstat"],
                capture_output=True, text=True, timeout=10, check=False,
            ).stdout.splitlines()  # fmt: skip
            for names, values in zip(text[::2], text[1::2], strict=False):
                for name, value in zip(names.split()[1:], values.split()[1:], strict=False):
                    if name in wanted and value.lstrip("-").isdigit():
                        total[wanted[name]] += int(value)
        return total

    def _link_drops(self) -> int:
        """Packets the links' rate limiters dropped so far (both directions, every host): TCP's losses."""
        return sum(s["drops"] for h in self.net.hosts for s in self.net.link_stats(h).values())

    def _tail(self, proc: subprocess.Popen[bytes]) -> str:
        if proc.poll() is None:
            return "still starting"
        err = proc.communicate(timeout=10)[1].decode()
        return (
            err if len(err) <= 3000 else f"{err[:1000]} [...] {err[-2000:]}"
        )  # the first error, and the last

    def close(self) -> None:
        for proc in self.workers + self.servers:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


class CellRates:
    """Each cell's link rate: ``fixed`` Mbit/s, or (``fixed`` None) the highest rate up to ``max_mbit``
    at which the cell's own processes should use at most ``share`` of the machine's ``cpus`` cores.

    The cell's CPU grows with the bytes it moves: at its bound a push_pull cell sends
    2 min(n, k) B (the workers' uplinks and the shards' downlinks, or the other way round) and a ring of n
    sends n B. ``cost`` (cores per Mbit/s sent) is the highest seen so far; the first cell runs at
    ``max_mbit`` to learn it.
    """

    SAFETY = 0.8  # aim below the share: a cell's CPU varies by ~20 % from run to run
    MIN_MBIT = 2.0

    def __init__(self, fixed: float | None, max_mbit: float, share: float, cpus: int) -> None:
        self.fixed, self.max_mbit, self.share, self.cpus = fixed, max_mbit, share, cpus
        self.cost: float | None = None

    def pick(self, links: int) -> float:
        """The rate for a cell whose bound sends ``links`` x B Mbit/s in all."""
        if self.fixed is not None:
            return self.fixed
        if self.cost is None:
            return self.max_mbit
        rate = self.SAFETY * self.share * self.cpus / (self.cost * links)
        return float(max(self.MIN_MBIT, min(self.max_mbit, round(rate, 1))))

    def learn(self, cell: dict[str, Any], sent_bytes_per_round: float) -> bool:
        """Learns the cost of a Mbit/s from a measured cell; True when it used more than its share
        and should run again at the lower rate ``pick`` now gives."""
        sent_mbit_s = sent_bytes_per_round * 8 / 1e6 / cell["round_s"]
        cell["cpu_share"] = round(cell["cell_cores"] / self.cpus, 2)
        if sent_mbit_s > 0:
            self.cost = max(self.cost or 0.0, cell["cell_cores"] / sent_mbit_s)
        return self.fixed is None and cell["cpu_share"] > self.share and cell["rate_mbit"] > self.MIN_MBIT


def shape_cell(net: NetnsCluster, hosts: list[Host], rate_mbit: float) -> None:
    """Shapes the links of a cell's ``hosts`` to ``rate_mbit`` (those already at that rate are left)."""
    for host in hosts:
        if host.rate_mbit != rate_mbit:
            net.shape(host, rate_mbit, net.burst_kib)


def measured(
    net: NetnsCluster, rates: CellRates, links: int, hosts: list[Host], sent_per_round: float, run: Any
) -> dict[str, Any]:
    """Runs a cell (``run(rate_mbit)``) at the rate ``rates`` picks for it, again at a lower one (at
    most twice) while it used more than its share of the machine."""
    for _attempt in range(3):
        rate = rates.pick(links)
        shape_cell(net, hosts, rate)
        cell = run(rate)
        cell["rate_mbit"] = rate
        if not rates.learn(cell, sent_per_round) or rates.pick(links) >= rate:
            return cell
        print(
            f"  {cell['system']} n={cell['n']} k={cell['k']}: the cell used {cell['cpu_share']:.0%} of the "
            f"machine at {rate:g} Mbit/s; again at {rates.pick(links):g}",
            file=sys.stderr,
            flush=True,
        )
    return cell


def run_ps_cell(
    net: NetnsCluster, args: argparse.Namespace, system: str, n: int, k: int, rate_mbit: float
) -> dict[str, Any]:
    shard_hosts, worker_hosts = net.hosts[: args.max_shards], net.hosts[args.max_shards :]
    cell = Cell(net, args, f"{system}-n{n}-k{k}")
    cell.roles = {"worker": worker_hosts[:n], "shard": shard_hosts[:k]}
    shards = None
    try:
        sync = getattr(args, "mode", "async") == "sync"
        if system in ("ps", "ps-together"):
            mode_args = ["--mode", "sync", "--replicas-to-aggregate", str(n), "--total-replicas", str(n)]
            shards = net.shards(shard_hosts[:k], mode_args if sync else ()).start()
            cell.servers = [p for p in shards.procs if p is not None]
            trace = getattr(args, "trace", None)
            cfgs = [
                {
                    "addresses": shards.addresses,
                    "worker_id": f"w{i}",
                    "vars": getattr(args, "vars", 16),
                    "trace_file": str(Path(trace) / f"{system}-n{n}-k{k}-w{i}.json") if trace else None,
                    "sync": sync,
                    "parts": getattr(args, "parts", 1),
                    "wire": getattr(args, "wire", "data_port"),
                    "inflight": getattr(args, "inflight", 1),
                    "stagger": system == "ps",
                }
                for i in range(n)
            ]
            cell.start_workers(worker_hosts[:n], "ps", cfgs)
        else:
            piece = cell.size // k
            streamed = system == "raw-stream"
            addresses = []
            for j, host in enumerate(shard_hosts[:k]):
                ready = cell.dir / f"server{j}"
                cfg = {
                    "host": host.address,
                    "ready_file": str(ready),
                    "conns": n,
                    "piece": piece,
                    "barrier": sync,
                }
                cell.servers.append(
                    cell.spawn(host, "raw-server", {**cfg, "streamed": streamed, "seconds": 0})
                )
                addresses.append(cm.wait_for_file(ready, 30, cell.servers[-1]))
            cfgs = [{"addresses": addresses, "piece": piece, "streamed": streamed} for _ in range(n)]
            cell.start_workers(worker_hosts[:n], "raw-worker", cfgs)
        out = cell.run()
    finally:
        cell.close()
        if shards is not None:
            shards.stop()
    bound = max(cell.size, n * cell.size / k) / (rate_mbit * 1e6 / 8)
    if system in ("ps", "ps-together") and getattr(args, "trace", None):
        out["trace"] = trace_summary([Path(c["trace_file"]) for c in cfgs])
    return {"system": system, "n": n, "k": k, "bound_s": bound, "ratio": bound / out["round_s"], **out}


def _busy(intervals: list[tuple[float, float]], t0: float, t1: float) -> list[float]:
    """How long 0, 1, 2, ... of ``intervals`` were open at once within [t0, t1] (a sweep)."""
    edges = sorted([(max(a, t0), 1) for a, b in intervals if b > t0 and a < t1]
                   + [(min(b, t1), -1) for a, b in intervals if b > t0 and a < t1])  # fmt: skip
    spans: list[float] = []
    depth, at = 0, t0
    for t, step in edges:
        while len(spans) <= depth:
            spans.append(0.0)
        spans[depth] += t - at
        depth, at = depth + step, t
    while len(spans) <= depth:
        spans.append(0.0)
    spans[depth] += t1 - at
    return spans


def _collisions_repeated(workers: list[list[dict[str, Any]]]) -> list[int]:
    """[collisions, repeated]: pairs of parts of two workers uploading to the same shard at once (for at
    least 30 % of the shorter), and how many of those pairs' next parts (each worker's next) did too.
    Workers visiting the shards in the same cyclic order move on together: a collision repeats."""
    parts = [sorted((e for e in w if "sent" in e), key=lambda e: e["up"]) for w in workers]
    by_shard: dict[str, list[tuple[float, float, int, int]]] = {}
    for w, seq in enumerate(parts):
        for i, e in enumerate(seq):
            by_shard.setdefault(e["shard"], []).append((e["up"], e["sent"], w, i))

    def overlap(a: dict[str, Any], b: dict[str, Any]) -> float:
        return min(a["sent"], b["sent"]) - max(a["up"], b["up"])

    collisions = repeated = 0
    for ivs in by_shard.values():
        ivs.sort()
        for x, (up, sent, w, i) in enumerate(ivs):
            for up2, sent2, w2, j in ivs[x + 1 :]:
                if up2 >= sent:
                    break
                if w2 == w or min(sent, sent2) - up2 < 0.3 * min(sent - up, sent2 - up2):
                    continue
                collisions += 1
                if i + 1 < len(parts[w]) and j + 1 < len(parts[w2]):
                    a, b = parts[w][i + 1], parts[w2][j + 1]
                    repeated += a["shard"] == b["shard"] and overlap(a, b) > 0
    return [collisions, repeated]


def trace_summary(files: list[Path]) -> dict[str, Any]:
    """What the workers' timelines (``--trace``: each large request's shard, when its upload began and was
    handed to the kernel, when its answer began and ended) say about the order of uploads and answers:

    - ``shard_uploaders``: the share of the time a shard had 0, 1, 2, ... workers uploading to it at once
      (mean over shards): 0 is a shard's downlink idle for want of an upload, 2+ two workers sharing it;
    - ``shard_answering``: the same for answers coming down from a shard (its uplink idle or split);
    - ``worker_up`` / ``worker_down``: the share of the time a worker was uploading / receiving an answer;
    - ``answer_wait_ms``: from a part handed to the kernel to its answer's first bytes (p50, p90): the
      upload's last bytes on the link, the shard's apply and the answer's queue;
    - ``turn_wait_ms``: from a part asking for its turn on the uplink to its upload's start (p50, p90);
    - ``delivered_ms``: from a part handed to the kernel to the end of its delivery wait
      (``Turns.deliver``, slow links only: delivered, or given up at ``STAGGER_WAIT_S``; p50, p90);
    - ``collisions_repeated``: of the pairs of parts of two workers that went up to one shard at once (for
      at least 30 % of the shorter), the share whose next parts did too (``_collisions_repeated``).
    """
    workers = [json.loads(f.read_text()) for f in files if f.exists()]
    events = [e for w in workers for e in w if {"up", "sent", "answer", "end"} <= e.keys()]
    if not events:
        return {}
    # a request that failed before its upload began (a retry) has no "up"
    t0 = max(min((e["up"] for e in w if "up" in e), default=math.inf) for w in workers if w)
    t1 = min(max((e["end"] for e in w if "end" in e), default=-math.inf) for w in workers if w)
    span = max(t1 - t0, 1e-9)

    def shares(groups: dict[str, list[tuple[float, float]]]) -> list[float]:
        table = [_busy(iv, t0, t1) for iv in groups.values()]
        width = max(map(len, table))
        return [round(sum(row[i] if i < len(row) else 0.0 for row in table) / len(table) / span, 3)
                for i in range(width)]  # fmt: skip

    ups: dict[str, list[tuple[float, float]]] = {}
    downs: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        ups.setdefault(e["shard"], []).append((e["up"], e["sent"]))
        downs.setdefault(e["shard"], []).append((e["answer"], e["end"]))
    mine = [
        (
            [(e["up"], e["sent"]) for e in w if "sent" in e],
            [(e["answer"], e["end"]) for e in w if "answer" in e],
        )
        for w in workers
    ]
    waits = sorted(e["answer"] - e["sent"] for e in events)
    turn = sorted(e["up"] - e["asked"] for e in events)
    delivered = sorted(e["delivered"] - e["sent"] for e in events if "delivered" in e)
    return {
        "collisions_repeated": _collisions_repeated(workers),
        "seconds": round(span, 2),
        "shard_uploaders": shares(ups),
        "shard_answering": shares(downs),
        "worker_up": round(sum(1 - _busy(u, t0, t1)[0] / span for u, _ in mine) / len(mine), 3),
        "worker_down": round(sum(1 - _busy(d, t0, t1)[0] / span for _, d in mine) / len(mine), 3),
        "answer_wait_ms": [round(1e3 * cm.percentile(waits, q), 1) for q in (50, 90)],
        "turn_wait_ms": [round(1e3 * cm.percentile(turn, q), 1) for q in (50, 90)],
        "delivered_ms": [round(1e3 * cm.percentile(delivered, q), 1) for q in (50, 90)] if delivered else [],
    }


def cell_line(c: dict[str, Any]) -> str:
    """One cell in a line, for progress output."""
    return (
        f"{c['system']:10s} n={c['n']} k={c['k']}: {c['ratio']:.2f} of bound "
        f"({c['round_s'] * 1e3:.1f} ms vs {c['bound_s'] * 1e3:.1f} ms), CPU {c['machine_cpu_pct']} %, "
        f"cell {c['cell_cores']} cores, busiest {c['busiest_proc_cores']}, {c['link_drops']} drops, "
        f"rounds {c['rounds']}; links' use (min, mean, max) "
        + ", ".join(f"{role} {lo}/{mean}/{hi}" for role, (lo, mean, hi) in c.get("link_use", {}).items())
        + (f"; trace {c['trace']}" if c.get("trace") else "")
    )


def run_ring_cell(net: NetnsCluster, args: argparse.Namespace, n: int, rate_mbit: float) -> dict[str, Any]:
    hosts = net.hosts[args.max_shards : args.max_shards + n]
    addresses = [f"{h.address}:{_RING_PORT}" for h in hosts]
    cell = Cell(net, args, f"ring-n{n}")
    cell.roles = {"rank": hosts}
    try:
        chunk = getattr(args, "ring_chunk_kib", None)
        options = {"chunk_bytes": chunk << 10} if chunk else {}
        cell.start_workers(
            hosts, "ring", [{"addresses": addresses, "rank": r, "options": options} for r in range(n)]
        )
        out = cell.run()
    finally:
        cell.close()
    bound = 2 * (n - 1) / n * cell.size / (rate_mbit * 1e6 / 8)
    return {"system": "ring", "n": n, "k": 0, "bound_s": bound, "ratio": bound / out["round_s"], **out}


def rate_text(args: argparse.Namespace, unit: str = "cell") -> str:
    """The links' rate as a report names it (``--rate-mbit auto``: per ``unit``, its row says)."""
    if args.rate_mbit is not None:
        return f"{args.rate_mbit:g} Mbit/s each way"
    return (
        f"a rate per {unit}, each way (at most {args.max_rate_mbit:g} Mbit/s), at which the {unit}'s own "
        f"processes use at most {args.cpu_share:.0%} of the machine's cores"
    )


def rate_arg(text: str) -> float | None:
    """``--rate-mbit``: a number, or ``auto`` (None)."""
    return None if text == "auto" else float(text)


def add_rate_args(parser: argparse.ArgumentParser, unit: str) -> None:
    """``--rate-mbit`` (a number or ``auto``), ``--max-rate-mbit`` and ``--cpu-share``, for benches whose
    ``unit`` (a cell, a case) runs on a namespace cluster at one link rate (``CellRates`` reads them)."""
    parser.add_argument(
        "--rate-mbit",
        type=rate_arg,
        default=200.0,
        help=f"every link's rate each way, Mbit/s (default 200), or 'auto': a rate per {unit}, at most "
        f"--max-rate-mbit, at which the {unit}'s own processes use at most --cpu-share of the cores",
    )
    parser.add_argument(
        "--max-rate-mbit", type=float, default=200.0, help="with --rate-mbit auto: the top rate (default 200)"
    )
    parser.add_argument(
        "--cpu-share",
        type=float,
        default=0.6,
        help=f"with --rate-mbit auto: the share of the machine's cores a {unit} may use (default 0.6)",
    )


def parts_text(args: argparse.Namespace) -> str:
    """How a sync step's push goes (``--parts``), for the results' header: nothing for whole pushes."""
    parts = getattr(args, "parts", 1)
    return f", each sync step pushed in {parts} parts" if args.mode == "sync" and parts > 1 else ""


def render(args: argparse.Namespace, cells: list[dict[str, Any]], note: dict[str, Any], command: str) -> str:
    by = {(c["system"], c["n"], c["k"]): c for c in cells}
    lines = [
        "# Scaling on a namespace cluster (bench/bench_scaling.py)",
        "",
        f"Command: `{command}`",
        "",
        f"Every shard and worker in a network namespace of its own, each link shaped to "
        f"{rate_text(args)} ({cm.link_text(args)}), "
        f"{cm.congestion_text(args)}; "
        f"model M = {args.size_mib} MiB in {args.vars} float32 variables; "
        f"{args.seconds:g} s and at least {args.min_rounds} rounds per worker per cell; "
        f"{args.mode} mode, {args.inflight if args.mode == 'async' else 1} push_pull round(s) in flight per "
        f"ps worker{parts_text(args)}. "
        f"Machine: {note['cpus']} x {note['cpu_model']}, load before "
        f"{note['loadavg_1_5_15']}.",
        "",
        "Cells are achieved / bound (bound of a round: max(M/B, n M/(k B)), B the link rate); "
        "CPU, during the ps cell: the machine's busy % (all its cores, other tenants included), the cores "
        "the cell's own processes used (shards and workers), that as a share of the machine's cores, and "
        "its busiest process's cores; the cell's link rate.",
        "",
        "| workers n | shards k | ps | ps, uploads to every shard at once "
        "| raw TCP (whole push, whole answer) | raw TCP streamed | ps round ms | bound ms | machine CPU % "
        "| cell cores | cell's share | busiest process, cores | rate Mbit/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ratio(system: str, n: int, k: int) -> str:
        c = by.get((system, n, k))
        return f"{c['ratio']:.2f}" if c else "-"

    for n in args.workers:
        for k in args.shards:
            ps = next((by[s, n, k] for s in SYSTEMS if (s, n, k) in by), {})
            if not ps:
                continue
            lines.append(
                f"| {n} | {k} | {ratio('ps', n, k)} | {ratio('ps-together', n, k)} | {ratio('raw', n, k)} "
                f"| {ratio('raw-stream', n, k)} | "
                f"{ps['round_s'] * 1e3:.0f} | {ps['bound_s'] * 1e3:.0f} | {ps['machine_cpu_pct']} | "
                f"{ps['cell_cores']} | {ps.get('cpu_share', '-')} | {ps['busiest_proc_cores']} "
                f"| {ps.get('rate_mbit', args.rate_mbit):g} |"
            )
    rings = [c for c in cells if c["system"] == "ring"]
    if rings:
        lines += [
            "",
            "Ring all-reduce (`psclient.collective.Ring`), bound 2 (n-1)/n x M/B per all-reduce:",
            "",
            "| ranks n | achieved / bound | ms | bound ms | machine CPU % | cell cores | cell's share "
            "| busiest process, cores | rate Mbit/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {c['n']} | {c['ratio']:.2f} | {c['round_s'] * 1e3:.0f} | {c['bound_s'] * 1e3:.0f} | "
            f"{c['machine_cpu_pct']} | {c['cell_cores']} | {c.get('cpu_share', '-')} "
            f"| {c['busiest_proc_cores']} | {c.get('rate_mbit', args.rate_mbit):g} |"
            for c in rings
        ]
    return "\n".join(lines) + "\n"


def plot(path: str, cells: list[dict[str, Any]]) -> str | None:
    """Steps/s of the whole cluster against n, per k (and the ring), each with its bound drawn dashed;
    returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot written (pip install 'paramserver[load]')"
    fig, ax = plt.subplots(figsize=(8, 5))
    series = sorted({(c["system"], c["k"]) for c in cells if c["system"] in ("ps", "ring")})
    for i, (system, k) in enumerate(series):
        pts = sorted((c["n"], c) for c in cells if (c["system"], c["k"]) == (system, k))
        ns = [n for n, _ in pts]
        label = f"ps, k={k}" if system == "ps" else "ring"
        color = f"C{i}"
        ax.plot(ns, [n / c["round_s"] for n, c in pts], marker="o", color=color, label=label)
        ax.plot(ns, [n / c["bound_s"] for n, c in pts], linestyle="--", color=color, label=f"{label}: bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers n")
    ax.set_ylabel("steps/s, all workers together")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("push_pull and ring all-reduce on shaped links (dashed: the link bound)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs root, iproute2 and nftables. Cells: --workers x --shards for each of --systems, "
        "then --ring. Results: OUT.md (the tables and the command) and OUT.json (every number).",
    )
    parser.add_argument(
        "--workers", type=cm.ints, default=cm.ints("1,2,4,8"), help="n values (default 1,2,4,8)"
    )
    parser.add_argument("--shards", type=cm.ints, default=cm.ints("1,2,4"), help="k values (default 1,2,4)")
    parser.add_argument(
        "--ring", type=cm.ints, default=cm.ints("2,4,8"), help="ring ranks (default 2,4,8; '' skips)"
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="among ps,ps-together,raw,raw-stream (default all four; ps-together: "
        "the client's uploads to every shard at once, stagger_uploads=False)",
    )
    parser.add_argument("--size-mib", type=int, default=8, help="model size M in MiB (default 8)")
    add_rate_args(parser, "cell")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per cell (default 4)")
    parser.add_argument(
        "--inflight",
        type=int,
        default=1,
        help="push_pull rounds each ps worker keeps in flight (default 1; 2: the next round's push goes out "
        "while the last one's values come back, as PSWorker(overlap=True) trains)",
    )
    cm.add_congestion_arg(parser)
    cm.add_sysctl_arg(parser)
    parser.add_argument(
        "--ring-chunk-kib",
        type=int,
        help="the ring's frame size (RingConfig.chunk_bytes) in KiB (default: the ring's own default)",
    )
    parser.add_argument(
        "--min-rounds", type=int, default=3, help="and at least this many rounds per worker (default 3)"
    )
    parser.add_argument(
        "--mode",
        choices=("async", "sync"),
        default="async",
        help="the shards' mode (default async; sync: every round a sync step of all n workers, one round in "
        "flight, as a sync worker trains)",
    )
    cm.add_link_args(parser)
    parser.add_argument(
        "--parts",
        type=int,
        default=1,
        help="sync mode: each ps worker pushes a step in this many parts (push_pull(parts=P)): a shard "
        "answers a part once every worker's is in, while the later parts arrive (default 1: whole pushes)",
    )
    parser.add_argument(
        "--vars",
        type=int,
        default=16,
        help="the model's variables (default 16): at least k, or shards past the variables' count stay empty",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="each ps worker writes its timeline to DIR (every large request's shard, when its upload began "
        "and was handed to the kernel, when its answer began and ended); the cell's line summarises it",
    )
    parser.add_argument("--quick", action="store_true", help="n in 1,2; k in 1,2; ring n=2; 2 s per cell")
    parser.add_argument("--out", help="write OUT.md and OUT.json (e.g. bench/results/scaling)")
    parser.add_argument("--plot", action="store_true", help="also OUT.png: steps/s against n, bounds dashed")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.shards, args.ring, args.seconds = [1, 2], [1, 2], [2], 2.0
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}")
    if cm.netns_missing("bench_scaling.py"):
        return 2
    args.max_shards = max(args.shards)
    if args.vars < 1:
        parser.error("--vars must be at least 1")
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    num_hosts = args.max_shards + max([*args.workers, *args.ring])
    command = cm.command_line("bench_scaling.py", argv)
    note = cm.machine_note()
    cells: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []  # cells that raised (their error), reported after the tables
    rates = CellRates(args.rate_mbit, args.max_rate_mbit, args.cpu_share, os.cpu_count() or 1)
    size = args.size_mib * MIB
    with NetnsCluster(
        num_hosts,
        rate_mbit=args.rate_mbit or args.max_rate_mbit,
        congestion=cm.congestion_of(args),
        sysctls=cm.sysctls_of(args),
        **cm.link_options(args),
    ) as net:
        cm.note_congestion(args, net, net.hosts[0])
        shard_hosts, worker_hosts = net.hosts[: args.max_shards], net.hosts[args.max_shards :]
        for n in args.workers:
            for k in args.shards:
                for system in systems:
                    try:
                        cell = measured(
                            net, rates, 2 * min(n, k), shard_hosts[:k] + worker_hosts[:n], 2 * n * size,
                            lambda rate, system=system, n=n, k=k: run_ps_cell(net, args, system, n, k, rate),
                        )  # fmt: skip
                    except RuntimeError as err:  # a cell that could not start or run: named, the others go on
                        failed.append({"system": system, "n": n, "k": k, "error": str(err)[-4000:]})
                        print(
                            f"{system} n={n} k={k} FAILED: {failed[-1]['error']}", file=sys.stderr, flush=True
                        )
                        continue
                    cells.append(cell)
                    print(cell_line(cells[-1]), file=sys.stderr, flush=True)
        for n in args.ring:
            cells.append(
                measured(
                    net, rates, n, worker_hosts[:n], 2 * (n - 1) * size,
                    lambda rate, n=n: run_ring_cell(net, args, n, rate),
                )
            )  # fmt: skip
            c = cells[-1]
            print(
                f"ring n={n}: {c['ratio']:.2f} of bound at {c['rate_mbit']:g} Mbit/s, CPU "
                f"{c['machine_cpu_pct']} %, the cell {c['cpu_share']:.0%} of the machine",
                file=sys.stderr,
            )
    text = render(args, cells, note, command)
    for f in failed:
        text += f"\nFailed: {f['system']} n={f['n']} k={f['k']}: {f['error'].splitlines()[0][:300]}\n"
    print(text)
    results = cm.results_record(
        command,
        note,
        cells,
        rate_mbit=args.rate_mbit if args.rate_mbit is not None else "auto",
        max_rate_mbit=args.max_rate_mbit,
        cpu_share=args.cpu_share,
        size_mib=args.size_mib,
        seconds=args.seconds,
        congestion=cm.congestion_text(args),
        ring_chunk_kib=args.ring_chunk_kib,
        failed=failed,
    )
    cm.write_results(args.out, text, results)
    if args.out and args.plot and (why := plot(f"{args.out}.png", cells)):
        print(why, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
