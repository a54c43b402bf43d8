"""Primary-backup replication of a shard (``psserver --backup-of PRIMARY``).

The backup opens a ``Replicate`` stream to its primary. The primary answers
with a consistent snapshot of its state (the checkpoint format, in pieces),
taken at the instant the backup is attached, then with every update it applies
from then on: creates, and each push's gradients with the version each one
produced, each Assign's values with the version each one produced, and each
UpdateOptimizer with the version it took effect at. The backup applies them
with the same optimizer code, per variable in version order, so its values,
slots and step counts stay bit-identical to the primary's, and records each
push's ``(worker_id, session, seq)`` in its dedup table. The primary
answers a push only after the backup has acknowledged its update, so an
acknowledged update is on both processes: ``kill -9`` of the primary loses none.

Roles (``GetStatus.role``):

- ``primary``: serves clients; forwards updates while a backup is attached. A
  backup that goes away or stops acknowledging (``ack_timeout_s``) is
  detached, with a warning, and the primary goes on alone.
- ``backup``: a standby. Client calls get UNAVAILABLE naming the primary, so
  clients given ``PRIMARY|BACKUP`` for the shard stay on (or go back to) the
  primary.
- ``orphaned``: a backup whose stream ended after it had caught up (the primary
  died, or cut it off). It never re-attaches (a restarted primary may be older
  than it); the next client call promotes it to ``primary``.

A backup that never caught up keeps retrying to attach, and refuses clients.
Replication needs ``--mode async`` (sync and ssp barriers are not replicated).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from pscore import codec, rpc, security
from pscore.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from psproto.v1 import ps_pb2
from psserver import checkpoint, optimizers, tables
from psserver.modes import Mode
from psserver.store import Store, Variable

log = logging.getLogger(__name__)

SNAPSHOT_PIECE_BYTES = 4 << 20
UPDATE_PIECE_BYTES = 4 << 20  # updates are cut into messages of about this much tensor data
DEFAULT_ACK_TIMEOUT_S = 30.0  # covers the catch-up snapshot of a large shard on a slow link
_ATTACH_RETRY_S = (0.05, 1.0)  # backoff bounds while the primary is not reachable yet
BACKUP_ADDRESS_KEY = "ps-backup-address"  # call metadata: where the backup serves (for status and logs)


class Primary:
    """The primary's side: attaches one backup and forwards updates to it.

    Args:
        store, mode: the shard's state.
        shard, num_shards: the shard's identity (in the snapshot).
        ack_timeout_s: how long an update waits for the backup's acknowledgement
            before the backup is detached.
    """

    def __init__(
        self,
        store: Store,
        mode: Mode,
        *,
        shard: int,
        num_shards: int,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.mode = mode
        self.shard = shard
        self.num_shards = num_shards
        self.ack_timeout_s = ack_timeout_s
        self._link: _Link | None = None
        self._ids = itertools.count(1)
        # Called with the seconds from forwarding an update to the backup's acknowledgement (metrics).
        self.on_ack: Callable[[float], None] | None = None

    @property
    def backup(self) -> str:
        """The attached backup's peer address ("" when none)."""
        return self._link.peer if self._link is not None else ""

    @property
    def unacknowledged(self) -> int:
        """Updates forwarded to the attached backup and not acknowledged yet (0 without a backup)."""
        link = self._link
        return len(link.waiting) if link is not None else 0

    async def serve(
        self, requests: AsyncIterator[bytes], peer: str
    ) -> AsyncIterator[ps_pb2.ReplicateResponse | codec.WireMessage]:
        """The body of the ``Replicate`` handler. Raises: FailedPreconditionError."""
        if self.mode.name != "async":
            raise FailedPreconditionError(f"replication needs --mode async; this shard runs {self.mode.name}")
        if self._link is not None:
            raise FailedPreconditionError(f"this shard already has a backup ({self._link.peer})")
        link = _Link(peer)

        def attach() -> None:  # at the snapshot's instant: every later update is forwarded
            self._link = link

        snap = await checkpoint.take_snapshot(
            self.store, self.mode, self.shard, self.num_shards, while_quiesced=attach
        )
        log.info(
            "shard %d: backup %s attached; sending %.1f MiB of state", self.shard, peer, snap.nbytes / 2**20
        )
        acks = asyncio.create_task(self._read_acks(requests, link))
        try:
            data = await asyncio.to_thread(_encode, snap)
            for start in range(0, max(len(data), 1), SNAPSHOT_PIECE_BYTES):
                piece = data[start : start + SNAPSHOT_PIECE_BYTES]
                done = start + SNAPSHOT_PIECE_BYTES >= len(data)
                yield ps_pb2.ReplicateResponse(snapshot=piece, snapshot_done=done)
            while True:
                message = await link.outbox.get()
                if message is None:  # detached
                    if link.error is not None:  # raised here: the call ends from its own task
                        raise InvalidArgumentError(f"malformed replication stream: {link.error}")
                    return
                yield message
        finally:
            acks.cancel()
            self._detach(link, "its replication stream ended")

    async def _read_acks(self, requests: AsyncIterator[bytes], link: _Link) -> None:
        # Raw bytes, parsed here: this task is not the handler's, and an abort from it would hang the call.
        try:
            async for raw in requests:
                request = ps_pb2.ReplicateRequest.FromString(raw)
                for update_id in request.acks:
                    waiter = link.waiting.pop(update_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(True)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        except Exception as err:  # a malformed message
            link.error = err
        finally:
            self._detach(link, "it closed its stream" if link.error is None else f"bad stream: {link.error}")

    def close(self, why: str) -> None:
        """Ends the attached backup's ``Replicate`` stream (shutdown: no update is in flight any more).

        The backup sees its primary's stream end and takes over on the next client call.
        """
        link = self._link
        if link is not None:
            log.info("shard %d: ending the replication stream of backup %s (%s)", self.shard, link.peer, why)
            self._detach(link, why, quiet=True)

    def _detach(self, link: _Link, why: str, *, quiet: bool = False) -> None:
        if self._link is not link:
            return
        self._link = None
        if not quiet:
            log.warning(
                "shard %d: backup %s detached (%s); going on without a backup", self.shard, link.peer, why
            )
        for waiter in link.waiting.values():
            if not waiter.done():
                waiter.set_result(False)
        link.waiting.clear()
        link.outbox.put_nowait(None)

    async def forward_push(
        self,
        worker_id: str,
        seq: int,
        grads: Mapping[str, tables.Grad],
        versions: Sequence[int],
        *,
        session: int = 0,
        time_unix: float = 0.0,
        shards: Sequence[int] = (),
    ) -> None:
        """Sends an applied push to the backup and waits for its acknowledgement (no-op without one).

        ``time_unix``: the time the push was applied with (the backup applies it with the same).
        """
        link = self._link
        if link is None:
            return
        header = ps_pb2.ReplicateResponse(
            worker_id=worker_id,
            seq=seq,
            session=session,
            versions=list(versions),
            time_unix=time_unix,
            shards=list(shards),
        )
        await self._forward(link, header, tables.wire_tensors(grads))

    async def forward_create(
        self, specs: Sequence[ps_pb2.VariableSpec], values: Mapping[str, np.ndarray]
    ) -> None:
        """Sends newly created variables to the backup and waits for its acknowledgement."""
        link = self._link
        if link is None or not specs:
            return
        # A dynamic table piece, or one with an initializer, has none: the backup makes its rows.
        tensors = [(s.name, values[s.name]) for s in specs if s.name in values]
        await self._forward(link, ps_pb2.ReplicateResponse(create=list(specs)), tensors)

    async def forward_assign(self, values: Mapping[str, np.ndarray], versions: Sequence[int]) -> None:
        """Sends an Assign (the values and the version each produced) and waits for its acknowledgement."""
        link = self._link
        if link is None or not values:
            return
        header = ps_pb2.ReplicateResponse(assign=True, versions=list(versions))
        await self._forward(link, header, list(values.items()))

    def send_optimizer_update(
        self, variables: Sequence[Variable], *, reset: bool = False
    ) -> Awaitable[None] | None:
        """Queues an UpdateOptimizer for the backup now; returns what waits for its acknowledgement.

        Queued synchronously (call it with the variables' locks held), so every
        update the primary applies after the change reaches the backup after it.
        ``reset``: the optimizer was replaced (fresh slots, step count 0). None
        without a backup.
        """
        link = self._link
        if link is None or not variables:
            return None
        header = ps_pb2.ReplicateResponse(
            id=next(self._ids),
            optimizer_updates=[v.spec for v in variables],
            versions=[v.version for v in variables],
            reset=reset,
        )
        waiter = asyncio.get_running_loop().create_future()
        link.waiting[header.id] = waiter
        link.outbox.put_nowait(header)
        return self._await_ack(link, header.id, waiter, time.perf_counter())

    async def _await_ack(
        self, link: _Link, update_id: int, waiter: asyncio.Future[bool], sent: float
    ) -> None:
        """Waits for the backup's acknowledgement of an update queued at ``sent`` (``perf_counter``)."""
        try:
            async with asyncio.timeout(self.ack_timeout_s):
                acked = await asyncio.shield(waiter)
        except TimeoutError:
            self._detach(link, f"update {update_id} not acknowledged within {self.ack_timeout_s:g}s")
            return
        if acked and self.on_ack is not None:
            self.on_ack(time.perf_counter() - sent)

    async def _forward(
        self, link: _Link, header: ps_pb2.ReplicateResponse, tensors: list[tuple[str, np.ndarray]]
    ) -> None:
        header.id = next(self._ids)
        waiter = asyncio.get_running_loop().create_future()
        link.waiting[header.id] = waiter
        sent = time.perf_counter()
        batches = list(codec.wire_batches(tensors, UPDATE_PIECE_BYTES)) or [[]]
        for i, batch in enumerate(batches):  # in application order; no await between the pieces
            message = header if i == 0 else ps_pb2.ReplicateResponse()
            message.more = i < len(batches) - 1
            link.outbox.put_nowait(codec.WireMessage(message, "tensors", batch))
        await self._await_ack(link, header.id, waiter, sent)


@dataclass(eq=False)
class _Link:
    peer: str
    outbox: asyncio.Queue[codec.WireMessage | ps_pb2.ReplicateResponse | None] = field(
        default_factory=asyncio.Queue
    )
    waiting: dict[int, asyncio.Future[bool]] = field(default_factory=dict)
    error: Exception | None = None  # why the backup's side of the stream failed


def _encode(snap: checkpoint.Snapshot) -> bytes:
    buf = io.BytesIO()
    checkpoint.dump(snap, buf, ckpt_id=0)
    return buf.getvalue()


class Backup:
    """The backup's side: follows a primary, refuses clients until promoted.

    Args:
        primary: the primary's ``HOST:PORT``.
        store, mode: this (empty) shard's state.
        shard: this shard's index (the primary's must match).
        auth_token: sent to the primary when it requires one.
        connect: opens the channel to the primary (TLS, message sizes, keepalive; default: plaintext).
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
    ) -> None:
        self.primary = primary
        self.connect = connect or grpc.aio.insecure_channel
        self.store = store
        self.mode = mode
        self.shard = shard
        self.auth_token = auth_token
        self.role = "backup"
        self.address = ""  # this backup's own HOST:PORT (set once it serves): the primary shows it
        self.caught_up = False
        self.applied = 0
        # Per variable: updates that arrived before their predecessor
        # (target version -> (gradient or assigned value, update id, whether it is an assignment,
        # the primary's time of the update)).
        self._early: dict[str, dict[int, tuple[np.ndarray, int, bool, float]]] = {}
        self._remaining: dict[int, int] = {}  # update id -> gradients (or assigned values) not applied yet
        self._assigns: set[int] = set()  # ids of the Assigns among them (not counted as pushes)
        self._acks: asyncio.Queue[int | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        # UpdateOptimizer changes not applied yet: per variable, (version, spec, update id, reset) in order.
        self._swaps: dict[str, list[tuple[int, ps_pb2.OptimizerSpec, int, bool]]] = {}
        self._swaps_left: dict[int, int] = {}  # update id -> changes not applied yet

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def check_serving(self, what: str) -> None:
        """Lets a client call through on a primary; promotes an orphaned backup. Raises: UnavailableError."""
        if self.role == "primary":
            return
        if self.role == "orphaned":
            self.role = "primary"
            log.warning(
                "shard %d: promoted to primary on a client's %s (primary %s is gone); %d updates replicated",
                self.shard, what, self.primary, self.applied,
            )  # fmt: skip
            return
        raise UnavailableError(f"standby backup of primary {self.primary}: send {what} to the primary")

    async def run(self) -> None:
        """Attaches to the primary (retrying until it answers), then applies its updates until the end."""
        delay = _ATTACH_RETRY_S[0]
        async with self.connect(self.primary) as channel:
            call = rpc.Stub(channel).Replicate
            metadata = (*security.auth_metadata(self.auth_token), (BACKUP_ADDRESS_KEY, self.address))
            while True:
                try:
                    await self._follow(call(self._ack_stream(), metadata=metadata, wait_for_ready=False))
                    why = "the primary closed the stream"
                except grpc.RpcError as err:
                    why = f"{err.code().name}: {err.details()}"
                    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        log.error("shard %d: primary %s refuses a backup: %s", self.shard, self.primary, why)
                if self.caught_up:
                    break
                await asyncio.sleep(delay)  # the primary is not up yet: try again
                delay = min(delay * 2, _ATTACH_RETRY_S[1])
        self.role = "orphaned"
        log.warning(
            "shard %d: replication from %s ended (%s); taking over on the next client call",
            self.shard, self.primary, why,
        )  # fmt: skip

    async def _ack_stream(self) -> AsyncIterator[ps_pb2.ReplicateRequest]:
        while True:
            first = await self._acks.get()
            if first is None:
                return
            acks = [first]
            while not self._acks.empty():
                more = self._acks.get_nowait()
                if more is None:
                    break
                acks.append(more)
            yield ps_pb2.ReplicateRequest(acks=acks)

    async def _follow(self, stream: grpc.aio.StreamStreamCall) -> None:
        pieces: list[bytes] = []
        update: tuple[ps_pb2.ReplicateResponse, codec.Assembler] | None = None
        async for message in stream:
            if not self.caught_up:
                pieces.append(message.snapshot)
                if message.snapshot_done:
                    await self._load(b"".join(pieces))
                    pieces = []
                continue
            if update is None:  # the first message of an update carries its header
                update = (message, codec.Assembler())
            for chunk in message.tensors:
                update[1].add(chunk)
            if message.more:
                continue
            header, tensors = update
            update = None
            if header.create:  # a table piece with an initializer comes without rows: made here too
                made = await self.store.make_rows(header.create)
                self.store.create(list(header.create), tensors.result(), made)
                self._acks.put_nowait(header.id)
            elif header.optimizer_updates:
                self._update_optimizers(header)
            elif header.assign:
                self._apply(header, tensors.result(), assign=True)
            else:
                self._apply(header, tables.pair(tensors.result()))

    async def _load(self, data: bytes) -> None:
        snap = await asyncio.to_thread(checkpoint.load, io.BytesIO(data), f"snapshot from {self.primary}")
        if snap.shard != self.shard:
            raise RuntimeError(
                f"primary {self.primary} is shard {snap.shard}; this backup is shard {self.shard}"
            )
        checkpoint.load_into(snap, self.store, self.mode)
        self.caught_up = True
        log.info(
            "shard %d: caught up with primary %s (%d tensors, %.1f MiB); following",
            self.shard, self.primary, len(snap.tensors), snap.nbytes / 2**20,
        )  # fmt: skip

    def _apply(
        self, message: ps_pb2.ReplicateResponse, tensors: Mapping[str, tables.Grad], *, assign: bool = False
    ) -> None:
        """A push (gradients) or, with ``assign``, an Assign (values) of the primary."""
        if len(tensors) != len(message.versions):
            raise RuntimeError(
                f"update {message.id}: {len(tensors)} tensors, {len(message.versions)} versions"
            )
        if not assign:
            # Recorded, not claimed: the primary already decided (its order of claims may differ from
            # this order of applied updates, so a takeover must not refuse anything here).
            self.store.record(message.worker_id, message.seq, message.session)
            if len(message.shards) > 1:
                self.store.note_sent(message.worker_id, message.seq, message.session, message.shards)
        self._remaining[message.id] = len(tensors)
        if assign:
            self._assigns.add(message.id)
        for (name, tensor), version in zip(tensors.items(), message.versions, strict=True):
            if assign:  # kept by the store: its own copy, not a view of the message
                tensor = np.array(tensor, copy=True, order="C")
            self._early.setdefault(name, {})[version] = (tensor, message.id, assign, message.time_unix)
            self._drain(name)

    def _drain(self, name: str) -> None:
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
            tensor, update_id, assign, when = entry
            if assign:
                self.store.assign_one(var, tensor)
            else:
                self.store.apply_one(var, tensor, when or None)
            self._done(update_id)
            self._swap_when_due(name)

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
            _, spec, update_id, reset = pending.pop(0)
            self.store.set_optimizer(var, optimizers.from_spec(spec), reset=reset)
            left = self._swaps_left[update_id] - 1
            if left:
                self._swaps_left[update_id] = left
            else:
                del self._swaps_left[update_id]
                self._acks.put_nowait(update_id)
        if not pending:
            self._swaps.pop(name, None)

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
        self._acks.put_nowait(update_id)
