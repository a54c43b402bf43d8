"""Pure request building and response merging, shared by both clients (no I/O).

A user-visible variable maps to one or more pieces (stored tensors) on shards
(see ``pscore.placement``). Outgoing tensors are cut per piece and grouped per
shard; incoming pieces are stitched back into whole arrays.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from pscore import codec
from pscore.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from pscore.optimizers import Optimizer
from pscore.placement import Piece
from psproto.v1 import ps_pb2


class PushedValues(dict[str, Any]):
    """What ``push_pull`` returns: the updated values by name (a plain ``dict``), and whether the push
    was applied.

    Attributes:
        applied: True if every shard applied the push; False if one did not (a retry the shard had
            already applied, or in sync mode a gradient dropped as stale: the values are then the
            shards' current ones, which a worker that fell behind loads to catch up).
    """

    def __init__(self, values: Mapping[str, Any], *, applied: bool) -> None:
        super().__init__(values)
        self.applied = applied


class Registry:
    """Where each variable's pieces live (learned from creates and from ListVariables)."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[Piece]] = {}
        self.by_stored: dict[str, Piece] = {}

    def add(self, pieces: Iterable[Piece]) -> None:
        """Learns where pieces live.

        Raises:
            FailedPreconditionError: a piece this registry knows on one shard is found on another: the
                variable is stored twice, and workers may be updating different copies.
        """
        for piece in pieces:
            known = self.pieces.get(piece.variable, [])
            for p in known:
                if p.index == piece.index and (p.shard, p.stored_name) != (piece.shard, piece.stored_name):
                    del self.pieces[piece.variable]  # unknown again: the next call lists it, and fails too
                    raise _stored_twice(piece, p)
            self.by_stored[piece.stored_name] = piece
            group = [p for p in known if p.index != piece.index]
            group.append(piece)
            group.sort(key=lambda p: p.index)
            self.pieces[piece.variable] = group

    def complete(self, name: str) -> bool:
        group = self.pieces.get(name)
        return bool(group) and len(group) == group[0].count

    def resolve(self, names: Iterable[str]) -> dict[str, list[Piece]]:
        """The pieces of each name. Raises: NotFoundError for a name with no (or missing) pieces."""
        out = {}
        pieces = self.pieces
        for name in names:
            group = pieces.get(name)
            if not group or len(group) != group[0].count:  # ``complete``, inline
                raise NotFoundError(f"variable {name!r} does not exist on any shard")
            out[name] = group
        return out


def _stored_twice(piece: Piece, other: Piece) -> FailedPreconditionError:
    return FailedPreconditionError(
        f"variable {piece.variable!r} is stored twice: as {other.stored_name!r} on shard {other.shard} "
        f"and as {piece.stored_name!r} on shard {piece.shard}, two copies that workers may be updating "
        "apart. Workers that create the same variables must place them alike (the same partition_bytes; "
        "psclient before 2026-12-07 could place a create_many batch apart when workers created it at "
        "once). Restore the job from a checkpoint taken before, or restart the shards and create the "
        "model once"
    )


def piece_from_spec(spec: ps_pb2.VariableSpec, shard: int) -> Piece:
    dtype = codec.numpy_dtype(spec.dtype)
    if spec.HasField("dynamic"):
        d = spec.dynamic
        keys = "string" if d.key_type == ps_pb2.KEY_TYPE_STRING else "int64"
        return Piece(d.table, spec.name, shard, (0, d.dim), dtype, d.index, d.count, 0, 0, True, keys)
    if spec.HasField("table"):
        t = spec.table
        return Piece(
            t.table, spec.name, shard, (t.num_rows, t.dim), dtype, t.index, t.count, 0, t.rows * t.dim, True
        )
    if spec.HasField("partition"):
        p = spec.partition
        return Piece(
            p.variable, spec.name, shard, tuple(p.full_shape), dtype,
            p.index, p.count, p.offset, math.prod(spec.shape),
        )  # fmt: skip
    shape = tuple(spec.shape)
    return Piece(spec.name, spec.name, shard, shape, dtype, 0, 1, 0, math.prod(shape))


def spec_of(piece: Piece, optimizer: Optimizer) -> ps_pb2.VariableSpec:
    spec = ps_pb2.VariableSpec(
        name=piece.stored_name,
        dtype=codec.wire_dtype(piece.dtype),
        shape=piece.stored_shape,
        optimizer=optimizer.to_proto(),
    )
    if piece.partitioned:
        spec.partition.CopyFrom(
            ps_pb2.Partition(
                variable=piece.variable,
                full_shape=piece.full_shape,
                index=piece.index,
                count=piece.count,
                offset=piece.offset,
            )
        )
    return spec


def piece_view(piece: Piece, value: np.ndarray) -> np.ndarray:
    """The part of a whole-variable array that ``piece`` stores (a view, no copy; a copy for a table)."""
    if piece.table:
        return np.ascontiguousarray(value[piece.index :: piece.count])
    if not piece.partitioned:
        return value
    return value.reshape(-1)[piece.offset : piece.offset + piece.size]


def split_by_shard(
    pieces: Mapping[str, list[Piece]], tensors: Mapping[str, np.ndarray], what: str
) -> dict[int, list[tuple[str, np.ndarray]]]:
    """Cuts the tensor of each variable of ``pieces`` into its pieces and groups them per shard (``tensors``
    may hold others).

    Raises:
        InvalidArgumentError: a tensor's shape or dtype differs from its variable's.
    """
    out: dict[int, list[tuple[str, np.ndarray]]] = {}
    for name, group in pieces.items():
        raw = tensors[name]
        full_shape, dtype = group[0].full_shape, group[0].dtype
        try:  # an array that is one already (C order, little-endian) as is, else codec.as_wire_array's
            wire = type(raw) is np.ndarray and raw.flags.c_contiguous and raw.dtype.byteorder != ">"
            arr = raw if wire else codec.as_wire_array(raw)
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"{what} for {name!r} is not an array: {err}") from None
        if arr.shape != full_shape:
            raise InvalidArgumentError(
                f"{what} for {name!r} has shape {arr.shape}; variable has shape {full_shape}"
            )
        if arr.dtype != dtype:
            raise InvalidArgumentError(
                f"{what} for {name!r} has dtype {arr.dtype.name}; variable has dtype {dtype.name}"
            )
        for piece in group:
            view = arr if piece.count == 1 and not piece.table else piece_view(piece, arr)  # whole: as is
            out.setdefault(piece.shard, []).append((piece.stored_name, view))
    return out


def split_parts(tensors: list[tuple[str, np.ndarray]], parts: int) -> list[list[tuple[str, np.ndarray]]]:
    """One shard's tensors cut in ``parts`` groups of about equal bytes, by stored name: every worker that
    pushes the same variables cuts them the same way, whatever order it gives them in (a sync push in
    parts, ``AsyncPSClient.push_pull``'s ``parts``). A group may be empty (fewer tensors than parts).

    >>> z = np.zeros(4, np.float32)
    >>> [[n for n, _ in g] for g in split_parts([("c", z), ("a", z), ("b", z)], 2)]
    [['a', 'b'], ['c']]
    >>> [len(g) for g in split_parts([("a", z)], 3)]
    [1, 0, 0]
    """
    groups: list[list[tuple[str, np.ndarray]]] = [[] for _ in range(parts)]
    ordered = sorted(tensors, key=lambda t: t[0])
    total = sum(t.nbytes for _, t in ordered)
    before = 0  # the bytes of the tensors before this one: a tensor goes to the part its first byte is in
    for name, t in ordered:
        groups[min(parts - 1, before * parts // total) if total else 0].append((name, t))
        before += t.nbytes
    return groups


def payload_bytes(tensors: list[tuple[str, np.ndarray]]) -> int:
    return sum(t.nbytes for _, t in tensors)


def versions_of(chunks: Iterable[ps_pb2.TensorChunk], versions: Iterable[int]) -> dict[str, int]:
    """Pairs each tensor that starts in this message (its chunk at offset 0) with its version."""
    names = [c.name for c in chunks if c.offset == 0]
    return dict(zip(names, versions, strict=False))


class Gather:
    """Writes pulled chunks straight into the whole arrays the caller gets: one copy per byte.

    Replaces Assembler on the pull path: a partitioned variable's
    pieces, from any shard and in any number of chunks, land in one array
    allocated once. A variable that arrives whole in one chunk stays a
    zero-copy view of the received message. Returned arrays are read-only.
    """

    def __init__(
        self,
        pieces: Mapping[str, list[Piece]],
        alloc: Callable[[int, np.dtype], np.ndarray] | None = None,
        alloc_min_bytes: int = 0,
    ) -> None:
        self._pieces = pieces
        self._alloc = alloc or _empty
        self._alloc_min_bytes = alloc_min_bytes  # smaller arrays: np.empty, without calling ``alloc``
        self._by_stored: dict[str, Piece] = {}  # a loop, not a comprehension: no call per request
        for group in pieces.values():
            for p in group:
                self._by_stored[p.stored_name] = p
        self._flat: dict[str, np.ndarray] = {}  # variable -> its whole array, flat
        # stored name -> element ranges received; ``_WHOLE``: received whole, once (by ``place``)
        self._filled: dict[str, codec.Coverage | object] = {}
        self._versions: dict[str, int] = {}  # per stored name
        self.arrived = False  # whether a tensor arrived (``restart`` has anything to forget)

    def add_versions(self, versions: Mapping[str, int]) -> None:
        """Records stored tensors' versions (see ``versions_of``)."""
        self._versions.update(versions)

    @property
    def versions(self) -> dict[str, int]:
        """Each variable's version, keyed like ``result()``; a partitioned one has its oldest piece's."""
        out = {}
        for name, group in self._pieces.items():
            got = [self._versions[p.stored_name] for p in group if p.stored_name in self._versions]
            if got:
                out[name] = min(got)
        return out

    def restart(self, pieces: Iterable[Piece] | None = None) -> None:
        """Forgets what arrived for ``pieces`` (None: every piece; a retried stream sends them again).

        With ``add`` and ``place``, a Gather is the ``Sink`` of a request whose answer holds all of it
        (one shard's): ``_link.ShardLink.request`` takes it as one.
        """
        if not self.arrived:  # nothing arrived yet (a first attempt): nothing to forget
            return
        if pieces is None:
            pieces = [p for group in self._pieces.values() for p in group]
        for p in pieces:
            self._filled.pop(p.stored_name, None)
            flat = self._flat.get(p.variable)
            if flat is not None and not flat.flags.writeable:  # a zero-copy view: drop it
                del self._flat[p.variable]

    def place(self, chunk: Any) -> memoryview | None:
        """Where the whole stored tensor ``chunk`` announces is to be received: a writable byte view of
        its place in the variable's array (it then counts as received), or None where it must go
        through ``add`` (a piece of a table spread over several shards).

        Raises:
            CodecError: a malformed chunk, or one that does not match the requested piece.
        """
        piece = self._by_stored.get(chunk.name)
        if piece is None:
            raise codec.CodecError(f"a shard sent tensor {chunk.name!r}, which was not requested")
        # The common case without a call: a known dtype, the shape of a whole variable or partition.
        dtype, shape = codec.WIRE_DTYPES.get(chunk.dtype), tuple(chunk.shape)
        stored = piece.full_shape if piece.count == 1 and not piece.table else piece.stored_shape
        if dtype is None or dtype != piece.dtype or shape != stored:
            dtype, shape = codec.numpy_dtype(chunk.dtype), codec.chunk_shape(chunk)  # their errors first
            raise codec.CodecError(
                f"tensor {chunk.name!r}: got {dtype.name}{list(shape)}, "
                f"expected {piece.dtype.name}{list(piece.stored_shape)}"
            )
        if piece.table and piece.count > 1:
            return None
        flat = self._flat.get(piece.variable)
        if flat is None or not flat.flags.writeable:
            size = math.prod(piece.full_shape)
            if size * piece.dtype.itemsize < self._alloc_min_bytes:
                flat = self._flat[piece.variable] = np.empty(size, dtype=piece.dtype)
            else:
                flat = self._flat[piece.variable] = self._alloc(size, piece.dtype)
        self.arrived = True
        if piece.stored_name in self._filled:  # a second time (a malformed answer): ``result`` says so
            self._covered(piece).add(0, piece.size)
        else:  # the common case: no Coverage to make and check
            self._filled[piece.stored_name] = _WHOLE
        if piece.size == flat.size:  # the whole variable: the array itself, no slice of it
            return memoryview(flat).cast("B")
        return memoryview(flat[piece.offset : piece.offset + piece.size]).cast("B")

    def add(self, chunk: Any) -> None:
        """Adds one received chunk (``ps_pb2.TensorChunk`` or ``codec.WireChunk``).

        Raises:
            CodecError: a malformed chunk, or one that does not match the requested piece.
        """
        piece = self._by_stored.get(chunk.name)
        if piece is None:
            raise codec.CodecError(f"a shard sent tensor {chunk.name!r}, which was not requested")
        elems = codec.chunk_elements(chunk, chunk.data)
        if elems.dtype != piece.dtype or codec.chunk_shape(chunk) != piece.stored_shape:
            raise codec.CodecError(
                f"tensor {chunk.name!r}: got {elems.dtype.name}{list(codec.chunk_shape(chunk))}, "
                f"expected {piece.dtype.name}{list(piece.stored_shape)}"
            )
        self.arrived = True
        var = piece.variable
        flat = self._flat.get(var)
        if piece.table and piece.count > 1:  # rows index, index + count, ... of the whole table
            if flat is None or not flat.flags.writeable:
                flat = self._flat[var] = self._alloc(math.prod(piece.full_shape), piece.dtype)
            rows = flat.reshape(piece.full_shape)[piece.index :: piece.count]
            rows.flat[chunk.offset : chunk.offset + elems.size] = elems
            self._covered(piece).add(chunk.offset, elems.size)
            return
        if flat is None and piece.count == 1 and chunk.offset == 0 and elems.size == piece.size:
            self._flat[var] = elems  # whole in one chunk: keep the view, no copy
            self._covered(piece).add(0, elems.size)
            return
        if flat is None or not flat.flags.writeable:
            flat = self._alloc(math.prod(piece.full_shape), piece.dtype)
            self._flat[var] = flat
        start = piece.offset + chunk.offset
        flat[start : start + elems.size] = elems
        self._covered(piece).add(chunk.offset, elems.size)

    def _covered(self, piece: Piece) -> codec.Coverage:
        coverage = self._filled.get(piece.stored_name)
        if isinstance(coverage, codec.Coverage):
            return coverage
        covered = self._filled[piece.stored_name] = codec.Coverage(piece.size)
        if coverage is _WHOLE:
            covered.add(0, piece.size)
        return covered

    def result(self) -> dict[str, np.ndarray]:
        """The whole variables, read-only.

        Raises:
            NotFoundError: a piece did not arrive.
            CodecError: a piece arrived incomplete, or with elements twice.
        """
        out = {}
        filled = self._filled
        for name, group in self._pieces.items():
            if len(group) == 1 and group[0].stored_name in filled:  # a whole variable, arrived
                missing = None
            else:
                missing = [p.stored_name for p in group if p.stored_name not in filled]
            if missing:
                raise NotFoundError(f"variable {name!r}: pieces {missing} were not returned by their shards")
            for p in group:
                coverage = filled[p.stored_name]
                if coverage is not _WHOLE:
                    coverage.check(p.stored_name)  # type: ignore[attr-defined]
            flat = self._flat[name]
            flat.flags.writeable = False
            out[name] = flat.reshape(group[0].full_shape)
        return out


_WHOLE = object()  # ``Gather._filled``'s mark of a stored tensor received whole, once


def _empty(size: int, dtype: np.dtype) -> np.ndarray:
    return np.empty(size, dtype=dtype)


class ArrayPool:
    """Recycles big result arrays once their caller has dropped every reference to them.

    A fresh array of many MiB costs a page fault per 4 KiB page on first write
    (2-3 us each), which makes copying into it several times slower than into
    warm memory. A pull's result array is handed out read-only; when only the
    pool still holds it (the caller let go of it and of every view of it), the
    next pull of the same size and dtype writes into it again. Arrays below
    ``min_bytes`` are not pooled.

    Not thread-safe: use it from one thread (the client's event loop).
    """

    def __init__(self, min_bytes: int = 1 << 20, max_bytes: int = 1 << 30, per_key: int = 2) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.per_key = per_key
        self._free: dict[tuple[str, int], list[np.ndarray]] = {}
        self._held = 0

    def take(self, size: int, dtype: np.dtype) -> np.ndarray:
        """A flat writable array of ``size`` elements (recycled when one is free)."""
        dtype = np.dtype(dtype)
        nbytes = size * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(size, dtype=dtype)
        arrays = self._free.setdefault((dtype.str, size), [])
        for arr in arrays:
            # References: the pool's list, this loop variable and getrefcount's argument.
            if sys.getrefcount(arr) <= 3:
                arr.flags.writeable = True
                return arr
        arr = np.empty(size, dtype=dtype)
        if len(arrays) < self.per_key and self._held + nbytes <= self.max_bytes:
            arrays.append(arr)
            self._held += nbytes
        return arr

    def clear(self) -> None:
        self._free.clear()
        self._held = 0
