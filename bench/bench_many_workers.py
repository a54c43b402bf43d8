"""Many workers: 64 simulated workers on 4 shards, a sync barrier from 2 to 64, 256 clients on one shard.

Runs on a ``trainer.netns.NetnsCluster``: each shard on a host (network namespace) of its own, the
simulated workers packed into a few worker processes (``psload --clients-per-worker``: one
``AsyncPSClient`` and worker id per simulated worker, all on the process's event loop), each process
on a host of its own, every link shaped to ``--rate-mbit`` each way. The load is ``psload`` itself,
run inside a driver host with ``--worker-netns`` (its processes enter their hosts) and ``--exact``
(every push also adds 1 to an exact counter per shard, SGD with learning rate 1; at the end the
counters and every variable's version must equal the acknowledged pushes, sync mode: steps).

Cases (each on freshly started shards):

- ``async``: n = ``--async-n`` (64) simulated workers on ``--shards`` (4) shards, async mode: errors,
  exact counts, per-worker steps/s (min, max, max/min), p50/p99 push_pull latency.
- ``sync``: n in ``--sync-n`` (2..64), shards in ``--mode sync --replicas-to-aggregate n
  --total-replicas n``: a step's time (run time / steps) beside the bandwidth term of a step, the
  bytes of the busiest link over its rate: max(C M / B through a worker host's link, n M s / B
  through the busiest shard's link, s its share of the model), each way (full duplex), C the
  simulated workers on one worker host. excess = step - bandwidth term; "at most linear in n" holds
  when excess grows as n^e with e <= 1.1 (least squares of log excess on log n).
- ``conns``: ``--conns`` (256) simulated workers on one shard, async mode, a smaller model
  (``--conns-model``): errors, latency, RSS and file descriptors.

Every case also reports each shard's RSS and open file descriptors idle (before the load) and at the
sample with the most TCP connections established to it (``/proc/<pid>/status``, ``/proc/<pid>/fd``,
``/proc/<pid>/net/tcp*`` read from outside its namespace), and fds per connection = (fds under load
- idle fds) / connections. Beside each result: the machine's CPU (busy % of all cores over the
measured seconds, other tenants included, from /proc/stat) and the busiest process of the case
(cores), shards and worker processes.

    sudo python bench/bench_many_workers.py --quick        # async n=16, sync n=2,4,8, 32 conns, 5 s each
    sudo python bench/bench_many_workers.py --out bench/results/many_workers

Needs root, iproute2 and nftables (``trainer.netns.netns_available``). Every wait is bounded; the
namespaces and processes go on every exit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm
from bench_scaling import CellRates, add_rate_args, measured, rate_text

from psload.spec import ModelSpec
from trainer.cluster import cpu_seconds, rss_mib
from trainer.netns import Host, NetnsCluster

_SAMPLE_S = 0.5  # shard RSS / fd / connection sampling period
_EXTRA_S = 240.0  # a case's psload run may take this long beyond its seconds (start-up on 2 cores, stop)
_ESTABLISHED, _LISTEN = "01", "0A"  # /proc/net/tcp states


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _tcp_connections(pid: int) -> int | None:
    """TCP connections established to a listening port of the network namespace ``pid`` runs in (the
    shard is alone in its host, so these are its connections)."""
    rows: list[tuple[int, str]] = []
    try:
        for name in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{name}") as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    rows.append((int(parts[1].rsplit(":", 1)[1], 16), parts[3]))
    except OSError:
        return None
    listening = {port for port, state in rows if state == _LISTEN}
    return sum(1 for port, state in rows if state == _ESTABLISHED and port in listening)


def _tcp_ext(text: str) -> dict[str, int]:
    """The TcpExt counters of a /proc/net/netstat text."""
    head, values = (line.split() for line in text.splitlines()[:2])
    return {k: int(v) for k, v in zip(head[1:], values[1:], strict=True)}


def _listen_overflows(pid: int) -> int | None:
    """TcpExt ListenOverflows of the network namespace ``pid`` runs in: connection attempts dropped
    because a listening socket's accept queue (its backlog) was full."""
    try:
        return _tcp_ext(Path(f"/proc/{pid}/net/netstat").read_text()).get("ListenOverflows", 0)
    except (OSError, ValueError):
        return None


_TCP_COUNTERS = (  # TcpExt counters summed over a case's hosts (nstat names without "TcpExt")
    "TCPSynRetrans",  # SYNs sent again: connection attempts whose SYN or SYN-ACK was lost
    "TCPTimeouts",  # retransmission timeouts
    "TCPToZeroWindowAdv",  # a receiver closed its window (its application did not read)
    "TCPWinProbe",  # zero-window probes sent (a sender waiting on a closed window, backing off)
    "TCPSpuriousRTOs",  # timeouts whose segment had not been lost after all (DSACK / F-RTO)
    "TCPDSACKRecv",  # the peer reported a duplicate: a retransmission that was not needed
    "TCPRcvQDrop",  # segments dropped by a receiver whose socket was over its memory
    "TCPZeroWindowDrop",  # segments dropped because the receiver's window was closed
    "PruneCalled",  # a receive queue was pruned for memory
)


def _network(net: NetnsCluster, hosts: list[Host]) -> dict[str, int]:
    """Counters of the hosts so far, summed: packets their links' rate limiters dropped (both ways), and
    the TCP counters of ``_TCP_COUNTERS``."""
    out = {"link_drops": sum(s["drops"] for h in hosts for s in net.link_stats(h).values())}
    out.update(dict.fromkeys(_TCP_COUNTERS, 0))
    for h in hosts:
        text = subprocess.run(
            [*h.launcher, "cat", "/proc/net/netstat"], capture_output=True, text=True, timeout=15, check=False
        ).stdout
        ext = _tcp_ext(text) if text else {}
        for k in _TCP_COUNTERS:
            out[k] += ext.get(k, 0)
    return out


@dataclass
class Sampler:
    """Samples the shards (RSS, fds, connections) and the machine's CPU while a case runs."""

    shard_pids: list[int]
    samples: list[dict[str, Any]] = field(default_factory=list)

    def sample(self) -> dict[str, Any]:
        busy, total = cm.machine_cpu()
        row = {
            "t": time.monotonic(),
            "busy": busy,
            "total": total,
            "shards": [
                {"rss_mib": round(rss_mib(p), 1), "fds": _fds(p), "conns": _tcp_connections(p),
                 "cpu_s": cpu_seconds(p), "listen_overflows": _listen_overflows(p)}
                for p in self.shard_pids
            ],
        }  # fmt: skip
        self.samples.append(row)
        return row


class Case:
    """One case: fresh shards on the shard hosts, psload in the driver host, sampled from outside."""

    def __init__(self, net: NetnsCluster, args: argparse.Namespace, name: str) -> None:
        self.net, self.args, self.name = net, args, name
        self.dir = net.workdir / name
        self.dir.mkdir()

    def run(
        self,
        shard_hosts: list[Host],
        worker_hosts: list[Host],
        clients: int,
        model: str,
        server_args: list[str],
    ) -> dict[str, Any]:
        net, args = self.net, self.args
        shards = net.shards(shard_hosts, server_args).start()
        try:
            pids = [p.pid for p in shards.procs if p is not None]
            sampler = Sampler(pids)
            idle = sampler.sample()
            hosts = [*shard_hosts, *worker_hosts]
            net0 = _network(net, hosts)
            out = self.dir / "psload.json"
            argv = [
                sys.executable, "-m", "psload", *shards.addresses, "--workers", str(len(worker_hosts)),
                "--clients-per-worker", str(clients), "--model", model, "--duration", str(args.seconds),
                "--exact", "--worker-netns", ",".join(h.netns for h in worker_hosts), "--json", str(out),
                "--timeout", str(args.timeout), "--data-port-min-bytes", args.data_port_min_bytes,
                *(["--warm-up"] if args.warm_up else []),
            ]  # fmt: skip
            log_path = self.dir / "psload.log"
            with open(log_path, "wb") as logf:
                proc = net.popen(net.host("driver"), argv, stdout=logf, stderr=subprocess.STDOUT)
            window = self._watch(proc, log_path, sampler, worker_hosts)
            net1 = _network(net, hosts)
        finally:
            shards.stop()
        if not out.exists():
            raise RuntimeError(
                f"{self.name}: psload exited {proc.returncode}: {log_path.read_text()[-3000:]}"
            )
        result = json.loads(out.read_text())
        return {
            "case": self.name,
            "psload_exit": proc.returncode,
            "psload_command": shlex.join(argv[1:]),
            "psload": {
                k: result[k] for k in ("config", "summary", "shards", "balance", "counts") if k in result
            },
            "shard_resources": _resources(idle, sampler.samples),
            "cpu": window,
            "network": {k: net1[k] - net0[k] for k in net0},
            "data_port_fallbacks": log_path.read_text().count("cannot be reached"),
        }

    def _watch(
        self, proc: subprocess.Popen[bytes], log_path: Path, sampler: Sampler, worker_hosts: list[Host]
    ) -> dict[str, Any]:
        """Samples until psload exits (bounded); returns the CPU over its measured seconds.

        psload prints its first live line ("psload [   1/...") a little over a second after the start:
        the measured window is [that line - 1.3 s, + --seconds].
        """
        deadline = time.monotonic() + self.args.seconds + _EXTRA_S
        first_line: float | None = None
        worker_cpu0: dict[int, float] = {}
        worker_cpu1: dict[int, float] = {}
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(timeout=30)
                raise RuntimeError(f"{self.name}: psload ran past {self.args.seconds + _EXTRA_S:.0f} s")
            row = sampler.sample()
            if first_line is None and b"psload [" in log_path.read_bytes():
                first_line = row["t"]
                worker_cpu0 = {p: cpu_seconds(p) for h in worker_hosts for p in self.net.pids(h)}
            elif first_line is not None and row["t"] <= first_line - 1.3 + self.args.seconds:
                worker_cpu1 = {p: cpu_seconds(p) for p in worker_cpu0}
            time.sleep(_SAMPLE_S)
        if first_line is None:
            return {}
        start, end = first_line - 1.3, first_line - 1.3 + self.args.seconds
        inside = [s for s in sampler.samples if start <= s["t"] <= end] or sampler.samples[-2:]
        a, b = inside[0], inside[-1]
        span = max(b["t"] - a["t"], 1e-9)
        shard_cores = [
            (y["cpu_s"] - x["cpu_s"]) / span for x, y in zip(a["shards"], b["shards"], strict=True)
        ]
        worker_cores = [
            (worker_cpu1[p] - worker_cpu0[p]) / span
            for p in worker_cpu1
            if not math.isnan(worker_cpu1[p] - worker_cpu0[p])
        ]
        cores = [c for c in shard_cores + worker_cores if not math.isnan(c)]
        return {
            "machine_cpu_pct": round(100 * (b["busy"] - a["busy"]) / max(1, b["total"] - a["total"]), 1),
            "shard_cores": [round(c, 2) for c in shard_cores],
            "worker_process_cores": [round(c, 2) for c in sorted(worker_cores, reverse=True)[:8]],
            "case_cores": round(sum(cores), 2),
            "busiest_proc_cores": round(max(cores, default=float("nan")), 2),
            "loadavg_1": round(os.getloadavg()[0], 2),
        }


def _resources(idle: dict[str, Any], samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shard: idle RSS and fds; at the sample with the most connections: RSS, fds, connections, fds
    per connection; and the peak RSS and fds of any sample."""
    out = []
    for i, before in enumerate(idle["shards"]):
        rows = [s["shards"][i] for s in samples if s["shards"][i]["fds"] is not None]
        busiest = max(rows, key=lambda r: r["conns"] or 0)
        conns = busiest["conns"] or 0
        out.append(
            {
                "shard": i,
                "idle_rss_mib": before["rss_mib"],
                "idle_fds": before["fds"],
                "connections": conns,
                "rss_mib": busiest["rss_mib"],
                "fds": busiest["fds"],
                "fds_per_connection": round((busiest["fds"] - before["fds"]) / conns, 2) if conns else None,
                "peak_rss_mib": max(r["rss_mib"] for r in rows),
                "peak_fds": max(r["fds"] for r in rows),
                "listen_overflows": (rows[-1]["listen_overflows"] or 0) - (before["listen_overflows"] or 0),
            }
        )
    return out


def _placement(n: int, hosts: int) -> tuple[int, int]:
    """(worker processes, simulated workers per process) for n simulated workers on up to ``hosts``."""
    procs = min(n, hosts)
    if n % procs:
        raise ValueError(f"{n} simulated workers do not split evenly over {procs} worker hosts")
    return procs, n // procs


def _bandwidth_s(model_bytes: int, share: float, n: int, clients: int, rate_mbit: float) -> float:
    """A step's bandwidth term: the busiest link's bytes (each way) over its rate (0 when unshaped)."""
    if not rate_mbit:
        return 0.0
    rate = rate_mbit * 1e6 / 8
    return max(clients * model_bytes, n * model_bytes * share) / rate


def run_case(
    net: NetnsCluster,
    args: argparse.Namespace,
    kind: str,
    n: int,
    shard_hosts: list[Host],
    worker_hosts: list[Host],
    model: str,
    rate_mbit: float,
) -> dict[str, Any]:
    procs, clients = _placement(n, len(worker_hosts))
    server_args = ["--mode", "async"]
    if kind == "sync":
        server_args = ["--mode", "sync", "--replicas-to-aggregate", str(n), "--total-replicas", str(n)]
    case = Case(net, args, f"{kind}-n{n}")
    out = case.run(shard_hosts, worker_hosts[:procs], clients, model, server_args)
    s = out["psload"]["summary"]
    steps = [int(v) for v in s["steps_per_worker"].values()]
    rates = [v / s["duration_s"] for v in steps]
    share = max((sh["share"] for sh in out["psload"]["shards"]), default=1.0)
    model_bytes = ModelSpec.parse(model).total_bytes
    out.update(
        kind=kind, n=n, k=len(shard_hosts), worker_processes=procs, clients_per_process=clients, model=model,
        model_bytes=model_bytes, max_shard_share=share, errors=s["errors"],
        counts_ok=bool(out["psload"].get("counts", {}).get("ok")),
        steps_per_s=s["steps_per_s"], worker_rate_min=min(rates, default=0.0),
        worker_rate_max=max(rates, default=0.0), worker_rate_max_over_min=s["steps_max_over_min"],
        p50_ms=s["latency"]["p50_ms"], p99_ms=s["latency"]["p99_ms"],
        bandwidth_s=_bandwidth_s(model_bytes, share, n, clients, rate_mbit), rate_mbit=rate_mbit,
        # for ``bench_scaling.measured``'s rate per case: a "round" is a step of the whole cluster
        system=kind, round_s=1.0 / s["steps_per_s"] if s["steps_per_s"] else float("inf"),
        cell_cores=out["cpu"].get("case_cores", 0.0),
    )  # fmt: skip
    if kind == "sync" and steps and min(steps) > 0:
        out["step_s"] = s["duration_s"] / max(steps)
        out["excess_s"] = out["step_s"] - out["bandwidth_s"]
    return out


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def render(args: argparse.Namespace, cells: list[dict[str, Any]], note: dict[str, Any], command: str) -> str:
    lines = [
        "# Many workers on a namespace cluster (bench/bench_many_workers.py)",
        "",
        f"Command: `{command}`",
        "",
        f"Every shard in a network namespace of its own; the simulated workers (an `AsyncPSClient` and "
        f"worker id each) packed into up to {args.worker_hosts} `psload` worker processes, each in a "
        f"namespace of its own; every link shaped to {rate_text(args, 'case')} ({cm.link_text(args)}), "
        f"{cm.congestion_text(args)}. {args.seconds:g} s measured per case, push_pull, exact counters on. "
        f"Machine: {note['cpus']} x "
        f"{note['cpu_model']}, load before {note['loadavg_1_5_15']}. CPU: the machine's busy % over the "
        "measured seconds (all cores, other tenants included), the case's own processes (shards and worker "
        "processes) in cores, and its busiest process's.",
        "",
    ]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        by_kind.setdefault(c["kind"], []).append(c)
    for kind in ("async", "conns"):
        rows = by_kind.get(kind, [])
        if not rows:
            continue
        title = "Async mode" if kind == "async" else "Many connections to one shard (async mode)"
        lines += [
            f"{title}:",
            "",
            "| n | shards | processes x workers | model | errors | counts exact | steps/s "
            "| per-worker steps/s min-max | max/min | p50 ms | p99 ms | machine CPU % | case cores "
            "| busiest process | rate Mbit/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [_async_row(c, args.rate_mbit) for c in rows]
        lines.append("")
    sync = by_kind.get("sync", [])
    if sync:
        lines += [
            "Sync mode (a barrier of n replicas on every shard): a step's time against n; bandwidth term "
            "= the busiest link's bytes each way over its rate, max(C M, n M s) / B (C workers per worker "
            "host, s the busiest shard's share of the model M); excess = step - bandwidth term.",
            "",
            "| n | processes x workers | errors | counts exact | step ms | bandwidth term ms | excess ms "
            "| excess / n ms | p99 ms | machine CPU % | case cores | busiest process | rate Mbit/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in sync:
            step, excess = c.get("step_s"), c.get("excess_s")
            lines.append(
                f"| {c['n']} | {c['worker_processes']} x {c['clients_per_process']} | {c['errors']} | "
                f"{'yes' if c['counts_ok'] else 'NO'} | {_fmt(step and step * 1e3, '.0f')} | "
                f"{c['bandwidth_s'] * 1e3:.0f} | {_fmt(excess and excess * 1e3, '.0f')} | "
                f"{_fmt(excess and excess * 1e3 / c['n'], '.1f')} | {_fmt(c['p99_ms'], '.0f')} | "
                f"{c['cpu'].get('machine_cpu_pct', '-')} | {c['cpu'].get('case_cores', '-')} | "
                f"{c['cpu'].get('busiest_proc_cores', '-')} | "
                f"{_fmt(c.get('rate_mbit', args.rate_mbit), 'g')} |"
            )
        lines.append("")
    lines += [
        "Shard resources: idle (shards started, no load) and at the sample with the most connections "
        "established to the shard; fds per connection = (fds - idle fds) / connections.",
        "",
        "| case | shard | connections | RSS idle MiB | RSS MiB | peak RSS MiB | fds idle | fds "
        "| fds per connection | listen overflows |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cells:
        if c["kind"] == "sync" and c["n"] != max(x["n"] for x in sync):
            continue  # the largest barrier stands for the sync cases
        for r in c["shard_resources"]:
            lines.append(
                f"| {c['case']} | {r['shard']} | {r['connections']} | {r['idle_rss_mib']:.0f} | "
                f"{r['rss_mib']:.0f} | {r['peak_rss_mib']:.0f} | {r['idle_fds']} | {r['fds']} | "
                f"{_fmt(r['fds_per_connection'])} | {r['listen_overflows']} |"
            )
    lines += ["", *goals(cells)]
    return "\n".join(lines) + "\n"


def _async_row(c: dict[str, Any], rate_mbit: float | None) -> str:
    pushes = c["psload"].get("counts", {}).get("acknowledged_pushes", "-")
    cpu = c["cpu"]
    return (
        f"| {c['n']} | {c['k']} | {c['worker_processes']} x {c['clients_per_process']} | {c['model']} | "
        f"{c['errors']} | {'yes' if c['counts_ok'] else 'NO'} ({pushes} pushes) | {c['steps_per_s']:.1f} | "
        f"{c['worker_rate_min']:.2f}-{c['worker_rate_max']:.2f} | {_fmt(c['worker_rate_max_over_min'])} | "
        f"{_fmt(c['p50_ms'], '.0f')} | {_fmt(c['p99_ms'], '.0f')} | {cpu.get('machine_cpu_pct', '-')} | "
        f"{cpu.get('case_cores', '-')} | {cpu.get('busiest_proc_cores', '-')} | "
        f"{_fmt(c.get('rate_mbit', rate_mbit), 'g')} |"
    )


def _growth_exponent(ns: list[int], values: list[float]) -> float:
    """The slope of log(value) against log(n), least squares: 1 is linear growth."""
    xs, ys = [math.log(n) for n in ns], [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def goals(cells: list[dict[str, Any]]) -> list[str]:
    """The issue's goals, met or missed, as lines of text."""
    out = ["Goals (issue 24):", ""]
    for c in (c for c in cells if c["kind"] == "async"):
        spread = c["worker_rate_max_over_min"]
        met = c["errors"] == 0 and c["counts_ok"] and spread is not None and spread <= 1.5
        exact = "exact" if c["counts_ok"] else "NOT exact"
        out.append(
            f"- async, {c['n']} workers: {c['errors']} errors, counts {exact}, per-worker step rate "
            f"max/min {_fmt(spread)} (goal <= 1.5): {'met' if met else 'MISSED'}"
        )
    sync = [c for c in cells if c["kind"] == "sync" and (c.get("excess_s") or 0) > 0]
    if len(sync) >= 2:
        exponent = _growth_exponent([c["n"] for c in sync], [c["excess_s"] for c in sync])
        met = exponent <= 1.1
        per = ", ".join(f"{c['excess_s'] * 1e3 / c['n']:.1f}" for c in sync)
        out.append(
            f"- sync, n {sync[0]['n']}-{sync[-1]['n']}: excess = step - bandwidth term grows as "
            f"n^{exponent:.2f} "
            f"(least squares on log-log; excess / n: {per} ms): "
            f"{'at most linear' if met else 'faster than linear'} (goal: exponent <= 1.1): "
            f"{'met' if met else 'MISSED'}"
        )
    for c in (c for c in cells if c["kind"] == "conns"):
        r = c["shard_resources"][0]
        out.append(
            f"- {c['n']} clients on one shard: {c['errors']} errors, counts "
            f"{'exact' if c['counts_ok'] else 'NOT exact'}, {r['connections']} connections, {r['fds']} fds "
            f"({_fmt(r['fds_per_connection'])} per connection), RSS {r['rss_mib']:.0f} MiB"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs root, iproute2 and nftables. Results: OUT.md (the tables and the command) and OUT.json "
        "(every number, psload's results included).",
    )
    parser.add_argument("--cases", default="async,sync,conns", help="among async,sync,conns (default all)")
    parser.add_argument("--async-n", type=int, default=64, help="simulated workers, async case (default 64)")
    parser.add_argument(
        "--sync-n", type=cm.ints, default=cm.ints("2,4,8,16,32,64"), help="barrier sizes (default 2,4,...,64)"
    )
    parser.add_argument("--conns", type=int, default=256, help="simulated workers on one shard (default 256)")
    parser.add_argument(
        "--shards", type=int, default=4, help="shards k of the async and sync cases (default 4)"
    )
    parser.add_argument(
        "--worker-hosts", type=int, default=4, help="worker processes, a host each, at most (default 4)"
    )
    parser.add_argument(
        "--model", default="4x256KiB", help="psload model of async and sync (default 4x256KiB)"
    )
    parser.add_argument("--conns-model", default="4x16KiB", help="psload model of conns (default 4x16KiB)")
    add_rate_args(parser, "case")
    cm.add_congestion_arg(parser)
    cm.add_link_args(parser)
    cm.add_sysctl_arg(parser)
    parser.add_argument("--seconds", type=float, help="measured seconds per case (default 15; --quick: 5)")
    parser.add_argument("--timeout", type=float, default=60.0, help="psload's per-call deadline (default 60)")
    parser.add_argument(
        "--quick", action="store_true", help="async n=16, sync n=2,4,8, 32 conns, 5 s per case"
    )
    parser.add_argument(
        "--data-port-min-bytes",
        default="0",
        help="psload's: pushes and pulls of this much per shard or more take the data port, a connection "
        "per client and shard (default 0: all; 1GiB: gRPC only, its connection shared in a process)",
    )
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="measure from the start: without psload's --warm-up (a pull before the clock starts: it opens "
        "the data connections), the first steps of many workers starting at once are in the numbers",
    )
    parser.add_argument("--workdir", help="keep the logs here (psload's and the shards'; default: removed)")
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="only render the tables of an earlier run's OUT.json again (to stdout)",
    )
    parser.add_argument("--out", help="write OUT.md and OUT.json (e.g. bench/results/many_workers)")
    args = parser.parse_args(argv)
    if args.render:
        old = json.loads(Path(args.render).read_text())
        print(render(argparse.Namespace(**old["args"]), old["cells"], old["machine"], old["command"]), end="")
        return 0
    if args.quick:
        args.async_n, args.sync_n, args.conns = 16, [2, 4, 8], 32
    if args.seconds is None:
        args.seconds = 5.0 if args.quick else 15.0
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - {"async", "sync", "conns"}:
        parser.error(f"unknown cases {sorted(unknown)}")
    try:
        for n in [args.async_n, *args.sync_n, args.conns]:
            _placement(n, args.worker_hosts)
    except ValueError as e:
        parser.error(str(e))
    if cm.netns_missing("bench_many_workers.py"):
        return 2
    command = cm.command_line("bench_many_workers.py", argv)
    note = cm.machine_note()
    cells: list[dict[str, Any]] = []
    with NetnsCluster(
        rate_mbit=args.rate_mbit or args.max_rate_mbit,
        workdir=args.workdir,
        congestion=cm.congestion_of(args),
        sysctls=cm.sysctls_of(args),
        **cm.link_options(args),
    ) as net:
        shard_hosts = [net.add_host(f"ps{i}") for i in range(args.shards)]
        worker_hosts = [net.add_host(f"w{i}") for i in range(args.worker_hosts)]
        net.add_host("driver")
        cm.note_congestion(args, net, shard_hosts[0])
        plan = [("async", args.async_n, shard_hosts, args.model)] if "async" in cases else []
        plan += [("sync", n, shard_hosts, args.model) for n in args.sync_n] if "sync" in cases else []
        plan += [("conns", args.conns, shard_hosts[:1], args.conns_model)] if "conns" in cases else []
        rates = CellRates(args.rate_mbit, args.max_rate_mbit, args.cpu_share, os.cpu_count() or 1)
        for kind, n, hosts, model in plan:
            procs = _placement(n, len(worker_hosts))[0]
            c = measured(
                net, rates, 2 * min(procs, len(hosts)), [*hosts, *worker_hosts[:procs]],
                2 * ModelSpec.parse(model).total_bytes,
                lambda rate, kind=kind, n=n, hosts=hosts, model=model: run_case(
                    net, args, kind, n, hosts, worker_hosts, model, rate
                ),
            )  # fmt: skip
            cells.append(c)
            step = (
                f", step {c['step_s'] * 1e3:.0f} ms vs {c['bandwidth_s'] * 1e3:.0f} ms"
                if "step_s" in c
                else ""
            )
            cpu = c["cpu"]
            print(
                f"{c['case']:10s} {c['worker_processes']}x{c['clients_per_process']} on {c['k']} shard(s): "
                f"{c['errors']} errors, counts {'exact' if c['counts_ok'] else 'NOT exact'}, "
                f"{c['steps_per_s']:.1f} steps/s, max/min {_fmt(c['worker_rate_max_over_min'])}, "
                f"p50 {_fmt(c['p50_ms'], '.0f')} p99 {_fmt(c['p99_ms'], '.0f')} ms{step}, "
                f"CPU {cpu.get('machine_cpu_pct', '-')} %, the case {c['cpu_share']:.0%} of the machine at "
                f"{c['rate_mbit']:g} Mbit/s, busiest {cpu.get('busiest_proc_cores')}, "
                f"{c['data_port_fallbacks']} data-port fallbacks, network {c['network']}",
                file=sys.stderr,
                flush=True,
            )
    text = render(args, cells, note, command)
    print(text)
    results = cm.results_record(command, note, cells, args=vars(args))
    cm.write_results(args.out, text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
