"""Consistent cuts: every shard's checkpoint at one instant of the cluster (``psctl save --consistent``).

A coordinator (``psclient``'s ``save_checkpoint(consistent=True)``) runs two
phases over every shard; this module is one shard's side.

1. ``PrepareCut``: the shard holds new updates back (``UpdateGate.hold``; pulls go
   on), waits for the updates in progress, and reports its sync step and the
   pushes it applied in the last minute that were sent to other shards too
   (``PushRequest.shards``, remembered by ``PushLedger.note_sent``).
2. ``CommitCut``: every shard gets the pushes the others applied that were
   sent to it too, and (sync mode) the largest step of any shard. It lets those
   updates through the held gate (they are waiting there, or arrive soon: the
   client sent every piece of a push at once), waits until they are applied,
   snapshots, releases the hold and writes the checkpoint with the id the
   coordinator chose (the same on every shard).

So a push is in the cut on all of its shards or on none, and in sync mode every
shard's snapshot is at the same step boundary: a restore gives one version of
the whole model. ``ReleaseCut`` aborts (releasing the hold, deleting a file the
cut wrote). Every hold also ends by itself after ``hold_s`` seconds, so a
coordinator that dies never wedges the cluster; a cut a shard no longer holds
fails its commit with ABORTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pscore.errors import AbortedError, DeadlineExceededError, FailedPreconditionError, InvalidArgumentError
from psproto.v1 import ps_pb2
from psserver import checkpoint, ckptfile
from psserver.ledger import PushKey
from psserver.modes import Mode, SyncMode, step_key
from psserver.store import Store

log = logging.getLogger(__name__)

DEFAULT_HOLD_S = 10.0
MAX_HOLD_S = 300.0
_DONE_KEPT = 8  # finished cuts remembered (a retried commit gets its reply; a late abort finds its file)
# Pushes one commit may name: a session remembers 4096 of them (the dedup window), so this covers 256
# worker sessions sending every push to several shards within a minute.
MAX_INCLUDED = 1 << 20


@dataclass(eq=False)
class _Cut:
    id: str
    hold_s: float
    held: bool = True
    expiry: asyncio.TimerHandle | None = None
    report: ps_pb2.PrepareCutResponse | None = None
    reply: ps_pb2.SaveCheckpointResponse | None = None
    path: Path | None = None
    why_released: str = ""
    committing: asyncio.Task[ps_pb2.SaveCheckpointResponse] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


def seq_ranges(seqs: Iterable[int]) -> list[int]:
    """Sorted sequence numbers as flat ``[first, last, first, last, ...]`` inclusive ranges.

    >>> seq_ranges([1, 2, 3, 7, 9, 10])
    [1, 3, 7, 7, 9, 10]
    """
    out: list[int] = []
    for s in sorted(seqs):
        if out and s == out[-1] + 1:
            out[-1] = s
        else:
            out += [s, s]
    return out


def expand_ranges(ranges: Iterable[int], limit: int = MAX_INCLUDED) -> list[int]:
    """The sequence numbers of ``seq_ranges`` output.

    >>> expand_ranges([1, 3, 7, 7])
    [1, 2, 3, 7]

    Raises:
        InvalidArgumentError: an odd count, a range that runs backwards, or more than ``limit`` numbers.
    """
    flat = list(ranges)
    if len(flat) % 2:
        raise InvalidArgumentError("seq_ranges must hold [first, last] pairs")
    out: list[int] = []
    for first, last in zip(flat[::2], flat[1::2], strict=True):
        if last < first or len(out) + last - first >= limit:
            raise InvalidArgumentError(
                f"bad sequence range [{first}, {last}] (backwards, or over {limit} pushes)"
            )
        out.extend(range(first, last + 1))
    return out


class CutHolds:
    """One shard's side of consistent cuts (at most one held at a time).

    Not thread-safe: call it from the shard's event loop.

    Args:
        store, mode: the shard's state.
        checkpointer: writes the cut's file (None: the shard has no checkpoint dir).
        shard, num_shards: the shard's identity.
    """

    def __init__(
        self,
        store: Store,
        mode: Mode,
        checkpointer: checkpoint.Checkpointer | None,
        *,
        shard: int,
        num_shards: int,
    ) -> None:
        self.store = store
        self.mode = mode
        self.checkpointer = checkpointer
        self.shard = shard
        self.num_shards = num_shards
        self._active: _Cut | None = None
        self._done: dict[str, _Cut] = {}

    @property
    def active(self) -> str | None:
        """The id of the cut holding this shard, if any."""
        return self._active.id if self._active is not None else None

    # -- phase one ----------------------------------------------------------

    async def prepare(self, cut_id: str, hold_s: float, deadline: float | None) -> ps_pb2.PrepareCutResponse:
        """Holds updates back and reports (``PrepareCut``); idempotent for the cut holding the shard.

        Raises:
            InvalidArgumentError: no cut id, or a bad hold time.
            FailedPreconditionError: no checkpoint dir.
            AbortedError: another cut holds the shard, or this one ended already.
            DeadlineExceededError: the updates in progress did not finish in time (the hold is released).
        """
        if not cut_id:
            raise InvalidArgumentError("PrepareCut needs a cut_id")
        if not 0 <= hold_s <= MAX_HOLD_S:
            raise InvalidArgumentError(f"hold_s must be in [0, {MAX_HOLD_S:g}] seconds, got {hold_s}")
        if self.checkpointer is None:
            raise FailedPreconditionError("no checkpoint directory (start the shard with --checkpoint-dir)")
        cut = self._active
        if cut is not None and cut.id != cut_id:
            left = cut.expiry.when() - asyncio.get_running_loop().time() if cut.expiry else 0.0
            raise AbortedError(
                f"another consistent cut ({cut.id}) holds this shard (released within {max(left, 0):.1f}s)"
            )
        if cut_id in self._done:
            raise AbortedError(f"consistent cut {cut_id} has ended here ({self._done[cut_id].why_released})")
        if cut is None:
            cut = self._active = _Cut(cut_id, hold_s or DEFAULT_HOLD_S)
            self.store.gate.hold()
            cut.expiry = asyncio.get_running_loop().call_later(cut.hold_s, self._expire, cut)
            log.info("shard %d: cut %s: holding updates (%.1fs at most)", self.shard, cut_id, cut.hold_s)
        if cut.report is not None:
            return cut.report
        try:
            async with asyncio.timeout(_limit(cut, deadline)):
                await self.store.gate.wait_idle()
        except TimeoutError:
            self._end(cut, "the updates in progress did not finish in time")
            raise DeadlineExceededError(
                f"consistent cut {cut_id}: the updates in progress did not finish within {cut.hold_s:g}s "
                "or the caller's deadline; released"
            ) from None
        except BaseException:  # the call was cancelled: nothing stays held
            self._end(cut, "its PrepareCut call was cancelled")
            raise
        self._check_held(cut)
        assert self.checkpointer is not None
        cut.report = ps_pb2.PrepareCutResponse(
            shard=self.shard,
            num_shards=self.num_shards,
            mode=self.mode.name,
            step=self.mode.current_step(),
            applied=[]  # sync mode: the cut is a step boundary, the same on every shard
            if self.mode.name == "sync"
            else [
                ps_pb2.PushKeys(
                    worker_id=worker, session=session, seq_ranges=seq_ranges(seqs), shards=_shards(mask)
                )
                for worker, session, mask, seqs in self.store.ledger.sent_pushes()
            ],
            next_checkpoint_id=self.checkpointer.next_id,
        )
        return cut.report

    # -- phase two ----------------------------------------------------------

    async def commit(
        self, request: ps_pb2.CommitCutRequest, deadline: float | None
    ) -> ps_pb2.SaveCheckpointResponse:
        """Lets through what the cut must hold, snapshots, releases, writes (``CommitCut``).

        Raises:
            AbortedError: this shard does not hold the cut.
            DeadlineExceededError: a push to include, or a sync step, did not arrive in time.
            InvalidArgumentError: malformed ranges or checkpoint id.
            CheckpointError: the file could not be written.
        """
        done = self._done.get(request.cut_id)
        if done is not None and done.reply is not None:
            return done.reply  # a retry of a commit that succeeded
        cut = self._active
        if cut is None or cut.id != request.cut_id:
            why = f" ({done.why_released})" if done is not None else ""
            raise AbortedError(f"consistent cut {request.cut_id} is not held by this shard{why}")
        if cut.committing is None:
            cut.committing = asyncio.create_task(self._commit(cut, request, deadline))
            cut.committing.add_done_callback(_retrieve)  # its caller may have gone (a cancelled call)
        return await asyncio.shield(cut.committing)

    async def _commit(
        self, cut: _Cut, request: ps_pb2.CommitCutRequest, deadline: float | None
    ) -> ps_pb2.SaveCheckpointResponse:
        assert self.checkpointer is not None
        if request.checkpoint_id < 1:
            self._end(cut, "its commit was malformed")
            raise InvalidArgumentError(f"checkpoint_id must be >= 1, got {request.checkpoint_id}")
        try:
            include: list[PushKey] = []
            for keys in request.include:
                seqs = expand_ranges(keys.seq_ranges, MAX_INCLUDED - len(include))
                include.extend((keys.worker_id, keys.session, seq) for seq in seqs)
        except InvalidArgumentError:
            self._end(cut, "its commit was malformed")
            raise
        target = request.step if self.mode.name == "sync" else None
        if target is not None:
            include = []  # a sync step's update holds every push of the step
        try:
            async with asyncio.timeout(_limit(cut, deadline)):
                await self._settle(cut, include, target)
                started = time.monotonic()
                snap = await self.checkpointer.snapshot()
            self._end(cut, "committed")
            snap.cut = {"id": cut.id, "num_shards": self.num_shards}
            result = await self.checkpointer.write_snapshot(snap, request.checkpoint_id, started)
        except TimeoutError:
            missing = self._missing(include, target)
            self._end(cut, "its commit timed out")
            raise DeadlineExceededError(
                f"consistent cut {cut.id} timed out waiting for {missing}; released"
            ) from None
        except BaseException:
            self._end(cut, "its commit failed")
            raise
        cut.path = result.path
        cut.reply = ps_pb2.SaveCheckpointResponse(
            path=str(result.path),
            id=result.id,
            num_variables=result.num_variables,
            bytes=result.nbytes,
            seconds=result.seconds,
        )
        return cut.reply

    async def _settle(self, cut: _Cut, include: list[PushKey], target: int | None) -> None:
        """Lets the cut's updates through and waits until they are applied and nothing else runs."""
        if target is not None:
            self.store.gate.let_through(step_key(s) for s in range(self.mode.current_step(), target))
        self.store.gate.let_through(include)
        while True:
            self._check_held(cut)
            if not self._missing(include, target) and not self.store.gate.updating:
                return
            await self.store.gate.changed()

    def _missing(self, include: list[PushKey], target: int | None) -> str:
        """What the cut still waits for ("" when nothing)."""
        if target is not None and self.mode.current_step() < target:
            return f"sync step {self.mode.current_step()} to complete (the cut is at step {target})"
        for worker, session, seq in include:
            if not self.store.has_applied(worker, seq, session):
                return (
                    f"push {seq} of worker {worker} (session {session:016x}), applied on another shard "
                    "and not here"
                )
        return ""

    # -- release ------------------------------------------------------------

    def release(self, cut_id: str, *, discard: bool = False) -> tuple[bool, bool]:
        """Ends a cut (``ReleaseCut``): ``(released a hold, deleted its file)``; unknown cuts are a no-op."""
        released = discarded = False
        cut = self._active
        if cut is not None and cut.id == cut_id:
            released = True
            self._end(cut, "released by its coordinator")
        done = self._done.get(cut_id)
        if discard and done is not None and done.path is not None:
            with contextlib.suppress(FileNotFoundError):
                done.path.unlink()
                discarded = True
                log.warning("shard %d: cut %s aborted: deleted %s", self.shard, cut_id, done.path.name)
            done.path = None
            done.reply = None
        return released, discarded

    def abort(self, why: str) -> None:
        """Releases the cut holding this shard, if any (shutdown)."""
        if self._active is not None:
            self._end(self._active, why)

    def _expire(self, cut: _Cut) -> None:
        if self._active is cut:
            log.warning(
                "shard %d: consistent cut %s: no commit within %.1fs; releasing the hold",
                self.shard, cut.id, cut.hold_s,
            )  # fmt: skip
            self._end(cut, f"its hold expired after {cut.hold_s:g}s")

    def _end(self, cut: _Cut, why: str) -> None:
        if not cut.held:
            return
        cut.held = False
        cut.why_released = why
        if cut.expiry is not None:
            cut.expiry.cancel()
        if self._active is cut:
            self._active = None
        self.store.gate.release()
        self._done[cut.id] = cut
        while len(self._done) > _DONE_KEPT:
            del self._done[next(iter(self._done))]
        log.info("shard %d: consistent cut %s: hold released (%s)", self.shard, cut.id, why)

    def _check_held(self, cut: _Cut) -> None:
        if not cut.held:
            raise AbortedError(
                f"consistent cut {cut.id} is no longer held by this shard ({cut.why_released})"
            )


def _limit(cut: _Cut, deadline: float | None) -> float:
    """Seconds a phase may wait: until the caller's deadline (a little before), within the hold."""
    left = cut.expiry.when() - asyncio.get_running_loop().time() if cut.expiry else cut.hold_s
    if deadline is not None:
        left = min(left, deadline - time.monotonic() - min(0.5, max(0.0, deadline - time.monotonic()) / 4))
    return max(left, 0.0)


def _retrieve(task: asyncio.Task[object]) -> None:
    if not task.cancelled():
        task.exception()


def _shards(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


class StepCuts:
    """Sync mode's periodic checkpoints (``--checkpoint-every``): all at one step boundary on every shard.

    Shard 0 picks the boundary: when its timer fires and something changed, its
    step + 2. The choice travels with the workers, with no shard-to-shard link:
    every push answer carries it (``PushResponse.checkpoint_step``) and the
    client sends the largest it has seen on every later push
    (``PushRequest.checkpoint_step``). A worker pushes step k + 1 only after
    every shard answered its push of step k, and shard 0 answers pushes of step
    t + 1 only after it picked t + 2 (its step was t): so every push of step t + 2
    carries the choice, and no shard completes step t + 2 (passes the boundary)
    before it learnt it. When its step reaches the boundary a shard holds the
    next step's update back, snapshots and releases: every shard's file holds
    the same steps. A shard whose step has not moved for a whole period, with no
    gradient gathered, saves on its own (the workers stopped: every shard that
    got every step is at that step too).

    Args:
        mode: the shard's sync mode.
        store: its variables.
        checkpointer: writes the files.
        shard: this shard's index (shard 0 picks the boundaries).
    """

    def __init__(
        self, mode: SyncMode, store: Store, checkpointer: checkpoint.Checkpointer, *, shard: int
    ) -> None:
        self.mode = mode
        self.store = store
        self.checkpointer = checkpointer
        self.shard = shard
        self.target = 0  # the boundary picked or learnt (0: none yet)
        # The parts a worker's step is pushed in (PushRequest.parts, the latest seen; 1: whole steps): the
        # mode counts each part as a step, and a boundary is picked at a whole step of the workers'.
        self.parts = 1
        self.saving: asyncio.Task[None] | None = None
        mode.on_step = self._stepped

    @property
    def announced(self) -> int:
        """The boundary to tell workers (``PushResponse.checkpoint_step``): 0 once passed."""
        return self.target if self.target >= self.mode.step else 0

    def learn(self, step: int) -> None:
        """A push carried a boundary (``PushRequest.checkpoint_step``)."""
        if step <= self.target:
            return
        if step < self.mode.step:
            log.warning(
                "shard %d: the periodic checkpoint at step %d was learnt at step %d, too late; skipped here "
                "(a worker joined without having seen it)",
                self.shard, step, self.mode.step,
            )  # fmt: skip
            self.target = step
            return
        self.target = step
        if step == self.mode.step and self.mode.at_boundary():
            self._stepped(step)  # at the boundary already

    def pick(self) -> None:
        """Shard 0's timer: the next boundary is two steps on (unless one is pending), the first whole step
        from there for a step pushed in parts."""
        if self.target < self.mode.step:
            self.target = -(-(self.mode.step + 2) // self.parts) * self.parts
            log.debug("shard %d: next periodic checkpoint at step %d", self.shard, self.target)

    def _stepped(self, step: int) -> None:
        if step != self.target:
            return
        self.store.gate.hold()  # the next step's update waits here: the snapshot is at this boundary
        self.saving = asyncio.create_task(self._save(step, held=True, after=self.saving))

    async def _save(self, step: int, *, held: bool, after: asyncio.Task[None] | None = None) -> None:
        try:
            if after is not None:  # a save still running (an idle one): this one follows it
                with contextlib.suppress(Exception):
                    await asyncio.shield(after)
            started = time.monotonic()
            snap = await self.checkpointer.snapshot()
            if held:
                self.store.gate.release()
                held = False
            snap.cut = {"step": step}
            await self.checkpointer.write_snapshot(snap, self.checkpointer.next_id, started)
        except (ckptfile.CheckpointError, TimeoutError) as err:
            log.error("shard %d: periodic checkpoint at step %d failed: %s", self.shard, step, err)
        finally:
            if held:
                self.store.gate.release()
            if self.saving is asyncio.current_task():
                self.saving = None

    async def run_periodic(self, every_s: float) -> None:
        """The ``--checkpoint-every`` timer of a sync shard; runs until cancelled."""
        last = self.mode.step
        while True:
            await asyncio.sleep(every_s)
            if not self.checkpointer.dirty or self.saving is not None:
                last = self.mode.step
                continue
            if self.mode.step == last and self.mode.idle() and self.mode.step % self.parts == 0:
                self.saving = asyncio.create_task(self._save(self.mode.step, held=False))
                await asyncio.shield(self.saving)
            elif self.shard == 0:
                self.pick()
            last = self.mode.step
