"""The backup's side of primary-backup replication (``psserver --backup-of PRIMARY``).

A ``Backup`` attaches to its primary's ``Replicate`` stream (the protocol is
``psserver.replication``'s), loads the snapshot it sends, then applies every
update it forwards, per variable in version order, with the store's own update
routine (``Store.apply_one``: the primary's), acknowledging each whole update.
Until promoted it refuses client calls naming its primary; once confirmed, a
stream that ends (or a primary silent for longer than the lease allows) makes
it orphaned, and the first client call after the lease wait promotes it to
primary, once it has applied every update it read.

Reading and applying are two tasks. The reader takes every message as it
comes and acknowledges heartbeats at once; the updates go, in the order read,
to one replaying task, which applies them one at a time (the store's only
writer on a backup), its large computations in a worker thread as on the
primary. So an update that takes seconds (an unbounded table's growth copies
all of its rows) holds back only the updates after it: the heartbeats are
still read and acknowledged, and the primary keeps its lease. An
acknowledgement still follows the read of what it acknowledges, which is all
the lease needs (``psserver.lease``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import BinaryIO

import grpc
import numpy as np

from pscore import codec, rpc, security
from pscore.errors import UnavailableError
from psproto.v1 import ps_pb2
from psserver import checkpoint, ckptfile, lease, optimizers, tables
from psserver.modes import Mode
from psserver.replication import BACKUP_ADDRESS_KEY, BACKUP_TERM_KEY
from psserver.store import Store, Variable
from psserver.tier import spool

log = logging.getLogger(__name__)

_ATTACH_RETRY_S = (0.05, 1.0)  # backoff bounds while the primary is not reachable yet
_RESIGN_WAIT_S = 2.0  # a backup shutting down waits this long for its primary to take its resignation
_PAUSE_CHECK_S = 0.25  # a backup that finds its primary silent listens a heartbeat (at least this) more
_RESIGN = object()  # in a backup's acknowledgement queue: send ``resign`` and end the stream
_Update = tuple[ps_pb2.ReplicateResponse, dict[str, np.ndarray]]  # a whole update read: header, tensors


class Backup:
    """The backup's side: follows a primary, refuses clients until promoted.

    Args:
        primary: the primary's ``HOST:PORT``.
        store, mode: this (empty) shard's state.
        shard: this shard's index (the primary's must match).
        auth_token: sent to the primary when it requires one.
        connect: opens the channel to the primary (TLS, message sizes, keepalive; default: plaintext).
        term: the newest replication term this process has seen (a primary restarting in-process as
            its peer's backup keeps its own); sent to the primary, which never serves an older one.
    """

    def __init__(
        self,
        primary: str,
        store: Store,
        mode: Mode,
        *,
        shard: int,
        auth_token: str | None = None,
        connect: Callable[[str], grpc.aio.Channel] | None = None,
        term: int = 0,
    ) -> None:
        self.primary = primary
        self.connect = connect or grpc.aio.insecure_channel
        self.store = store
        self.mode = mode
        self.shard = shard
        self.auth_token = auth_token
        self.role = "backup"
        self.term = term  # the primary's (from its snapshot and every message); a promotion raises it
        # Called with the new term when this backup takes over (the primary's side serves from then on).
        self.on_promoted: Callable[[int], None] | None = None
        self.address = ""  # this backup's own HOST:PORT (set once it serves): the primary shows it
        self.loaded = False  # a snapshot is loaded (this attempt)
        self.caught_up = False  # confirmed by the primary: it may take over when the primary goes
        self.resigned = False  # shutting down: it will never take over
        self.applied = 0
        self.lease_s = lease.DEFAULT_LEASE_S  # the primary's (from its snapshot)
        self.last_heard = 0.0  # lease clock: when the last message from the primary was read
        self._heard = 0  # messages read (a pause is told from silence by this)
        self._takeover_at = float("inf")  # lease clock: when an orphaned backup may take over
        self._released = False  # the primary released its lease (SIGTERM): take over at once
        self._acks: asyncio.Queue[object] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        # The updates read and not applied yet, in the order read (None: the stream ended), and the task
        # that applies them; set while a stream with a loaded snapshot is followed.
        self._updates: asyncio.Queue[_Update | None] = asyncio.Queue()
        self._replaying: asyncio.Task[None] | None = None
        self._replayed = False  # orphaned, and every update read is applied: it may take over
        self._reset()

    def _reset(self) -> None:
        """Forgets what a previous attempt to attach applied (a new snapshot replaces it)."""
        # Per variable: updates that arrived before their predecessor
        # (target version -> (gradient or assigned value, update id, whether it is an assignment,
        # the primary's time of the update)).
        self._early: dict[str, dict[int, tuple[np.ndarray, int, bool, float]]] = {}
        self._remaining: dict[int, int] = {}  # update id -> gradients (or assigned values) not applied yet
        self._assigns: set[int] = set()  # ids of the Assigns among them (not counted as pushes)
        self._then: dict[int, Callable[[], None]] = {}  # update id -> the mode's replay once it is applied
        # UpdateOptimizer changes not applied yet: per variable, (version, spec, update id, reset) in order.
        self._swaps: dict[str, list[tuple[int, ps_pb2.OptimizerSpec, int, bool]]] = {}
        self._swaps_left: dict[int, int] = {}  # update id -> changes not applied yet

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Stops following. A standby that has its primary's state resigns first (it never takes over)."""
        if self._task is None:
            return
        if self.role == "backup" and self.loaded and not self._task.done():
            self.resigned = True
            self._acks.put_nowait(_RESIGN)
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                async with asyncio.timeout(_RESIGN_WAIT_S):
                    await asyncio.shield(self._task)  # the primary takes it and ends the stream
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def check_serving(self, what: str) -> None:
        """Lets a client call through on a primary; promotes an orphaned backup. Raises: UnavailableError."""
        if self.role == "primary":
            return
        if self.role == "orphaned" and not self.resigned:
            wait = self._takeover_at - lease.clock()
            if wait > 0:
                raise UnavailableError(
                    f"backup of {self.primary}: its primary is gone; it takes over in {wait:.1f}s, once the "
                    "primary's lease has surely expired; retry"
                )
            if not self._replayed:
                raise UnavailableError(
                    f"backup of {self.primary}: its primary is gone; it takes over once it has applied the "
                    f"updates it received last (about {self._updates.qsize()} wait); retry"
                )
            self.role = "primary"
            self.term += 1
            log.warning(
                "shard %d: promoted to primary in term %d on a client's %s (primary %s is gone); %d updates "
                "replicated", self.shard, self.term, what, self.primary, self.applied,
            )  # fmt: skip
            if self.on_promoted is not None:
                self.on_promoted(self.term)
            return
        raise UnavailableError(f"standby backup of primary {self.primary}: send {what} to the primary")

    async def run(self) -> None:
        """Attaches to the primary (retrying until it confirms this backup), then follows it until the end."""
        try:
            await self._attach_and_follow()
        finally:
            await self._stop_replaying()

    async def _attach_and_follow(self) -> None:
        delay = _ATTACH_RETRY_S[0]
        async with self.connect(self.primary) as channel:
            stub = rpc.Stub(channel)
            address = (*security.auth_metadata(self.auth_token), (BACKUP_ADDRESS_KEY, self.address))
            while True:
                self._acks = asyncio.Queue()  # never an acknowledgement meant for another stream
                metadata = (*address, (BACKUP_TERM_KEY, str(self.term)))
                call = stub.Replicate(self._ack_stream(self._acks), metadata=metadata, wait_for_ready=False)
                self.last_heard = lease.clock()
                follow = asyncio.create_task(self._follow(call))
                silent = asyncio.create_task(self._watch_silence(follow))
                try:
                    await follow
                    why = "the primary closed the stream"
                except grpc.RpcError as err:
                    why = f"{err.code().name}: {err.details()}"
                    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        log.error("shard %d: primary %s refuses a backup: %s", self.shard, self.primary, why)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if (task is not None and task.cancelling()) or not silent.done():
                        raise
                    why = f"no word from it for {lease.clock() - self.last_heard:.1f}s"
                except Exception as err:  # its state does not fit (another shard or mode), or would diverge
                    log.error(
                        "shard %d: stopped following primary %s: %s; this backup will not take over "
                        "(restart it to attach afresh)", self.shard, self.primary, err,
                    )  # fmt: skip
                    return
                finally:
                    silent.cancel()
                    call.cancel()
                    # Ends the acknowledgements: gRPC's task reading them would otherwise be left waiting
                    # on the queue and destroyed pending, the generator with it ("aclose(): asynchronous
                    # generator is already running", logged as an exception never retrieved).
                    self._acks.put_nowait(None)
                    if not self.caught_up:  # the next attempt starts over from a new snapshot
                        await self._stop_replaying()
                if self.caught_up or self.resigned:
                    break
                await asyncio.sleep(delay)  # the primary is not up yet (or dropped this backup): try again
                delay = min(delay * 2, _ATTACH_RETRY_S[1])
        if self.resigned:
            return
        self.role = "orphaned"
        wait = 0.0 if self._released else lease.backup_wait(self.lease_s)
        self._takeover_at = (lease.clock() if self._released else self.last_heard) + wait
        log.warning(
            "shard %d: replication from %s ended (%s); taking over on the next client call%s",
            self.shard, self.primary, why,
            " (it handed over)" if self._released else f", {wait:.2f}s after its last message (its lease)",
        )  # fmt: skip
        try:
            if self._replaying is not None:
                await self._replaying  # every update read (the queue ends with the stream's None)
            async with self.store.gate.passing():
                await self._flush()
        except Exception as err:  # the updates would diverge from the primary's
            self.role = "backup"
            log.error(
                "shard %d: stopped replaying primary %s: %s; this backup will not take over",
                self.shard, self.primary, err,
            )  # fmt: skip
            return
        self._replayed = True

    async def _stop_replaying(self) -> None:
        """Ends the replaying task (shutdown, or a new attempt: a new snapshot replaces its state) once
        the update it is applying is whole: the updates still queued are dropped, and none is cut short
        (a worker thread still writing into a store that a new snapshot replaces, a table's rows spilled
        to disk and still counted in memory)."""
        task, self._replaying = self._replaying, None
        if task is None:
            return
        while not self._updates.empty():
            self._updates.get_nowait()
        self._updates.put_nowait(None)
        with contextlib.suppress(Exception):
            await asyncio.shield(task)

    async def _watch_silence(self, follow: asyncio.Task[None]) -> None:
        """Ends ``follow`` when the primary has said nothing for ``lease.silence_limit`` (a silent death)."""
        while True:
            await asyncio.sleep(lease.heartbeat_every(self.lease_s))
            if lease.clock() - self.last_heard <= lease.silence_limit(self.lease_s):
                continue
            heard = self._heard
            # Paused (SIGSTOP, a stalled machine)? Then the messages that waited in the socket come now.
            await asyncio.sleep(max(lease.heartbeat_every(self.lease_s), _PAUSE_CHECK_S))
            if self._heard == heard:
                log.warning(
                    "shard %d: no word from primary %s for %.1fs: counting it as gone",
                    self.shard, self.primary, lease.clock() - self.last_heard,
                )  # fmt: skip
                follow.cancel()
                return

    async def _ack_stream(self, acks: asyncio.Queue[object]) -> AsyncIterator[ps_pb2.ReplicateRequest]:
        while True:
            first = await acks.get()
            if first is None:
                return
            if first is _RESIGN:
                yield ps_pb2.ReplicateRequest(resign=True)
                return
            batch = [first]
            while not acks.empty():
                more = acks.get_nowait()
                if more is None or more is _RESIGN:
                    acks.put_nowait(more)  # after this batch
                    break
                batch.append(more)
            yield ps_pb2.ReplicateRequest(acks=batch)  # type: ignore[arg-type]

    def _ack(self, update_id: int) -> None:
        if update_id:
            self._acks.put_nowait(update_id)

    async def _follow(self, stream: grpc.aio.StreamStreamCall) -> None:
        """Reads the stream: loads the snapshot, acknowledges heartbeats, queues the updates (``_replay``).

        Raises what the replaying task failed with, at the next message.
        """
        tier = self.store.tier
        received: BinaryIO | None = None
        update: tuple[ps_pb2.ReplicateResponse, codec.Assembler] | None = None
        self.loaded = False
        updates = self._updates = asyncio.Queue()
        try:
            async for message in stream:
                self.last_heard = lease.clock()  # before any acknowledgement of it
                self._heard += 1
                if self._replaying is not None and self._replaying.done():
                    self._replaying.result()  # it failed (an update would diverge): the stream ends
                if not self.loaded:
                    if received is None:
                        received = spool(tier)  # the primary's snapshot, as it arrives
                    await asyncio.to_thread(received.write, message.snapshot)
                    if message.snapshot_done:
                        received.seek(0)
                        with received:
                            await self._load(received, mapped=tier is not None)
                        received = None
                        if message.lease_s > 0:
                            self.lease_s = message.lease_s
                        self.term = max(self.term, message.term)
                        self._replaying = asyncio.create_task(self._replay(updates))
                        self._ack(message.id)
                    continue
                if update is None:  # the first message of an update carries its header
                    update = (message, codec.Assembler())
                for chunk in message.tensors:
                    update[1].add(chunk)
                if message.more:
                    continue
                header, tensors = update
                update = None
                if header.term > self.term:  # the primary took a newer term from a backup's (never lower)
                    self.term = header.term
                if header.heartbeat:
                    if header.confirmed and not self.caught_up:
                        self.caught_up = True
                        log.info("shard %d: confirmed by primary %s as its backup", self.shard, self.primary)
                    self._ack(header.id)
                elif header.release:
                    self._released = True  # the stream ends next
                else:
                    updates.put_nowait((header, tensors.result()))
        finally:
            if received is not None:  # the stream ended in the middle of the snapshot
                received.close()
            updates.put_nowait(None)  # the replay ends once it has applied what was read

    async def _replay(self, updates: asyncio.Queue[_Update | None]) -> None:
        """Applies the updates read, one at a time in the order read, until the stream's end (None).

        Each passes the store's gate whole, so a snapshot of this backup
        (``--checkpoint-every``) never holds half of one.
        """
        while (item := await updates.get()) is not None:
            header, tensors = item
            async with self.store.gate.passing():
                await self._replay_one(header, tensors)

    async def _replay_one(self, header: ps_pb2.ReplicateResponse, tensors: dict[str, np.ndarray]) -> None:
        if header.create:  # a table piece with an initializer comes without rows: made here too
            made = await self.store.make_rows(header.create)
            self.store.create(list(header.create), tensors, made)
            self._ack(header.id)
        elif header.optimizer_updates:
            self._update_optimizers(header)
        elif header.leave:
            self.mode.replay_leave(header.leave)
            self._ack(header.id)
        elif header.assign:
            await self._apply(header, tensors, assign=True)
        else:
            await self._apply(header, tables.pair(tensors))

    async def _load(self, received: BinaryIO, *, mapped: bool) -> None:
        label = f"snapshot from {self.primary}"
        snap = await asyncio.to_thread(ckptfile.load, received, label, mapped=mapped)
        if snap.shard != self.shard:
            raise RuntimeError(
                f"primary {self.primary} is shard {snap.shard}; this backup is shard {self.shard}"
            )
        if snap.mode != self.mode.name:
            raise RuntimeError(
                f"primary {self.primary} runs {snap.mode} mode; this backup runs {self.mode.name} "
                "(start it with the primary's --mode flags)"
            )
        if len(self.store):  # an earlier attempt loaded a snapshot and was not confirmed: start over
            self.store.clear()
            self._reset()
        checkpoint.load_into(snap, self.store, self.mode, restored=False)
        self.loaded = True
        log.info(
            "shard %d: caught up with primary %s (%d tensors, %.1f MiB); following",
            self.shard, self.primary, len(snap.tensors), snap.nbytes / 2**20,
        )  # fmt: skip

    async def _apply(
        self, message: ps_pb2.ReplicateResponse, tensors: Mapping[str, tables.Grad], *, assign: bool = False
    ) -> None:
        """A push or a sync step (gradients) or, with ``assign``, an Assign (values) of the primary."""
        if len(tensors) != len(message.versions):
            raise RuntimeError(
                f"update {message.id}: {len(tensors)} tensors, {len(message.versions)} versions"
            )
        if message.sync_step:
            # Recorded, not claimed: the primary already decided (its order of claims may differ from
            # this order of applied updates, so a takeover must not refuse anything here).
            for key in message.claims:
                self.store.ledger.record(key.worker_id, key.seq_ranges[0], key.session)
            workers = [key.worker_id for key in message.claims]
            self._then[message.id] = functools.partial(self.mode.replay_step, message.step, workers)
        elif not assign:
            self.store.ledger.record(message.worker_id, message.seq, message.session)
            if len(message.shards) > 1:
                self.store.ledger.note_sent(message.worker_id, message.seq, message.session, message.shards)
            self._then[message.id] = functools.partial(self.mode.replay_push, message.worker_id, message.step)
        self._remaining[message.id] = len(tensors)
        if assign:
            self._assigns.add(message.id)
        if not tensors:  # an empty push or step (every mode takes them): nothing waits
            self._remaining[message.id] = 1
            self._done(message.id)
            return
        for (name, tensor), version in zip(tensors.items(), message.versions, strict=True):
            if assign:  # kept by the store: its own copy, not a view of the message
                tensor = np.array(tensor, copy=True, order="C")
            self._early.setdefault(name, {})[version] = (tensor, message.id, assign, message.time_unix)
            await self._drain(name)

    async def _drain(self, name: str) -> None:
        """Applies the waiting updates of ``name`` next in version order; acknowledges whole updates."""
        var = self.store.get(name)
        early = self._early[name]
        while early:
            version = var.version
            for stale in [v for v in early if v <= version]:  # already in the snapshot
                self._done(early.pop(stale)[1])
            entry = early.pop(version + 1, None)
            if entry is None:
                return
            await self._apply_one(var, entry)
            self._swap_when_due(name)

    async def _apply_one(self, var: Variable, entry: tuple[np.ndarray, int, bool, float]) -> None:
        tensor, update_id, assign, when = entry
        if assign:
            self.store.assign_one(var, tensor)
        else:
            await self.store.apply_one(var, tensor, when or None)
        self._done(update_id)

    async def _flush(self) -> None:
        """Once orphaned: applies what waits for a predecessor that will never come, in version order.

        The primary applied those updates after others it did not get to
        forward (never acknowledged: their retries come here); every update read
        is whole here (its pushes are recorded), so none is left half-applied.
        """
        for name in sorted(set(self._early) | set(self._swaps)):
            var = self.store.get(name)
            early = self._early.pop(name, {})
            swaps = self._swaps.pop(name, [])
            for version in sorted(early):
                while swaps and swaps[0][0] < version:
                    self._swap(var, swaps.pop(0))
                await self._apply_one(var, early[version])
            for swap in swaps:
                self._swap(var, swap)

    def _update_optimizers(self, message: ps_pb2.ReplicateResponse) -> None:
        """An UpdateOptimizer of the primary: each change takes effect at the version it was made at.

        A change whose version is ahead of this backup waits for the updates
        before it (``_swap_when_due``). A variable already past that version
        was updated with the old optimizer where the primary used the new one:
        the backup refuses to go on (the stream fails) rather than diverge.
        """
        if len(message.optimizer_updates) != len(message.versions):
            raise RuntimeError(f"update {message.id}: optimizer updates and versions do not pair up")
        self._swaps_left[message.id] = len(message.optimizer_updates)
        for spec, version in zip(message.optimizer_updates, message.versions, strict=True):
            var = self.store.get(spec.name)
            if var.version > version:
                raise RuntimeError(
                    f"variable {spec.name!r}: the primary changed its optimizer at version {version}, "
                    f"this backup is already at {var.version}; refusing to diverge"
                )
            self._swaps.setdefault(spec.name, []).append((version, spec.optimizer, message.id, message.reset))
            self._swap_when_due(spec.name)

    def _swap_when_due(self, name: str) -> None:
        pending = self._swaps.get(name)
        var = self.store.get(name)
        while pending and pending[0][0] == var.version:
            self._swap(var, pending.pop(0))
        if not pending:
            self._swaps.pop(name, None)

    def _swap(self, var: Variable, swap: tuple[int, ps_pb2.OptimizerSpec, int, bool]) -> None:
        _, spec, update_id, reset = swap
        self.store.set_optimizer(var, optimizers.from_spec(spec), reset=reset)
        left = self._swaps_left[update_id] - 1
        if left:
            self._swaps_left[update_id] = left
        else:
            del self._swaps_left[update_id]
            self._ack(update_id)

    def _done(self, update_id: int) -> None:
        left = self._remaining[update_id] - 1
        if left:
            self._remaining[update_id] = left
            return
        del self._remaining[update_id]
        self.applied += 1
        if update_id in self._assigns:
            self._assigns.discard(update_id)
        else:
            self.store.pushes += 1
        then = self._then.pop(update_id, None)
        if then is not None:
            then()
        self._ack(update_id)
