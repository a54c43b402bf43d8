"""Prometheus metrics of one shard: RPC counts, bytes, latency, staleness, barrier waits, versions.

Everything a shard exports lives in its own ``CollectorRegistry`` (never the
process-global one), so several shards can run in one process (tests) and each
serves only its own numbers. Three pieces feed it, none of which needs the
servicer's handlers to know about metrics:

- ``ShardMetrics.interceptor()``: a grpc.aio server interceptor that times every
  ``ParameterServer`` RPC, counts errors by status code, counts tensor bytes in
  and out, counts pushes by outcome (applied, duplicate, stale, restored) and pulls, and
  measures each push's staleness.
- ``ShardMetrics`` as the mode's ``listener`` (``psserver.modes.WaitListener``):
  times how long pushes and pulls wait inside the mode (the sync barrier, the
  SSP wait), remembering who is waiting so ``stall_report`` can name who they
  wait for.
- a collector that reads the store at scrape time: variables, stored bytes,
  each variable's version, the longest current wait, checkpoint age and whether
  changes are not saved yet, the replication role and backup link (``attach``
  hands it the shard's checkpointer and replication ends).

Staleness of a push: the number of updates the shard applied between the
pushing worker's last read (a pull, or a push that returned values) and this
push; 0 means the gradient was computed on the newest values.

The metrics HTTP endpoint (``serve``) runs prometheus-client's WSGI server in a
daemon thread. What every request adds to (pushes by outcome, pulls, bytes, RPC
latency, staleness, barrier waits) is plain numbers (``Tally``, ``Timings``) that
only the event loop writes, without a lock or a call into prometheus-client per
request; the scrape reads them (``_RequestCollector``). The rarer counters are
prometheus-client's (it makes them safe across threads).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pscore.errors import status_from_number
from pscore.security import HandlerWrappingInterceptor
from psproto.v1 import ps_pb2
from psserver.store import Store

if TYPE_CHECKING:
    from psserver.backup import Backup
    from psserver.checkpoint import Checkpointer
    from psserver.replication import Primary

log = logging.getLogger(__name__)

_SERVICE_PREFIX = f"/{ps_pb2.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/"
_PULLS = frozenset({"Pull", "PullStream"})
_PUSHES = frozenset({"Push", "PushStream"})
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
_MAX_TRACKED_WORKERS = 10_000  # bounds the per-worker tables against endless fresh worker ids
ROLES = ("primary", "backup", "orphaned")  # psserver_role{role}: GetStatus.role of a shard process


@dataclass(frozen=True, slots=True)
class Wait:
    """A push or pull currently waiting inside the mode."""

    op: str  # "push" or "pull"
    worker_id: str
    step: int
    since: float  # time.monotonic()


class Tally:
    """A counter the event loop adds to (``inc``, or ``value`` directly), read at scrape time: no lock and
    no call into prometheus-client per request. Only the shard's event loop writes it; the scrape (the
    HTTP thread) reads one float."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Timings:
    """A histogram the event loop observes into, read at scrape time (as ``Tally``). ``counts[i]``: the
    observations in bucket ``i`` (at most ``bounds[i]``; the last, above every bound: ``+Inf``)."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class ShardMetrics:
    """The metrics of one shard, in a private registry.

    Args:
        shard: the shard index (every sample carries it as the ``shard`` label).
        store: the shard's variables (read at scrape time).
        mode_name: the shard's update mode (barrier waits are recorded in sync and ssp modes).
    """

    def __init__(self, shard: int, store: Store, mode_name: str = "async") -> None:
        self.shard = shard
        self.store = store
        self.mode_name = mode_name
        self.registry = CollectorRegistry(auto_describe=True)
        label = {"shard": str(shard)}
        reg = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ("shard", *labels), registry=reg)

        # The counts and timings every request adds to are plain numbers (``Tally``, ``Timings``: no lock,
        # no call into prometheus-client per request), exported at scrape time by ``_RequestCollector``.
        self._pushes_by_outcome: dict[str, Tally] = {}  # psserver_pushes{outcome}
        for outcome in ("applied", "duplicate", "stale"):  # present (at 0) before the first push
            self._pushes_by_outcome[outcome] = Tally()
        self._latency_by_rpc: dict[str, Timings] = {}  # psserver_rpc_latency_seconds{rpc}
        self._barrier_by_op: dict[str, Timings] = {}  # psserver_barrier_wait_seconds{op}
        self.pulls = Tally()
        self.push_bytes = Tally()
        self.pull_bytes = Tally()
        self.staleness = Timings(_STALENESS_BUCKETS)
        self._errors = counter("psserver_rpc_errors", "RPCs that ended with an error status", ("rpc", "code"))
        self.dropped_stale = counter(
            "psserver_dropped_stale_gradients", "Gradients dropped because their step had passed (sync)"
        ).labels(**label)
        self.checkpoints = counter("psserver_checkpoints", "Checkpoints written").labels(**label)
        self.loop_stalls = counter(
            "psserver_event_loop_stalls", "Times the shard's event loop stopped turning for 2 s or more"
        ).labels(**label)
        self.loop_blocked = counter(
            "psserver_event_loop_blocked_seconds", "Seconds the event loop spent in those stalls"
        ).labels(**label)
        self.replication_ack = Histogram(
            "psserver_replication_ack_seconds",
            "Replication lag: time from forwarding an update to the backup until it acknowledged it",
            ("shard",),
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        ).labels(**label)
        self.last_checkpoint: float | None = None  # time.time() of the last checkpoint written
        self.checkpointer: Checkpointer | None = None
        self.checkpoint_every_s = 0.0
        self.primary: Primary | None = None
        self.backup: Backup | None = None
        self.waits: dict[int, Wait] = {}
        self._wait_ids = itertools.count()
        self._last_read: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.workers_seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        reg.register(_StoreCollector(self))
        reg.register(_RequestCollector(self))
        self._http: Any = None
        self.port: int | None = None

    def attach(
        self,
        *,
        checkpointer: Checkpointer | None = None,
        checkpoint_every_s: float | None = None,
        primary: Primary | None = None,
        backup: Backup | None = None,
    ) -> None:
        """Hooks the shard's checkpointer and replication ends (each optional) into the metrics.

        Checkpoints written are recorded (``psserver_checkpoints_total``, age),
        the backup's acknowledgements timed (``psserver_replication_ack_seconds``),
        and the rest is read at scrape time.
        """
        if checkpointer is not None:
            self.checkpointer = checkpointer
            self.checkpoint_every_s = checkpoint_every_s or 0.0
            checkpointer.on_saved = self.checkpoint_saved
        if primary is not None:
            self.primary = primary
            primary.on_ack = self.replication_ack.observe
        self.backup = backup

    # -- recording ----------------------------------------------------------

    def pushed(self, outcome: str) -> None:
        tally = self._pushes_by_outcome.get(outcome)
        if tally is None:
            tally = self._pushes_by_outcome[outcome] = Tally()
        tally.value += 1
        if outcome == "stale":
            self.dropped_stale.inc()

    def rpc_done(self, rpc: str, seconds: float, code: grpc.StatusCode) -> None:
        timings = self._latency_by_rpc.get(rpc)
        if timings is None:
            timings = self._latency_by_rpc[rpc] = Timings(_LATENCY_BUCKETS)
        timings.counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1  # Timings.observe, inline
        timings.sum += seconds
        if code != grpc.StatusCode.OK:
            self._errors.labels(shard=str(self.shard), rpc=rpc, code=code.name).inc()

    def push_received(self, request: Any, nbytes: int) -> None:
        """A push arrived (any RPC, or the data port) with ``nbytes`` of gradients."""
        worker_id = request.worker_id
        if worker_id:  # saw_worker and push_arrived, inline: one call a push
            seen = self.workers_seen
            seen[worker_id] = time.monotonic()
            seen.move_to_end(worker_id)
            if len(seen) > _MAX_TRACKED_WORKERS:
                seen.popitem(last=False)
            last = self._last_read.get(worker_id)
            if last is not None:  # staleness.observe(updates - last), inline
                lag, staleness = max(0, self.store.pushes - last), self.staleness
                staleness.counts[bisect.bisect_left(staleness.bounds, lag)] += 1
                staleness.sum += lag
        self.push_bytes.value += nbytes

    def push_done(self, request: Any, response: Any, code: grpc.StatusCode, seconds: float, rpc: str) -> None:
        """A push ended with ``code`` after ``seconds`` (``response``: its first answer, or None)."""
        timings = self._latency_by_rpc.get(rpc)  # rpc_done and pushed, inline: one call a push
        if timings is None:
            timings = self._latency_by_rpc[rpc] = Timings(_LATENCY_BUCKETS)
        timings.counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        timings.sum += seconds
        if code != grpc.StatusCode.OK:
            self._errors.labels(shard=str(self.shard), rpc=rpc, code=code.name).inc()
            return
        if request is None or response is None:
            return
        outcome = "applied" if response.applied else (response.reason or "not_applied")
        tally = self._pushes_by_outcome.get(outcome)
        if tally is None:
            tally = self._pushes_by_outcome[outcome] = Tally()
        tally.value += 1
        if outcome == "stale":
            self.dropped_stale.inc()
        worker_id = request.worker_id
        if request.return_values and worker_id:  # read_by, inline
            reads = self._last_read
            reads[worker_id] = self.store.pushes
            reads.move_to_end(worker_id)
            if len(reads) > _MAX_TRACKED_WORKERS:
                reads.popitem(last=False)

    def pull_done(self, request: Any, code: grpc.StatusCode, seconds: float, rpc: str) -> None:
        """A pull ended with ``code`` after ``seconds``."""
        self.rpc_done(rpc, seconds, code)
        if code == grpc.StatusCode.OK and request is not None:
            self.pulls.value += 1
            self.read_by(request.worker_id)

    def barrier_wait(self, op: str, seconds: float) -> None:
        timings = self._barrier_by_op.get(op)
        if timings is None:
            timings = self._barrier_by_op[op] = Timings(_LATENCY_BUCKETS)
        timings.observe(seconds)

    def checkpoint_saved(self, when: float | None = None) -> None:
        """Records a checkpoint written at ``when`` (``time.time()``; default now)."""
        self.last_checkpoint = time.time() if when is None else when
        self.checkpoints.inc()

    def _updates(self) -> int:
        return self.store.pushes

    def saw_worker(self, worker_id: str) -> None:
        if not worker_id:
            return
        self.workers_seen[worker_id] = time.monotonic()
        self.workers_seen.move_to_end(worker_id)
        if len(self.workers_seen) > _MAX_TRACKED_WORKERS:
            self.workers_seen.popitem(last=False)

    def read_by(self, worker_id: str) -> None:
        """``worker_id`` has just read the shard's current values."""
        if not worker_id:
            return
        self._last_read[worker_id] = self._updates()
        self._last_read.move_to_end(worker_id)
        if len(self._last_read) > _MAX_TRACKED_WORKERS:
            self._last_read.popitem(last=False)

    def push_arrived(self, worker_id: str) -> None:
        """Observes the staleness of a push from ``worker_id`` (when the worker has read before)."""
        last = self._last_read.get(worker_id)
        if last is not None:
            self.staleness.observe(max(0, self._updates() - last))  # as push_received does it

    def wait_begin(self, op: str, worker_id: str, step: int) -> int:
        token = next(self._wait_ids)
        self.waits[token] = Wait(op, worker_id, step, time.monotonic())
        return token

    def wait_end(self, token: int) -> None:
        wait = self.waits.pop(token, None)
        if wait is not None and self.mode_name != "async":
            self.barrier_wait(wait.op, time.monotonic() - wait.since)

    # -- stall report -------------------------------------------------------

    def stall_report(self, older_than_s: float, now: float | None = None) -> str | None:
        """Describes pushes/pulls waiting in the mode for longer than ``older_than_s``, or None.

        Names the waiting workers and steps, and the awaited ones: workers seen
        by this shard that are not waiting (they have not pushed the step yet).
        """
        now = time.monotonic() if now is None else now
        stalled = sorted(
            (w for w in self.waits.values() if now - w.since > older_than_s), key=lambda w: w.since
        )
        if not stalled:
            return None
        waiting = {w.worker_id for w in self.waits.values()}
        awaited = sorted(w for w in self.workers_seen if w not in waiting)
        parts = [
            f"{w.op} of {w.worker_id or '(anonymous)'} for step {w.step} waiting {now - w.since:.1f}s"
            for w in stalled[:8]
        ]
        if len(stalled) > 8:
            parts.append(f"and {len(stalled) - 8} more")
        text = f"shard {self.shard} ({self.mode_name} mode) stalled: {'; '.join(parts)}; awaiting "
        text += ", ".join(awaited) if awaited else "workers not seen yet"
        return text

    async def watch_stalls(self, *, interval_s: float = 5.0, older_than_s: float = 10.0) -> None:
        """Logs a warning every ``interval_s`` while a wait exceeds ``older_than_s``; runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            report = self.stall_report(older_than_s)
            if report:
                log.warning("%s", report)

    def on_loop_stall(self, blocked_s: float) -> None:
        """Counts one stall of the event loop (``pscore.loopwatch.LoopWatch``'s ``on_stall``)."""
        self.loop_stalls.inc()
        self.loop_blocked.inc(blocked_s)

    # -- interceptor --------------------------------------------------------

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor recording this shard's RPC metrics."""
        return _MetricsInterceptor(self)

    # -- HTTP endpoint ------------------------------------------------------

    def serve(self, host: str, port: int) -> int:
        """Serves ``/metrics`` on ``host:port`` (0: an ephemeral port) in a daemon thread; returns the port.

        Raises:
            OSError: the port cannot be bound.
        """
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        """Stops the HTTP endpoint (if serving). Idempotent."""
        server, self._http = self._http, None
        if server is not None:
            server.shutdown()
            server.server_close()

    async def aclose(self) -> None:
        """``close`` off the event loop (shutdown waits for the serving thread)."""
        if self._http is not None:
            await asyncio.to_thread(self.close)


class _StoreCollector(Collector):
    """Reads the store at scrape time (from the HTTP thread: only atomic reads of immutable state)."""

    def __init__(self, metrics: ShardMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        shard = str(self.m.shard)
        variables = list(self.m.store.variables())
        states = [(v.name, v.state) for v in variables]
        count = GaugeMetricFamily("psserver_variables", "Stored tensors on this shard", labels=["shard"])
        count.add_metric([shard], len(states))
        size = GaugeMetricFamily("psserver_stored_bytes", "Bytes of stored values", labels=["shard"])
        size.add_metric([shard], sum(value.nbytes for _, (value, _) in states))
        version = GaugeMetricFamily(
            "psserver_variable_version", "Updates applied to each stored tensor", labels=["shard", "variable"]
        )
        nbytes = GaugeMetricFamily(
            "psserver_variable_bytes", "Bytes of each stored tensor", labels=["shard", "variable"]
        )
        for name, (value, ver) in states:
            version.add_metric([shard, name], ver)
            nbytes.add_metric([shard, name], value.nbytes)
        uptime = GaugeMetricFamily(
            "psserver_uptime_seconds", "Seconds since the shard started", labels=["shard"]
        )
        uptime.add_metric([shard], time.monotonic() - self.m.store.started)
        waiting = GaugeMetricFamily(
            "psserver_waiting_requests", "Pushes and pulls waiting in the mode now", labels=["shard"]
        )
        waiting.add_metric([shard], len(self.m.waits))
        oldest = GaugeMetricFamily(
            "psserver_oldest_wait_seconds",
            "Seconds the longest-waiting push or pull has waited in the mode (0: none waits)",
            labels=["shard"],
        )
        since = min((w.since for w in list(self.m.waits.values())), default=None)
        oldest.add_metric([shard], 0.0 if since is None else max(0.0, time.monotonic() - since))
        age = GaugeMetricFamily(
            "psserver_checkpoint_age_seconds",
            "Seconds since the last checkpoint was written (NaN: none yet)",
            labels=["shard"],
        )
        last = self.m.last_checkpoint
        age.add_metric([shard], math.nan if last is None else max(0.0, time.time() - last))
        yield from (count, size, version, nbytes, uptime, waiting, oldest, age)
        yield from self._checkpointing(shard)
        yield from self._replication(shard)
        yield from _dynamic_families(shard, variables)
        yield from _tier_families(shard, variables)

    def _checkpointing(self, shard: str) -> Iterator[GaugeMetricFamily]:
        checkpointer = self.m.checkpointer
        if checkpointer is None:  # no --checkpoint-dir: nothing to watch
            return
        dirty = GaugeMetricFamily(
            "psserver_checkpoint_dirty",
            "1 while the shard holds changes that no checkpoint has saved yet",
            labels=["shard"],
        )
        dirty.add_metric([shard], 1.0 if checkpointer.dirty else 0.0)
        every = GaugeMetricFamily(
            "psserver_checkpoint_interval_seconds",
            "--checkpoint-every (0: checkpoints only at shutdown and on request)",
            labels=["shard"],
        )
        every.add_metric([shard], self.m.checkpoint_every_s)
        yield from (dirty, every)

    def _replication(self, shard: str) -> Iterator[Metric]:
        backup = self.m.backup
        current = backup.role if backup is not None else "primary"
        role = GaugeMetricFamily(
            "psserver_role", "1 for the process's current replication role, 0 for the others",
            labels=["shard", "role"],
        )  # fmt: skip
        for name in ROLES:
            role.add_metric([shard, name], 1.0 if name == current else 0.0)
        yield role
        primary = self.m.primary
        if primary is not None:  # a backup may attach
            attached = GaugeMetricFamily(
                "psserver_replication_backup_attached",
                "1 while a confirmed backup follows this shard (every update waits for its acknowledgement)",
                labels=["shard"],
            )
            attached.add_metric([shard], 1.0 if primary.backup else 0.0)
            unacked = GaugeMetricFamily(
                "psserver_replication_unacked_updates",
                "Updates forwarded to the backup and not acknowledged yet",
                labels=["shard"],
            )
            unacked.add_metric([shard], primary.unacknowledged)
            lease_left = GaugeMetricFamily(
                "psserver_replication_lease_seconds",
                "Seconds left on the lease the backup's acknowledgements renew (a replicated primary "
                "refuses client calls at 0); -1 when none is needed (no backup confirmed, or it resigned)",
                labels=["shard"],
            )
            lease_left.add_metric([shard], primary.lease_left() if current == "primary" else 0.0)
            term = GaugeMetricFamily(
                "psserver_replication_term",
                "The replication term of the history this process holds (raised by every takeover)",
                labels=["shard"],
            )
            term.add_metric([shard], primary.term if current == "primary" else backup.term if backup else 0)
            unprotected = GaugeMetricFamily(
                "psserver_replication_unprotected",
                "1 while a primary serves with no backup after a failover or its backup's resignation "
                "(--serve-alone): what it acknowledges is on this process only",
                labels=["shard"],
            )
            unprotected.add_metric([shard], 1.0 if current == "primary" and primary.unprotected else 0.0)
            yield from (attached, unacked, lease_left, term, unprotected)
        if backup is not None:  # --backup-of: this process follows a primary
            applied = CounterMetricFamily(
                "psserver_replication_updates_applied",
                "Pushes and assignments of its primary this backup has applied",
                labels=["shard"],
            )
            applied.add_metric([shard], backup.applied)
            yield applied

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


_DYNAMIC_COUNTERS = (
    ("admitted", "psserver_table_admitted_rows", "Rows a dynamic table created (ids admitted)"),
    ("evicted", "psserver_table_evicted_rows", "Rows a dynamic table evicted to stay within its capacity"),
    ("expired", "psserver_table_expired_rows", "Rows a dynamic table removed for their TTL"),
    (
        "dropped_updates",
        "psserver_table_dropped_row_updates",
        "Row updates a dynamic table dropped (id not admitted yet, or no room in the push)",
    ),
    (
        "initializer_reads",
        "psserver_table_initializer_reads",
        "Ids a dynamic table was asked for without a row (answered with the initializer's row)",
    ),
)


class _RequestCollector(Collector):
    """Exports what every request adds to (``Tally``, ``Timings``) as prometheus-client's ``Counter`` and
    ``Histogram`` would: the same names, labels and samples (``_created`` included). Runs in the HTTP
    thread: copies each list before reading it."""

    def __init__(self, metrics: ShardMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        shard = str(m.shard)
        pushes = CounterMetricFamily(
            "psserver_pushes", "Push RPCs completed, by outcome", labels=["shard", "outcome"]
        )
        for outcome, tally in list(m._pushes_by_outcome.items()):
            pushes.add_metric([shard, outcome], tally.value, created=tally.created)
        yield pushes
        for name, doc, tally in (
            ("psserver_pulls", "Pull RPCs completed", m.pulls),
            ("psserver_push_bytes", "Gradient bytes received", m.push_bytes),
            ("psserver_pull_bytes", "Value bytes sent", m.pull_bytes),
        ):
            family = CounterMetricFamily(name, doc, labels=["shard"])
            family.add_metric([shard], tally.value, created=tally.created)
            yield family
        yield _histogram(
            "psserver_rpc_latency_seconds",
            "Time to serve a ParameterServer RPC, by method",
            "rpc",
            {rpc: t for rpc, t in list(m._latency_by_rpc.items())},
            shard,
        )
        yield _histogram(
            "psserver_push_staleness",
            "Updates applied between the pushing worker's last read and its push",
            None,
            {"": m.staleness},
            shard,
        )
        yield _histogram(
            "psserver_barrier_wait_seconds",
            "Time a push (sync barrier) or pull (ssp bound) waited in the mode",
            "op",
            {op: t for op, t in list(m._barrier_by_op.items())},
            shard,
        )

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())


def _histogram(name: str, doc: str, label: str | None, by: dict[str, Timings], shard: str) -> Metric:
    """A histogram family with a ``shard`` label (and ``label``, one series per key of ``by``), as
    prometheus-client's ``Histogram`` exports it."""
    family = Metric(name, doc, "histogram")
    for key, timings in by.items():
        labels = {"shard": shard} if label is None else {"shard": shard, label: key}
        counts = list(timings.counts)  # one atomic copy: the buckets and the count agree
        total = 0.0
        for bound, count in zip((*timings.bounds, math.inf), counts, strict=True):
            total += count
            family.add_sample(name + "_bucket", {**labels, "le": floatToGoString(bound)}, total)
        family.add_sample(name + "_count", labels, total)
        family.add_sample(name + "_sum", labels, timings.sum)
        family.add_sample(name + "_created", labels, timings.created)
    return family


def _dynamic_families(shard: str, variables: list[Any]) -> Iterator[Any]:
    """Rows, capacity and counters of each dynamic table piece on the shard (labels: shard, table)."""
    pieces = [(v.dyn.config.table, v.dyn) for v in variables if v.dyn is not None]
    if not pieces:
        return
    rows = GaugeMetricFamily(
        "psserver_table_rows", "Rows a dynamic table holds on this shard", labels=["shard", "table"]
    )
    capacity = GaugeMetricFamily(
        "psserver_table_capacity_rows",
        "Rows a dynamic table holds on this shard at most (0: unbounded)",
        labels=["shard", "table"],
    )
    for table, dyn in pieces:
        rows.add_metric([shard, table], len(dyn))
        capacity.add_metric([shard, table], dyn.config.capacity)
    yield from (rows, capacity)
    for attr, name, doc in _DYNAMIC_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["shard", "table"])
        for table, dyn in pieces:
            family.add_metric([shard, table], getattr(dyn.stats, attr))
        yield family


def piece_memory_bytes(var: Any) -> int:
    """Bytes a dynamic table piece holds in memory: rows, optimizer slots and bookkeeping (a tiered piece:
    its claim on the shard's budget)."""
    return int(var.dyn.memory_bytes(var))


def _tier_families(shard: str, variables: list[Any]) -> Iterator[Any]:
    """The disk tier of each tiered dynamic table piece (labels: shard, table, and tier: memory or disk).

    Exported (without samples) by every shard, so dashboards and alerts can name them.
    Hit rate: ``lookups{tier="memory"} / sum(lookups)``; mean batched read latency:
    ``rate(read_seconds) / rate(reads)``.
    """
    pieces = [
        (v.dyn.config.table, v, v.dyn.tier) for v in variables if v.dyn is not None and v.dyn.tier is not None
    ]
    labels = ["shard", "table", "tier"]
    rows = GaugeMetricFamily(
        "psserver_table_tier_rows",
        "Rows of a dynamic table in each tier (disk: the rows that live only there, as ListVariables' "
        "rows_on_disk and psctl status count them)",
        labels=labels,
    )
    records = GaugeMetricFamily(
        "psserver_table_tier_disk_records",
        "Records in a dynamic table's disk tier: its rows on disk, the older copies of rows filled back "
        "into memory (replaced when spilled again), and expired records not yet deleted",
        labels=["shard", "table"],
    )
    size = GaugeMetricFamily(
        "psserver_table_tier_bytes",
        "Bytes of a dynamic table in each tier (memory: rows, slots, bookkeeping; disk: allocated blocks)",
        labels=labels,
    )
    budget = GaugeMetricFamily(
        "psserver_table_tier_memory_budget_rows",
        "Rows of a dynamic table the in-memory tier holds at most now (its claim on --table-memory, "
        "which grows while the shard's budget has room)",
        labels=["shard", "table"],
    )
    lookups = CounterMetricFamily(
        "psserver_table_tier_lookups",
        "Ids of pushes and lookups found in each tier (the memory tier's share is the hit rate)",
        labels=labels,
    )
    spilled = CounterMetricFamily(
        "psserver_table_tier_spilled_rows", "Rows moved from memory to disk", labels=["shard", "table"]
    )
    filled = CounterMetricFamily(
        "psserver_table_tier_filled_rows",
        "Rows a push moved from disk back into memory",
        labels=["shard", "table"],
    )
    reads = CounterMetricFamily(
        "psserver_table_tier_reads", "Batched reads of the disk tier", labels=["shard", "table"]
    )
    read_s = CounterMetricFamily(
        "psserver_table_tier_read_seconds",
        "Seconds in batched reads of the disk tier",
        labels=["shard", "table"],
    )
    for table, var, tier in pieces:
        dyn = var.dyn
        rows.add_metric([shard, table, "memory"], dyn.hot_len)
        rows.add_metric([shard, table, "disk"], dyn.cold_len)  # one count with ListVariables
        records.add_metric([shard, table], len(tier))
        size.add_metric([shard, table, "memory"], piece_memory_bytes(var))
        size.add_metric([shard, table, "disk"], tier.disk_used)
        budget.add_metric([shard, table], dyn.limit)
        lookups.add_metric([shard, table, "memory"], tier.stats.hot_hits)
        lookups.add_metric([shard, table, "disk"], tier.stats.cold_hits)
        spilled.add_metric([shard, table], tier.stats.spilled)
        filled.add_metric([shard, table], tier.stats.filled)
        reads.add_metric([shard, table], tier.stats.reads)
        read_s.add_metric([shard, table], tier.stats.read_seconds)
    yield from (rows, records, size, budget, lookups, spilled, filled, reads, read_s)


def _chunk_bytes(chunks: Iterable[ps_pb2.TensorChunk]) -> int:
    return sum(len(c.data) for c in chunks)


class _MetricsInterceptor(HandlerWrappingInterceptor):
    """Wraps each ParameterServer handler (once per method) to time it and count what goes through it."""

    def __init__(self, metrics: ShardMetrics) -> None:
        super().__init__()
        self.m = metrics

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if not method.startswith(_SERVICE_PREFIX):
            return handler
        rpc = method[len(_SERVICE_PREFIX) :]
        m = self.m
        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }

        def on_request(req: Any) -> None:
            if rpc in _PUSHES:
                m.push_received(req, _chunk_bytes(req.grads))
            elif rpc in _PULLS:
                m.saw_worker(req.worker_id)

        def on_response(resp: Any, req: Any) -> None:
            if rpc in _PULLS or rpc in _PUSHES:  # pulled values, or a push_pull's returned values
                m.pull_bytes.inc(_chunk_bytes(resp.values))

        def on_done(req: Any, first_resp: Any, code: grpc.StatusCode, started: float) -> None:
            seconds = time.perf_counter() - started
            if rpc in _PULLS:
                m.pull_done(req, code, seconds, rpc)
            elif rpc in _PUSHES:
                m.push_done(req, first_resp, code, seconds, rpc)
            else:
                m.rpc_done(rpc, seconds, code)

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started = time.perf_counter()
                code = grpc.StatusCode.UNKNOWN
                response = None
                try:
                    on_request(request)
                    response = await inner_uu(request, context)
                    on_response(response, request)
                    code = _code_of(context, grpc.StatusCode.OK)
                    return response
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code_of(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    on_done(request, response, code, started)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)

        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                started = time.perf_counter()
                code = grpc.StatusCode.UNKNOWN
                first = None
                try:
                    on_request(request)
                    async for response in inner_us(request, context):
                        first = response if first is None else first
                        on_response(response, request)
                        yield response
                    code = _code_of(context, grpc.StatusCode.OK)
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code_of(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    on_done(request, first, code, started)

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)

        if rpc == "PushSession" and handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_metered_session(m, handler.stream_stream), **kw)

        inner_su, inner_ss = handler.stream_unary, handler.stream_stream

        async def _requests(iterator: AsyncIterator[Any], seen: list[Any]) -> AsyncIterator[Any]:
            async for request in iterator:
                if not seen:
                    seen.append(request)
                    on_request(request)
                elif rpc in _PUSHES:
                    m.push_bytes.inc(_chunk_bytes(request.grads))
                yield request

        if inner_su is not None:

            async def stream_unary(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                started = time.perf_counter()
                code = grpc.StatusCode.UNKNOWN
                seen: list[Any] = []
                response = None
                try:
                    response = await inner_su(_requests(iterator, seen), context)
                    code = _code_of(context, grpc.StatusCode.OK)
                    return response
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code_of(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    on_done(seen[0] if seen else None, response, code, started)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)

        async def stream_stream(
            iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            started = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            seen: list[Any] = []
            first = None
            try:
                async for response in inner_ss(_requests(iterator, seen), context):
                    first = response if first is None else first
                    on_response(response, seen[0] if seen else None)
                    yield response
                code = _code_of(context, grpc.StatusCode.OK)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except BaseException:
                code = _code_of(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                on_done(seen[0] if seen else None, first, code, started)

        return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


def _metered_session(m: ShardMetrics, inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    """PushSession: each request message is one push and each response its outcome, counted like a Push."""

    async def stream_stream(
        iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        arrived: collections.deque[tuple[Any, float]] = collections.deque()

        async def requests() -> AsyncIterator[Any]:
            async for req in iterator:
                m.push_received(req, _chunk_bytes(req.grads))
                arrived.append((req, time.perf_counter()))
                yield req

        async for resp in inner(requests(), context):
            req, started = arrived.popleft() if arrived else (None, time.perf_counter())
            code = status_from_number(resp.code)
            # A push, whichever RPC carried it.
            m.push_done(req, resp, code, time.perf_counter() - started, "Push")
            if code == grpc.StatusCode.OK and req is not None and req.return_values:
                m.pull_bytes.inc(_chunk_bytes(resp.values))
            yield resp

    return stream_stream


def _code_of(context: grpc.aio.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    try:
        code = context.code()
    except Exception:  # pragma: no cover - older grpc without ServicerContext.code()
        return default
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return status_from_number(code)
    return default
