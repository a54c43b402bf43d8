"""How a shard applies pushes: asynchronously (default), with a sync barrier, or with bounded staleness.

A mode sits between the servicer and the store: it decides when a validated
push is applied and when a pull may proceed.

- ``async``: every push is applied on arrival.
- ``sync`` (SyncReplicasOptimizer semantics): the update of step ``k`` is the
  mean of the first ``N`` gradients pushed for ``k`` by distinct workers,
  applied once; a push returns when its step's update is applied (the push is
  the barrier); pushes for past steps are dropped (``reason="stale"``). With
  ``M > N`` workers, the ``M - N`` extra ones are backups absorbing stragglers.
  Each shard runs its own barrier over the variables it owns; the shard's step
  is the number of updates applied so far (equal to each variable's version
  when every push carries every variable). A shard restored from a checkpoint
  at step ``t`` answers a push for a later step at once, not applied
  (``reason="restored"``), until it completes a step: it cannot gather a later
  step before ``t``, and a worker that kept running would wait at that barrier
  until it timed out. The worker goes back to the smallest of the shards'
  steps (``GetStatus.step``; ``psclient.keras.PSWorker`` does) and trains on
  from there: every shard then applies the same steps (shards that are ahead
  drop the repeated ones as stale).
- ``ssp`` (stale synchronous parallel): pushes are applied on arrival; a worker
  whose clock (steps pushed so far) is more than ``S`` ahead of the slowest of
  the ``M`` workers waits in its pull.

Every wait is bounded by the barrier timeout and by the caller's own deadline
(``deadline``: a wait gives up a little before it, so that the caller reads the
shard's diagnosis, not a bare deadline of its own); either is DEADLINE_EXCEEDED
naming the step and the workers waited for. When the shard shuts down
(``Mode.shutdown``), every wait ends at once with UNAVAILABLE and its gradient
is withdrawn: the worker's retry applies it on the restarted shard. The same
happens when a replicated primary loses its lease (``Mode.interrupt``): the
workers retry on whichever process serves next.

Replication (``psserver.replication``): a sync shard hands each step it applies
to ``replicate_step`` and answers the step's pushes only once the backup has
acknowledged it; a backup replays what its primary did with ``replay_step``,
``replay_push`` (ssp clocks) and ``replay_leave``.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from pscore.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    PSError,
    UnavailableError,
    WorkerIdConflictError,
)
from psserver import tables
from psserver.ledger import PushKey
from psserver.store import Store, Variable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PushOutcome:
    applied: bool
    reason: str = ""
    versions: tuple[int, ...] = ()  # async, ssp: the version each gradient produced (replication)
    time_unix: float = 0.0  # async, ssp: the time it was applied with (replication: dynamic tables' TTL)
    # Async, ssp: this push was applied on its own, so the servicer forwards it to a backup (sync mode
    # forwards whole steps itself, through ``SyncMode.replicate_step``).
    forward: bool = False


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """A sync step as applied: what a backup needs to apply it the same way."""

    step: int
    update: Sequence[tuple[Variable, tables.Grad]]  # each variable's mean gradient
    versions: Sequence[int]  # the version each variable reached
    claims: Sequence[PushKey]  # the pushes the step applied
    time_unix: float  # the time it was applied with (dynamic tables' TTL)


# Hands a sync step to replication: queued for the backup at once; returns what waits for the backup's
# acknowledgement (None: no backup).
StepReplicator = Callable[[StepUpdate], Awaitable[None] | None]


class WaitListener(Protocol):
    """Told when a push or a pull enters the mode and when it leaves (``psserver.metrics``)."""

    def wait_begin(self, op: str, worker_id: str, step: int) -> int: ...

    def wait_end(self, token: int) -> None: ...


class Mode(abc.ABC):
    """The update discipline of a shard."""

    name: str
    pushes_now: bool = False  # whether ``push_now`` may serve a push (else it returns None at once)

    def __init__(self, store: Store) -> None:
        self.store = store
        self.stopping = False  # set by shutdown(): waits end, new pushes are refused
        self.listener: WaitListener | None = None  # told when pushes and pulls enter and leave the mode
        # Raises UnavailableError while this shard may not apply updates (a replicated primary
        # without its lease: psserver.replication); None: always may.
        self.lease_check: Callable[[], None] | None = None

    def shutdown(self) -> None:
        """The shard is shutting down: ends every wait with UNAVAILABLE and refuses later pushes.

        Waiting pushes are withdrawn (nothing half-applied); their workers retry
        them on the restarted shard.
        """
        self.stopping = True
        self.interrupt(UnavailableError("the shard is shutting down; retry on its restart"))

    def interrupt(self, error: PSError) -> None:  # noqa: B027 - optional hook
        """Ends every wait now with ``error`` (a gathered gradient is withdrawn; nothing half-applied).

        Later pushes are taken as usual (``shutdown`` refuses them too).
        """

    def _check_serving(self) -> None:
        """Raises UnavailableError once the shard is shutting down, or while it holds no lease."""
        if self.stopping:
            raise UnavailableError("the shard is shutting down; retry on its restart")
        if self.lease_check is not None:
            self.lease_check()

    async def push(
        self,
        worker_id: str,
        seq: int,
        step: int,
        grads: Mapping[str, np.ndarray],
        session: int = 0,
        deadline: float | None = None,
    ) -> PushOutcome:
        """Applies (or schedules, or drops) one worker's gradients for this shard.

        ``(worker_id, session, seq)`` identifies the push (``PushLedger.claim``).
        ``deadline`` (``time.monotonic()`` clock): the caller's; a wait gives up
        just before it, as at the barrier timeout. The ``listener`` sees the call
        from start to end (how long it waited in the mode).

        Raises:
            PSError: invalid gradients (nothing is applied), a barrier that
                timed out, or ``WorkerIdConflictError`` (an older session of the worker id).
        """
        listener = self.listener  # the listener sees the wait (no context manager on the path)
        if listener is None:
            return await self._push(worker_id, seq, step, grads, session, deadline)
        token = listener.wait_begin("push", worker_id, step)
        try:
            return await self._push(worker_id, seq, step, grads, session, deadline)
        finally:
            listener.wait_end(token)

    def push_now(
        self, worker_id: str, seq: int, session: int, grads: Mapping[str, tables.Grad]
    ) -> list[tuple[Variable, tables.Grad]] | Literal[False] | None:
        """``push``'s common case served with no await, where the mode allows it (async mode: a push that
        waits for nothing): applied, the variables and gradients applied (``Store.validate_grads``'
        pairs, never empty: push_pull's values are read from those variables, not looked up again);
        False a duplicate; None not served so (nothing done: serve it with ``push``). The push waits for
        nothing, so the ``listener`` never sees it waiting.

        Raises:
            PSError: as ``push`` (nothing applied).
        """
        return None

    async def before_pull(self, worker_id: str, step: int, deadline: float | None = None) -> None:
        """Waits until ``worker_id`` at ``step`` may read (ssp mode), at most until about ``deadline``.

        Raises:
            DeadlineExceededError: the wait timed out (or the caller's deadline came near).
            UnavailableError: the shard is shutting down.
        """
        listener = self.listener  # as push's
        if listener is None:
            await self._before_pull(worker_id, step, deadline)
            return
        token = listener.wait_begin("pull", worker_id, step)
        try:
            await self._before_pull(worker_id, step, deadline)
        finally:
            listener.wait_end(token)

    @abc.abstractmethod
    async def _push(
        self,
        worker_id: str,
        seq: int,
        step: int,
        grads: Mapping[str, np.ndarray],
        session: int,
        deadline: float | None,
    ) -> PushOutcome:
        """The mode's ``push``."""

    async def _before_pull(  # noqa: B027 - optional hook
        self, worker_id: str, step: int, deadline: float | None
    ) -> None:
        """The mode's wait before a read (none by default)."""

    async def leave(self, worker_id: str) -> None:  # noqa: B027 - optional hook
        """``worker_id`` is done: barriers stop waiting for it (until it pushes again)."""

    def current_step(self) -> int:
        """The step a worker that (re)joins pushes for (``GetStatus``): 0 unless the mode counts steps."""
        return 0

    # -- checkpoints (psserver.checkpoint) --------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The mode's state to checkpoint: JSON-serialisable (default: none)."""
        return {}

    def load_state_dict(  # noqa: B027 - optional hook
        self, state: Mapping[str, Any], *, restored: bool = True
    ) -> None:
        """Restores what ``state_dict`` returned.

        ``restored``: from a checkpoint (the workers may be anywhere); False: a
        backup taking its live primary's state (``psserver.replication``).
        """

    def pending_claims(self) -> list[PushKey]:
        """Pushes ``(worker_id, session, seq)`` claimed, not applied yet (a checkpoint forgets them)."""
        return []

    # -- a backup replaying its primary (psserver.replication) -------------------

    def replay_push(self, worker_id: str, step: int) -> None:  # noqa: B027 - optional hook
        """A push of ``worker_id`` for ``step`` that the primary applied is applied here too (ssp clocks)."""

    def replay_step(self, step: int, workers: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """The primary completed sync step ``step`` with the gradients of ``workers``."""

    def replay_leave(self, worker_id: str) -> None:  # noqa: B027 - optional hook
        """``worker_id`` left (``Leave``) on the primary."""


class AsyncMode(Mode):
    """Every push is applied on arrival, once (retries of one ``(worker_id, session, seq)`` are ignored)."""

    name = "async"
    pushes_now = True

    async def before_pull(self, worker_id: str, step: int, deadline: float | None = None) -> None:
        """A read never waits in async mode: nothing to wait for, nor for the listener to see."""

    def push_now(
        self, worker_id: str, seq: int, session: int, grads: Mapping[str, tables.Grad]
    ) -> list[tuple[Variable, tables.Grad]] | Literal[False] | None:
        """``_push`` with no await, where the store applies the push inline (``Store.applies_now``); an empty
        push goes to ``_push``."""
        store = self.store
        pairs = store.validate_grads(grads)
        if not pairs or not store.applies_now((worker_id, session, seq), pairs):
            return None  # an empty push (a part with nothing for this shard): ``_push`` notes it
        if store.apply_once_now(worker_id, seq, session, pairs, time.time()) is None:
            return False
        return pairs

    async def _push(
        self,
        worker_id: str,
        seq: int,
        step: int,
        grads: Mapping[str, np.ndarray],
        session: int = 0,
        deadline: float | None = None,
    ) -> PushOutcome:
        # An empty push is a push all the same: one part of a push in parts (``PushRequest.parts``) or
        # ``every_shard`` may hold nothing for this shard, and a consistent cut counts it with the others
        pairs = self.store.validate_grads(grads)
        now = time.time()
        versions = await self.store.apply_once(worker_id, seq, session, pairs, now)
        if versions is None:
            return PushOutcome(applied=False, reason="duplicate")
        return PushOutcome(applied=True, versions=tuple(versions), time_unix=now, forward=True)


_FINISHED = 1 << 62  # the clock of a worker that left (ssp)
# A wait bounded by the caller's deadline answers this long before it (at most a quarter of the time
# left), so that the answer reaches the caller before its own deadline fires.
_DEADLINE_MARGIN_S = (0.25, 1.0)


def step_key(step: int) -> tuple[str, int]:
    """The gate key of sync step ``step``'s update (``Store.apply``): what a consistent cut lets through."""
    return ("step", step)


def wait_limit(barrier_timeout_s: float, deadline: float | None) -> tuple[float, bool]:
    """How long a wait may last: ``(seconds, whether the caller's deadline is what bounds it)``.

    Args:
        barrier_timeout_s: the shard's ``--barrier-timeout``.
        deadline: the caller's deadline (``time.monotonic()`` clock), or None when unknown.

    >>> wait_limit(60.0, None)
    (60.0, False)
    """
    if deadline is None:
        return barrier_timeout_s, False
    left = deadline - time.monotonic()
    margin = min(max(_DEADLINE_MARGIN_S[0], 0.1 * left), _DEADLINE_MARGIN_S[1], max(left, 0.0) / 4)
    by_caller = max(left - margin, 0.0)
    if by_caller < barrier_timeout_s:
        return by_caller, True
    return barrier_timeout_s, False


def _why(barrier_timeout_s: float, by_caller: bool) -> str:
    if by_caller:
        return f" (the caller's deadline is near; barrier timeout {barrier_timeout_s:g}s)"
    return ""


def _names(workers: list[str]) -> str:
    return ", ".join(workers) if workers else "none"


@dataclass(slots=True)
class _Round:
    """The gradients gathered so far for one sync step."""

    done: asyncio.Future[None]
    # worker_id -> ((session, seq), validated pairs); insertion order is arrival order.
    contributions: dict[str, tuple[tuple[int, int], list[tuple[Variable, np.ndarray]]]] = field(
        default_factory=dict
    )
    closed: bool = False  # N gradients are in: later pushes for this step are stale
    # (worker_id, session, seq) of gradients a newer session of their worker id replaced.
    replaced: set[PushKey] = field(default_factory=set)
    withdrawn: set[str] = field(default_factory=set)  # workers whose push gave up waiting (timed out)


class SyncMode(Mode):
    """N-of-M synchronous updates; the push is the barrier.

    Args:
        store: the shard's variables.
        replicas_to_aggregate: N, gradients averaged into one update.
        total_replicas: M, the number of workers (``M - N`` are backups).
        barrier_timeout_s: how long a push waits for its step's update.
    """

    name = "sync"

    def __init__(
        self, store: Store, *, replicas_to_aggregate: int, total_replicas: int, barrier_timeout_s: float
    ) -> None:
        super().__init__(store)
        if not 1 <= replicas_to_aggregate <= total_replicas:
            raise ValueError(
                f"need 1 <= replicas_to_aggregate ({replicas_to_aggregate}) "
                f"<= total_replicas ({total_replicas})"
            )
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_replicas = total_replicas
        self.barrier_timeout_s = barrier_timeout_s
        self.step = 0  # the step whose update is being gathered (= updates applied so far)
        self._rounds: dict[int, _Round] = {}
        self._workers: dict[str, int] = {}  # every worker seen -> the last step it pushed (-1: none)
        self.left: set[str] = set()  # workers done with training (Leave): not waited for
        self.dropped = 0
        self.resuming = False  # restored, and no step completed since: later steps are refused
        # Called (on the event loop, with no await between) each time a step completes, with the new
        # step: periodic checkpoints at a step boundary hold the next step's update there (psserver.cut).
        self.on_step: Callable[[int], None] | None = None
        # Replication: each applied step is handed over here (queued for the backup at once) and its
        # pushes are answered once the backup acknowledged it. None: no replication.
        self.replicate_step: StepReplicator | None = None
        # Steps applied here whose acknowledgement by the backup is awaited: a push for such a step is
        # answered "stale" only once it is acknowledged (or fails with it).
        self._replicating: dict[int, _Round] = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "dropped": self.dropped,
            "left": sorted(self.left),
            "resuming": self.resuming,
        }

    def load_state_dict(self, state: Mapping[str, Any], *, restored: bool = True) -> None:
        self.step = int(state.get("step", 0))
        self.dropped = int(state.get("dropped", 0))
        self.left = {str(w) for w in state.get("left", ())}
        # Restored: the workers may be at other steps (see the module docstring). A backup's state is
        # its live primary's.
        self.resuming = True if restored else bool(state.get("resuming", False))

    def replay_step(self, step: int, workers: Sequence[str]) -> None:
        self.step = max(self.step, step + 1)
        self.resuming = False
        self.left.difference_update(workers)

    def replay_leave(self, worker_id: str) -> None:
        self.left.add(worker_id)

    def at_boundary(self) -> bool:
        """True unless the current step's update is being applied (the state is between two steps)."""
        current = self._rounds.get(self.step)
        return current is None or not current.closed

    def idle(self) -> bool:
        """True when no gradient is gathered for any step (every worker is between steps, or gone)."""
        return not any(rnd.contributions for rnd in self._rounds.values())

    def current_step(self) -> int:
        """The step being gathered (= steps completed)."""
        return self.step

    @property
    def needed(self) -> int:
        """Gradients that complete a step: N, or fewer once workers left (never fewer than 1)."""
        return max(1, min(self.replicas_to_aggregate, self.total_replicas - len(self.left)))

    async def leave(self, worker_id: str) -> None:
        if worker_id in self.left:
            return
        self.left.add(worker_id)
        log.info("sync: worker %s left; a step now needs %d gradient(s)", worker_id, self.needed)
        await self._advance()  # a round waiting only for it completes now

    def pending_claims(self) -> list[PushKey]:
        return [
            (w, session, seq)
            for rnd in self._rounds.values()
            for w, ((session, seq), _) in rnd.contributions.items()
        ]

    def shutdown(self) -> None:
        self.stopping = True
        self._fail_gathering(
            lambda step, rnd: UnavailableError(
                f"the shard is shutting down: the sync step {step} barrier was left "
                f"with {len(rnd.contributions)} of {self.needed} gradients; retry on its restart"
            )
        )

    def interrupt(self, error: PSError) -> None:
        self._fail_gathering(lambda step, rnd: error)

    def _fail_gathering(self, error: Callable[[int, _Round], PSError]) -> None:
        """Ends the waits of every round still gathering (a round being applied completes).

        The rounds and their gradients go at once (withdrawn: their pushes'
        retries are applied; a later push starts a new round).
        """
        for step, rnd in list(self._rounds.items()):
            if rnd.closed:
                continue
            del self._rounds[step]
            if not rnd.done.done():
                rnd.done.set_exception(error(step, rnd))
                rnd.done.exception()  # retrieved: waiters re-raise it
            for worker, ((session, seq), _) in rnd.contributions.items():
                self.store.ledger.unclaim(worker, seq, session)
            rnd.withdrawn.update(rnd.contributions)
            rnd.contributions.clear()

    def _seen(self, worker_id: str, step: int = -1) -> None:
        if worker_id:
            self._workers[worker_id] = max(self._workers.get(worker_id, -1), step)

    async def _before_pull(self, worker_id: str, step: int, deadline: float | None = None) -> None:
        self._seen(worker_id)

    async def _push(
        self,
        worker_id: str,
        seq: int,
        step: int,
        grads: Mapping[str, np.ndarray],
        session: int = 0,
        deadline: float | None = None,
    ) -> PushOutcome:
        pairs = self.store.validate_grads(grads)
        self._check_serving()  # a barrier gathered now would never complete
        self._seen(worker_id)
        if step < 0:
            raise InvalidArgumentError(f"sync mode: step must be >= 0, got {step}")
        key = (session, seq)
        if not self.store.ledger.claim(worker_id, seq, session):
            # A retry: join the original's round if it is still gathering.
            for k, rnd in self._rounds.items():
                if rnd.contributions.get(worker_id, (None,))[0] == key:
                    await self._wait(k, rnd, worker_id, key, deadline)
                    return PushOutcome(applied=True)
            return PushOutcome(applied=False, reason="duplicate")
        self._seen(worker_id, step)
        self.left.discard(worker_id)  # pushing again: counted in again
        if self.resuming and step > self.step:
            self.dropped += 1
            log.info(
                "sync: restored at step %d: refused %s's push for step %d (it goes back to step %d)",
                self.step, worker_id, step, self.step,
            )  # fmt: skip
            return PushOutcome(applied=False, reason="restored")
        rnd = self._rounds.get(step)
        if step < self.step or (rnd is not None and rnd.closed):
            # Answered once the step is on the backup too: were the primary to die first, the backup
            # would gather this step again, and this worker must still count for it.
            applying = rnd if rnd is not None else self._replicating.get(step)
            if applying is not None:
                try:
                    await self._wait(step, applying, worker_id, key, deadline)
                except BaseException:
                    self.store.ledger.unclaim(worker_id, seq, session)  # its retry is judged afresh
                    raise
            self.dropped += 1
            log.debug(
                "sync: dropped stale gradient of %s for step %d (at step %d)", worker_id, step, self.step
            )
            return PushOutcome(applied=False, reason="stale")
        if rnd is None:
            rnd = self._rounds[step] = _Round(done=asyncio.get_running_loop().create_future())
        if worker_id in rnd.contributions:
            # The worker's latest push for the step speaks for it, and is answered when the step is
            # applied, as every push for it is (the push is the barrier: answered at once, the worker
            # would read the step before its update). Same session: the worker pushed the step again
            # after its first push's answer was lost; that push, if still waiting, is answered with the
            # step too. A newer session (a restarted worker, or a second client that took over): the
            # older session's push is refused.
            (old_session, old_seq), _ = rnd.contributions[worker_id]
            del rnd.contributions[worker_id]
            self.store.ledger.unclaim(worker_id, old_seq, old_session)
            if old_session != session:
                rnd.replaced.add((worker_id, old_session, old_seq))
        rnd.contributions[worker_id] = (key, pairs)
        await self._advance()
        await self._wait(step, rnd, worker_id, key, deadline)
        return PushOutcome(applied=True)

    async def _wait(
        self, step: int, rnd: _Round, worker_id: str, key: tuple[int, int], deadline: float | None
    ) -> None:
        started = time.monotonic()
        limit, by_caller = wait_limit(self.barrier_timeout_s, deadline)
        try:
            async with asyncio.timeout(limit):
                await asyncio.shield(rnd.done)
        except TimeoutError:
            if rnd.done.done():  # completed in the same tick as the timeout
                rnd.done.result()
            else:
                waited = time.monotonic() - started
                raise DeadlineExceededError(self._timeout_message(step, rnd, waited, by_caller)) from None
        finally:
            if not rnd.closed and rnd.contributions.get(worker_id, (None,))[0] == key:
                # Nothing half-applied: withdraw this gradient; a retry of the push applies it.
                del rnd.contributions[worker_id]
                rnd.withdrawn.add(worker_id)
                self.store.ledger.unclaim(worker_id, key[1], key[0])
                if not rnd.contributions and self._rounds.get(step) is rnd:
                    del self._rounds[step]
        if (worker_id, *key) in rnd.replaced:
            raise WorkerIdConflictError(
                f"worker id {worker_id!r} is used by two clients at once: session {key[0]:016x}'s "
                f"gradient for step {step} was replaced by a newer session's, not applied; give each "
                "worker its own worker_id (TF_CONFIG task index, or PSWorker(worker_index=...))"
            )

    def _timeout_message(self, step: int, rnd: _Round, waited: float, by_caller: bool = False) -> str:
        n, m = self.needed, self.total_replicas
        got = sorted(rnd.contributions)
        why = _why(self.barrier_timeout_s, by_caller)
        if rnd.closed:  # every gradient came and the step is applied: its backup has not acknowledged it
            return (
                f"sync step {step} is applied here, but its backup has not acknowledged it after "
                f"{waited:.1f}s{why}; the step's pushes are answered once it has (a retry is answered "
                "from the push ledger, never applied twice)"
            )
        if step > self.step:
            return (
                f"sync barrier timed out after {waited:.1f}s{why}: a push for step {step} waits for step "
                f"{self.step} to complete first; step {self.step} has "
                f"{len(self._rounds[self.step].contributions) if self.step in self._rounds else 0} of {n} "
                f"gradients (workers seen: {_names(sorted(self._workers))})"
            )
        gave_up = sorted(w for w in rnd.withdrawn if w not in rnd.contributions)
        missing = sorted(
            w for w in self._workers if w not in rnd.contributions and w not in self.left and w not in gave_up
        )
        unseen = max(0, m - len(self._workers))
        text = (
            f"sync barrier for step {step} timed out after {waited:.1f}s{why}: has {len(got)} of "
            f"{n} gradients needed (from {_names(got)}); "
            f"no gradient for step {step} from worker(s) {_names(missing)}"
        )
        if unseen:
            text += f" and {unseen} of {m} worker(s) never seen"
        if gave_up:
            text += f"; withdrawn when their pushes timed out too: {_names(gave_up)}"
        return text

    async def _advance(self) -> None:
        """Applies every complete round, in step order."""
        while (rnd := self._rounds.get(self.step)) is not None and not rnd.closed:
            n = self.needed
            if len(rnd.contributions) < n:
                return
            rnd.closed = True
            step = self.step
            chosen = list(rnd.contributions.values())[:n]
            claims = [(w, session, seq) for w, ((session, seq), _) in list(rnd.contributions.items())[:n]]
            try:
                self._check_serving()  # a replicated primary without its lease applies nothing
                update = await self._mean(chosen)
                now = time.time()
                versions = await self.store.apply(update, now, key=step_key(step), claims=claims)
            except BaseException as err:
                for worker, ((session, seq), _) in rnd.contributions.items():
                    self.store.ledger.unclaim(worker, seq, session)
                del self._rounds[step]
                if not rnd.done.done():
                    rnd.done.set_exception(err)
                    rnd.done.exception()  # retrieved: waiters re-raise it
                raise
            # No await from here until the step is handed to replication: the mode's state (its step)
            # and the store's (values, dedup table) change together, as a snapshot must see them.
            del self._rounds[step]
            self.step = step + 1
            self.resuming = False
            if self.on_step is not None:
                self.on_step(self.step)
            replicate = self.replicate_step
            acknowledged = (
                replicate(StepUpdate(step, update, versions, claims, now)) if replicate is not None else None
            )
            if acknowledged is None:
                rnd.done.set_result(None)
                continue
            # The step's pushes are answered once the backup has it (or fail with why it has not);
            # its own task, so that no caller's cancellation leaves them waiting.
            self._replicating[step] = rnd
            ack = asyncio.ensure_future(acknowledged)
            ack.add_done_callback(functools.partial(self._replicated, step, rnd))

    def _replicated(self, step: int, rnd: _Round, ack: asyncio.Future[None]) -> None:
        self._replicating.pop(step, None)
        if rnd.done.done():
            return
        error = None if ack.cancelled() else ack.exception()
        if ack.cancelled() or error is not None:
            rnd.done.set_exception(
                error
                if isinstance(error, PSError)
                else UnavailableError(f"sync step {step} was not replicated ({error!r}); retry")
            )
            rnd.done.exception()  # retrieved: waiters re-raise it
        else:
            rnd.done.set_result(None)

    async def _mean(
        self, chosen: list[tuple[tuple[int, int], list[tuple[Variable, np.ndarray]]]]
    ) -> list[tuple[Variable, np.ndarray]]:
        by_var: dict[str, tuple[Variable, list[np.ndarray]]] = {}
        for _, pairs in chosen:
            for var, grad in pairs:
                by_var.setdefault(var.name, (var, []))[1].append(grad)

        def mean(grads: list[np.ndarray]) -> np.ndarray:
            if len(grads) == 1:
                return grads[0]
            acc = grads[0].copy()
            for g in grads[1:]:
                acc += g
            acc /= len(grads)
            return acc

        out = []
        for var, grads in by_var.values():
            if isinstance(grads[0], tables.RowGrad):  # a row absent from a worker's push counts as zero
                out.append((var, tables.mean(grads, len(chosen))))  # type: ignore[arg-type]
                continue
            if var.nbytes * len(grads) > self.store.inline_apply_bytes:
                out.append((var, await asyncio.to_thread(mean, grads)))
            else:
                out.append((var, mean(grads)))
        return out


class SSPMode(Mode):
    """Stale synchronous parallel: async updates, but no worker runs more than S steps ahead.

    A worker's clock is the number of steps it has pushed (its last pushed step
    plus one). A pull at step ``s`` waits while ``s - min(clock) > S``, the
    minimum taken over the M workers (a worker not seen yet has clock 0). With
    S = 0 this is bulk-synchronous: step ``s`` starts once every worker has
    pushed step ``s - 1``.

    Args:
        store: the shard's variables.
        total_replicas: M, the number of workers.
        staleness: S, how many steps a worker may run ahead of the slowest.
        barrier_timeout_s: how long a pull waits.
    """

    name = "ssp"

    def __init__(
        self, store: Store, *, total_replicas: int, staleness: int, barrier_timeout_s: float
    ) -> None:
        super().__init__(store)
        if total_replicas < 1 or staleness < 0:
            raise ValueError(
                f"need total_replicas >= 1 and staleness >= 0, got {total_replicas}, {staleness}"
            )
        self.total_replicas = total_replicas
        self.staleness = staleness
        self.barrier_timeout_s = barrier_timeout_s
        self.clocks: dict[str, int] = {}  # pushing worker -> steps pushed
        self.left: set[str] = set()  # workers done with training (Leave): they hold nobody back
        self._tick = asyncio.Event()
        self._interrupts = 0  # how many times waits were ended (interrupt): a waiter that saw one raises
        self._interrupt_error: PSError | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"clocks": dict(self.clocks), "left": sorted(self.left)}

    def load_state_dict(self, state: Mapping[str, Any], *, restored: bool = True) -> None:
        self.clocks = {str(w): int(c) for w, c in dict(state.get("clocks", {})).items()}
        self.left = {str(w) for w in state.get("left", ())}

    def replay_push(self, worker_id: str, step: int) -> None:
        self._advance_clock(worker_id, step)

    def replay_leave(self, worker_id: str) -> None:
        self.left.add(worker_id)

    def _advance_clock(self, worker_id: str, step: int) -> None:
        self.left.discard(worker_id)  # pushing again: counted in again
        if step + 1 > self.clocks.get(worker_id, 0):
            self.clocks[worker_id] = step + 1
            self._wake()

    def current_step(self) -> int:
        """The slowest worker's clock."""
        clock = self.min_clock()
        return clock if clock < _FINISHED else max(self.clocks.values(), default=0)

    def min_clock(self) -> int:
        """The slowest clock over the M most advanced workers (0 while fewer than M have pushed).

        A worker that left counts as infinitely far ahead.
        """
        clocks = {**self.clocks, **dict.fromkeys(self.left, _FINISHED)}
        if len(clocks) < self.total_replicas:
            return 0
        return sorted(clocks.values(), reverse=True)[self.total_replicas - 1]

    async def leave(self, worker_id: str) -> None:
        if worker_id not in self.left:
            self.left.add(worker_id)
            log.info("ssp: worker %s left; it holds nobody back", worker_id)
            self._wake()

    def _wake(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def _push(
        self,
        worker_id: str,
        seq: int,
        step: int,
        grads: Mapping[str, np.ndarray],
        session: int = 0,
        deadline: float | None = None,
    ) -> PushOutcome:
        pairs = self.store.validate_grads(grads)
        if step < 0:
            raise InvalidArgumentError(f"ssp mode: step must be >= 0, got {step}")
        now = time.time()
        versions = await self.store.apply_once(worker_id, seq, session, pairs, now)
        if versions is None:
            return PushOutcome(applied=False, reason="duplicate")
        self._advance_clock(worker_id, step)  # in the same step as the update: a snapshot sees both
        return PushOutcome(applied=True, versions=tuple(versions), time_unix=now, forward=True)

    def interrupt(self, error: PSError) -> None:
        self._interrupts += 1
        self._interrupt_error = error
        self._wake()

    async def _before_pull(self, worker_id: str, step: int, deadline: float | None = None) -> None:
        if step - self.min_clock() <= self.staleness:
            return
        started = time.monotonic()
        limit, by_caller = wait_limit(self.barrier_timeout_s, deadline)
        interrupts = self._interrupts
        try:
            async with asyncio.timeout(limit):
                while step - self.min_clock() > self.staleness:
                    self._check_serving()
                    if self._interrupts != interrupts and (error := self._interrupt_error) is not None:
                        raise type(error)(error.details)
                    await self._tick.wait()
        except TimeoutError:
            raise DeadlineExceededError(
                self._timeout_message(worker_id, step, time.monotonic() - started, by_caller)
            ) from None

    def _timeout_message(self, worker_id: str, step: int, waited: float, by_caller: bool = False) -> str:
        floor = self.min_clock()
        slow = sorted(w for w, c in self.clocks.items() if c <= floor)
        unseen = max(0, self.total_replicas - len(self.clocks))
        why = _why(self.barrier_timeout_s, by_caller)
        text = (
            f"ssp wait timed out after {waited:.1f}s{why}: worker {worker_id or '(anonymous)'} "
            f"at step {step} may run at most {self.staleness} step(s) ahead of the slowest worker, "
            f"which has pushed {floor} step(s); slowest: {_names(slow)}"
        )
        if unseen:
            text += f"; {unseen} of {self.total_replicas} worker(s) have not pushed yet"
        return text


def make_mode(name: str, store: Store, **options: object) -> Mode:
    """Builds the mode called ``name``.

    Options: ``replicas_to_aggregate``, ``total_replicas`` (sync), ``total_replicas``,
    ``staleness`` (ssp), ``barrier_timeout_s`` (both); others are ignored.

    Raises:
        ValueError: unknown mode, or missing or inconsistent options.
    """
    timeout = float(options.get("barrier_timeout_s") or 60.0)  # type: ignore[arg-type]
    if name == "async":
        return AsyncMode(store)
    if name == "sync":
        n, m = options.get("replicas_to_aggregate"), options.get("total_replicas")
        if n is None or m is None:
            raise ValueError("sync mode needs replicas_to_aggregate and total_replicas")
        return SyncMode(
            store,
            replicas_to_aggregate=int(n),
            total_replicas=int(m),
            barrier_timeout_s=timeout,  # type: ignore[call-overload]
        )
    if name == "ssp":
        m = options.get("total_replicas")
        if m is None:
            raise ValueError("ssp mode needs total_replicas")
        return SSPMode(
            store,
            total_replicas=int(m),  # type: ignore[call-overload]
            staleness=int(options.get("staleness") or 0),  # type: ignore[call-overload]
            barrier_timeout_s=timeout,
        )
    raise ValueError(f"mode {name!r} is not available")
