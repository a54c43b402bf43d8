"""``psload --chaos``: a replicated local cluster whose primaries are ``kill -9``-ed while the workers run.

Every shard is two ``psserver`` processes on fixed ports: a primary started with
``--backup-at BACKUP`` and a backup started with ``--backup-of PRIMARY``. Every
``kill_every_s`` seconds the monkey picks the next shard (round robin), finds
which of its two processes is the primary now, ``kill -9``-s it and restarts it
at once with the very same command line; the restarted process finds that its
peer took over and rejoins as that peer's backup. A shard is only hit once it
is redundant again (its primary has a backup attached), so every kill is a
single fault; a kill that had to wait for that says how long.

Per kill it measures:

- ``failover_s``: from the kill until a read through ``PRIMARY|BACKUP`` succeeds
  (the backup noticed, and was promoted by that call): what a client waits.
- ``redundant_s``: from the kill until the restarted process is attached as the
  new primary's backup (the shard survives the next fault again).

The workers' pushes carry exact counters (``psload.runner``), and a sampler
records the resident memory (``VmRSS`` from ``/proc``; Linux) of every shard
and worker process once a second.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import ClusterError, LocalCluster, reserve_ports

log = logging.getLogger(__name__)

_START_ATTEMPTS = 3  # new ports when a reserved one was taken before its process bound it
_PROBE_TIMEOUT_S = 60.0  # a failover takes about a second; this bounds a kill that never recovers
_STATUS_TIMEOUT_S = 2.0
_POLL_S = 0.02


class ChaosError(RuntimeError):
    """The chaos cluster could not be run (a process did not start, a shard never became redundant)."""


@dataclass
class Kill:
    """One ``kill -9`` of a primary and how the shard recovered."""

    t_s: float  # seconds into the run
    shard: int
    address: str  # the process killed (its command restarts it on this port)
    waited_s: float  # how long the kill waited for the shard to be redundant first
    failover_s: float | None = None
    redundant_s: float | None = None


class ChaosCluster:
    """``num_shards`` shards, each a primary and a backup process on fixed loopback ports.

    Args:
        num_shards: shard count.
        server_args: extra ``psserver`` flags for every process.
        workdir: logs and ready files (default: a temporary directory).
    """

    def __init__(
        self, num_shards: int, server_args: Sequence[str] = (), workdir: str | Path | None = None
    ) -> None:
        self.num_shards = num_shards
        self.server_args = list(server_args)
        self.workdir = Path(workdir) if workdir is not None else None
        self._plan()

    def _plan(self) -> None:
        """Reserves a port per process and builds their command lines around them."""
        ports = reserve_ports(2 * self.num_shards)
        self.pairs = [(ports[2 * i], ports[2 * i + 1]) for i in range(self.num_shards)]
        a = {i: ["--backup-at", b] for i, (_, b) in enumerate(self.pairs)}
        b = {i: ["--backup-of", p] for i, (p, _) in enumerate(self.pairs)}
        self.sides = [
            LocalCluster(self.num_shards, self.server_args, shard_args=args, workdir=self._dir(name))
            for name, args in (("a", a), ("b", b))
        ]

    def _dir(self, name: str) -> Path | None:
        return self.workdir / name if self.workdir is not None else None

    @property
    def addresses(self) -> list[str]:
        """``PRIMARY|BACKUP`` per shard, as clients take them."""
        return [f"{p}|{b}" for p, b in self.pairs]

    def start(self) -> ChaosCluster:
        """Starts every process and waits until every shard has its backup confirmed.

        A reserved port that another process took meanwhile (any ephemeral bind on the
        machine may) makes it start over on new ports, up to ``_START_ATTEMPTS`` times.
        """
        for attempt in range(_START_ATTEMPTS):
            try:
                for i in range(self.num_shards):
                    for side, address in zip(self.sides, self.pairs[i], strict=True):
                        side.start_shard(i, port=_port(address))
                for i in range(self.num_shards):
                    self.wait_redundant(i, 60.0)
                return self
            except ClusterError as err:
                self.stop()
                if "address already in use" not in str(err) or attempt == _START_ATTEMPTS - 1:
                    raise
                log.warning("chaos cluster: a reserved port was taken (%s); starting on new ports", err)
                self._plan()
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        for side in self.sides:
            side.stop()

    def __enter__(self) -> ChaosCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pids(self) -> list[int]:
        """The process ids of every live shard process."""
        return [p.pid for side in self.sides for p in side.procs if p is not None and p.poll() is None]

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(
            f"--- shard {i} process {'ab'[s]} ---\n{side.log_tail(i, lines)}"
            for s, side in enumerate(self.sides)
            for i in range(self.num_shards)
        )

    def primary(self, shard: int) -> int | None:
        """Which side (0: started as primary, 1: as backup) is the shard's primary now (None: neither).

        A primary that serves first (it holds its lease, or needs none), then a backup whose primary
        went away (the next client call promotes it), then a primary waiting for its backup.
        """
        roles = [_role(address) for address in self.pairs[shard]]
        for wanted in ("serving", "orphaned", "primary"):
            for side, (role, _, serving) in enumerate(roles):
                if (wanted == "serving" and serving) or role == wanted:
                    return side
        return None

    def redundant(self, shard: int) -> bool:
        """The shard's primary has its backup attached and confirmed (it survives the next single fault)."""
        side = self.primary(shard)
        if side is None:
            return False
        role, peer, serving = _role(self.pairs[shard][side])
        return role == "primary" and peer != "" and serving

    def wait_redundant(self, shard: int, timeout_s: float) -> float:
        """Waits until ``redundant(shard)``; returns the seconds waited. Raises: ChaosError."""
        started = time.monotonic()
        while not self.redundant(shard):
            if time.monotonic() - started > timeout_s:
                raise ChaosError(f"shard {shard} had no backup attached within {timeout_s:.0f}s")
            time.sleep(_POLL_S)
        return time.monotonic() - started

    def kill_primary(self, shard: int) -> tuple[str, int]:
        """``kill -9`` of the shard's primary, then its restart with the same command; (address, side)."""
        side = self.primary(shard)
        if side is None:
            raise ChaosError(f"shard {shard} has no primary to kill")
        address = self.pairs[shard][side]
        self.sides[side].kill_shard(shard)
        return address, side

    def restart(self, shard: int, side: int) -> None:
        """Starts the killed process again with its original command (same flags, same port)."""
        self.sides[side].start_shard(shard, port=_port(self.pairs[shard][side]))


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _role(address: str) -> tuple[str, str, bool]:
    """``(role, peer, serving)`` of one process (``("down", "", False)`` when it does not answer).

    ``serving``: a primary that holds its lease or needs none (``GetStatus.lease_s`` not 0).
    """
    try:
        with grpc.insecure_channel(address) as channel:
            status = ps_pb2_grpc.ParameterServerStub(channel).GetStatus(
                ps_pb2.GetStatusRequest(), timeout=_STATUS_TIMEOUT_S
            )
    except grpc.RpcError:
        return "down", "", False
    role = status.role or "primary"
    return role, status.peer, role == "primary" and status.lease_s != 0


class Monkey:
    """Kills a primary every ``kill_every_s`` seconds (round robin over shards) until stopped.

    Args:
        cluster: the chaos cluster.
        kill_every_s: seconds between kills.
        probe: reads through ``PRIMARY|BACKUP`` of a shard; returns once a read succeeds.
        started: ``time.monotonic()`` of the run's start (``Kill.t_s`` counts from it).
    """

    def __init__(
        self,
        cluster: ChaosCluster,
        kill_every_s: float,
        probe: Callable[[int], None],
        started: float,
    ) -> None:
        self.cluster = cluster
        self.kill_every_s = kill_every_s
        self.probe = probe
        self.started = started
        self.kills: list[Kill] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psload-chaos", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops the kills and waits for the one in progress to recover."""
        self._stop.set()
        self._thread.join(timeout=2 * _PROBE_TIMEOUT_S)

    def _run(self) -> None:
        try:
            shard = 0
            next_at = time.monotonic() + self.kill_every_s
            while not self._stop.wait(max(0.0, next_at - time.monotonic())):
                self._kill(shard)
                shard = (shard + 1) % self.cluster.num_shards
                next_at += self.kill_every_s
        except BaseException as err:  # reported in the result: the run's verdict fails
            log.exception("chaos monkey failed")
            self.error = err

    def _kill(self, shard: int) -> None:
        waited = self.cluster.wait_redundant(shard, _PROBE_TIMEOUT_S)
        killed_at = time.monotonic()
        address, side = self.cluster.kill_primary(shard)
        kill = Kill(t_s=killed_at - self.started, shard=shard, address=address, waited_s=waited)
        self.kills.append(kill)
        log.info("chaos: kill -9 of shard %d's primary %s at %.1fs", shard, address, kill.t_s)
        restart = threading.Thread(target=self.cluster.restart, args=(shard, side), daemon=True)
        restart.start()  # at once, with the same command, while the clients fail over
        self.probe(shard)
        kill.failover_s = time.monotonic() - killed_at
        restart.join(timeout=_PROBE_TIMEOUT_S)
        self.cluster.wait_redundant(shard, _PROBE_TIMEOUT_S)
        kill.redundant_s = time.monotonic() - killed_at


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class RssSampler:
    """Samples the resident memory of shard and worker processes once a second (a thread)."""

    shard_pids: Callable[[], Iterable[int]]
    worker_pids: Callable[[], Iterable[int]]
    started: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="psload-rss", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            shards = [r for r in map(_rss_mib, self.shard_pids()) if r is not None]
            workers = [r for r in map(_rss_mib, self.worker_pids()) if r is not None]
            if shards or workers:
                self.samples.append(
                    {
                        "t_s": round(time.monotonic() - self.started, 2),
                        "shards_mib": [round(r, 1) for r in shards],
                        "workers_mib": [round(r, 1) for r in workers],
                    }
                )


def rss_growth(samples: list[dict[str, Any]], key: str, warmup_s: float, end_s: float) -> dict[str, Any]:
    """RSS after warm-up vs at the end: the largest process of each sample, the median over a window.

    The window is a fifth of the time after the warm-up (2 to 60 s). ``baseline_mib``: the window from
    ``warmup_s`` on; ``end_mib``: the window before ``end_s``; ``growth``: ``end / baseline - 1``
    (None without samples in both windows); ``peak_mib``: the largest sample.

    >>> rows = [{"t_s": t, "w": [100.0 + (t > 50)]} for t in range(100)]
    >>> r = rss_growth(rows, "w", 20.0, 100.0)
    >>> (r["baseline_mib"], r["end_mib"], round(r["growth"], 3), r["window_s"])
    (100.0, 101.0, 0.01, 16.0)
    """
    window = min(60.0, max(2.0, (end_s - warmup_s) / 5))

    def median(lo: float, hi: float) -> float | None:
        values = [max(s[key]) for s in samples if lo <= s["t_s"] <= hi and s[key]]
        return statistics.median(values) if values else None

    baseline = median(warmup_s, warmup_s + window)
    end = median(end_s - window, end_s)
    growth = None if baseline is None or end is None or baseline <= 0 else end / baseline - 1
    peak = max((max(s[key]) for s in samples if s[key]), default=None)
    return {"baseline_mib": baseline, "end_mib": end, "growth": growth, "peak_mib": peak, "window_s": window}


def recovery(kills: list[Kill]) -> dict[str, float | None]:
    """p50 and max of the failover and redundancy times over the kills.

    >>> recovery([Kill(1.0, 0, "a", 0.0, 0.1, 0.5), Kill(2.0, 1, "b", 0.0, 0.3, 0.9)])["failover_max_s"]
    0.3
    """

    def stats(values: list[float]) -> tuple[float | None, float | None]:
        return (statistics.median(values), max(values)) if values else (None, None)

    f50, fmax = stats([k.failover_s for k in kills if k.failover_s is not None])
    r50, rmax = stats([k.redundant_s for k in kills if k.redundant_s is not None])
    return {"failover_p50_s": f50, "failover_max_s": fmax, "redundant_p50_s": r50, "redundant_max_s": rmax}


def kills_json(kills: list[Kill]) -> list[dict[str, Any]]:
    return [
        {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(kill).items()} for kill in kills
    ]


async def probe_read(
    addresses: Sequence[str], shard: int, name: str, timeout_s: float = _PROBE_TIMEOUT_S
) -> None:
    """Reads ``name`` (a variable on ``shard``) through the shard's ``PRIMARY|BACKUP`` until it succeeds."""
    import psclient

    async with psclient.AsyncPSClient(
        list(addresses), worker_id="psload-chaos-probe", timeout=timeout_s
    ) as c:
        await c.pull([name])  # fails over (and promotes the backup) exactly as the workers' calls do
