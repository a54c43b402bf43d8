"""Primary-backup replication of a shard (``psserver --backup-of PRIMARY``), in every mode, under a lease.

This module is the protocol and the primary's side (``Primary``); the backup's
side is ``psserver.backup``.

The backup opens a ``Replicate`` stream to its primary. The primary answers
with a consistent snapshot of its state (the checkpoint format, in pieces,
with the mode's state: sync step, workers that left, ssp clocks), taken at the
instant the backup is attached, then with every update it applies from then on:
creates; each push's gradients with the version each one produced (ssp: and
the worker's step, which advances its clock); each sync step's mean gradients
with the pushes it applied; each Assign, UpdateOptimizer and Leave. The backup
applies them with the same optimizer code, per variable in version order, so its
values, slots, step counts, dedup table and mode state stay bit-identical to the
primary's. The primary answers a push (in sync mode: a step's pushes) only after
the backup has acknowledged its update, so an acknowledged update is on both
processes: ``kill -9`` of the primary loses none, and a retry of it on the
backup is recognised. A sync round still gathering is on the primary only and
answered to nobody: its workers retry it on whichever process serves next.

The lease (``psserver.lease``) keeps two processes from serving at once. The
backup acknowledges the snapshot; from then on it is *confirmed* (the primary
tells it so) and the primary serves client calls only while it holds a lease,
renewed by every acknowledgement until ``lease_s`` after it sent the message
acknowledged (heartbeats every ``lease_s / 4`` keep it fresh). A primary that
cannot renew (its backup is down, paused or cut off) refuses client calls with
UNAVAILABLE, ends the waits of sync barriers and ssp bounds, and fails updates
its backup did not acknowledge (their retries are recognised). A confirmed
backup whose stream ends (or that hears nothing for ``silence_limit``) takes over
on a client call once ``backup_wait`` has passed since the last message it read,
when the primary's lease has surely expired; a primary that stops on SIGTERM
releases its lease first, so its backup takes over at once. A backup that shuts
down resigns: its primary goes on alone.

Roles (``GetStatus.role``):

- ``primary``: serves clients (while it holds its lease, once a backup has
  confirmed); forwards updates while a backup is attached. A primary whose
  backup is gone without resigning keeps refusing until a backup confirms
  again, or until it finds that its backup took over: then it restarts in-process
  as that one's backup (``on_taken_over``), dropping its own (unacknowledged) state.
- ``backup``: a standby. Client calls get UNAVAILABLE naming the primary, so
  clients given ``PRIMARY|BACKUP`` for the shard stay on (or go back to) the
  primary.
- ``orphaned``: a confirmed backup whose stream ended. It never re-attaches (a
  restarted primary may be older than it); the first client call after the
  lease wait promotes it to ``primary``.

A backup that was never confirmed keeps retrying to attach (starting over from a
new snapshot), and refuses clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import grpc
import numpy as np

from pscore import codec, rpc, security
from pscore.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from psproto.v1 import ps_pb2
from psserver import checkpoint, ckptfile, lease, tables
from psserver.ledger import PushKey
from psserver.modes import Mode, StepUpdate
from psserver.store import Store, Variable
from psserver.tier import TierConfig, spool

log = logging.getLogger(__name__)

SNAPSHOT_PIECE_BYTES = 4 << 20
UPDATE_PIECE_BYTES = 4 << 20  # updates are cut into messages of about this much tensor data
DEFAULT_ACK_TIMEOUT_S = 30.0  # covers the catch-up snapshot of a large shard on a slow link
BACKUP_ADDRESS_KEY = "ps-backup-address"  # call metadata: where the backup serves (for status and logs)
BACKUP_TERM_KEY = "ps-backup-term"  # call metadata: the newest replication term the backup has seen
_PEER_CHECK_EVERY_S = 0.5  # a primary without its lease asks its peer this often whether it took over
_PEER_CHECK_TIMEOUT_S = 2.0
# An update not acknowledged this long, while the lease holds (the backup acknowledges its heartbeats), is
# logged once: a backup that reads its stream but does not apply what it reads.
_SLOW_ACK_S = 5.0


class Primary:
    """The primary's side: attaches one backup, forwards updates to it, holds the lease it renews.

    Every shard process has one (a backup's takes effect once it is promoted).

    Args:
        store, mode: the shard's state.
        shard, num_shards: the shard's identity (in the snapshot).
        ack_timeout_s: how long an update waits for the backup's acknowledgement
            before the backup is detached.
        lease_s: the lease each acknowledgement renews (``psserver.lease``).
        required: serve only under a lease from the start (``--backup-at``: this
            shard is replicated, even before its backup has attached); otherwise
            from the first backup's confirmation on.
        peer: the other process of this shard (``--backup-at`` / ``--backup-of``; else the first
            backup that confirms), asked whether it took over while this one holds no lease.
        connect: opens a channel to ``peer`` (TLS, message sizes); default plaintext.
        auth_token: sent to ``peer``.
        serve_alone: once promoted (``promoted``), serve with no backup attached instead of refusing
            until one confirms (``--serve-alone``: availability before durability).
        term: the replication term of the history this process starts with (``promoted`` raises it).
    """

    def __init__(
        self,
        store: Store,
        mode: Mode,
        *,
        shard: int,
        num_shards: int,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        lease_s: float = lease.DEFAULT_LEASE_S,
        required: bool = False,
        peer: str = "",
        connect: Callable[[str], grpc.aio.Channel] | None = None,
        auth_token: str | None = None,
        serve_alone: bool = False,
        term: int = 1,
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.store = store
        self.mode = mode
        self.shard = shard
        self.num_shards = num_shards
        self.ack_timeout_s = ack_timeout_s
        self.lease_s = lease_s
        self.required = required
        self.peer = peer
        self.connect = connect or grpc.aio.insecure_channel
        self.auth_token = auth_token
        self.serve_alone = serve_alone
        self.term = term
        self.unprotected = False  # promoted with --serve-alone and no backup confirmed yet
        self._link: _Link | None = None
        # Whether a backup is attached (an update is answered once it acknowledged it): ``_link`` is not
        # None. An attribute, set with ``_link``: read on every push.
        self.forwarding = False
        self._ids = itertools.count(1)
        self._lease_until = 0.0  # lease clock; 0: none held
        self._released = False  # stopped serving for good (SIGTERM): never serves again
        self._had_lease = False
        self._task: asyncio.Task[None] | None = None
        self._peer_check: asyncio.Task[None] | None = None
        self._last_peer_check = 0.0
        # Pushes applied here and forwarded, not acknowledged yet: a retry waits for the acknowledgement.
        self.unsettled: dict[PushKey, asyncio.Future[bool]] = {}
        # Called with the seconds from forwarding an update to the backup's acknowledgement (metrics).
        self.on_ack: Callable[[float], None] | None = None
        # Called with why when this primary loses its lease (the servicer ends the mode's waits).
        self.on_lease_lost: Callable[[str], None] | None = None
        # Called with the peer's address when it has taken over (the server restarts as its backup).
        self.on_taken_over: Callable[[str], None] | None = None

    # -- the lease -------------------------------------------------------------

    @property
    def backup(self) -> str:
        """The confirmed backup's address ("" when none)."""
        link = self._link
        return link.peer if link is not None and link.confirmed else ""

    @property
    def unacknowledged(self) -> int:
        """Updates forwarded to the attached backup and not acknowledged yet (0 without a backup)."""
        link = self._link
        return len(link.waiting) if link is not None else 0

    def holds_lease(self) -> bool:
        """Whether this primary may serve clients now (always, while it needs no lease)."""
        if self._released:
            return False
        return not self.required or lease.clock() < self._lease_until

    def lease_left(self) -> float:
        """Seconds left on the lease; -1 while none is needed (``GetStatus.lease_s``)."""
        if self._released:
            return 0.0
        if not self.required:
            return -1.0
        return max(0.0, self._lease_until - lease.clock())

    def check(self, what: str) -> None:
        """Lets a client call through while this primary holds its lease. Raises: UnavailableError."""
        if not self._released and (not self.required or lease.clock() < self._lease_until):  # holds_lease()
            return
        self._note_lease(False)
        if self._released:
            raise UnavailableError(
                f"shard {self.shard} is shutting down (its backup takes over): send {what} there"
            )
        raise UnavailableError(self._why_no_lease(what))

    def promoted(self, term: int) -> None:
        """This process, a backup, took over (``Backup.on_promoted``) and serves the history of ``term``.

        It serves only once a backup has caught up from it and confirmed (its
        old primary, restarted or back from a partition, becomes that backup),
        so that nothing it acknowledges is on one process only; with
        ``serve_alone`` it serves at once, unprotected until a backup confirms.
        """
        self.term = max(self.term, term)
        self.required = not self.serve_alone
        self.unprotected = self.serve_alone
        self._lease_until = 0.0
        self._had_lease = False
        if self.serve_alone:
            log.warning(
                "shard %d: serving alone in term %d (--serve-alone): what it acknowledges before a backup "
                "confirms is on this process only", self.shard, self.term,
            )  # fmt: skip
        else:
            log.warning(
                "shard %d: primary in term %d; refusing client calls until a backup (%s, restarted with its "
                "usual flags) has caught up and confirmed", self.shard, self.term, self.peer or "any",
            )  # fmt: skip

    def _why_no_lease(self, what: str) -> str:
        link = self._link
        if link is None:
            waited = f"backup {self.peer}" if self.peer else "a backup"
            if self.term > 1 and self.peer:
                return (
                    f"replicated shard {self.shard} took over from {self.peer} (term {self.term}) and has no "
                    f"backup yet: it refuses {what} until {self.peer} (restarted, or back from a partition) "
                    "has caught up as its backup, so that nothing it acknowledges is on one process only "
                    "(psserver --serve-alone serves at once instead); retry"
                )
            return (
                f"replicated shard {self.shard} has no backup attached (waiting for {waited}): it cannot "
                f"prove no backup took over, so it refuses {what}; retry, or fail over to the backup"
            )
        if not link.confirmed:
            return (
                f"replicated shard {self.shard}: backup {link.peer} is catching up; {what} is refused "
                "until it has the snapshot; retry"
            )
        return (
            f"shard {self.shard} holds no lease: backup {link.peer} has not acknowledged anything for "
            f"{self.lease_s:g}s (down, paused or cut off), and may take over, so this primary refuses "
            f"{what}; retry, or fail over to the backup"
        )

    def _renew(self, link: _Link, sent: float) -> None:
        if link is self._link and link.confirmed and not self._released:
            self._lease_until = max(self._lease_until, sent + self.lease_s)

    def start(self) -> None:
        """Starts the heartbeats and the lease watch (on the running loop)."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for task in (self._task, self._peer_check):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _note_lease(self, holding: bool) -> None:
        """Logs a change of the lease; on its loss, ends the mode's waits (``on_lease_lost``)."""
        if self._had_lease and not holding and self.required and not self._released:
            why = self._why_no_lease("client calls")
            log.warning("shard %d: lost its lease: %s", self.shard, why)
            self._had_lease = holding
            if self.on_lease_lost is not None:
                self.on_lease_lost(why)
        elif holding and not self._had_lease and self.required:
            log.info("shard %d: holds the lease of backup %s; serving", self.shard, self.backup)
        self._had_lease = holding

    async def _run(self) -> None:
        every = lease.heartbeat_every(self.lease_s)
        while True:
            link = self._link
            if link is not None:
                self._queue(link, ps_pb2.ReplicateResponse(heartbeat=True, confirmed=link.confirmed), [])
            holding = self.holds_lease()
            self._note_lease(holding)
            if (
                not holding
                and self.required
                and not self._released
                and self.peer
                and self.on_taken_over is not None
                and (self._peer_check is None or self._peer_check.done())
                and lease.clock() - self._last_peer_check >= _PEER_CHECK_EVERY_S
            ):
                self._last_peer_check = lease.clock()
                self._peer_check = asyncio.create_task(self._ask_peer())
            pause = every
            if holding and self.required:  # awake when the lease runs out: the mode's waits end then
                pause = min(every, max(self._lease_until - lease.clock(), 0.0) + 0.001)
            await asyncio.sleep(pause)

    async def _ask_peer(self) -> None:
        """Asks the peer whether it took over; if so, hands this process over (``on_taken_over``)."""
        try:
            status = await peer_status(self.connect, self.peer, self.auth_token, _PEER_CHECK_TIMEOUT_S)
        except grpc.RpcError:
            return  # down or cut off: nothing known; the lease keeps this primary from serving
        if not has_taken_over(status, self.shard, self.term):
            return
        if self.holds_lease() or self._released or self.on_taken_over is None:
            return
        log.warning(
            "shard %d: %s is %s in term %d (this primary's: %d): it took over while this primary held no "
            "lease; becoming its backup (the updates only this process has were never acknowledged)",
            self.shard, self.peer, status.role, status.term, self.term,
        )  # fmt: skip
        self._released = True  # never serves again as this incarnation
        self.on_taken_over(self.peer)

    # -- the Replicate stream ----------------------------------------------------

    async def serve(
        self, requests: AsyncIterator[bytes], peer: str, backup_term: int = 0
    ) -> AsyncIterator[ps_pb2.ReplicateResponse | codec.WireMessage]:
        """The body of the ``Replicate`` handler. Raises: FailedPreconditionError.

        ``backup_term``: the newest term the attaching backup has seen; a newer
        one than this primary's is taken over (no term ever goes backwards).
        """
        if self._released:
            raise FailedPreconditionError(f"shard {self.shard} is shutting down: it cannot take a backup")
        if self._link is not None:
            if self._link.peer != peer or ":" not in peer:
                raise FailedPreconditionError(f"this shard already has a backup ({self._link.peer})")
            # The same backup attaching again: its earlier stream is dead to it (it gave up on it across a
            # partition or a pause), though the word has not reached this side yet. That one ends here.
            self._detach(self._link, "it attached again")
        link = _Link(peer)
        if backup_term > self.term:
            log.warning(
                "shard %d: backup %s has seen term %d, newer than this primary's %d; serving on in term %d",
                self.shard, peer, backup_term, self.term, backup_term,
            )  # fmt: skip
            self.term = backup_term

        def attach() -> None:  # at the snapshot's instant: every later update is forwarded
            self._link = link
            self.forwarding = True

        try:
            snap = await checkpoint.take_snapshot(
                self.store, self.mode, self.shard, self.num_shards, while_quiesced=attach
            )
        except BaseException:  # a tiered table's cold rows are read after the attach: that can fail
            self._detach(link, "its snapshot failed")
            raise
        log.info(
            "shard %d: backup %s attached; sending %.1f MiB of state", self.shard, peer, snap.nbytes / 2**20
        )
        acks = asyncio.create_task(self._read_acks(requests, link))
        try:
            encoded = await asyncio.to_thread(_encode, snap, self.store.tier)
            del snap  # the stream goes on for as long as the backup follows: keep no copy of the state
            with encoded:
                size = encoded.seek(0, io.SEEK_END)
                encoded.seek(0)
                for start in range(0, max(size, 1), SNAPSHOT_PIECE_BYTES):
                    message = ps_pb2.ReplicateResponse(
                        snapshot=await asyncio.to_thread(encoded.read, SNAPSHOT_PIECE_BYTES)
                    )
                    if start + SNAPSHOT_PIECE_BYTES >= size:  # the last piece: acknowledged once loaded
                        message.snapshot_done = True
                        message.lease_s = self.lease_s
                        message.term = self.term
                        message.id = link.snapshot_id = next(self._ids)
                        link.sent[message.id] = lease.clock()  # before it goes: the lease counts from here
                    yield message
            while True:
                out = await link.outbox.get()
                if out is None:  # detached
                    if link.error is not None:  # raised here: the call ends from its own task
                        raise InvalidArgumentError(f"malformed replication stream: {link.error}")
                    return
                yield out
        finally:
            acks.cancel()
            self._detach(link, "its replication stream ended")

    async def _read_acks(self, requests: AsyncIterator[bytes], link: _Link) -> None:
        # Raw bytes, parsed here: this task is not the handler's, and an abort from it would hang the call.
        try:
            async for raw in requests:
                request = ps_pb2.ReplicateRequest.FromString(raw)
                for update_id in request.acks:
                    self._acked(link, update_id)
                if request.resign:
                    self._resign(link)
                    return
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        except Exception as err:  # a malformed message
            link.error = err
        finally:
            self._detach(link, "it closed its stream" if link.error is None else f"bad stream: {link.error}")

    def _acked(self, link: _Link, update_id: int) -> None:
        sent = link.sent.pop(update_id, None)
        if update_id == link.snapshot_id and not link.confirmed and link is self._link:
            link.confirmed = True
            self.required = True
            self.unprotected = False
            if not self.peer and ":" in link.peer:  # started without --backup-at: ask this one from now on
                self.peer = link.peer
            log.info(
                "shard %d: backup %s has the snapshot; serving under its lease (%gs, renewed by every "
                "acknowledgement)", self.shard, link.peer, self.lease_s,
            )  # fmt: skip
            self._queue(link, ps_pb2.ReplicateResponse(heartbeat=True, confirmed=True), [])
        if sent is not None:
            self._renew(link, sent)
        waiter = link.waiting.pop(update_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def _resign(self, link: _Link) -> None:
        if self._link is not link:
            return
        alone = link.confirmed and self.serve_alone
        if alone:
            self.required = False
            self.unprotected = True
        then = (
            "going on alone (--serve-alone): unprotected until a backup confirms"
            if alone
            else "refusing client calls until a backup confirms (nothing is acknowledged on one process only)"
        )
        log.warning(
            "shard %d: backup %s resigned (it is shutting down and will not take over); %s",
            self.shard, link.peer, then,
        )  # fmt: skip
        self._detach(link, "it resigned", quiet=True)

    def close(self, why: str) -> None:
        """Stops serving for good and hands over (shutdown, once no update is in flight any more).

        The backup is told (``release``) after the last update, so it takes over
        at once on the next client call, with no lease to wait out.
        """
        self._released = True
        self._lease_until = 0.0
        link = self._link
        if link is not None:
            log.info("shard %d: handing over to backup %s (%s)", self.shard, link.peer, why)
            link.outbox.put_nowait(ps_pb2.ReplicateResponse(release=True))
            self._detach(link, why, quiet=True)

    def _detach(self, link: _Link, why: str, *, quiet: bool = False) -> None:
        if self._link is not link:
            return
        self._link = None
        self.forwarding = False
        if link.confirmed and self.required:
            self._lease_until = 0.0  # nothing can be replicated any more: serve nothing more
        if not quiet:
            alone = "refusing client calls until a backup confirms" if self.required else "going on alone"
            log.warning("shard %d: backup %s detached (%s); %s", self.shard, link.peer, why, alone)
        for waiter in link.waiting.values():
            if not waiter.done():
                waiter.set_result(False)
        link.waiting.clear()
        link.outbox.put_nowait(None)

    # -- forwarding updates --------------------------------------------------------

    def _queue(
        self,
        link: _Link,
        header: ps_pb2.ReplicateResponse,
        tensors: list[tuple[str, np.ndarray]],
        keys: Sequence[PushKey] = (),
    ) -> asyncio.Future[bool]:
        """Queues an update (or heartbeat) for the backup, now; returns its acknowledgement's future.

        ``keys``: the pushes it carries (``unsettled`` until it is acknowledged).
        """
        header.id = next(self._ids)
        header.term = self.term
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if not header.heartbeat:
            link.waiting[header.id] = waiter
        link.sent[header.id] = lease.clock()
        for key in keys:
            self.unsettled[key] = waiter
        if keys:
            waiter.add_done_callback(functools.partial(self._settled, tuple(keys)))
        batches = list(codec.wire_batches(tensors, UPDATE_PIECE_BYTES)) or [[]]
        for i, batch in enumerate(batches):  # in application order; no await between the pieces
            message = header if i == 0 else ps_pb2.ReplicateResponse()
            message.more = i < len(batches) - 1
            link.outbox.put_nowait(codec.WireMessage(message, "tensors", batch) if batch else message)
        return waiter

    def _settled(self, keys: tuple[PushKey, ...], waiter: asyncio.Future[bool]) -> None:
        for key in keys:
            if self.unsettled.get(key) is waiter:
                del self.unsettled[key]

    def _unreplicated(self) -> UnavailableError | None:
        """Why an update applied with no backup attached may not be answered (None: it may)."""
        if not self.required:
            return None
        return UnavailableError(
            f"shard {self.shard}: the update was applied here, but no backup is attached to take it, so "
            "it is not acknowledged; retry (a retry is recognised and answered once a backup has it)"
        )

    async def _await_ack(self, link: _Link, waiter: asyncio.Future[bool], what: str, sent: float) -> None:
        """Waits for the backup's acknowledgement of an update queued at ``sent`` (``perf_counter``).

        Gives up when the backup goes away, or (while this primary needs its lease)
        when the lease runs out first; after ``ack_timeout_s`` the backup is detached.

        Raises:
            UnavailableError: not acknowledged, and this primary may not answer without it.
        """
        begun = lease.clock()
        deadline = begun + self.ack_timeout_s
        slow_at = begun + _SLOW_ACK_S if self.ack_timeout_s > _SLOW_ACK_S else float("inf")
        while not waiter.done():
            now = lease.clock()
            left = deadline - now
            if left <= 0:
                self._detach(link, f"{what} not acknowledged within {self.ack_timeout_s:g}s")
                break
            if now >= slow_at:
                slow_at = float("inf")
                log.warning(
                    "shard %d: %s not acknowledged by backup %s for %.1fs (%d updates unacknowledged; the "
                    "lease %s); it is detached after %gs", self.shard, what, link.peer, now - begun,
                    len(link.waiting), "holds" if self.holds_lease() else "ran out", self.ack_timeout_s,
                )  # fmt: skip
            left = min(left, max(slow_at - now, 0.001))
            if self.required and link.confirmed:
                lease_left = self._lease_until - now
                if lease_left <= 0:
                    break
                left = min(left, lease_left)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await asyncio.shield(waiter)
        if waiter.done() and waiter.result():
            if self.on_ack is not None:
                self.on_ack(time.perf_counter() - sent)
            return
        if self.required:
            raise UnavailableError(
                f"shard {self.shard}: {what} was applied here but backup {link.peer} has not acknowledged "
                "it, and this primary's lease ran out (or the backup went away): it is not acknowledged; "
                "retry (a retry is recognised and answered once the backup has it)"
            )

    async def wait_settled(self, key: PushKey) -> None:
        """A retry of push ``key``: returns once its original is on the backup too (at once if it is).

        Raises:
            UnavailableError: the original is not acknowledged by the backup (and may not be).
        """
        waiter = self.unsettled.get(key)
        if waiter is None:
            return
        link = self._link
        if link is None:
            if (error := self._unreplicated()) is not None and not (waiter.done() and waiter.result()):
                raise error
            return
        await self._await_ack(link, waiter, "the push retried", time.perf_counter())

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
        step: int = 0,
    ) -> None:
        """Sends an applied push to the backup and waits for its acknowledgement (no-op without one).

        ``time_unix``: the time the push was applied with (the backup applies it with the same).
        ``step``: the worker's step (ssp: the backup advances its clock).

        Raises:
            UnavailableError: see ``_await_ack``.
        """
        link = self._link
        if link is None:  # no backup attached
            if self.required and (error := self._unreplicated()) is not None:
                raise error
            return
        header = ps_pb2.ReplicateResponse(
            worker_id=worker_id,
            seq=seq,
            session=session,
            versions=list(versions),
            time_unix=time_unix,
            shards=list(shards),
            step=step,
        )
        waiter = self._queue(link, header, tables.wire_tensors(grads), [(worker_id, session, seq)])
        await self._await_ack(link, waiter, f"push {seq} of {worker_id}", time.perf_counter())

    def send_step(self, step: StepUpdate) -> Awaitable[None] | None:
        """Queues a sync step's update for the backup now; returns what waits for its acknowledgement.

        Called in the same event-loop step as the update was applied (``SyncMode.replicate_step``).
        None without a backup, when this primary needs none.
        """
        link = self._link
        if link is None:
            error = self._unreplicated()
            return None if error is None else _raise(error)
        header = ps_pb2.ReplicateResponse(
            sync_step=True,
            step=step.step,
            versions=list(step.versions),
            time_unix=step.time_unix,
            claims=[ps_pb2.PushKeys(worker_id=w, session=s, seq_ranges=[q, q]) for w, s, q in step.claims],
        )
        tensors = tables.wire_tensors({var.name: grad for var, grad in step.update})
        waiter = self._queue(link, header, tensors, step.claims)
        return self._await_ack(link, waiter, f"sync step {step.step}", time.perf_counter())

    async def forward_leave(self, worker_id: str) -> None:
        """Sends a Leave (sync, ssp) and waits for its acknowledgement."""
        link = self._link
        if link is None:
            if (error := self._unreplicated()) is not None:
                raise error
            return
        waiter = self._queue(link, ps_pb2.ReplicateResponse(leave=worker_id), [])
        await self._await_ack(link, waiter, f"the Leave of {worker_id}", time.perf_counter())

    async def forward_create(
        self, specs: Sequence[ps_pb2.VariableSpec], values: Mapping[str, np.ndarray]
    ) -> None:
        """Sends newly created variables to the backup and waits for its acknowledgement."""
        link = self._link
        if not specs:
            return
        if link is None:
            if (error := self._unreplicated()) is not None:
                raise error
            return
        # A dynamic table piece, or one with an initializer, has none: the backup makes its rows.
        tensors = [(s.name, values[s.name]) for s in specs if s.name in values]
        waiter = self._queue(link, ps_pb2.ReplicateResponse(create=list(specs)), tensors)
        await self._await_ack(link, waiter, "a create", time.perf_counter())

    async def forward_assign(self, values: Mapping[str, np.ndarray], versions: Sequence[int]) -> None:
        """Sends an Assign (the values and the version each produced) and waits for its acknowledgement."""
        link = self._link
        if not values:
            return
        if link is None:
            if (error := self._unreplicated()) is not None:
                raise error
            return
        header = ps_pb2.ReplicateResponse(assign=True, versions=list(versions))
        waiter = self._queue(link, header, list(values.items()))
        await self._await_ack(link, waiter, "an Assign", time.perf_counter())

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
        if not variables:
            return None
        if link is None:
            error = self._unreplicated()
            return None if error is None else _raise(error)
        header = ps_pb2.ReplicateResponse(
            optimizer_updates=[v.spec for v in variables],
            versions=[v.version for v in variables],
            reset=reset,
        )
        waiter = self._queue(link, header, [])
        return self._await_ack(link, waiter, "an optimizer change", time.perf_counter())


async def _raise(error: Exception) -> None:
    raise error


def has_taken_over(status: ps_pb2.GetStatusResponse, shard: int, term: int) -> bool:
    """Whether the other process of shard ``shard``, by its ``GetStatus``, holds a newer history than
    this one's (of replication term ``term``; 0 for a process that holds none yet).

    A primary of a newer term (a backup that was promoted: whether it serves yet
    or waits for a backup), or a backup that lost its primary ("orphaned": it
    takes over on the next client call, in a newer term). A primary of the same
    or an older term has no more claim than this one.
    """
    if status.shard != shard:
        return False
    return status.role == "orphaned" or (status.role == "primary" and status.term > term)


async def peer_status(
    connect: Callable[[str], grpc.aio.Channel], address: str, token: str | None, timeout_s: float
) -> ps_pb2.GetStatusResponse:
    """``GetStatus`` of another shard process. Raises: grpc.RpcError."""
    async with connect(address) as channel:
        stub = rpc.Stub(channel)
        return await stub.GetStatus(
            ps_pb2.GetStatusRequest(), timeout=timeout_s, metadata=security.auth_metadata(token)
        )


@dataclass(eq=False)
class _Link:
    peer: str
    outbox: asyncio.Queue[codec.WireMessage | ps_pb2.ReplicateResponse | None] = field(
        default_factory=asyncio.Queue
    )
    waiting: dict[int, asyncio.Future[bool]] = field(default_factory=dict)  # update id -> acknowledged
    sent: dict[int, float] = field(default_factory=dict)  # message id -> lease clock when queued
    snapshot_id: int = 0
    confirmed: bool = False  # the backup acknowledged the snapshot: it may take over from now on
    error: Exception | None = None  # why the backup's side of the stream failed


def _encode(snap: ckptfile.Snapshot, tier: TierConfig | None) -> BinaryIO:
    """The snapshot in the checkpoint format: in memory, or with a disk tier in a removed file of its
    directory (a tiered table's state may exceed memory)."""
    out = spool(tier)
    try:
        ckptfile.dump(snap, out, ckpt_id=0)
    except BaseException:
        out.close()
        raise
    return out
