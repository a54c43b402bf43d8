"""Deterministic placement of variables on shards, balanced by bytes.

Rules (the same on every worker, with no coordination):

1. A variable of at least ``partition_bytes`` bytes is cut into
   ``k = min(num_shards, ceil(nbytes / partition_bytes))`` partitions: contiguous
   flat (C-order) element ranges of near-equal size, stored as 1-D tensors named
   ``"<name>/part_<i>"``. Smaller variables stay whole.
2. The pieces of one ``create`` call are placed greedily, largest first (ties by
   name): each goes to the shard that has been given the fewest bytes so far in
   this call; among equally loaded shards the search starts at
   ``crc32(name) % num_shards``, so single-variable creates spread by hash.

A client that did not create a variable learns its placement from the shards
(``ListVariables``), never by recomputing it.

>>> p = plan({"a": ((10,), "float32"), "b": ((1000,), "float32")}, num_shards=2, partition_bytes=1 << 20)
>>> sorted((piece.stored_name, piece.shard) for pieces in p.values() for piece in pieces)
[('a', 0), ('b', 1)]
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_PARTITION_BYTES = 8 << 20  # 8 MiB: big enough to amortise per-call cost, small enough to spread load


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

    @property
    def partitioned(self) -> bool:
        return self.count > 1

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return (self.size,) if self.partitioned else self.full_shape

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def partition_name(variable: str, index: int) -> str:
    """The stored name of partition ``index`` of ``variable``."""
    return f"{variable}/part_{index}"


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
) -> dict[str, list[Piece]]:
    """Places the variables of one create call; returns each variable's pieces in partition order.

    Raises:
        ValueError: ``num_shards`` is not positive.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    pieces = [
        p for name, (shape, dt) in specs.items() for p in split(name, shape, dt, num_shards, partition_bytes)
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
