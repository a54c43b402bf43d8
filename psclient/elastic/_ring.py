"""ElasticRing: the ring under ``psclient.horovod``, with Horovod's ``join`` and elastic re-forming.

Every collective first runs a *control round*: one all-reduce (sum) of a small int64 vector in
which each rank says whether it is active and, if so, which collective it calls (kind, op, and a
checksum of its shapes and dtypes). The sums tell every rank the same three things:

- how many ranks are active: all of them (the usual case: the collective then runs as it is);
  fewer, because some called ``join`` (they take part in the others' all-reduces with zeros, as
  Horovod's joined ranks do); or none (every rank has joined: ``join`` returns);
- whether the active ranks agree on the collective (a clear error now instead of a mismatch
  deeper in the ring);
- with ranks joined, the shapes and dtypes of the all-reduce (a second control round carries
  them), so the joined ranks can take part.

In elastic mode (a psrun elastic job) the underlying :class:`psclient.collective.Ring` belongs to
one *generation* of the job and is replaced (:meth:`ElasticRing.replace`) when the ranks form a
new ring. Collectives then run on a helper thread of the generation, so that a broken generation
(:meth:`ElasticRing.interrupt`, called when psrun reports a lost rank) fails the collective at once
with :class:`HorovodInternalError`, instead of after the ring's deadline.

Thread-safety: one collective at a time (as the ring's); ``interrupt`` may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import queue
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np

from psclient.collective import ALLREDUCE_DTYPES, REDUCE_OPS, Ring
from psclient.elastic._errors import HorovodInternalError
from pscore.codec import as_wire_array
from pscore.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    PSError,
    ResourceExhaustedError,
    UnauthenticatedError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Control vector: [active, kind, op, descriptor length, descriptor crc32], then per rank "has joined",
# then per rank "joins in this round" (to name the last rank to join).
_ACTIVE, _KIND, _OP, _DESC_LEN, _DESC_CRC = range(5)
_HEAD: Final[int] = 5
_ALLREDUCE, _ALLREDUCE_MANY, _BROADCAST, _ALLGATHER, _BARRIER = 1, 2, 3, 4, 5
_KIND_NAMES: Final[dict[int, str]] = {
    _ALLREDUCE: "allreduce",
    _ALLREDUCE_MANY: "allreduce_many",
    _BROADCAST: "broadcast",
    _ALLGATHER: "allgather",
    _BARRIER: "barrier",
}
_WITH_JOINED: Final[frozenset[int]] = frozenset({_ALLREDUCE, _ALLREDUCE_MANY, _BARRIER})
_OP_CODES: Final[dict[str, int]] = {name: i + 1 for i, name in enumerate(sorted(REDUCE_OPS))}
_OP_NAMES: Final[dict[int, str]] = {code: name for name, code in _OP_CODES.items()}
_DTYPES: Final[tuple[np.dtype, ...]] = tuple(sorted(ALLREDUCE_DTYPES, key=lambda d: d.str))
_DTYPE_CODES: Final[dict[np.dtype, int]] = {d: i + 1 for i, d in enumerate(_DTYPES)}
# Errors that a new ring would meet again (a bug or a setting, not a lost rank): never a reset.
_NOT_RECOVERABLE: Final[tuple[type[PSError], ...]] = (
    InvalidArgumentError,
    FailedPreconditionError,
    UnauthenticatedError,
    PermissionDeniedError,
    ResourceExhaustedError,
)


class _Caller:
    """A daemon thread that runs a generation's ring calls, so the caller can stop waiting for one."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fut, fn))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as err:  # handed to the caller's thread
                fut.set_exception(err)


@dataclass(eq=False)
class _Generation:
    number: int
    ring: Ring
    caller: _Caller | None
    broken: concurrent.futures.Future[HorovodInternalError] = field(default_factory=concurrent.futures.Future)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def break_with(self, error: HorovodInternalError) -> HorovodInternalError:
        """Marks the generation broken (first reason wins); returns the error it is broken with."""
        with self.lock:
            if not self.broken.done():
                self.broken.set_result(error)
        return self.broken.result()


def _describe(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The shapes and dtypes of an all-reduce's arrays as int64s: ``[n, (dtype, ndim, *dims) * n]``."""
    out = [len(arrays)]
    for a in arrays:
        out += [_DTYPE_CODES[a.dtype], a.ndim, *a.shape]
    return np.array(out, np.int64)


def _neutral_arrays(desc: np.ndarray, op: str) -> list[np.ndarray]:
    """What a joined rank contributes to an all-reduce described by ``desc``.

    Zeros for ``sum`` and ``mean`` (as Horovod: an average divides by every rank, joined or not);
    the largest value for ``min`` and the smallest for ``max``, so joined ranks do not count.
    """
    values = [int(v) for v in desc]
    n, pos, out = values[0], 1, []
    for _ in range(n):
        dtype, ndim = _DTYPES[values[pos] - 1], values[pos + 1]
        shape = tuple(values[pos + 2 : pos + 2 + ndim])
        pos += 2 + ndim
        if op in ("min", "max") and dtype.kind == "f":
            out.append(np.full(shape, np.inf if op == "min" else -np.inf, dtype))
        elif op in ("min", "max"):
            info = np.iinfo(dtype)
            out.append(np.full(shape, info.max if op == "min" else info.min, dtype))
        else:
            out.append(np.zeros(shape, dtype))
    return out


class ElasticRing:
    """One rank's ring for ``psclient.horovod``: the ring's collectives, plus ``join`` and elastic re-forming.

    Example::

        ring = ElasticRing(Ring(addresses, rank, timeout=60))
        grads = ring.allreduce_many(grads, op="mean")
        last = ring.join()          # after this rank's last batch; others may still be training

    Args:
        ring: the ring of the first generation (owned: closed by :meth:`close` or when replaced).
        generation: its generation number (0 outside a psrun elastic job).
        elastic: run collectives on a helper thread that :meth:`interrupt` can abandon, and turn ring
            errors into :class:`HorovodInternalError` (the generation is then broken).
        on_break: called (from the calling thread) with ``(generation, reason)`` when a collective of the
            generation fails, so that psrun can tell the other ranks at once.
        negotiate: run the control round before each collective (default). Without it collectives cost
            what the ring's do, and ``join`` is only a barrier that every rank must reach at the same
            point; every rank must use the same setting.
    """

    def __init__(
        self,
        ring: Ring,
        *,
        generation: int = 0,
        elastic: bool = False,
        on_break: Callable[[int, str], None] | None = None,
        negotiate: bool = True,
    ) -> None:
        self._elastic = elastic
        self._negotiates = negotiate
        self._on_break = on_break
        self._gen = self._new_generation(ring, generation)
        self._closed = False

    def _new_generation(self, ring: Ring, number: int) -> _Generation:
        caller = _Caller(f"psclient-elastic-ring-g{number}") if self._elastic else None
        return _Generation(number, ring, caller)

    # -- membership ------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the current generation."""
        return self._gen.ring.rank

    @property
    def world(self) -> int:
        """The number of ranks in the current generation."""
        return self._gen.ring.world

    @property
    def generation(self) -> int:
        """The current generation (0 outside a psrun elastic job)."""
        return self._gen.number

    @property
    def broken(self) -> bool:
        """Whether the current generation is broken (a collective failed or psrun reported a lost rank)."""
        return self._gen.broken.done()

    @property
    def config(self) -> Any:
        """The current ring's validated settings (``psclient.collective.RingConfig``)."""
        return self._gen.ring.config

    def interrupt(self, generation: int, reason: str, lost_ranks: Sequence[int] = ()) -> None:
        """Breaks ``generation`` if it is the current one: its running and later collectives raise at once.

        Called by the elastic session's watcher when psrun reports that a rank of the generation is gone.
        """
        gen = self._gen
        if gen.number == generation:
            gen.break_with(HorovodInternalError(reason, generation=generation, lost_ranks=tuple(lost_ranks)))

    def replace(self, ring: Ring, generation: int) -> None:
        """Continues on ``ring`` (the next generation); the previous ring is closed in the background.

        A collective of the previous generation that still runs on its helper thread is abandoned (it
        ends when its ring closes).
        """
        old = self._gen
        self._gen = self._new_generation(ring, generation)
        old.break_with(HorovodInternalError("replaced by a new ring", generation=old.number))

        def close_old() -> None:
            try:
                old.ring.close()
            except Exception as err:  # best effort: the old ring may be half-broken
                log.debug("closing the ring of generation %d: %s", old.number, err)
            if old.caller is not None:
                old.caller.stop()

        threading.Thread(target=close_old, name=f"psclient-close-ring-g{old.number}", daemon=True).start()

    def close(self) -> None:
        """Closes the current ring (idempotent)."""
        if self._closed:
            return
        self._closed = True
        gen = self._gen
        try:
            gen.ring.close()
        finally:
            if gen.caller is not None:
                gen.caller.stop()

    def __enter__(self) -> ElasticRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- collectives -----------------------------------------------------------

    def allreduce(
        self, x: Any, op: str = "sum", *, out: np.ndarray | None = None, timeout: float | None = None
    ) -> np.ndarray:
        """As :meth:`psclient.collective.Ring.allreduce`; joined ranks contribute zeros (see ``join``).

        Raises:
            InvalidArgumentError: bad input, or the ranks called different collectives.
            HorovodInternalError: (elastic mode) the ring broke.
            PSError: (otherwise) the ring failed or timed out.
        """
        arr = self._reduce_input(x, op)
        self._negotiate(_ALLREDUCE, _OP_CODES[op], _describe([arr]), timeout)
        return self._call(lambda r: r.allreduce(arr, op, out=out, timeout=timeout))

    def allreduce_many(
        self, tensors: Sequence[Any] | Mapping[str, Any], op: str = "sum", *, timeout: float | None = None
    ) -> list[np.ndarray] | dict[str, np.ndarray]:
        """As :meth:`psclient.collective.Ring.allreduce_many` (fused); joined ranks contribute zeros.

        Raises:
            InvalidArgumentError, HorovodInternalError, PSError: as in :meth:`allreduce`.
        """
        keys = sorted(tensors) if isinstance(tensors, Mapping) else None
        items = [tensors[k] for k in keys] if keys is not None else list(tensors)  # type: ignore[index]
        arrays = [self._reduce_input(t, op) for t in items]
        self._negotiate(_ALLREDUCE_MANY, _OP_CODES[op], _describe(arrays), timeout)
        out = self._call(lambda r: r.allreduce_many(arrays, op, timeout=timeout))
        return dict(zip(keys, out, strict=True)) if keys is not None else list(out)

    def broadcast(self, x: Any, root: int = 0, *, timeout: float | None = None) -> np.ndarray:
        """As :meth:`psclient.collective.Ring.broadcast`.

        Raises:
            FailedPreconditionError: ranks have joined (Horovod does not broadcast with joined ranks either).
            InvalidArgumentError, HorovodInternalError, PSError: as in :meth:`allreduce`.
        """
        arr = as_wire_array(x)
        self._negotiate(_BROADCAST, root + 1, np.array([arr.ndim, *arr.shape], np.int64), timeout)
        return self._call(lambda r: r.broadcast(arr, root, timeout=timeout))

    def allgather(self, x: Any, *, timeout: float | None = None) -> np.ndarray:
        """As :meth:`psclient.collective.Ring.allgather` (the first dimension may differ between ranks).

        Raises:
            FailedPreconditionError: ranks have joined (as in Horovod).
            InvalidArgumentError, HorovodInternalError, PSError: as in :meth:`allreduce`.
        """
        arr = as_wire_array(x)
        trailing = arr.shape[1:] if arr.ndim else ()
        self._negotiate(_ALLGATHER, 0, np.array([len(trailing), *trailing], np.int64), timeout)
        return self._call(lambda r: r.allgather(arr, timeout=timeout))

    def barrier(self, *, timeout: float | None = None) -> None:
        """As :meth:`psclient.collective.Ring.barrier` (joined ranks take part).

        Raises:
            HorovodInternalError, PSError: as in :meth:`allreduce`.
        """
        self._negotiate(_BARRIER, 0, np.zeros(0, np.int64), timeout)
        self._call(lambda r: r.barrier(timeout=timeout))

    def join(self, *, timeout: float | None = None) -> int:
        """Horovod's ``join``: this rank is out of data; serve the others' all-reduces until all have joined.

        Until every rank has called ``join``, this rank takes part in the all-reduces (and barriers) of
        the ranks still training, contributing zeros (``sum``/``mean``: as Horovod, an average still
        divides by every rank) or a neutral value (``min``/``max``). Each wait for the others' next
        collective is bounded by the ring's deadline (or ``timeout``). A broadcast or all-gather of the
        others fails for them (as in Horovod) while this rank waits on.

        Returns:
            The rank that joined last (the highest of those that joined in the same round).

        Raises:
            InvalidArgumentError: the others disagree on their collective.
            HorovodInternalError, PSError: as in :meth:`allreduce`.
        """
        if self.world == 1:
            return self.rank
        if not self._negotiates:  # a barrier that names the rank that reached it last
            stamps = self._call(lambda r: r.allgather(np.array([time.time()], np.float64), timeout=timeout))
            return int(np.argmax(stamps))
        first = True
        while True:
            ctl = np.zeros(_HEAD + 2 * self.world, np.int64)
            ctl[_HEAD + self.rank] = 1
            if first:
                ctl[_HEAD + self.world + self.rank] = 1
                first = False
            total = self._call(lambda r, c=ctl: r.allreduce(c, "sum", timeout=timeout))
            active = int(total[_ACTIVE])
            if active == 0:
                joined_now = np.flatnonzero(total[_HEAD + self.world :])
                return int(joined_now.max()) if joined_now.size else self.rank
            kind, op_code, n, _ = self._agreed(total, active, None)
            if kind not in _WITH_JOINED:
                continue  # the active ranks raise (Horovod fails that collective; joined ranks wait on)
            desc = self._call(lambda r, m=n: r.allreduce(np.zeros(m, np.int64), "sum", timeout=timeout))
            desc = desc // active
            if kind == _BARRIER:
                self._call(lambda r: r.barrier(timeout=timeout))
                continue
            arrays = _neutral_arrays(desc, _OP_NAMES[op_code])
            if kind == _ALLREDUCE:
                self._call(lambda r, a=arrays[0], o=_OP_NAMES[op_code]: r.allreduce(a, o, timeout=timeout))
            else:
                self._call(lambda r, a=arrays, o=_OP_NAMES[op_code]: r.allreduce_many(a, o, timeout=timeout))

    # -- internals -------------------------------------------------------------

    def _reduce_input(self, x: Any, op: str) -> np.ndarray:
        if op not in _OP_CODES:
            raise InvalidArgumentError(
                f"unknown reduce op {op!r}; use one of {sorted(_OP_CODES)}", method="allreduce"
            )
        arr = as_wire_array(x)
        if arr.dtype not in _DTYPE_CODES:
            raise InvalidArgumentError(
                f"allreduce does not support dtype {arr.dtype.name}; use float16, float32, float64, int32 "
                "or int64",
                method="allreduce",
            )
        return arr

    def _negotiate(self, kind: int, op_code: int, desc: np.ndarray, timeout: float | None) -> None:
        """The control round(s) before a collective; returns when the collective itself may run."""
        world = self.world
        if world == 1 or not self._negotiates:
            return
        ctl = np.zeros(_HEAD + 2 * world, np.int64)
        ctl[_ACTIVE], ctl[_KIND], ctl[_OP], ctl[_DESC_LEN] = 1, kind, op_code, desc.size
        ctl[_DESC_CRC] = zlib.crc32(desc.tobytes())
        total = self._call(lambda r: r.allreduce(ctl, "sum", timeout=timeout))
        active = int(total[_ACTIVE])
        self._agreed(total, active, ctl)
        if active == world:
            return
        if kind not in _WITH_JOINED:
            joined = [r for r in range(world) if total[_HEAD + r]]
            raise FailedPreconditionError(
                f"rank {self.rank}: {_KIND_NAMES[kind]} while rank(s) {joined} have joined (hvd.join): only "
                "allreduce and barrier run with joined ranks, as in Horovod"
            )
        self._call(lambda r: r.allreduce(desc, "sum", timeout=timeout))  # the shapes, for the joined ranks

    def _agreed(self, total: np.ndarray, active: int, mine: np.ndarray | None) -> tuple[int, int, int, int]:
        """The active ranks' (kind, op, descriptor length, crc); raises if they differ."""
        head = total[_KIND:_HEAD]
        agreed = active > 0 and not np.any(head % active)
        if mine is not None:
            agreed = agreed and bool(np.all(head == active * mine[_KIND:_HEAD]))
        if not agreed:
            what = f"{_KIND_NAMES[int(mine[_KIND])]}" if mine is not None else "join"
            raise InvalidArgumentError(
                f"rank {self.rank}: the ranks called different collectives (or with different ops, shapes or "
                f"dtypes) at the same point; this rank called {what}. Every rank must call the same "
                "collectives in the same order (with uneven data, a rank that has run out calls hvd.join())"
            )
        kind, op_code, n, crc = (int(v) // active for v in head)
        return kind, op_code, n, crc

    def _call(self, fn: Callable[[Ring], T]) -> T:
        gen = self._gen
        if not self._elastic:
            return fn(gen.ring)
        if gen.broken.done():
            raise gen.broken.result()
        assert gen.caller is not None
        fut = gen.caller.submit(lambda: fn(gen.ring))
        concurrent.futures.wait([fut, gen.broken], return_when=concurrent.futures.FIRST_COMPLETED)
        if not fut.done():
            raise gen.broken.result()
        try:
            return fut.result()
        except _NOT_RECOVERABLE:
            raise
        except PSError as err:
            lost = self._rank_of(gen, err.address)
            error = gen.break_with(
                HorovodInternalError(f"{type(err).__name__}: {err}", generation=gen.number, lost_ranks=lost)
            )
            if self._on_break is not None:
                self._on_break(gen.number, error.reason)
            raise error from err

    @staticmethod
    def _rank_of(gen: _Generation, address: str | None) -> tuple[int, ...]:
        addresses = gen.ring.config.addresses
        return (addresses.index(address),) if address in addresses else ()


def broadcast_object(ring: Any, obj: Any, root: int = 0) -> Any:
    """``root``'s picklable object on every rank of ``ring`` (a ``Ring`` or ``ElasticRing``): two broadcasts.

    Raises:
        PSError, HorovodInternalError: the ring failed.
    """
    if ring.world == 1:
        return obj
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if ring.rank == root else np.zeros(0, np.uint8)
    length = ring.broadcast(np.array([payload.size], np.int64), root=root)
    buf = payload if ring.rank == root else np.zeros(int(length[0]), np.uint8)
    data = ring.broadcast(buf, root=root)
    return obj if ring.rank == root else pickle.loads(data.tobytes())


def allgather_object(ring: Any, obj: Any) -> list[Any]:
    """Every rank's picklable object, in rank order: two all-gathers.

    Raises:
        PSError, HorovodInternalError: the ring failed.
    """
    if ring.world == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = ring.allgather(np.array([data.size], np.int64))
    blob = ring.allgather(data)
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(blob[offset : offset + n].tobytes()))
        offset += n
    return out
