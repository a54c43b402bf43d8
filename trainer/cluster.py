"""LocalCluster: starts psserver shards as real processes on loopback and stops them cleanly.

Used by ``pstrain demo``, the tests, the benchmarks and the load tool. Imports
no TensorFlow.

Example:
    with LocalCluster(num_shards=2) as cluster:
        client = psclient.PSClient(cluster.addresses)
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0  # a shard starts in well under a second; this covers a loaded CI machine
_STOP_TIMEOUT_S = 15.0


_LOWEST_PORT = 10000  # reserve_ports picks from here up to the kernel's ephemeral range


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (what ``bind(0)`` and ``connect`` draw from)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def reserve_ports(count: int, host: str = "127.0.0.1") -> list[str]:
    """``count`` distinct ``HOST:PORT`` addresses that were free a moment ago, for processes to bind later.

    Picked below the kernel's ephemeral range where it can: a port that ``bind(0)`` gave comes from the
    range every other ``bind(0)`` and ``connect`` on the machine draws from, so another socket may take
    it before its process binds it (a ring's rank once failed with "address already in use" on such a
    port); a port below the range is only taken by a process that asks for that very number. Else (no
    room below the range) ports from ``bind(0)``. Callers that can, still retry with new ports
    (``pstrain demo --mode allreduce`` does).
    """
    low = _ephemeral_low()
    chosen: list[int] = []
    pick = random.Random()  # not the global generator, which callers (tests) may seed
    tries = 100 * count if low - _LOWEST_PORT >= 1000 else 0  # bounded: ports in use are skipped
    for _ in range(tries):
        if len(chosen) == count:
            return [f"{host}:{port}" for port in chosen]
        port = pick.randrange(_LOWEST_PORT, low)
        if port in chosen:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        chosen.append(port)
    if len(chosen) == count:
        return [f"{host}:{port}" for port in chosen]
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [f"{host}:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


def rss_mib(pid: int | str = "self", field: str = "VmRSS") -> float:
    """A process's current (``VmRSS``) or peak (``VmHWM``) resident memory in MiB (NaN if unknown)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int | str = "self") -> float:
    """A process's CPU time so far (user + system, all its threads) in seconds (NaN if unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def is_local_host(name: str) -> bool:
    """Whether ``name`` is this host (loopback, or its host name)."""
    return name in _LOCAL_NAMES or name in (socket.gethostname(), socket.getfqdn())


class ClusterError(RuntimeError):
    """A shard failed to start or exited unexpectedly; the message carries its log tail."""


class LocalCluster:
    """``num_shards`` psserver processes on 127.0.0.1 with ephemeral ports.

    Args:
        num_shards: shard count.
        server_args: extra ``psserver`` flags for every shard (e.g. ``["--mode", "sync", ...]``).
        shard_args: extra flags per shard index.
        workdir: where ready files and logs go (default: a temporary directory).
        env: extra environment variables for the shard processes.
        hosts: the address each shard binds, per shard index (default: 127.0.0.1 for all).
        launchers: a command prefix per shard index, e.g. ``["ip", "netns", "exec", NAME]`` to start
            the shard inside a network namespace (``trainer.netns``); default none.
        start_timeout: seconds a shard may take to serve (its restore from a checkpoint included).
        stop_timeout: seconds a shard may take to exit after SIGTERM (its final checkpoint included)
            before it is killed.
    """

    def __init__(
        self,
        num_shards: int = 2,
        server_args: Sequence[str] = (),
        *,
        shard_args: dict[int, Sequence[str]] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        hosts: Sequence[str] | None = None,
        launchers: Sequence[Sequence[str]] | None = None,
        start_timeout: float = _START_TIMEOUT_S,
        stop_timeout: float = _STOP_TIMEOUT_S,
    ) -> None:
        self.num_shards = num_shards
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * num_shards
        self.launchers = [list(p) for p in launchers] if launchers is not None else [[]] * num_shards
        if len(self.hosts) != num_shards or len(self.launchers) != num_shards:
            raise ValueError(f"hosts and launchers need one entry per shard ({num_shards})")
        self.server_args = list(server_args)
        self.shard_args = shard_args or {}
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="pscluster-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = env or {}
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * num_shards
        self.addresses: list[str] = [""] * num_shards

    def log_path(self, shard: int) -> Path:
        return self.workdir / f"ps{shard}.log"

    def log_tail(self, shard: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(shard).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def command(self, shard: int, port: int = 0) -> list[str]:
        ready = self.workdir / f"ps{shard}.addr"
        return [
            *self.launchers[shard], sys.executable, "-m", "psserver",
            "--shard", str(shard), "--num-shards", str(self.num_shards),
            "--host", self.hosts[shard], "--port", str(port), "--ready-file", str(ready),
            *self.server_args, *self.shard_args.get(shard, ()),
        ]  # fmt: skip

    def start_shard(self, shard: int, port: int = 0, timeout: float | None = None) -> str:
        """Starts (or restarts) one shard and waits for its ready file; returns ``HOST:PORT``.

        ``timeout``: seconds to wait (default ``start_timeout``).

        Raises:
            ClusterError: the shard exited or did not become ready in time.
        """
        ready = self.workdir / f"ps{shard}.addr"
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        logf = open(self.log_path(shard), "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        proc = subprocess.Popen(self.command(shard, port), stdout=logf, stderr=subprocess.STDOUT, env=env)
        logf.close()
        self.procs[shard] = proc
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready.exists():
                self.addresses[shard] = ready.read_text().strip()
                return self.addresses[shard]
            if proc.poll() is not None:
                raise ClusterError(f"shard {shard} exited with {proc.returncode}:\n{self.log_tail(shard)}")
            time.sleep(0.02)
        proc.kill()
        raise ClusterError(f"shard {shard} not ready after {timeout:.0f}s:\n{self.log_tail(shard)}")

    def start(self) -> LocalCluster:
        """Starts every shard (in parallel) and waits until all serve."""
        try:
            for shard in range(self.num_shards):
                self.start_shard(shard)
        except BaseException:
            self.stop()
            raise
        log.info("local cluster up: %s", ", ".join(self.addresses))
        return self

    def kill_shard(self, shard: int) -> None:
        """SIGKILLs one shard (fault-injection)."""
        proc = self.procs[shard]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=self.stop_timeout)

    def stop_shard(self, shard: int, timeout: float | None = None) -> int | None:
        """SIGTERMs one shard and waits; SIGKILL after ``timeout`` (default ``stop_timeout``). Returns its
        exit code."""
        timeout = self.stop_timeout if timeout is None else timeout
        proc = self.procs[shard]
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("shard %d ignored SIGTERM for %.0fs; killing it", shard, timeout)
                proc.kill()
                proc.wait(timeout=timeout)
        return proc.returncode

    def stop(self) -> list[int | None]:
        """Stops every shard (SIGTERM, then SIGKILL after a timeout); returns their exit codes."""
        codes = [self.stop_shard(s) for s in range(self.num_shards)]
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return codes

    def shard_rss_mib(self, field: str = "VmRSS") -> list[float]:
        """Each running shard's resident memory (``rss_mib``), in shard order (NaN for a stopped one)."""
        return [
            rss_mib(p.pid, field) if p is not None and p.poll() is None else float("nan") for p in self.procs
        ]

    def __enter__(self) -> LocalCluster:
        if all(p is not None and p.poll() is None for p in self.procs):  # ``LocalCluster(...).start()``:
            return self  # started already (starting again would leave the first shards running, unowned)
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and not issubclass(exc_type, (KeyboardInterrupt, GeneratorExit)):
            log.warning("a local cluster's block failed; its shards:\n%s", self.failure_report())
        self.stop()

    def failure_report(self, lines: int = 150) -> str:
        """What a failed run shows of its shards: every live shard first writes its threads' stacks and its
        asyncio tasks into its log (SIGUSR1, SIGUSR2: ``pscore.loopwatch``), then each shard's log tail
        (``lines``), under a heading."""
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)  # its threads (even with its event loop blocked)
                os.kill(proc.pid, signal.SIGUSR2)  # its asyncio tasks and where each awaits
        time.sleep(0.5 if live else 0)  # the dumps reach the logs
        parts = []
        for s, p in enumerate(self.procs):
            state = "running" if p is not None and p.poll() is None else "stopped"
            parts.append(
                f"--- shard {s} {self.addresses[s] or '(not up)'} ({state}) ---\n{self.log_tail(s, lines)}"
            )
        return "\n".join(parts)


_ATTACH_TIMEOUT_S = 30.0  # a backup attaches within a second; this covers a loaded CI machine


@contextlib.contextmanager
def backups_of(cluster: LocalCluster, server_args: Sequence[str] = ()) -> Iterator[LocalCluster]:
    """Starts a backup process per shard of ``cluster`` (``psserver --backup-of``); yields them once every
    primary reports its backup attached. Clients then take ``f"{primary}|{backup}"`` per shard.

    Raises:
        ClusterError: a backup did not start, or not every primary had its backup within 30 s.
    """
    import asyncio

    from psclient import admin

    extra = {i: ["--backup-of", cluster.addresses[i]] for i in range(cluster.num_shards)}
    with LocalCluster(cluster.num_shards, server_args, shard_args=extra) as backups:
        deadline = time.monotonic() + _ATTACH_TIMEOUT_S
        while True:  # bounded by the deadline
            statuses = asyncio.run(admin.cluster_status(cluster.addresses, variables=False))
            if [s.peer for s in statuses] == backups.addresses:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"backups did not attach within {_ATTACH_TIMEOUT_S:.0f}s: {statuses}")
            time.sleep(0.05)
        yield backups
