"""Deterministic placement of variables on shards, balanced by bytes.

Rules (the same on every worker, with no coordination):

1. A variable of at least ``partition_bytes`` bytes is cut into
   ``k = min(num_shards, ceil(nbytes / partition_bytes))`` partitions: contiguous
   flat (C-order) element ranges of near-equal size, stored as 1-D tensors named
   ``"<name>/part_<i>"``. Smaller variables stay whole, and so does a variable
   whose optimizer needs all of it (clipnorm, Adafactor, Lamb: ``plan``'s ``whole``).
2. The pieces of one ``create`` call are placed greedily, largest first (ties by
   name): each goes to the shard that has been given the fewest bytes so far in
   this call; among equally loaded shards the search starts at
   ``crc32(name) % num_shards``, so single-variable creates spread by hash.

A client that did not create a variable learns its placement from the shards
(``ListVariables``), never by recomputing it.

Embedding tables (``create_embedding``) are spread by row over every shard,
whatever their size, outside the byte balance above: row ``i`` of a table
lives on shard ``i % num_shards`` at local row ``i // num_shards``, so shard
``s`` holds rows ``s, s + S, s + 2S, ...`` in a piece named
``"<table>/rows_<s>"`` of shape ``[table_rows(num_rows, s, S), dim]``. The
modulo keeps shards balanced in rows and, as ids are usually numbered by
frequency, in hot rows too. Checkpoints restore a table into another shard
count by re-cutting its rows with the new ``S``.

Dynamic tables (``create_embedding(name, None, dim)``: a hash table keyed by
any 64-bit id) are spread by a hash of the id instead: id ``i`` lives on shard
``mix64(i) % S`` (``dynamic_row_shard``; ``mix64`` is the splitmix64
finalizer), in a piece named ``"<table>/rows_<s>"`` too, so sequential ids,
ids with a common stride and hashed strings all spread evenly. A table's
``capacity`` is split evenly: each shard holds at most
``ceil(capacity / S)`` rows (``dynamic_capacity``).

>>> dynamic_row_shard(np.array([0, 1, 2, 3, -1]), 2)
array([1, 1, 0, 1, 0])
>>> dynamic_capacity(1_000_001, 2), dynamic_capacity(0, 2)
(500001, 0)

>>> row_shard(np.array([0, 1, 2, 3, 4]), 2), local_row(np.array([0, 1, 2, 3, 4]), 2)
(array([0, 1, 0, 1, 0]), array([0, 0, 1, 1, 2]))
>>> [table_rows(5, s, 2) for s in range(2)], global_row(np.array([0, 1, 2]), 1, 2)
([3, 2], array([1, 3, 5]))

>>> p = plan({"a": ((10,), "float32"), "b": ((1000,), "float32")}, num_shards=2, partition_bytes=1 << 20)
>>> sorted((piece.stored_name, piece.shard) for pieces in p.values() for piece in pieces)
[('a', 0), ('b', 1)]
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# 64 KiB: a variable of this size or more is cut into up to num_shards pieces, so a model's few large kernels
# spread over the shards (an MLP's 784 x 256 first kernel, three quarters of its weights, held one shard's
# link at 0.75 of every step at the former 8 MiB). Measured against 8 MiB (2026-12-07): Keras MLP, 8 workers,
# 4 shards, 50 Mbit/s links, sync 0.43 -> 1.32-1.36 steps/s a worker; on loopback (2 shards) the MLP's and
# CNN's CPU a step the same or lower, workers' and shards', sync MLP 1.3-1.7x the steps/s
# (bench/results/training_partition_2026-12-07/, keras_netns_sync_parts_2026-12-07/).
DEFAULT_PARTITION_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored tensor: a whole variable or one partition of it."""

    variable: str
    stored_name: str
    shard: int
    full_shape: tuple[int, ...]
    dtype: np.dtype
    index: int = 0
    count: int = 1
    offset: int = 0  # flat index of the first element
    size: int = 0  # number of elements
    table: bool = False  # one shard's rows of an embedding table (index: the shard, count: shards)
    keys: str = ""  # a dynamic table's: "int64" or "string" (its full_shape is (0, dim))

    @property
    def partitioned(self) -> bool:
        return self.count > 1 and not self.table

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if self.table:
            return (table_rows(self.full_shape[0], self.index, self.count), self.full_shape[1])
        return (self.size,) if self.partitioned else self.full_shape

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def partition_name(variable: str, index: int) -> str:
    """The stored name of partition ``index`` of ``variable``."""
    return f"{variable}/part_{index}"


def table_piece_name(table: str, shard: int) -> str:
    """The stored name of shard ``shard``'s rows of embedding table ``table``."""
    return f"{table}/rows_{shard}"


def row_shard(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each (global) row id."""
    return ids % num_shards


def local_row(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Each (global) row id's index among its shard's rows."""
    return ids // num_shards


def global_row(local: np.ndarray, shard: int, num_shards: int) -> np.ndarray:
    """The global row ids of ``shard``'s local rows ``local``."""
    return local * num_shards + shard


_GOLDEN_INT = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MIX_STEPS = ((np.uint64(30), np.uint64(0xBF58476D1CE4E5B9)), (np.uint64(27), np.uint64(0x94D049BB133111EB)))
_MIX_LAST = np.uint64(31)


def mix64(ids: np.ndarray, seed: int = 0) -> np.ndarray:
    """A 64-bit hash of each int64 id (splitmix64's finalizer of ``id + (seed + 1) * golden``), as uint64.

    The same on every process and platform (pure integer arithmetic); ``seed``
    gives independent hashes (shards, a shard's hash index, sketch rows).
    """
    x = np.asarray(ids).astype(np.int64, copy=False).view(np.uint64)
    # Array arithmetic wraps modulo 2**64 without a warning; the offset is reduced in Python ints. In place
    # on one new array: a hash of a few hundred ids costs the calls, not the arithmetic.
    x = np.asarray(x + np.uint64((_GOLDEN_INT * (seed + 1)) & _MASK64))  # a new array (0-d too)
    for shift, factor in _MIX_STEPS:
        np.bitwise_xor(x, x >> shift, out=x)
        np.multiply(x, factor, out=x)
    np.bitwise_xor(x, x >> _MIX_LAST, out=x)
    return x if x.ndim else x[()]  # a scalar for a scalar, as numpy's arithmetic gives


def dynamic_row_shard(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each id of a dynamic table (int64 array, same shape as ``ids``)."""
    return (mix64(ids) % np.uint64(num_shards)).astype(np.int64)


def dynamic_capacity(capacity: int, num_shards: int) -> int:
    """The rows one shard of a dynamic table holds at most (0: unbounded)."""
    return -(-int(capacity) // int(num_shards)) if capacity > 0 else 0


def table_rows(num_rows: int, shard: int, num_shards: int) -> int:
    """How many of a table's ``num_rows`` rows shard ``shard`` of ``num_shards`` holds."""
    return max(0, (num_rows - shard + num_shards - 1) // num_shards)


def dynamic_pieces(table: str, dim: int, dtype: np.dtype | str, num_shards: int, keys: str) -> list[Piece]:
    """The pieces of a dynamic table (``keys``: "int64" or "string"), one per shard, in shard order."""
    dt = np.dtype(dtype)
    return [
        Piece(table, table_piece_name(table, s), s, (0, dim), dt, s, num_shards, 0, 0, True, keys)
        for s in range(num_shards)
    ]


def table_pieces(table: str, num_rows: int, dim: int, dtype: np.dtype | str, num_shards: int) -> list[Piece]:
    """The pieces of an embedding table, one per shard, in shard order.

    >>> [(p.stored_name, p.shard, p.stored_shape) for p in table_pieces("e", 5, 3, "float32", 2)]
    [('e/rows_0', 0, (3, 3)), ('e/rows_1', 1, (2, 3))]
    """
    dt = np.dtype(dtype)
    pieces = []
    for s in range(num_shards):
        size = table_rows(num_rows, s, num_shards) * dim
        pieces.append(
            Piece(table, table_piece_name(table, s), s, (num_rows, dim), dt, s, num_shards, 0, size, True)
        )
    return pieces


def split(
    variable: str, shape: Sequence[int], dtype: np.dtype | str, num_shards: int, partition_bytes: int
) -> list[Piece]:
    """Cuts one variable into pieces (shard not yet assigned: -1).

    >>> [(p.offset, p.size) for p in split("v", (10, 3), "float32", 4, 40)]
    [(0, 10), (10, 10), (20, 10)]
    """
    dt = np.dtype(dtype)
    full_shape = tuple(int(d) for d in shape)
    size = math.prod(full_shape)
    nbytes = size * dt.itemsize
    count = 1
    if partition_bytes > 0 and nbytes >= partition_bytes and num_shards > 1 and size > 1:
        count = min(num_shards, math.ceil(nbytes / partition_bytes), size)
    if count == 1:
        return [Piece(variable, variable, -1, full_shape, dt, 0, 1, 0, size)]
    base, extra = divmod(size, count)
    pieces, offset = [], 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        pieces.append(Piece(variable, partition_name(variable, i), -1, full_shape, dt, i, count, offset, n))
        offset += n
    return pieces


def plan(
    specs: Mapping[str, tuple[Sequence[int], np.dtype | str]],
    num_shards: int,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    whole: Container[str] = frozenset(),
) -> dict[str, list[Piece]]:
    """Places the variables of one create call; returns each variable's pieces in partition order.

    ``whole``: variables never cut, whatever their size (their optimizer's rule needs the whole
    variable: clipnorm, Adafactor, Lamb).

    Raises:
        ValueError: ``num_shards`` is not positive.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    pieces = [
        p
        for name, (shape, dt) in specs.items()
        for p in split(name, shape, dt, num_shards, 0 if name in whole else partition_bytes)
    ]
    load = [0] * num_shards
    placed: dict[str, Piece] = {}
    for piece in sorted(pieces, key=lambda p: (-p.nbytes, p.stored_name)):
        start = zlib.crc32(piece.stored_name.encode()) % num_shards
        shard = min(range(num_shards), key=lambda s: (load[s], (s - start) % num_shards))
        load[shard] += max(piece.nbytes, 1)
        placed[piece.stored_name] = Piece(
            piece.variable, piece.stored_name, shard, piece.full_shape, piece.dtype,
            piece.index, piece.count, piece.offset, piece.size,
        )  # fmt: skip
    return {name: [placed[p.stored_name] for p in pieces if p.variable == name] for name in specs}
