"""The variables one shard owns: values, optimizer slots, versions, and the push dedup table.

Concurrency: everything runs on the shard's event loop. Each variable's update
is serialised by its ``asyncio.Lock``; values are copy-on-write (an update
builds a new array and swaps it in with one assignment), so a pull reads a
consistent ``(value, version)`` snapshot without taking the lock, and an update
of a large tensor runs in a worker thread without blocking readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from psclient import codec
from psproto.v1 import ps_pb2
from psserver import optimizers
from psserver.errors import AlreadyExists, InvalidArgument, NotFound

log = logging.getLogger(__name__)

_DEDUP_WINDOW = 4096  # sequence numbers remembered per worker; older ones count as already applied


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
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

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


class _SeqWindow:
    """The sequence numbers of one worker's recent pushes."""

    __slots__ = ("floor", "seen")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.floor = -1  # every seq <= floor counts as seen

    def __contains__(self, seq: int) -> bool:
        return seq <= self.floor or seq in self.seen

    def add(self, seq: int) -> None:
        self.seen.add(seq)
        if len(self.seen) > _DEDUP_WINDOW:
            newest = max(self.seen)
            self.floor = newest - _DEDUP_WINDOW
            self.seen = {s for s in self.seen if s > self.floor}

    def discard(self, seq: int) -> None:
        self.seen.discard(seq)


def _spec_key(spec: ps_pb2.VariableSpec) -> bytes:
    return spec.SerializeToString(deterministic=True)


def _freeze(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class Store:
    """The variables of one shard.

    Not thread-safe: call it from the shard's event loop only.
    """

    def __init__(self, *, allow_non_finite: bool = False, inline_apply_bytes: int = 1 << 20) -> None:
        self._vars: dict[str, Variable] = {}
        self._seqs: dict[str, _SeqWindow] = {}
        self.allow_non_finite = allow_non_finite
        self.inline_apply_bytes = inline_apply_bytes
        self.pushes = 0
        self.pulls = 0
        self.started = time.monotonic()
        # Checkpoint gate (see ``quiesced``): updates in progress, and whether new ones may start.
        self._updating = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._held_claims: set[tuple[str, int]] = set()  # claimed while the gate was closed

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
        """Raises: NotFound."""
        try:
            return self._vars[name]
        except KeyError:
            raise NotFound(f"variable {name!r} does not exist on this shard") from None

    def lookup(self, names: Iterable[str]) -> list[Variable]:
        """The named variables, or all of them when ``names`` is empty. Raises: NotFound."""
        names = list(names)
        if not names:
            return self.variables()
        missing = [n for n in names if n not in self._vars]
        if missing:
            raise NotFound(f"variables {missing} do not exist on this shard")
        return [self._vars[n] for n in names]

    # -- create -------------------------------------------------------------

    def create(self, specs: list[ps_pb2.VariableSpec], values: Mapping[str, np.ndarray]) -> list[bool]:
        """Creates variables all-or-nothing; returns which ones this call created.

        Raises:
            InvalidArgument: a spec is malformed or its value missing or mismatched.
            AlreadyExists: a name exists with a different spec.
        """
        staged: list[Variable | None] = []
        seen: set[str] = set()
        for spec in specs:
            name = spec.name
            if not name:
                raise InvalidArgument("variable name must not be empty")
            if name in seen:
                raise InvalidArgument(f"variable {name!r} is listed twice")
            seen.add(name)
            existing = self._vars.get(name)
            if existing is not None:
                if _spec_key(existing.spec) != _spec_key(spec):
                    raise AlreadyExists(
                        f"variable {name!r} already exists with a different spec: "
                        f"has {_describe(existing.spec)}, asked for {_describe(spec)}"
                    )
                staged.append(None)
                continue
            staged.append(self._build(spec, values.get(name)))
        extra = set(values) - seen
        if extra:
            raise InvalidArgument(f"values given for variables without a spec: {sorted(extra)}")
        for var in staged:
            if var is not None:
                self._vars[var.name] = var
                log.info(
                    "created %s %s%s (%s)", var.name, var.dtype.name, list(var.shape), var.optimizer.name
                )
        return [var is not None for var in staged]

    def _build(self, spec: ps_pb2.VariableSpec, value: np.ndarray | None) -> Variable:
        name = spec.name
        try:
            dtype = codec.numpy_dtype(spec.dtype)
        except codec.CodecError as err:
            raise InvalidArgument(f"variable {name!r}: {err}") from None
        shape = tuple(int(d) for d in spec.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"variable {name!r}: negative dimension in shape {shape}")
        if value is None:
            raise InvalidArgument(f"variable {name!r}: no initial value was sent")
        if value.dtype != dtype or value.shape != shape:
            raise InvalidArgument(
                f"variable {name!r}: initial value is {value.dtype.name}{list(value.shape)}, "
                f"spec says {dtype.name}{list(shape)}"
            )
        if spec.HasField("partition"):
            p = spec.partition
            full = math.prod(int(d) for d in p.full_shape)
            if not (0 <= p.index < p.count and p.offset >= 0 and p.offset + math.prod(shape) <= full):
                raise InvalidArgument(f"variable {name!r}: partition {p.index}/{p.count} is inconsistent")
        try:
            optimizer = optimizers.from_spec(spec.optimizer)
        except ValueError as err:
            raise InvalidArgument(f"variable {name!r}: {err}") from None
        value = np.array(value, dtype=dtype, copy=True)
        return Variable(
            spec=spec,
            dtype=dtype,
            shape=shape,
            optimizer=optimizer,
            slots=optimizer.init_slots(value),
            state=(_freeze(value), 0),
        )

    # -- push ---------------------------------------------------------------

    def validate_grads(self, grads: Mapping[str, np.ndarray]) -> list[tuple[Variable, np.ndarray]]:
        """Checks every gradient before any is applied.

        Raises:
            NotFound: an unknown variable.
            InvalidArgument: a dtype or shape mismatch, or a non-finite gradient.
        """
        if not grads:
            raise InvalidArgument("push carries no gradients")
        pairs = []
        for name, grad in grads.items():
            var = self.get(name)
            if grad.dtype != var.dtype:
                raise InvalidArgument(
                    f"gradient for {name!r} has dtype {grad.dtype.name}; variable has dtype {var.dtype.name}"
                )
            if grad.shape != var.shape:
                raise InvalidArgument(
                    f"gradient for {name!r} has shape {tuple(grad.shape)}; variable has shape {var.shape}"
                )
            if var.dtype.kind != "f":
                raise InvalidArgument(f"variable {name!r} has dtype {var.dtype.name} and is not trainable")
            if not self.allow_non_finite and not np.isfinite(grad).all():
                bad = int(grad.size - np.count_nonzero(np.isfinite(grad)))
                raise InvalidArgument(
                    f"gradient for {name!r} has {bad} non-finite (NaN or Inf) elements; rejected "
                    "(start the shard with --allow-non-finite to apply them)"
                )
            pairs.append((var, grad))
        return pairs

    def claim(self, worker_id: str, seq: int) -> bool:
        """Records push ``(worker_id, seq)``; False if it was already recorded (a retry)."""
        window = self._seqs.setdefault(worker_id, _SeqWindow())
        if seq in window:
            return False
        window.add(seq)
        if not self._open.is_set():
            self._held_claims.add((worker_id, seq))  # its apply waits at the gate: not in a snapshot
        return True

    def unclaim(self, worker_id: str, seq: int) -> None:
        """Forgets a claimed push that failed before it was applied, so a retry applies it."""
        window = self._seqs.get(worker_id)
        if window is not None:
            window.discard(seq)
        self._held_claims.discard((worker_id, seq))

    async def apply(self, pairs: list[tuple[Variable, np.ndarray]]) -> list[int]:
        """Applies validated gradients, one variable at a time under its lock; returns new versions.

        Waits while a checkpoint snapshot is being taken (``quiesced``), so a
        snapshot never holds half of one update.
        """
        while not self._open.is_set():
            await self._open.wait()
        self._updating += 1
        self._idle.clear()
        try:
            versions = []
            for var, grad in pairs:
                async with var.lock:
                    value, version = var.state
                    if value.nbytes > self.inline_apply_bytes:
                        new = await asyncio.to_thread(var.optimizer.apply, value, grad, var.slots, version)
                    else:
                        new = var.optimizer.apply(value, grad, var.slots, version)
                    var.state = (_freeze(new), version + 1)
                    versions.append(version + 1)
            self.pushes += 1
            return versions
        finally:
            self._updating -= 1
            if not self._updating:
                self._idle.set()

    def apply_one(self, var: Variable, grad: np.ndarray) -> int:
        """Applies one validated gradient now, on the event loop (a backup replaying its primary's updates).

        Returns the new version.
        """
        value, version = var.state
        var.state = (_freeze(var.optimizer.apply(value, grad, var.slots, version)), version + 1)
        return version + 1

    @contextlib.asynccontextmanager
    async def quiesced(self, timeout_s: float = 60.0) -> AsyncIterator[set[tuple[str, int]]]:
        """Holds new updates back and waits for those in progress (checkpoint snapshots).

        Inside the block no ``apply`` runs, so values, slots, versions and the
        dedup table agree. Pulls and creates go on. Yields the pushes claimed
        while the gate was closed (their updates are not applied yet, so a
        snapshot must not count them as seen). Not reentrant.

        Raises:
            TimeoutError: updates in progress did not finish within ``timeout_s``.
        """
        if not self._open.is_set():
            raise RuntimeError("Store.quiesced is not reentrant")
        self._open.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            yield self._held_claims
        finally:
            self._held_claims = set()
            self._open.set()

    def assign(self, name: str, value: np.ndarray, version: int) -> None:
        """Replaces a value (checkpoint restore, aggregated sync updates)."""
        var = self.get(name)
        var.state = (_freeze(np.array(value, dtype=var.dtype, copy=True).reshape(var.shape)), version)

    # -- dedup table (checkpoints) -------------------------------------------

    def dedup_state(self) -> dict[str, tuple[int, list[int]]]:
        return {w: (s.floor, sorted(s.seen)) for w, s in self._seqs.items()}

    def load_dedup_state(self, state: Mapping[str, tuple[int, list[int]]]) -> None:
        self._seqs = {}
        for worker, (floor, seen) in state.items():
            window = _SeqWindow()
            window.floor = int(floor)
            window.seen = {int(s) for s in seen}
            self._seqs[worker] = window


def _describe(spec: ps_pb2.VariableSpec) -> str:
    dtype = ps_pb2.DType.Name(spec.dtype).removeprefix("DTYPE_").lower()
    params = ", ".join(f"{k}={v:g}" for k, v in sorted(spec.optimizer.params.items()))
    return f"{dtype}{list(spec.shape)} {spec.optimizer.name}({params})"
