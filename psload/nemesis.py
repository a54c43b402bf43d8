"""A nemesis on the cluster in a box (Jepsen's way): clients push and pull counters on a replicated shard
while faults are injected at random, then a checker (``psload.checker``) judges the recorded history.

The cluster (``trainer.netns.NetnsCluster``): host ``pa`` runs the shard's first process
(``--backup-at`` the second), ``pb`` the second (``--backup-of`` the first), ``mon`` a monitor that reads
both processes' ``GetStatus`` four times a second (the roles, for the nemesis and the two-primaries
check; it is never faulted), and ``c0``, ``c1``, ... one client each (``psload._nemesis_client``; odd
clients over the data port, even ones over gRPC). Faults, one at a time, each bounded in time, chosen with
a seeded random generator (every kind once in a random order, then again), and only once the shard is
redundant again (its primary has its backup attached), so each is a single fault:

- ``cut_pair``: the primary and the backup cut apart (clients reach both);
- ``cut_clients``: every client cut from the primary; ``cut_client``: one client;
- ``isolate``: one host (a process's or a client's) cut from everyone;
- ``flap``: the primary-backup link cut and healed every 0.2-1 s;
- ``flap_all``: the whole network flapping: every host but the monitor's cut from everyone and healed
  every 0.2-1 s;
- ``drop``: a host drops 5-30 % of its packets;
- ``pause``: SIGSTOP of the primary or the backup, then SIGCONT;
- ``kill``: ``kill -9`` of the primary, restarted at once with its usual flags (it rejoins as backup);
- ``isolate_kill``: two faults in a row (issue 47): the primary's host cut from everyone (its backup
  takes over), then ``kill -9`` of the process that took over, the cut healed, and that process restarted
  with its usual flags (``--backup-of`` the old primary, as a supervisor would).

At the end everything heals, the clients stop, a final read of every counter is made, and the checker
runs on the histories of every process.

Example:
    result = run_nemesis(NemesisConfig(mode="sync", seconds=20, seed=1))
    assert result["ok"], result["report"]
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from psload import checker, history
from psload.history import Op
from trainer.cluster import LocalCluster
from trainer.netns import Host, NetnsCluster

log = logging.getLogger(__name__)

FAULTS = (
    "cut_pair",
    "cut_clients",
    "cut_client",
    "isolate",
    "flap",
    "flap_all",
    "drop",
    "pause",
    "kill",
    "isolate_kill",
)
MODES = ("async", "sync", "ssp")
_PORT = 7100
_START_TIMEOUT_S = 120.0  # interpreters starting on a loaded 2-core machine
_REDUNDANT_TIMEOUT_S = 30.0  # a backup attaches within seconds after a fault
_SETTLE_S = 3.0  # fault-free seconds after the last fault before the clients stop
_FINAL_READ_S = 60.0
_MONITOR_INTERVAL_S = 0.25
_POLL_S = 0.05
_TAIL_BYTES = 8192  # the monitor's last few status reads (a line is about 250 bytes)


@dataclass(frozen=True, kw_only=True)
class NemesisConfig:
    """One nemesis run.

    Args:
        mode: the shard's mode: async, sync (N = M = clients) or ssp (staleness 1).
        seconds: how long faults are injected.
        clients: client hosts (one client process each).
        seed: the fault schedule's random seed.
        faults: the kinds to choose from (``FAULTS``).
        fault_s: each fault lasts a uniform time in this range.
        gap_s: fault-free time between two faults (uniform in this range).
        timeout_s: the clients' deadline per call.
        slack_s: how far past its deadline a call may return (the checker's bound).
        lease_s: the shard's ``--lease`` (None: the server's default).
        pull_every: a client pulls every counter after this many pushes.
        burners: processes that spin on the CPU for the whole run (a loaded machine: the schedules a
            faulty replication protocol loses updates in are the ones a busy machine makes).
        workdir: keeps histories and logs here (default: a temporary directory, removed).
    """

    mode: str = "async"
    seconds: float = 20.0
    clients: int = 2
    seed: int = 0
    faults: tuple[str, ...] = FAULTS
    fault_s: tuple[float, float] = (2.0, 6.0)
    gap_s: tuple[float, float] = (1.0, 3.0)
    timeout_s: float = 15.0
    slack_s: float = 5.0
    lease_s: float | None = None
    pull_every: int = 5
    burners: int = 0
    workdir: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        unknown = set(self.faults) - set(FAULTS)
        if unknown or not self.faults:
            raise ValueError(f"faults must be some of {', '.join(FAULTS)}, got {sorted(self.faults)}")
        if self.clients < 1 or self.seconds <= 0:
            raise ValueError("need at least one client and seconds > 0")


@dataclass(slots=True)
class Fault:
    """One injected fault: what, on whom, and when (seconds since the faults began)."""

    kind: str
    target: str
    start_s: float
    end_s: float = 0.0
    detail: str = ""
    waited_s: float = 0.0  # how long it waited for the shard to be redundant first
    recovered_s: float | None = None  # heal to every client's next acknowledged push (_recovery)
    first_ack_s: float | None = None  # start to the first push acknowledged that began after it (_recovery)


@dataclass
class _Shard:
    """The shard's two processes: side 0 started with ``--backup-at``, side 1 with ``--backup-of``."""

    hosts: tuple[Host, Host]
    sides: tuple[LocalCluster, LocalCluster]
    addresses: tuple[str, str]
    monitor_path: Path

    def statuses(self) -> dict[str, Op]:
        """The monitor's latest status read of each process (ok or not)."""
        latest: dict[str, Op] = {}
        with contextlib.suppress(OSError), open(self.monitor_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
            for line in f.read().decode(errors="replace").splitlines()[-20:]:
                with contextlib.suppress(ValueError, TypeError):
                    op = Op.from_json(json.loads(line))
                    latest[op.address] = op
        return latest

    def primary(self) -> int | None:
        """The side serving as primary now, by the monitor (None: neither)."""
        latest = self.statuses()
        for side, address in enumerate(self.addresses):
            op = latest.get(address)
            if op is not None and op.ok and op.role == "primary" and op.lease_s != 0:
                return side
        return None

    def redundant(self) -> bool:
        side = self.primary()
        if side is None:
            return False
        op = self.statuses()[self.addresses[side]]
        return op.peer != "" and op.lease_s > 0

    def wait_redundant(self, timeout_s: float) -> float | None:
        """Waits until redundant; the seconds waited (None: not within ``timeout_s``)."""
        started = time.monotonic()
        while not self.redundant():
            if time.monotonic() - started > timeout_s:
                return None
            time.sleep(_POLL_S)
        return time.monotonic() - started

    def proc(self, side: int) -> subprocess.Popen[bytes] | None:
        return self.sides[side].procs[0]


def _server_args(config: NemesisConfig) -> list[str]:
    n = str(config.clients)
    args = {
        "async": ["--mode", "async"],
        "sync": ["--mode", "sync", "--replicas-to-aggregate", n, "--total-replicas", n],
        "ssp": ["--mode", "ssp", "--total-replicas", n, "--staleness", "1"],
    }[config.mode]
    return args + (["--lease", str(config.lease_s)] if config.lease_s is not None else [])


class Nemesis:
    """Injects faults (``FAULTS``) at random into a running shard until ``stop``; heals at the end.

    Args:
        net: the cluster.
        shard: its two processes.
        clients: the client hosts.
        config: the kinds, durations and seed.
    """

    def __init__(self, net: NetnsCluster, shard: _Shard, clients: list[Host], config: NemesisConfig) -> None:
        self.net = net
        self.shard = shard
        self.clients = clients
        self.config = config
        self.rng = random.Random(config.seed)
        self._deck: list[str] = []
        self.faults: list[Fault] = []
        self.unredundant: list[float] = []  # times (s) the shard was not redundant within the bound
        self._stopped: set[int] = set()  # pids under SIGSTOP
        self.t0 = time.monotonic()

    def run(self, seconds: float) -> None:
        """Injects faults for ``seconds``; each one ends (heals) before the next begins."""
        self.t0 = time.monotonic()
        end = self.t0 + seconds
        while time.monotonic() < end:
            waited = self.shard.wait_redundant(_REDUNDANT_TIMEOUT_S)
            if waited is None:
                self.unredundant.append(time.monotonic() - self.t0)
                log.warning("nemesis: the shard was not redundant within %.0f s", _REDUNDANT_TIMEOUT_S)
            if not self._deck:  # every kind once, in a random order, then again
                self._deck = self.rng.sample(self.config.faults, len(self.config.faults))
            kind = self._deck.pop()
            duration = min(self.rng.uniform(*self.config.fault_s), max(0.5, end - time.monotonic()))
            fault = Fault(kind, "", time.monotonic() - self.t0, waited_s=waited or 0.0)
            self.faults.append(fault)
            try:
                getattr(self, f"_{kind}")(fault, duration)
            finally:
                self.heal()
                fault.end_s = time.monotonic() - self.t0
            log.info("nemesis: %s %s %s (%.1f-%.1f s)", kind, fault.target, fault.detail, fault.start_s,
                     fault.end_s)  # fmt: skip
            time.sleep(min(self.rng.uniform(*self.config.gap_s), max(0.0, end - time.monotonic())))

    def heal(self) -> None:
        """Undoes every fault: links healed, no drops, stopped processes continued."""
        for host in self.net.hosts:
            if host.cut_all or host.cut_peers:
                self.net.heal(host)
            if host.drop_percent:
                self.net.drop(host, 0)
        for pid in list(self._stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self._stopped.discard(pid)

    def _primary_side(self) -> int:
        side = self.shard.primary()
        return side if side is not None else self.rng.randrange(2)

    def _name(self, host: Host) -> str:
        return f"{host.name} ({host.address})"

    def _cut_pair(self, fault: Fault, duration: float) -> None:
        a, b = self.shard.hosts
        fault.target = f"{self._name(a)} | {self._name(b)}"
        self.net.cut(a, b)
        time.sleep(duration)

    def _cut_clients(self, fault: Fault, duration: float, clients: list[Host] | None = None) -> None:
        primary = self.shard.hosts[self._primary_side()]
        cut = clients if clients is not None else self.clients
        fault.target = f"{', '.join(c.name for c in cut)} | primary {self._name(primary)}"
        for client in cut:
            self.net.cut(primary, client)
        time.sleep(duration)

    def _cut_client(self, fault: Fault, duration: float) -> None:
        self._cut_clients(fault, duration, [self.rng.choice(self.clients)])

    def _isolate(self, fault: Fault, duration: float) -> None:
        host = self.rng.choice([*self.shard.hosts, *self.clients])
        fault.target = f"{self._name(host)} | everyone"
        self.net.cut(host)
        time.sleep(duration)

    def _flap(self, fault: Fault, duration: float) -> None:
        a, b = self.shard.hosts
        fault.target = f"{self._name(a)} | {self._name(b)}"
        end = time.monotonic() + duration
        flips = 0
        while time.monotonic() < end:
            if flips % 2 == 0:
                self.net.cut(a, b)
            else:
                self.net.heal(a, b)
            flips += 1
            time.sleep(min(self.rng.uniform(0.2, 1.0), max(0.0, end - time.monotonic())))
        fault.detail = f"{flips} flips"

    def _flap_all(self, fault: Fault, duration: float) -> None:
        hosts = [*self.shard.hosts, *self.clients]
        fault.target = "every host but the monitor's"
        end = time.monotonic() + duration
        flips = 0
        while time.monotonic() < end:
            for host in hosts:
                if flips % 2 == 0:
                    self.net.cut(host)
                else:
                    self.net.heal(host)
            flips += 1
            time.sleep(min(self.rng.uniform(0.2, 1.0), max(0.0, end - time.monotonic())))
        fault.detail = f"{flips} flips"

    def _drop(self, fault: Fault, duration: float) -> None:
        host = self.rng.choice([*self.shard.hosts, *self.clients])
        percent = self.rng.randint(5, 30)
        fault.target, fault.detail = self._name(host), f"{percent} %"
        self.net.drop(host, percent)
        time.sleep(duration)

    def _pause(self, fault: Fault, duration: float) -> None:
        side = self._primary_side() if self.rng.random() < 0.7 else 1 - self._primary_side()
        proc = self.shard.proc(side)
        role = "primary" if side == self.shard.primary() else "process"
        fault.target = f"{role} {self.shard.addresses[side]}"
        if proc is None or proc.poll() is not None:
            fault.detail = "not running"
            return
        os.kill(proc.pid, signal.SIGSTOP)
        self._stopped.add(proc.pid)
        time.sleep(duration)

    def _kill(self, fault: Fault, duration: float) -> None:
        side = self._primary_side()
        fault.target = f"primary {self.shard.addresses[side]}"
        self.shard.sides[side].kill_shard(0)
        self.shard.sides[side].start_shard(0, port=_PORT, timeout=_START_TIMEOUT_S)
        fault.detail = "restarted with its flags"

    def _isolate_kill(self, fault: Fault, duration: float) -> None:
        side = self._primary_side()
        other = 1 - side
        host = self.shard.hosts[side]
        fault.target = f"primary {self.shard.addresses[side]}, then {self.shard.addresses[other]}"
        self.net.cut(host)
        time.sleep(duration)  # the other process takes over (and, by default, waits for a backup)
        self.shard.sides[other].kill_shard(0)
        self.net.heal(host)
        self.shard.sides[other].start_shard(0, port=_PORT, timeout=_START_TIMEOUT_S)
        fault.detail = "isolated, then the other process killed and restarted with its flags"


def _spawn(net: NetnsCluster, host: Host, args: dict[str, Any], log_name: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "psload._nemesis_client", json.dumps(args)]
    return net.popen(host, argv, log_name=log_name)


def _wait_for(
    what: str, ready: Callable[[], bool], timeout_s: float, procs: Sequence[subprocess.Popen[bytes]] = ()
) -> None:
    """Waits until ``ready()`` (bounded); a process of ``procs`` that exits first ends the wait."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:.0f} s")
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: a process exited early: {dead[0]}")
        time.sleep(_POLL_S)


@contextlib.contextmanager
def _workdir(config: NemesisConfig) -> Iterator[str | None]:
    if config.workdir is None:
        yield None
        return
    Path(config.workdir).mkdir(parents=True, exist_ok=True)
    yield config.workdir


@contextlib.contextmanager
def cpu_burners(count: int, limit_s: float) -> Iterator[None]:
    """``count`` processes that keep a core busy inside the block (each ends by itself after ``limit_s``)."""
    spin = f"import time\nend = time.monotonic() + {limit_s!r}\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


def run_nemesis(config: NemesisConfig) -> dict[str, Any]:
    """Runs clients under the nemesis for ``config.seconds``, then checks their history; returns the result:
    ``ok``, the checker's ``report`` (``psload.checker.Report.to_json``), the faults, the configuration, and
    ``workdir`` (histories ``*.jsonl`` and logs, kept when ``config.workdir`` was given).

    Raises:
        trainer.netns.NetnsError: the machine cannot make namespaces (``netns_available``).
        TimeoutError, RuntimeError: the cluster or the clients did not start.
    """
    started = time.monotonic()
    with _workdir(config) as workdir, NetnsCluster(workdir=workdir) as net:
        pa, pb, mon = net.add_host("pa"), net.add_host("pb"), net.add_host("mon")
        clients = [net.add_host(f"c{i}") for i in range(config.clients)]
        addresses = (f"{pa.address}:{_PORT}", f"{pb.address}:{_PORT}")
        pair = "|".join(addresses)
        args = _server_args(config)
        side_a = net.shards([pa], args, shard_args={0: ["--backup-at", addresses[1]]})
        side_b = net.shards([pb], args, shard_args={0: ["--backup-of", addresses[0]]})
        shard = _Shard((pa, pb), (side_a, side_b), addresses, net.workdir / "monitor.jsonl")
        try:
            with cpu_burners(config.burners, config.seconds + 10 * _START_TIMEOUT_S):
                side_a.start_shard(0, port=_PORT, timeout=_START_TIMEOUT_S)
                side_b.start_shard(0, port=_PORT, timeout=_START_TIMEOUT_S)
                result = _run(config, net, shard, mon, clients, pair)
        finally:
            side_b.stop()
            side_a.stop()
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        if workdir is not None:
            (Path(workdir) / "result.json").write_text(json.dumps(result, indent=1))
        return result


def _run(
    config: NemesisConfig, net: NetnsCluster, shard: _Shard, mon: Host, clients: list[Host], pair: str
) -> dict[str, Any]:
    horizon = time.monotonic() + config.seconds + 10 * _START_TIMEOUT_S  # bounds every helper process
    monitor = _spawn(
        net, mon, {"role": "monitor", "addresses": pair, "history": str(shard.monitor_path),
                   "end_at": horizon, "interval_s": _MONITOR_INTERVAL_S}, "monitor",
    )  # fmt: skip
    _wait_for("a primary with its backup attached", shard.redundant, _START_TIMEOUT_S, [monitor])
    counters = (
        ["nem/steps"] if config.mode == "sync" else [f"nem/{c.name}" for c in clients]
    )  # sync: one step counter every client pushes; else each client its own
    go = net.workdir / "go"
    common = {"addresses": pair, "mode": config.mode, "counters": counters, "timeout_s": config.timeout_s}
    procs, paths = [], []
    for i, host in enumerate(clients):
        path = net.workdir / f"{host.name}.jsonl"
        paths.append(path)
        procs.append(_spawn(net, host, {
            **common, "role": "client", "name": host.name, "history": str(path),
            "own": counters[0] if config.mode == "sync" else f"nem/{host.name}",
            "pull_every": config.pull_every, "go": str(go), "end_at": horizon,
            "data_port_min_bytes": 0 if i % 2 else 1 << 30,
        }, host.name))  # fmt: skip
    ready = [Path(f"{p}.ready") for p in paths]
    _wait_for("the clients' variables", lambda: all(r.exists() for r in ready), _START_TIMEOUT_S, procs)
    end_at = time.monotonic() + config.seconds + _SETTLE_S
    go.write_text(repr(end_at))
    nemesis = Nemesis(net, shard, clients, config)
    try:
        nemesis.run(config.seconds)
    finally:
        nemesis.heal()
    hung = []
    for host, proc in zip(clients, procs, strict=True):
        try:
            proc.wait(timeout=max(0.0, end_at - time.monotonic()) + config.timeout_s + config.slack_s + 30)
        except subprocess.TimeoutExpired:
            hung.append(host.name)
            proc.kill()
            proc.wait(timeout=10)
    final_path = net.workdir / "final.jsonl"
    final = _spawn(net, clients[0], {**common, "role": "final", "name": "final", "history": str(final_path),
                                     "end_at": time.monotonic() + _FINAL_READ_S}, "final")  # fmt: skip
    final.wait(timeout=_FINAL_READ_S + _START_TIMEOUT_S)
    monitor.terminate()
    monitor.wait(timeout=10)
    ops = history.load([p for p in [*paths, final_path, shard.monitor_path] if p.exists()])
    for name in hung:
        ops.append(Op(name, "client", 0.0, deadline_s=config.timeout_s))  # never completed: incomplete
    for p in paths:
        if not p.exists() and p.stem not in hung:
            ops.append(Op(p.stem, "client", 0.0, deadline_s=config.timeout_s))  # exited without a history
    report = checker.check(ops, mode=config.mode, addresses=shard.addresses, slack_s=config.slack_s)
    report.stats["faults"] = len(nemesis.faults)
    report.stats["not_redundant_within_30s"] = len(nemesis.unredundant)
    report.stats["longest_push_gap_s"] = _longest_gap(ops, [c.name for c in clients])
    report.stats.update(_recovery(ops, [c.name for c in clients], nemesis))
    result = {
        "ok": report.ok,
        "config": {**asdict(config), "addresses": list(shard.addresses)},
        "faults": [asdict(f) for f in nemesis.faults],
        "report": report.to_json(),
        "summary": report.summary(),
        "workdir": str(net.workdir),
        "cluster": net.suffix,
    }
    if not report.ok:
        result["server_logs"] = {
            a: side.log_tail(0, 80) for a, side in zip(shard.addresses, shard.sides, strict=True)
        }
        result["timeline"] = timeline(ops, report, nemesis)
        history.dump(ops, net.workdir / "history.jsonl")
    return result


_TIMELINE_BEFORE_S = 20.0  # how far before the first anomaly's first op a failed run's timeline starts
_TIMELINE_LAST_S = 20.0  # and, when only the final read shows it, that much more before the final read
_TIMELINE_LINES = 80


def timeline(ops: list[Op], report: checker.Report, nemesis: Nemesis) -> str:
    """A failed run's pushes, pulls, role changes and faults around its anomalies, one per line, stamped with
    the wall clock of the servers' log lines (ops carry ``time.monotonic()``), to lay beside those logs."""
    to_wall = time.time() - time.monotonic()
    shown = [op for a in report.anomalies for op in a.ops if op.invoke]
    if not shown:
        return ""
    end = max(op.complete or op.invoke for op in shown)
    # the ops that show the anomaly; the final read alone (lost, applied twice): the run's last seconds
    earlier = [op.invoke for op in shown if op.process != checker.FINAL]
    start = (min(earlier) if earlier else end - _TIMELINE_LAST_S) - _TIMELINE_BEFORE_S

    def stamp(t: float) -> str:
        return (
            time.strftime("%H:%M:%S", time.localtime(t + to_wall)) + f".{int((t + to_wall) % 1 * 1000):03d}"
        )

    events: list[tuple[float, str]] = []
    roles: dict[str, str] = {}
    for op in sorted(ops, key=lambda o: o.invoke):
        if not start <= op.invoke <= end:
            continue
        if op.f == "status":
            if op.ok and roles.get(op.address) != op.role:
                roles[op.address] = op.role
                events.append((op.invoke, f"status {op.address}: {op.role}"))
            continue
        done = stamp(op.complete) if op.complete is not None else "never"
        what = f"step {op.step} {op.writes}" if op.f == "push" else json.dumps(op.reads)
        outcome = f"applied={op.applied}" if op.ok and op.f == "push" else op.outcome
        if op.error:
            outcome += f" {op.error_type}: {op.error[:100]}"
        events.append((op.invoke, f"{op.process} {op.f} {what} -> {done} {outcome}"))
    for f in nemesis.faults:
        for t, edge in ((nemesis.t0 + f.start_s, "starts"), (nemesis.t0 + f.end_s, "heals")):
            if start <= t <= end:
                events.append((t, f"fault {f.kind} {f.target} {edge}"))
    events.sort()
    lines = [f"{stamp(t)} {text}" for t, text in events]
    if len(lines) > _TIMELINE_LINES:
        lines = lines[-_TIMELINE_LINES:]
    return "\n".join(lines)


def _recovery(ops: list[Op], clients: list[str], nemesis: Nemesis) -> dict[str, Any]:
    """Per fault, the time from its heal until every client had a push acknowledged that began after the
    heal (``Fault.recovered_s``), counted only up to the next fault's start (None: the next fault, or the
    end of the run, came first); their median and largest, and how many were cut short. And per fault,
    from its start to the first push acknowledged that began after it (``Fault.first_ack_s``): for a
    pause of the primary, how long the shard acknowledged nothing."""
    acked = {name: [op for op in ops if op.process == name and op.f == "push" and op.ok] for name in clients}
    starts = [nemesis.t0 + f.start_s for f in nemesis.faults[1:]] + [float("inf")]
    for fault, next_start in zip(nemesis.faults, starts, strict=True):
        healed = nemesis.t0 + fault.end_s
        ends = [next((op.complete for op in acked[name] if op.invoke >= healed), None) for name in clients]
        done = [e for e in ends if e is not None and e <= next_start]
        fault.recovered_s = round(max(done) - healed, 2) if len(done) == len(clients) else None
        began = nemesis.t0 + fault.start_s  # a pause: how long the shard acknowledged nothing (issue 46)
        first = min(
            (op.complete for ops_ in acked.values() for op in ops_ if op.invoke >= began), default=None
        )
        fault.first_ack_s = round(first - began, 2) if first is not None and first <= next_start else None
    times = sorted(f.recovered_s for f in nemesis.faults if f.recovered_s is not None)
    pauses = sorted(
        f.first_ack_s for f in nemesis.faults if f.kind == "pause" and "primary" in f.target and f.first_ack_s
    )
    worst = max(nemesis.faults, key=lambda f: f.recovered_s or 0.0, default=None)
    return {
        "recovery_p50_s": times[len(times) // 2] if times else None,
        "recovery_max_s": times[-1] if times else None,
        "recovery_worst": f"{worst.kind} {worst.target}" if worst is not None else "",
        "recovery_cut_short": len(nemesis.faults) - len(times),
        # A pause of the primary: from its start to the first push acknowledged that began after it.
        "primary_pause_first_ack_s": pauses,
    }


def _longest_gap(ops: list[Op], clients: list[str]) -> float:
    """The longest time a client went without an acknowledged push (a measure of availability)."""
    gap = 0.0
    for name in clients:
        ends = sorted(op.complete or 0.0 for op in ops if op.process == name and op.f == "push" and op.ok)
        gap = max([gap, *(b - a for a, b in itertools.pairwise(ends))])
    return round(gap, 2)
