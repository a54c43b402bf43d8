"""A dynamic table piece's settings (``ps_pb2.DynamicTable``, validated), its counters, and the
names the piece's modules share: what holds its rows (``Holder``) and a heavy step of a push (``Work``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from pscore.embedding import check_initializer
from pscore.placement import dynamic_capacity
from psproto.v1 import ps_pb2
from psserver.sketch import MAX_MIN_COUNT
from psserver.tables import row_initializer

_SKETCH_MIN_WIDTH = 1 << 16
_SKETCH_UNBOUNDED_WIDTH = 1 << 20
EVICT_SLACK = 64  # a full shard evicts capacity // 64 rows more than it needs at once
# A heavy step of an update (``psserver.store.Store._update``): the bytes it works on, and the computation.
Work = tuple[int, Callable[[], Any]]


def pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """A dynamic table piece's settings (``ps_pb2.DynamicTable``, validated)."""

    table: str
    dim: int
    index: int
    count: int
    capacity: int  # rows this shard holds at most (0: unbounded)
    min_count: int
    lfu: bool
    ttl_steps: int
    ttl_seconds: float
    initializer: str | tuple[Any, ...]

    @classmethod
    def of(cls, spec: ps_pb2.VariableSpec) -> Config:
        """Raises: ValueError for inconsistent settings (the message names the problem)."""
        d = spec.dynamic
        if not d.table:
            raise ValueError("a dynamic table piece needs a table name")
        if spec.HasField("partition") or spec.HasField("table"):
            raise ValueError("a dynamic table piece cannot also be a partition or a fixed table")
        if d.dim < 1 or not 0 <= d.index < d.count:
            raise ValueError(f"dim {d.dim}, shard {d.index} of {d.count} are inconsistent")
        if tuple(spec.shape) != (0, d.dim):
            raise ValueError(f"shape {list(spec.shape)} must be [0, {d.dim}] (rows come and go)")
        if d.capacity < 0:
            raise ValueError(f"capacity {d.capacity} is negative (0: unbounded)")
        if not 0 <= d.min_count <= MAX_MIN_COUNT:
            raise ValueError(f"min_count {d.min_count} is out of range [1, {MAX_MIN_COUNT}]")
        if d.ttl_steps < 0 or not (math.isfinite(d.ttl_seconds) and d.ttl_seconds >= 0):
            raise ValueError(f"ttl_steps {d.ttl_steps} and ttl_seconds {d.ttl_seconds} must be >= 0")
        if d.key_type not in ps_pb2.KeyType.values():
            raise ValueError(f"unknown key type {d.key_type}")
        if d.eviction not in ps_pb2.Eviction.values():
            raise ValueError(f"unknown eviction policy {d.eviction}")
        init = row_initializer(d.initializer)
        check_initializer(init, d.table)
        return cls(
            table=d.table,
            dim=int(d.dim),
            index=int(d.index),
            count=int(d.count),
            capacity=dynamic_capacity(d.capacity, d.count),
            min_count=max(1, int(d.min_count)),
            lfu=d.eviction == ps_pb2.EVICTION_LFU,
            ttl_steps=int(d.ttl_steps),
            ttl_seconds=float(d.ttl_seconds),
            initializer=init,
        )

    @property
    def sketch_width(self) -> int:
        return max(_SKETCH_MIN_WIDTH, 2 * self.capacity) if self.capacity else _SKETCH_UNBOUNDED_WIDTH


class Holder(Protocol):
    """What holds a piece's row storage (``psserver.store.Variable``)."""

    state: tuple[np.ndarray, int]
    slots: dict[str, np.ndarray]


@dataclasses.dataclass(slots=True)
class Stats:
    """Counters since the shard started (``ps_pb2.DynamicStats``)."""

    admitted: int = 0
    evicted: int = 0
    expired: int = 0
    dropped_updates: int = 0
    initializer_reads: int = 0
