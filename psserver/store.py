"""The variables one shard owns: values, optimizer slots, versions, and how updates change them.

The store also holds the shard's push ledger (``psserver.ledger``: which
pushes were applied, so a retry is applied once) and its update gate
(``psserver.gate``: where updates wait while a checkpoint snapshot or a
consistent cut holds them back).

Concurrency: everything runs on the shard's event loop. Each variable's update
is serialised by its ``asyncio.Lock``; values are copy-on-write (an update
builds a new array and swaps it in with one assignment), so a pull reads a
consistent ``(value, version)`` snapshot without taking the lock, and an update
of a large tensor runs in a worker thread without blocking readers. A primary's
push and its backup's replay of it are one update (``Store._update``).

Embedding table pieces (``psserver.tables``) are the exception: a row
gradient's new rows are computed (in a thread when large) and then written
into the stored array in place, on the event loop, with the version, in one
step with no await; a frozen (read-only) value is copied once first. So a
stored value that is writable is updated in place: readers that keep it past
an await (pulls, checkpoint snapshots) copy it (``stable_value``); a lookup's
gather copies the rows at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pscore import codec
from pscore.embedding import Regularizer
from pscore.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from pscore.placement import table_rows
from psproto.v1 import ps_pb2
from psserver import optimizers, tables
from psserver.gate import UpdateGate
from psserver.ledger import PushKey, PushLedger
from psserver.rows import Config, DynamicRows, Work
from psserver.tier import TierBudget, TierConfig, TierDirError, TierFullError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_Work = Work  # a heavy step of one variable's update (``Store._update``): its bytes, its computation


@dataclass(slots=True)
class Variable:
    """One stored tensor and its optimizer state."""

    spec: ps_pb2.VariableSpec
    dtype: np.dtype
    shape: tuple[int, ...]
    optimizer: optimizers.ServerOptimizer
    slots: dict[str, np.ndarray]
    # (value, version): replaced as a whole, never mutated, so readers need no lock.
    state: tuple[np.ndarray, int]
    # Pushes applied with the current optimizer (Keras's optimizer.iterations): the step of bias
    # correction and schedules. Unlike the version, an assignment does not count and a
    # replacement of the optimizer (UpdateOptimizer with reset) restarts it at 0.
    iterations: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # A dynamic table piece: its id -> row map and bookkeeping (the rows are ``state[0]``).
    dyn: DynamicRows | None = None
    # A table piece's regularizer (from its spec, checked at creation), applied with each row update.
    regularizer: Regularizer | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def value(self) -> np.ndarray:
        return self.state[0]

    @property
    def version(self) -> int:
        return self.state[1]

    @property
    def nbytes(self) -> int:
        return self.state[0].nbytes

    @property
    def is_table(self) -> bool:
        """A piece of an embedding table, fixed or dynamic."""
        return tables.is_table(self.spec)

    def stable_value(self) -> tuple[np.ndarray, int]:
        """``(value, version)`` that later updates will not change (a copy of a table updated in place)."""
        value, version = self.state
        return (value.copy() if value.flags.writeable else value), version


def _spec_key(spec: ps_pb2.VariableSpec) -> bytes:
    """What makes two specs equal for an idempotent create: all but a fixed table's initializer (how its
    rows started, not what the table is: an equal table created with another initializer keeps its rows)."""
    if spec.HasField("table") and spec.table.HasField("initializer"):
        spec = ps_pb2.VariableSpec.FromString(spec.SerializeToString())
        spec.table.ClearField("initializer")
    return spec.SerializeToString(deterministic=True)


def _run_inline(update: Generator[_Work, Any, int]) -> int:
    """``Store._run_offloaded`` for an update whose every computation is small: all of it now, no await."""
    try:
        result: Any = None
        while True:
            try:
                _nbytes, work = update.send(result)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            result = work()
    finally:
        update.close()


def _freeze(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _set_dense(var: Variable, new: np.ndarray) -> int:
    """A dense update's end (no await: readers see the value and its version change together): ``new``,
    frozen, in place of the value; the version and the step counted. Returns the new version."""
    new.flags.writeable = False  # _freeze, inline
    version = var.state[1] + 1
    var.state = (new, version)
    var.iterations += 1
    return version


async def _whole(update: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``update`` in a task of its own and returns (or raises) what it does, however often the
    caller is cancelled meanwhile: each cancellation is taken back (``uncancel``), and the caller goes on
    as if it had come after the call (a gRPC call's answer is then dropped).

    A cancelled call (its deadline passed, its client gone) cuts neither the
    update short nor what follows it in the caller: a half-applied update (one
    variable of a push and not the next, a table's rows admitted and not
    trained, spilled to disk and still counted in memory), or an applied one
    not recorded as sent, not forwarded to the backup or not handed to
    replication as a sync step, would be worse than one applied after its
    caller gave up, which the retry finds applied (the push ledger).
    """
    task = asyncio.ensure_future(update)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            if (caller := asyncio.current_task()) is not None:
                caller.uncancel()


class Store:
    """The variables of one shard.

    Not thread-safe: call it from the shard's event loop only.
    """

    def __init__(
        self,
        *,
        allow_non_finite: bool = False,
        inline_apply_bytes: int = 1 << 20,
        tier: TierConfig | None = None,
    ) -> None:
        self._vars: dict[str, Variable] = {}
        # The disk tier (``psserver.tier``): dynamic tables without a capacity keep their hot rows in
        # memory under its budget and the others on disk; None: every row in memory.
        self.tier = tier
        self.tier_budget = TierBudget(tier.memory_bytes) if tier is not None else None
        self.ledger = PushLedger()  # the pushes applied here (retries are applied once)
        self.allow_non_finite = allow_non_finite
        self.inline_apply_bytes = inline_apply_bytes
        self.pushes = 0
        self.pulls = 0
        self.changes = 0  # creates, updates, assignments, optimizer changes: what a checkpoint must save
        self.started = time.monotonic()
        # Updates pass it (``_updates``); checkpoint snapshots and consistent cuts hold them back.
        self.gate = UpdateGate()

    def clear(self) -> None:
        """Forgets every variable and the dedup table (a backup about to load a new snapshot)."""
        if self.gate.busy:
            raise RuntimeError("Store.clear while updates are in progress")
        self.close()
        self._vars = {}
        self.ledger = PushLedger()

    def close(self) -> None:
        """Closes (and removes) the dynamic tables' disk tiers; the store is not used after."""
        for var in self._vars.values():
            if var.dyn is not None:
                var.dyn.close()

    # -- inspection ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self._vars)

    def __contains__(self, name: str) -> bool:
        return name in self._vars

    @property
    def total_bytes(self) -> int:
        return sum(v.nbytes for v in self._vars.values())

    def variables(self) -> list[Variable]:
        return list(self._vars.values())

    def get(self, name: str) -> Variable:
        """Raises: NotFoundError."""
        try:
            return self._vars[name]
        except KeyError:
            raise NotFoundError(f"variable {name!r} does not exist on this shard") from None

    def lookup(self, names: Iterable[str]) -> list[Variable]:
        """The named variables, or all of them when ``names`` is empty. Raises: NotFoundError."""
        names = list(names)
        if not names:
            return self.variables()
        known, found = self._vars, []
        for n in names:  # a loop, not comprehensions: no call per look-up
            var = known.get(n)
            if var is None:
                missing = [m for m in names if m not in known]
                raise NotFoundError(f"variables {missing} do not exist on this shard")
            found.append(var)
        return found

    # -- create -------------------------------------------------------------

    def create(
        self,
        specs: list[ps_pb2.VariableSpec],
        values: Mapping[str, np.ndarray],
        made: Mapping[str, np.ndarray] | None = None,
    ) -> list[bool]:
        """Creates variables all-or-nothing; returns which ones this call created.

        A table piece whose spec names an initializer (``TableRows.initializer``)
        takes no value: its rows are ``made[name]`` (from ``make_rows``, which
        computes them off the event loop) or, when absent, computed here.

        Raises:
            InvalidArgumentError: a spec is malformed or its value missing or mismatched, or a
                value was sent for a piece whose rows the shard makes.
            AlreadyExistsError: a name exists with a different spec.
        """
        made = made or {}
        staged: list[Variable | None] = []
        try:
            self._stage(specs, values, made, staged)
        except BaseException:
            for var in staged:  # a dynamic piece's disk tier was created: drop it with the piece
                if var is not None and var.dyn is not None:
                    var.dyn.close()
            raise
        for var in staged:
            if var is not None:
                self._vars[var.name] = var
                self.changes += 1
                log.info(
                    "created %s %s%s (%s)", var.name, var.dtype.name, list(var.shape), var.optimizer.name
                )
        return [var is not None for var in staged]

    def _stage(
        self,
        specs: list[ps_pb2.VariableSpec],
        values: Mapping[str, np.ndarray],
        made: Mapping[str, np.ndarray],
        staged: list[Variable | None],
    ) -> None:
        """``create``'s checks and builds: appends each spec's new variable (None: it exists)."""
        seen: set[str] = set()
        for spec in specs:
            name = spec.name
            if not name or "\x00" in name:
                raise InvalidArgumentError(f"invalid variable name {name!r} (empty, or with a NUL byte)")
            if name in seen:
                raise InvalidArgumentError(f"variable {name!r} is listed twice")
            seen.add(name)
            existing = self._vars.get(name)
            if existing is not None:
                if _spec_key(existing.spec) != _spec_key(spec):
                    raise AlreadyExistsError(
                        f"variable {name!r} already exists with a different spec: "
                        f"has {_describe(existing.spec)}, asked for {_describe(spec)}"
                    )
                staged.append(None)
                continue
            if tables.made_here(spec):
                if name in values:
                    raise InvalidArgumentError(
                        f"table piece {name!r}: a value was sent, but its spec names an initializer "
                        "(the shard makes its rows)"
                    )
                staged.append(self._build(spec, made.get(name), made=True))
            else:
                staged.append(self._build(spec, values.get(name)))
        extra = set(values) - seen
        if extra:
            raise InvalidArgumentError(f"values given for variables without a spec: {sorted(extra)}")

    async def make_rows(self, specs: Iterable[ps_pb2.VariableSpec]) -> dict[str, np.ndarray]:
        """The rows of the new table pieces in ``specs`` whose spec names an initializer, for ``create``.

        Computed block by block (``tables.initial_rows``), in a worker thread when
        large, so a big table neither blocks the event loop nor needs the client to
        send it. Pieces that exist already are skipped (``create`` keeps them).

        Raises:
            InvalidArgumentError: a malformed table piece spec, or an unknown initializer.
            ResourceExhaustedError: the piece's rows and optimizer slots need more memory than the
                shard's machine has available (nothing is allocated).
        """
        made: dict[str, np.ndarray] = {}
        for spec in specs:
            if not tables.made_here(spec) or spec.name in self._vars or spec.name in made:
                continue
            dtype, shape = _parse(spec)
            optimizer = _optimizer(spec)
            _check_table(spec, dtype, shape, optimizer)
            _check_memory(spec, dtype, shape, optimizer)
            if math.prod(shape) * dtype.itemsize > self.inline_apply_bytes:
                made[spec.name] = await asyncio.to_thread(_initial_rows, spec, dtype)
            else:
                made[spec.name] = _initial_rows(spec, dtype)
        return made

    def _build(self, spec: ps_pb2.VariableSpec, value: np.ndarray | None, *, made: bool = False) -> Variable:
        """A new variable from its spec and initial value; ``made``: a table piece whose rows the shard
        makes (``value`` from ``make_rows``, or None to compute them now), kept without a copy."""
        name = spec.name
        dtype, shape = _parse(spec)
        if spec.HasField("dynamic"):
            return _build_dynamic(spec, dtype, value, self.tier, self.tier_budget)
        if value is None and not made:
            raise InvalidArgumentError(f"variable {name!r}: no initial value was sent")
        if spec.HasField("partition"):
            p = spec.partition
            full = math.prod(int(d) for d in p.full_shape)
            if not (0 <= p.index < p.count and p.offset >= 0 and p.offset + math.prod(shape) <= full):
                raise InvalidArgumentError(
                    f"variable {name!r}: partition {p.index}/{p.count} is inconsistent"
                )
        optimizer = _optimizer(spec)
        if spec.HasField("table"):
            _check_table(spec, dtype, shape, optimizer)
        if spec.HasField("partition") and optimizer.needs_whole_variable:
            raise InvalidArgumentError(
                f"variable {spec.partition.variable!r} is cut into {spec.partition.count} partitions, but "
                f"{optimizer.config!r} needs the whole variable on one shard (clipnorm, Adafactor and Lamb "
                "use norms or means over the whole variable); create it unpartitioned "
                "(ClientConfig(partition_bytes=0)) or use clipvalue / global_clipnorm"
            )
        if made and value is None:
            _check_memory(spec, dtype, shape, optimizer)
            value = _initial_rows(spec, dtype)
        assert value is not None
        if value.dtype != dtype or value.shape != shape:
            raise InvalidArgumentError(
                f"variable {name!r}: initial value is {value.dtype.name}{list(value.shape)}, "
                f"spec says {dtype.name}{list(shape)}"
            )
        # The shard's own array is kept writable (a table piece's rows are updated in place).
        state = (value, 0) if made else (_freeze(np.array(value, dtype=dtype, copy=True)), 0)
        return Variable(
            spec=spec,
            dtype=dtype,
            shape=shape,
            optimizer=optimizer,
            slots=optimizer.init_slots(state[0]),
            state=state,
            regularizer=tables.regularizer(spec),
        )

    # -- push ---------------------------------------------------------------

    def validate_grads(self, grads: Mapping[str, tables.Grad]) -> list[tuple[Variable, tables.Grad]]:
        """Checks every gradient before any is applied.

        Args:
            grads: name -> gradient: an array, or a ``RowGrad`` for a table piece
                (returned with its duplicate ids summed).

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: a dtype or shape mismatch, a
                non-finite gradient, or a bad row gradient (``tables.validate``).
        """
        pairs: list[tuple[Variable, tables.Grad]] = []
        known = self._vars
        for name, grad in grads.items():
            var = known.get(name)
            if var is None:
                var = self.get(name)  # raises NotFoundError
            if isinstance(grad, tables.RowGrad):
                rows = tables.validate(var.spec, var.dtype, grad, allow_non_finite=self.allow_non_finite)
                pairs.append((var, rows))
                continue
            if grad.dtype != var.dtype:
                raise InvalidArgumentError(
                    f"gradient for {name!r} has dtype {grad.dtype.name}; variable has dtype {var.dtype.name}"
                )
            if grad.shape != var.shape:
                raise InvalidArgumentError(
                    f"gradient for {name!r} has shape {tuple(grad.shape)}; variable has shape {var.shape}"
                )
            if var.dtype.kind != "f":
                raise InvalidArgumentError(
                    f"variable {name!r} has dtype {var.dtype.name} and is not trainable"
                )
            # A finite sum of squares: every element finite (a NaN or an Inf makes it NaN or Inf; no
            # finite square is negative), in one pass with no temporary array; an overflow (huge, finite
            # elements) is told apart by the element-wise check.
            if (
                not self.allow_non_finite
                and not math.isfinite(np.vdot(grad, grad))
                and not np.logical_and.reduce(np.isfinite(grad), axis=None)
            ):
                bad = int(grad.size - np.count_nonzero(np.isfinite(grad)))
                raise InvalidArgumentError(
                    f"gradient for {name!r} has {bad} non-finite (NaN or Inf) elements; rejected "
                    "(start the shard with --allow-non-finite to apply them)"
                )
            pairs.append((var, grad))
        return pairs

    async def apply_once(
        self,
        worker_id: str,
        seq: int,
        session: int,
        pairs: list[tuple[Variable, tables.Grad]],
        now: float | None = None,
    ) -> list[int] | None:
        """Applies push ``(worker_id, session, seq)`` unless it was already applied (then returns None).

        The one claim / apply / unclaim sequence of every mode that applies a push
        on arrival: a push whose apply fails is forgotten, so its retry applies it.
        ``now``: the push's time (see ``apply``).
        At a held gate the push is named by its key (a consistent cut may let it through).

        A retry that arrives while the original is still being applied waits for
        it: None once it is applied, or this one applies it if the original failed.

        Raises:
            WorkerIdConflictError: see ``PushLedger.claim``; nothing applied.
        """
        key = (worker_id, session, seq)
        while not self.ledger.claim(worker_id, seq, session):
            if not self.gate.is_pending(key):
                return None
            await self.gate.left_pending(key)
        failed = functools.partial(self.ledger.unclaim, worker_id, seq, session)
        return await self._apply(pairs, now, key, (key,), failed)

    def applies_now(self, key: PushKey, pairs: list[tuple[Variable, tables.Grad]]) -> bool:
        """Whether ``apply_once_now`` may apply push ``key``'s ``pairs`` in this event-loop step: the gate
        open and the push not at it (no retry's original being applied), every update small enough to run
        inline (``_inline``)."""
        gate = self.gate
        return not gate.held and not gate.is_pending(key) and self._inline(pairs)

    def apply_once_now(
        self, worker_id: str, seq: int, session: int, pairs: list[tuple[Variable, tables.Grad]], now: float
    ) -> list[int] | None:
        """``apply_once`` with no await, for a push that ``applies_now`` accepted in this same event-loop
        step: the versions, or None (already applied). From the claim to the last version nothing awaits,
        so no other task sees the push at the gate: it is not counted there (``enter`` and ``leave`` in
        one step change nothing another task could see).

        Raises:
            WorkerIdConflictError: see ``PushLedger.claim``; nothing applied.
        """
        if not self.ledger.claim(worker_id, seq, session):
            return None
        try:
            versions = self._apply_inline(pairs, now)
        except BaseException:  # as ``_apply``: forgotten, so that its retry applies it
            self.changes += 1
            self.ledger.unclaim(worker_id, seq, session)
            raise
        self.pushes += 1
        self.changes += 1
        return versions

    def has_applied(self, worker_id: str, seq: int, session: int) -> bool:
        """Whether push ``(worker_id, session, seq)`` is applied here (recorded, not waiting at the gate)."""
        key = (worker_id, session, seq)
        return self.ledger.recorded(worker_id, seq, session) and not self.gate.is_pending(key)

    async def apply(
        self,
        pairs: list[tuple[Variable, tables.Grad]],
        now: float | None = None,
        *,
        key: Hashable = None,
        claims: Iterable[PushKey] = (),
    ) -> list[int]:
        """Applies validated gradients, one variable at a time under its lock; returns new versions.

        Waits while updates are held back (``UpdateGate.hold``: a checkpoint snapshot, a
        consistent cut), so a snapshot never holds half of one update.

        Args:
            pairs: from ``validate_grads``.
            now: the push's time (``time.time()``; default: now): dynamic tables'
                ``ttl_seconds`` counts from it (a backup replays its primary's).
            key: names the update at the gate: a consistent cut may let it through
                (a push's ``(worker_id, session, seq)``; a sync step's ``("step", k)``).
            claims: the pushes this update applies (a snapshot counts them as seen only once it is done).

        A caller cancelled once the update has passed the gate (its call
        cancelled, its deadline passed) waits for it to end whole and goes on
        (``_whole``): an update is never cut between two variables, nor inside
        one, nor from what follows it.
        """
        return await self._apply(pairs, now, key, claims)

    async def _apply(
        self,
        pairs: list[tuple[Variable, tables.Grad]],
        now: float | None,
        key: Hashable,
        claims: Iterable[PushKey],
        failed: Callable[[], None] | None = None,
    ) -> list[int]:
        """``apply``; ``failed`` is called if the update was not applied (it failed, or its caller was
        cancelled before it passed the gate)."""
        now = time.time() if now is None else now
        claims = tuple(claims)
        gate = self.gate
        try:
            await gate.enter(key, claims)  # as ``_updates``, without its context managers
            try:
                versions = self._apply_now(pairs, now)  # all of it now, no await: nothing can cut it
                if versions is None and (len(pairs) > 1 or (pairs and pairs[0][0].dyn is not None)):
                    versions = await _whole(self._apply_each(pairs, now))
                elif versions is None:  # one change, at the end (``_write_rows``, ``var.state``): a cancel
                    versions = await self._apply_each(pairs, now)  # lands before it
                self.pushes += 1
            finally:
                self.changes += 1
                gate.leave(claims)
        except BaseException:
            if failed is not None:
                failed()
            raise
        if self.tier_budget is not None and self.tier_budget.owed:  # a tiered piece overdrew the budget
            await _whole(self._give_back_owed())
        return versions

    async def _give_back_owed(self) -> None:
        """The pieces over their share give the budget back what a piece overdrew (``_give_back``)."""
        for var in self._over_share():
            async with var.lock:
                self._give_back(var)

    def _apply_now(self, pairs: list[tuple[Variable, tables.Grad]], now: float) -> list[int] | None:
        """The common case of ``_apply_each``, with no await (no task of its own, no lock taken) where
        ``_inline`` allows it. Returns the versions, or None (nothing done) where it does not."""
        return self._apply_inline(pairs, now) if self._inline(pairs) else None

    def _inline(self, pairs: list[tuple[Variable, tables.Grad]]) -> bool:
        """Whether ``pairs`` may be applied with no await: every variable free, none a dynamic table piece,
        each computation small (a dense update of at most ``inline_apply_bytes``; a fixed table's rows of
        at most that, on a piece that needs no copy of more, without an every-row regularizer)."""
        limit = self.inline_apply_bytes
        for var, grad in pairs:
            if var.dyn is not None or var.lock.locked():
                return False
            value = var.state[0]
            if isinstance(grad, tables.RowGrad):
                if grad.values.nbytes > limit or (value.nbytes > limit and not value.flags.writeable):
                    return False
                if var.regularizer is not None and var.regularizer.every_row:  # every row: a pass over all
                    return False
            elif value.nbytes > limit:
                return False
        return True

    def _apply_inline(self, pairs: list[tuple[Variable, tables.Grad]], now: float) -> list[int]:
        """Applies ``pairs`` that ``_inline`` accepted, with no await; returns the versions."""
        versions = []
        for var, grad in pairs:
            if isinstance(grad, tables.RowGrad):  # ``_update``'s fixed-table branch, without its generator
                reg = var.regularizer
                rows, values = tables.rows_to_update(
                    var.spec, tables.local_rows(var.spec, grad.ids), grad.values, reg
                )
                value = var.state[0]
                new = var.optimizer.apply_rows(value, rows, values, var.slots, var.iterations, reg)
                versions.append(
                    self._write_rows(var, value if value.flags.writeable else value.copy(), rows, new)
                )
                continue
            value = var.state[0]  # ``_update``'s dense branch, without its generator
            versions.append(_set_dense(var, var.optimizer.apply(value, grad, var.slots, var.iterations)))
        return versions

    async def _apply_each(self, pairs: list[tuple[Variable, tables.Grad]], now: float) -> list[int]:
        versions = []
        for var, grad in pairs:
            lock = var.lock
            if (
                not lock.locked()
                and not isinstance(grad, tables.RowGrad)
                and var.state[0].nbytes <= self.inline_apply_bytes
            ):
                # A dense update small enough to run inline makes no await: no other task runs before it
                # ends, so the lock, free now, would guard nothing (its five calls a variable saved). A
                # task waiting for the lock has not begun its own work yet; it goes on after this one.
                versions.append(_run_inline(self._update(var, grad, now)))
                continue
            async with lock:
                versions.append(await self._run_offloaded(self._update(var, grad, now)))
        return versions

    def _over_share(self) -> list[Variable]:
        """While the disk tier's budget is overdrawn (``TierBudget.owed``): the tiered pieces holding more
        than an equal share, most first."""
        budget = self.tier_budget
        if budget is None or not budget.owed:
            return []
        over = [v for v in self._vars.values() if v.dyn is not None and v.dyn.claimed > budget.fair()]
        return sorted(over, key=lambda v: -(v.dyn.claimed if v.dyn is not None else 0))

    def _give_back(self, var: Variable) -> None:
        """Shrinks an over-share piece by what the budget owes (down to its equal share). The caller holds
        its lock, or is the backup's replaying task (the store's only writer there)."""
        budget, dyn = self.tier_budget, var.dyn
        assert budget is not None and dyn is not None
        owed = min(budget.owed, dyn.claimed - budget.fair())
        if owed <= 0:
            return
        try:
            dyn.shrink(var, -(-owed // dyn.row_bytes))
        except TierFullError as err:  # the budget stays overdrawn until a later update tries again
            log.warning("%s: cannot give memory back to the other tables: %s", var.name, err)

    def _update(self, var: Variable, grad: tables.Grad, now: float) -> Generator[_Work, Any, int]:
        """The update of one variable by one validated gradient: the primary's push and its backup's replay.

        The caller holds ``var.lock``. Each heavy computation (the optimizer's
        rule, the copy of a frozen table piece, the growth of an unbounded
        dynamic table or the rebuild of a table's id index: a copy of all its
        rows or ids; a dynamic table's plan of the push when its expiry sweep is
        due, and a full table's choice of the rows it evicts: a pass over them;
        a tiered table's disk reads and write) is yielded
        with the bytes it works on, and its result sent back: the primary's push
        and the backup's replay both run the large ones in a worker thread
        (``_run_offloaded``), so the event loop turns on (a backup's goes on
        acknowledging its primary's heartbeats); the values are the same either
        way. Returns the new version.
        """
        if not isinstance(grad, tables.RowGrad):
            value = var.state[0]
            work = functools.partial(var.optimizer.apply, value, grad, var.slots, var.iterations)
            return _set_dense(var, (yield value.nbytes, work))
        reg = var.regularizer
        if var.dyn is not None:  # a dynamic table's push: its rows found, made or filled, then updated
            dyn_update = var.dyn.update(var, grad.ids, grad.values, now, var.optimizer, var.iterations, reg)
            rows, new = yield from dyn_update
            return self._write_rows(var, var.value, rows, new)
        rows, values = tables.rows_to_update(
            var.spec, tables.local_rows(var.spec, grad.ids), grad.values, reg
        )
        value = var.state[0]  # var.value, without its property
        work = functools.partial(
            var.optimizer.apply_rows, value, rows, values, var.slots, var.iterations, reg
        )
        new = yield values.nbytes, work
        if not value.flags.writeable:  # frozen (created, restored, assigned): copy once, then in place
            value = yield value.nbytes, value.copy
        return self._write_rows(var, value, rows, new)

    async def _run_offloaded(self, update: Generator[_Work, Any, int]) -> int:
        """Runs an ``_update``, its computations on more than ``inline_apply_bytes`` in a worker thread."""
        try:
            result: Any = None
            while True:
                try:
                    nbytes, work = update.send(result)
                except StopIteration as done:
                    return done.value
                result = await asyncio.to_thread(work) if nbytes > self.inline_apply_bytes else work()
        finally:
            update.close()

    def _write_rows(self, var: Variable, value: np.ndarray, rows: np.ndarray, new: np.ndarray) -> int:
        # No await from here on: readers on the event loop see the rows and the version change together.
        value[rows] = new
        version = var.state[1] + 1  # var.version, without its property
        var.state = (value, version)
        var.iterations += 1
        return version

    @contextlib.asynccontextmanager
    async def _updates(self, key: Hashable = None, claims: Iterable[PushKey] = ()) -> AsyncIterator[None]:
        """An update of the store, through the gate (``UpdateGate.passing``), counted in ``changes``."""
        async with self.gate.passing(key, claims):
            try:
                yield
            finally:
                self.changes += 1

    async def apply_one(self, var: Variable, grad: tables.Grad, now: float | None = None) -> int:
        """Applies one gradient (a backup replaying its primary's updates, one at a time).

        The same update as the primary's (``_update``, its large computations in
        a worker thread), with no gate and no lock: the backup's one replaying
        task is the store's only writer. A row gradient as the primary forwarded
        it is first validated as the primary did (duplicates summed, in the same
        order). ``now``: the push's time on the primary (dynamic tables' TTL).
        Returns the new version.
        """
        if isinstance(grad, tables.RowGrad):
            grad = tables.validate(var.spec, var.dtype, grad, allow_non_finite=True)
        version = await self._run_offloaded(self._update(var, grad, time.time() if now is None else now))
        self.changes += 1
        for over in self._over_share():
            self._give_back(over)
        return version

    # -- assign (Assign) -------------------------------------------------------

    def validate_values(self, values: Mapping[str, np.ndarray]) -> list[tuple[Variable, np.ndarray]]:
        """Checks every value of an Assign before any is set.

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: no values, a dtype or shape mismatch, or a non-finite
                value of a floating-point variable (unless the shard allows them).
        """
        if not values:
            raise InvalidArgumentError("assign carries no values")
        pairs = []
        for name, value in values.items():
            var = self.get(name)
            if var.dyn is not None:
                raise InvalidArgumentError(
                    f"{name!r} is a piece of dynamic table {var.dyn.config.table!r}: its rows cannot be "
                    "assigned (push row gradients)"
                )
            if value.dtype != var.dtype:
                raise InvalidArgumentError(
                    f"value for {name!r} has dtype {value.dtype.name}; variable has dtype {var.dtype.name}"
                )
            if value.shape != var.shape:
                raise InvalidArgumentError(
                    f"value for {name!r} has shape {tuple(value.shape)}; variable has shape {var.shape}"
                )
            if var.dtype.kind == "f" and not self.allow_non_finite and not np.isfinite(value).all():
                bad = int(value.size - np.count_nonzero(np.isfinite(value)))
                raise InvalidArgumentError(
                    f"value for {name!r} has {bad} non-finite (NaN or Inf) elements; rejected "
                    "(start the shard with --allow-non-finite to assign them)"
                )
            pairs.append((var, value))
        return pairs

    async def set_values(self, pairs: list[tuple[Variable, np.ndarray]]) -> list[int]:
        """Sets validated values (``validate_values``), keeping slots and step counts; returns new versions.

        Each variable is set under its lock (between two of its updates), its
        version + 1. Like ``apply``, waits while a checkpoint snapshot is taken.
        """
        copies = []
        for _, value in pairs:  # own copies: ``value`` may be a view of the request's bytes
            if value.nbytes > self.inline_apply_bytes:
                copies.append(await asyncio.to_thread(_owned, value))
            else:
                copies.append(_owned(value))

        async def assign_each() -> list[int]:
            versions = []
            for (var, _), new in zip(pairs, copies, strict=True):
                async with var.lock:
                    versions.append(self.assign_one(var, new))
            return versions

        async with self._updates():
            return await _whole(assign_each())  # never some of the values and not the others

    def assign_one(self, var: Variable, value: np.ndarray) -> int:
        """Sets one validated value now (a backup replaying its primary's Assign); returns the new version.

        ``value`` is kept (frozen), not copied.
        """
        version = var.version + 1
        var.state = (_freeze(value.reshape(var.shape)), version)
        self.changes += 1
        return version

    def assign(self, name: str, value: np.ndarray, version: int) -> None:
        """Replaces a value (checkpoint restore, aggregated sync updates)."""
        var = self.get(name)
        var.state = (_freeze(np.array(value, dtype=var.dtype, copy=True).reshape(var.shape)), version)

    # -- optimizer updates (UpdateOptimizer) ----------------------------------

    @contextlib.asynccontextmanager
    async def update_optimizer(
        self,
        names: Iterable[str],
        params: Mapping[str, float],
        spec: ps_pb2.OptimizerSpec | None = None,
        *,
        reset: bool = False,
    ) -> AsyncIterator[list[Variable]]:
        """Changes the optimizer hyper-parameters of variables, keeping values, versions and slots.

        With ``reset``, replaces the optimizer instead: ``spec`` may name any
        class, and each variable gets fresh slots (as at creation) and a step
        count (``Variable.iterations``) of 0, as a Keras model compiled with a
        new optimizer has.

        All or nothing: every variable is checked before any changes. The
        change is made with each variable's lock held, between two of its
        updates, and the block runs with the locks still held and the changed
        variables yielded (a primary queues the change for its backup there,
        so no later update can overtake it).

        Args:
            names: stored names; empty: every variable whose learning rate is
                not a schedule (the others are skipped).
            params: hyper-parameters to set by Keras name, merged into each spec.
            spec: instead of ``params``, the whole new spec (same optimizer class
                unless ``reset``).
            reset: replace the optimizer (needs ``spec`` and ``names``).

        Raises:
            NotFoundError: an unknown name.
            InvalidArgumentError: neither or both of params and spec, another optimizer
                class, an invalid or unknown parameter, a change of the slots, or
                a learning rate for a variable whose learning rate is a schedule;
                with ``reset``: no spec or no names, an invalid spec, or an
                optimizer that needs the whole variable for a partition.
        """
        names = list(names)
        if (spec is None) == (not params):
            raise InvalidArgumentError("UpdateOptimizer needs either params or an optimizer spec (not both)")
        if reset and (spec is None or not names):
            raise InvalidArgumentError(
                "UpdateOptimizer with reset needs an optimizer spec and variable names"
            )
        staged: list[tuple[Variable, optimizers.ServerOptimizer]] = []
        for var in self.lookup(names):
            old = var.spec.optimizer
            if spec is not None and reset:
                new = ps_pb2.OptimizerSpec()
                new.CopyFrom(spec)
            elif spec is not None:
                if spec.name.lower() != old.name.lower():
                    raise InvalidArgumentError(
                        f"variable {var.name!r} has optimizer {old.name!r}; the new spec names {spec.name!r} "
                        "(UpdateOptimizer keeps the optimizer class and its slots)"
                    )
                new = ps_pb2.OptimizerSpec()
                new.CopyFrom(spec)
            else:
                if "learning_rate" in params and old.HasField("learning_rate_schedule"):
                    if not names:
                        continue
                    raise InvalidArgumentError(
                        f"variable {var.name!r}: its learning rate is a schedule "
                        f"({old.learning_rate_schedule.name}), which cannot be set (as in Keras)"
                    )
                new = ps_pb2.OptimizerSpec()
                new.CopyFrom(old)
                new.params.update(params)
            try:
                optimizer = optimizers.from_spec(new)
            except ValueError as err:
                raise InvalidArgumentError(f"variable {var.name!r}: {err}") from None
            before, after = var.optimizer.slot_shapes(var.shape), optimizer.slot_shapes(var.shape)
            if not reset and var.dtype.kind == "f" and before != after:
                raise InvalidArgumentError(
                    f"variable {var.name!r}: {optimizer.config!r} would change its slots from "
                    f"{sorted(before)} to {sorted(after)}; UpdateOptimizer keeps the slots"
                )
            if var.spec.HasField("partition") and optimizer.needs_whole_variable:
                raise InvalidArgumentError(
                    f"variable {var.name!r} is a partition; {optimizer.config!r} needs the whole variable"
                )
            if var.is_table:
                try:
                    optimizer.check_rows()
                except ValueError as err:
                    raise InvalidArgumentError(f"table {tables.table_name(var.spec)!r}: {err}") from None
            staged.append((var, optimizer))
        # Through the checkpoint gate: a snapshot never holds a new spec with the old slots.
        async with self._updates(), contextlib.AsyncExitStack() as locks:
            for var, _ in staged:
                await locks.enter_async_context(var.lock)
            for var, optimizer in staged:
                self.set_optimizer(var, optimizer, reset=reset)
            yield [var for var, _ in staged]

    def set_optimizer(
        self, var: Variable, optimizer: optimizers.ServerOptimizer, *, reset: bool = False
    ) -> None:
        """Swaps a variable's optimizer (and the optimizer in its spec).

        Its slots and step count stay as they are, or with ``reset`` start afresh
        (slots as at creation, step count 0).
        """
        spec = ps_pb2.VariableSpec()
        spec.CopyFrom(var.spec)
        spec.optimizer.CopyFrom(optimizer.spec)
        if reset:
            var.slots = optimizer.init_slots(var.value)
            var.iterations = 0
        var.spec = spec
        var.optimizer = optimizer
        self.changes += 1
        log.info("variable %s: optimizer is now %r%s", var.name, optimizer.config, " (reset)" * reset)


def _parse(spec: ps_pb2.VariableSpec) -> tuple[np.dtype, tuple[int, ...]]:
    """A spec's dtype and shape. Raises: InvalidArgumentError."""
    try:
        dtype = codec.numpy_dtype(spec.dtype)
    except codec.CodecError as err:
        raise InvalidArgumentError(f"variable {spec.name!r}: {err}") from None
    shape = tuple(int(d) for d in spec.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"variable {spec.name!r}: negative dimension in shape {shape}")
    return dtype, shape


def _optimizer(spec: ps_pb2.VariableSpec) -> optimizers.ServerOptimizer:
    """A (non-dynamic) spec's optimizer. Raises: InvalidArgumentError."""
    try:
        return optimizers.from_spec(spec.optimizer)
    except ValueError as err:
        raise InvalidArgumentError(f"variable {spec.name!r}: {err}") from None


def _available_bytes() -> int | None:
    """The machine's available memory (``MemAvailable`` of /proc/meminfo), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_memory(
    spec: ps_pb2.VariableSpec, dtype: np.dtype, shape: tuple[int, ...], optimizer: optimizers.ServerOptimizer
) -> None:
    """Raises ResourceExhaustedError for a piece the shard makes that could not fit in memory: a small
    request must not make it allocate (and page in) more than the machine has."""
    row = np.zeros((1, *shape[1:]), dtype)
    per_row = row.nbytes + sum(a.nbytes for a in optimizer.init_slots(row).values() if a.shape == row.shape)
    need = per_row * (shape[0] if shape else 1)
    available = _available_bytes()
    if available is not None and need > available:
        raise ResourceExhaustedError(
            f"table piece {spec.name!r}: its rows and optimizer slots need {need / 2**30:.1f} GiB; the "
            f"shard's machine has {available / 2**30:.1f} GiB available (use more shards)"
        )


def _initial_rows(spec: ps_pb2.VariableSpec, dtype: np.dtype) -> np.ndarray:
    """``tables.initial_rows`` of a checked piece. Raises: InvalidArgumentError (an unknown initializer)."""
    try:
        return tables.initial_rows(spec, dtype)
    except ValueError as err:
        raise InvalidArgumentError(f"table piece {spec.name!r}: {err}") from None


def _check_table(
    spec: ps_pb2.VariableSpec, dtype: np.dtype, shape: tuple[int, ...], optimizer: optimizers.ServerOptimizer
) -> None:
    """Raises InvalidArgumentError for an inconsistent table piece spec (see ``ps_pb2.TableRows``)."""
    t = spec.table
    what = f"table piece {spec.name!r}"
    if not t.table or spec.HasField("partition"):
        raise InvalidArgumentError(f"{what}: a table piece needs a table name and cannot be a partition")
    if not (t.num_rows >= 1 and t.dim >= 1 and 0 <= t.index < t.count):
        raise InvalidArgumentError(
            f"{what}: num_rows {t.num_rows}, dim {t.dim}, shard {t.index} of {t.count} are inconsistent"
        )
    rows = table_rows(t.num_rows, t.index, t.count)
    if t.rows != rows or shape != (rows, t.dim):
        raise InvalidArgumentError(
            f"{what}: shape {list(shape)} (rows {t.rows}); shard {t.index} of {t.count} holds "
            f"{rows} of {t.num_rows} rows of dim {t.dim}"
        )
    if dtype.kind != "f":
        raise InvalidArgumentError(f"{what}: dtype {dtype.name} is not floating point (tables are trainable)")
    try:
        optimizer.check_rows()
    except ValueError as err:
        raise InvalidArgumentError(f"table {t.table!r}: {err}") from None
    tables.regularizer(spec)


def _build_dynamic(
    spec: ps_pb2.VariableSpec,
    dtype: np.dtype,
    value: np.ndarray | None,
    tier: TierConfig | None = None,
    budget: TierBudget | None = None,
) -> Variable:
    """A new, empty dynamic table piece, with its disk tier when ``tier`` is set and it has no capacity.

    Raises:
        InvalidArgumentError: a bad spec (or a value sent), or a tier budget too small for the table.
        ResourceExhaustedError: its disk tier cannot be created.
    """
    what = f"dynamic table piece {spec.name!r}"
    if value is not None and value.size:
        raise InvalidArgumentError(f"{what}: takes no initial value (rows are created on their first push)")
    try:
        config = Config.of(spec)
    except ValueError as err:
        raise InvalidArgumentError(f"{what}: {err}") from None
    if dtype.kind != "f":
        raise InvalidArgumentError(f"{what}: dtype {dtype.name} is not floating point (tables are trainable)")
    try:
        optimizer = optimizers.from_spec(spec.optimizer)
        optimizer.check_rows()
    except ValueError as err:
        raise InvalidArgumentError(f"table {config.table!r}: {err}") from None
    regularizer = tables.regularizer(spec)
    hot_rows = 0
    if tier is not None and not config.capacity:
        try:
            hot_rows = DynamicRows.hot_rows_for(config, dtype, optimizer, tier.memory_bytes)
        except ValueError as err:
            raise InvalidArgumentError(f"{what}: {err}") from None
    elif tier is not None:
        log.info(
            "%s: table %r has a capacity (%d rows on this shard): kept in memory, not tiered",
            spec.name,
            config.table,
            config.capacity,
        )
    rows = DynamicRows(config, dtype, hot_rows)
    storage, slots = rows.new_storage(optimizer)
    var = Variable(
        spec=spec,
        dtype=dtype,
        shape=(0, config.dim),
        optimizer=optimizer,
        slots=slots,
        state=(storage, 0),
        dyn=rows,
        regularizer=regularizer,
    )
    if hot_rows:
        assert tier is not None and budget is not None
        try:
            rows.attach_tier(tier, spec.name, var, budget, optimizer)
        except TierDirError as err:
            raise ResourceExhaustedError(f"{what}: {err}") from None
        except ValueError as err:  # an equal share of the budget is too small for the table
            raise InvalidArgumentError(f"{what}: {err}") from None
    return var


def _owned(value: np.ndarray) -> np.ndarray:
    return np.array(value, copy=True, order="C")


def _describe(spec: ps_pb2.VariableSpec) -> str:
    dtype = ps_pb2.DType.Name(spec.dtype).removeprefix("DTYPE_").lower()
    params = ", ".join(f"{k}={v:g}" for k, v in sorted(spec.optimizer.params.items()))
    return f"{dtype}{list(spec.shape)} {spec.optimizer.name}({params})"
