"""Dynamic embedding table pieces: 64-bit ids -> preallocated rows, with admission, eviction and expiry.

One shard's piece of a dynamic table (``ps_pb2.DynamicTable``; see
``pscore.placement`` for which shard holds an id) is a ``DynamicRows``:

- row storage preallocated for the shard's capacity (``ceil(capacity / S)``
  rows; an unbounded table starts small and doubles), with the optimizer's
  slots beside it, so memory is bounded by the capacity whatever ids arrive;
- an id -> slot map (``HashIndex``: open addressing with linear probing,
  vectorised over a batch of ids in probe rounds), and per slot its id, the
  table's push count at its last update (``last_step``), its number of
  updates (``hits``) and the time of its last update;
- with ``min_count > 1``, a count-min sketch (``CountMinSketch``) that counts
  the pushes of ids that have no row yet.

Every change happens when a push is applied (``prepare`` / ``write``), as a
function of the pushed ids, the table's push count and the push's time only:
lookups change nothing. So a backup replaying its primary's pushes (with the
primary's times) and a shard restored from a checkpoint and fed the same
pushes hold the same rows. An applied push, in order:

1. Rows of pushed ids that exist are marked updated (``last_step``, ``hits``, time).
2. Absent ids are counted in the sketch; those seen in at least ``min_count``
   pushes are admitted, the others' updates dropped (``dropped_updates``).
3. Every ``max(1, ttl_steps // 8)`` pushes (or ``ttl_seconds / 8`` seconds) a
   sweep removes the rows not updated for ``ttl_steps`` pushes (or
   ``ttl_seconds``): a row lives between its TTL and 9/8 of it.
4. If the admitted ids do not fit, rows are evicted: LRU (least recently
   updated first) or LFU (fewest updates, then least recent), ties by smallest
   id, never a row of this push; ``capacity // 64`` extra rows are evicted at
   once so that a stream of new ids pays the selection (one pass over the
   shard's rows) once per many pushes. A push with more new ids than the shard
   holds admits the smallest ids that fit and drops the rest.
5. New rows get the table's initializer row (a function of the table name
   and the id: the same on every process) and fresh optimizer slots; then the
   optimizer's row rule updates every kept row (``write``).

With a disk tier (``psserver.tier``; a shard started with ``--table-memory``,
for tables without a capacity) the rows live in two places: at most ``limit``
in memory (the piece's claim on the shard's budget, ``TierBudget``, which grows
while the budget has room), the others on disk, each row in exactly one.
Where a row lives changes nothing of the above: a push first fills its cold
rows back into memory (one batched read), claiming more of the budget or
spilling rows it does not touch by the eviction policy to make room, and
deleting the rows an expiry sweep removes from both tiers (one write
transaction, before anything else changes: ``tier_step``, its disk reads and
its write in a worker thread); then steps 1-5 run as for an unbounded table in
memory. So a tiered piece holds bit-for-bit the rows, slots and counters an
unbounded in-memory piece fed the same pushes holds. Lookups and scans read
cold rows without filling them.

A lookup of an id without a row returns its initializer row (what its row
would start from). The sketch's counters halve whenever it has counted as
many ids as it has columns, so admission counts recent pushes (an id must
recur within about ``width`` counted ids, ``2 x`` the shard's capacity).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import numpy as np

from pscore.embedding import check_initializer, init_rows
from pscore.errors import InternalError, ResourceExhaustedError
from pscore.placement import dynamic_capacity
from psproto.v1 import ps_pb2
from psserver.hashindex import HashIndex
from psserver.sketch import MAX_MIN_COUNT, SKETCH_ROWS, CountMinSketch
from psserver.tables import row_initializer
from psserver.tier import (
    CHUNK_ROWS,
    NO_CUT,
    ColdTier,
    Cut,
    ReadCost,
    TierBudget,
    TierConfig,
    TierView,
    anonymous_array,
    higher_cut,
    record_dtype,
    release_rows,
)

_INITIAL_ROWS = 1024  # an unbounded table's first allocation (rows per shard); it doubles when full
# hash seeds: the shard rule uses seed 0, the index (``psserver.hashindex``) 1; the sketch rows their own
_SKETCH_MIN_WIDTH = 1 << 16
_SKETCH_UNBOUNDED_WIDTH = 1 << 20
_EVICT_SLACK = 64  # a full shard evicts capacity // 64 rows more than it needs at once
_VICTIM_QUEUE = 8  # a tiered piece chooses the victims of this many spills at once (``_spill_victims``)
_SWEEPS_PER_TTL = 8  # expiry sweeps per TTL period
# A heavy step of an update (``psserver.store.Store._update``): the bytes it works on, and the computation.
Work = tuple[int, Callable[[], Any]]
_EXPIRE_BATCH = 2048  # expired records a push deletes from the disk tier at most (per expiry index)
# Memory per hot row besides its value and slots: slot_ids, last_step, hits, last_time (8 B each), live (1),
# the free stack (8), the hash index at its fullest (4 entries of 17 B per live row after a rebuild)
# and its tier flag (on_disk: 1); with a TTL, its older copy's stamps (disk_stamps: 8 B per TTL kind).
_ROW_BOOKKEEPING_BYTES = 4 * 8 + 1 + 1 + 8 + 4 * 17
_MIN_HOT_ROWS = 64
_SELECT_CHUNK = 1 << 20  # positions a selection over more rows than memory holds takes at once (_largest)
_RECORD_META = ("last_step", "hits", "last_time")  # a row's bookkeeping, as the disk tier's records hold it


def _pow2(n: int) -> int:
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


class Export:
    """A piece's export begun at one instant (``DynamicRows.begin_export``): call it once for the arrays,
    then ``close`` it (whether or not it was called)."""

    def __init__(
        self,
        make: Callable[[], tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]],
        release: Callable[[], None] | None = None,
    ) -> None:
        self._make = make
        self._release = release

    def __call__(self) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(values, slots, bookkeeping arrays)`` as ``DynamicRows.export`` gives them."""
        return self._make()

    def close(self) -> None:
        """Releases what the export pinned (the disk tier's read transaction)."""
        if self._release is not None:
            self._release()
            self._release = None


@dataclasses.dataclass(slots=True)
class RowRead:
    """A lookup of a piece's rows, begun at one instant (``DynamicRows.read_begin``)."""

    piece: DynamicRows
    ids: np.ndarray
    out: np.ndarray  # the rows: those in memory copied at the start
    cold: np.ndarray  # the positions in ``ids`` of the rows not in memory
    view: TierView | None  # the disk tier then, when some are on disk
    cold_bytes: int = 0  # the bytes of records ``read_cold`` may read
    found: np.ndarray | None = None  # which of the cold ones the disk has (``read_cold``)
    records: np.ndarray | None = None  # their records
    cost: ReadCost = (0.0, 0)


@dataclasses.dataclass(frozen=True)
class Grown:
    """A piece's larger storage (``DynamicRows.grown``), for ``DynamicRows.adopt``."""

    old: int  # rows allocated when it was made
    values: np.ndarray
    slots: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray]  # the per-row bookkeeping arrays, by attribute name
    free: np.ndarray
    index: HashIndex


@dataclasses.dataclass(frozen=True)
class PushPlan:
    """What a push of distinct ids does to a piece in memory, worked out before it changes anything
    (``DynamicRows.plan``): ``Store._update`` grows the piece or picks its victims first (in another
    thread for a large piece), and ``prepare`` takes the rest instead of working it out again.

    ``None`` fields are not worked out ahead: ``prepare`` works them out itself (a tiered piece, whose
    fill of cold rows changes the rows first).
    """

    clock: int  # the piece's push counter when it was made: ``prepare`` must be the next push
    found: np.ndarray | None = None  # each id's row, -1 for an id without one (``HashIndex.get``)
    expired: np.ndarray | None = None  # the rows the push's due sweep removes (``_expired``)
    grow_to: int = 0  # the rows an unbounded piece grows to first (``grown``; 0: none)
    evict: int = 0  # the rows a full piece evicts (``victims_ahead``; 0: none)


class DynamicRows:
    """The hash table and bookkeeping of one dynamic table piece (see the module docs).

    The row values and optimizer slots live in the holder (``var.state[0]``,
    ``var.slots``: ``[allocated rows, dim]``); this object maps ids to their
    rows and decides which rows exist. Not thread-safe: call it from the
    shard's event loop (``write``'s row math may run in a thread meanwhile:
    it touches only the rows ``prepare`` returned).

    Args:
        config: the piece's settings.
        dtype: the rows' dtype.
    """

    def __init__(self, config: Config, dtype: np.dtype, hot_rows: int = 0) -> None:
        self.config = config
        self.dtype = np.dtype(dtype)
        # With a disk tier (``attach_tier``): the most rows memory could hold (the shard's whole budget);
        # 0: no limit but the capacity.
        self.hot_rows = hot_rows
        self.tier: ColdTier | None = None
        self.budget: TierBudget | None = None
        self.row_bytes = 0  # with a tier: the budget's bytes per row in memory
        self.sketch_bytes = 0  # with a tier: the admission sketch's bytes, claimed on the budget
        # A tiered piece maps arrays for the whole budget at once (``anonymous_array``: pages take memory
        # only as rows are written, so its claim bounds it), so no growth ever holds two copies at once.
        rows = config.capacity or hot_rows or _INITIAL_ROWS
        zeros = anonymous_array if hot_rows else np.zeros
        self.index = HashIndex(0 if hot_rows else rows)  # tiered: grows with the rows it holds
        self.slot_ids = zeros(rows, np.int64)
        self.last_step = zeros(rows, np.int64)
        self.hits = zeros(rows, np.int64)
        self.last_time = zeros(rows, np.float64)
        self.live = zeros(rows, bool)
        # Disk tier: the row in memory also has an older copy on disk (filled rows keep theirs: deleting
        # it would cost a write per fill; the next spill overwrites it). ``stale``: how many do.
        self.on_disk = zeros(rows, bool)
        self.stale = 0
        # A tiered LRU piece's next spill victims, in LRU order (``_spill_victims``): rows, and their ids
        # and last steps when chosen.
        self._victim_queue: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        # With an expiry index (a TTL): the stamps of each older copy (``ColdTier.stamps``), whose index
        # entries its next spill replaces without reading it first.
        self.disk_stamps: np.ndarray | None = None
        # Rows below ``limit`` are in use or free: a tiered piece's claim; the allocated rows otherwise.
        self.limit = 0 if hot_rows else rows
        self.free = zeros(rows, np.int64)  # a stack of free rows: the top is free[nfree - 1]
        self.free[: self.limit] = np.arange(self.limit - 1, -1, -1, dtype=np.int64)
        self.nfree = self.limit
        self.sketch = CountMinSketch(config.sketch_width) if config.min_count > 1 else None
        self.clock = 0  # pushes applied to this piece
        self.last_sweep = (0, 0.0)  # (clock, time) of the last expiry sweep
        self.stats = Stats()

    # -- storage ----------------------------------------------------------------

    def new_storage(self, optimizer: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Zeroed row storage and slots for the allocated rows (pages stay untouched until written)."""
        return self._storage(optimizer, self.allocated)

    def _storage(
        self, optimizer: Any, rows: int, zeros: Callable[..., np.ndarray] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        dim = self.config.dim
        zeros = zeros or (anonymous_array if self.hot_rows else np.zeros)
        small = optimizer.init_slots(np.zeros((1, dim), self.dtype))
        slots = {k: (zeros((rows, dim), a.dtype) if a.shape == (1, dim) else a) for k, a in small.items()}
        return zeros((rows, dim), self.dtype), slots

    @property
    def allocated(self) -> int:
        return self.slot_ids.size

    @property
    def hot_len(self) -> int:
        """Rows held in memory."""
        return self.limit - self.nfree

    def __len__(self) -> int:
        """Rows of the piece: in memory and, with a disk tier, on disk."""
        return self.hot_len + self.cold_len

    @property
    def cold_len(self) -> int:
        """Rows only on disk (not counting the older copies of rows in memory). Expired rows count until
        a push deletes them (``ColdTier.cut``)."""
        return len(self.tier) - self.stale if self.tier is not None else 0

    @staticmethod
    def memory_cost(config: Config, dtype: np.dtype, optimizer: Any) -> tuple[int, int]:
        """``(bytes per row, bytes besides)`` a tiered piece holds in memory: a row's value, row slots and
        bookkeeping; the admission sketch."""
        dim = config.dim
        row = np.zeros((1, dim), dtype)
        slots = optimizer.init_slots(row)
        per_row = row.nbytes + sum(a.nbytes for a in slots.values() if a.shape == (1, dim))
        per_row += _ROW_BOOKKEEPING_BYTES + 8 * (bool(config.ttl_steps) + bool(config.ttl_seconds))
        sketch = SKETCH_ROWS * _pow2(config.sketch_width) * 2 if config.min_count > 1 else 0
        return per_row, sketch

    @staticmethod
    def hot_rows_for(config: Config, dtype: np.dtype, optimizer: Any, memory_bytes: int) -> int:
        """How many rows fit an in-memory budget of ``memory_bytes`` (values, row slots, bookkeeping,
        the admission sketch).

        Raises:
            ValueError: the budget does not hold ``_MIN_HOT_ROWS`` rows (the message gives the bytes per row).
        """
        per_row, sketch = DynamicRows.memory_cost(config, dtype, optimizer)
        rows = (memory_bytes - sketch) // per_row
        if rows < _MIN_HOT_ROWS:
            raise ValueError(
                f"--table-memory {memory_bytes} bytes holds {max(0, rows)} rows of table {config.table!r} "
                f"({per_row} bytes each with slots and bookkeeping, plus {sketch} bytes of sketch); "
                f"at least {_MIN_HOT_ROWS} are needed"
            )
        return int(rows)

    def attach_tier(
        self, tier: TierConfig, name: str, holder: Holder, budget: TierBudget, optimizer: Any
    ) -> None:
        """Gives this (new, empty) piece its disk tier, an LMDB environment named after piece ``name``, and
        its first claim on the shard's ``budget``: its sketch and ``_MIN_HOT_ROWS`` rows (overdrawn if
        the budget is spent: the pieces over an equal share give it back at the next update).

        Raises:
            ValueError: an equal share of the budget, this piece counted, is less than that (the message
                says what the table needs).
            TierDirError: the environment cannot be created.
        """
        self.row_bytes, sketch = self.memory_cost(self.config, self.dtype, optimizer)
        floor = sketch + _MIN_HOT_ROWS * self.row_bytes
        share = budget.total // (budget.pieces + 1)
        if share < floor:
            raise ValueError(
                f"--table-memory {budget.total} bytes shared by {budget.pieces + 1} tables gives each "
                f"{share}, and table {self.config.table!r} needs {floor} to start ({_MIN_HOT_ROWS} rows of "
                f"{self.row_bytes} bytes with slots and bookkeeping, plus {sketch} bytes of sketch); raise "
                "--table-memory"
            )
        dim = self.config.dim
        row_slots = {k: a.dtype for k, a in holder.slots.items() if a.shape == (self.allocated, dim)}
        record = record_dtype(dim, self.dtype, row_slots)
        c = self.config
        expiry = [kind for kind, ttl in (("last_step", c.ttl_steps), ("last_time", c.ttl_seconds)) if ttl]
        self.tier = tier.open_piece(name, record, c.table, expiry)
        if self.tier.stamps is not None:
            self.disk_stamps = anonymous_array((self.allocated,), self.tier.stamps)
        self.budget = budget
        self.sketch_bytes = budget.claim(sketch, overdraw=True)
        budget.pieces += 1
        self._claim(_MIN_HOT_ROWS, up_to_fair=True)

    def close(self) -> None:
        """Closes and removes the disk tier and gives back its claim (the piece is dropped)."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self.budget is not None:
            self.budget.release(self.claimed)
            self.budget.pieces -= 1
            self.budget = None

    @property
    def claimed(self) -> int:
        """Bytes this piece holds of the shard's budget: its sketch and ``limit`` rows (0 untiered)."""
        return self.sketch_bytes + self.limit * self.row_bytes if self.budget is not None else 0

    def _claim(self, rows: int, up_to_fair: bool = False) -> int:
        """Claims up to ``rows`` more rows of the budget (as many as it has left, at most the mapped rows;
        ``up_to_fair``: beyond what it has left, up to an equal share: ``TierBudget.overdraw``); they
        become free rows. Returns how many it got."""
        b, size = self.budget, self.row_bytes
        assert b is not None
        rows = min(rows, self.allocated - self.limit)
        got = b.claim(rows * size, size) // size
        if up_to_fair and got < rows:
            fair = (b.fair() - self.claimed) // size - got
            got += b.claim(min(rows - got, fair) * size, size, overdraw=True) // size
        if got:
            self.free[self.nfree : self.nfree + got] = np.arange(self.limit + got - 1, self.limit - 1, -1)
            self.nfree += got
            self.limit += got
        return got

    def shrink(self, holder: Holder, rows: int) -> int:
        """Gives ``rows`` rows of the piece's claim back to the budget (keeping ``_MIN_HOT_ROWS``): the rows
        in memory above the new limit are spilled (one write transaction) and their pages given back.
        Returns the rows given. Call it with the piece's updates held back (its lock).

        Raises:
            TierFullError: the disk tier cannot take the spilled rows (nothing changed).
        """
        assert self.budget is not None and self.tier is not None
        new = max(_MIN_HOT_ROWS, self.limit - rows)
        if new >= self.limit:
            return 0
        tail = self._by_id(new + np.flatnonzero(self.live[new : self.limit]))
        self.tier.write(self.slot_ids[tail], self._records(holder, tail), older=self._older(tail))
        # Nothing below fails.
        self._release(tail)
        free = self.free[: self.nfree]
        free = free[free < new]
        self.free[: free.size] = free
        self.nfree = free.size
        per_row = [self.slot_ids, self.last_step, self.hits, self.last_time, self.live, self.on_disk]
        per_row += [self.free, self.disk_stamps, holder.state[0], *holder.slots.values()]
        for arr in per_row:
            if arr is not None and arr.shape[:1] == (self.allocated,):
                release_rows(arr, new)
        given = self.limit - new
        self.limit = new
        self.budget.release(given * self.row_bytes)
        return given

    def memory_bytes(self, holder: Holder) -> int:
        """Bytes the piece holds in memory: its rows, slots and bookkeeping (a tiered piece: its claim)."""
        if self.budget is not None:
            return self.claimed
        return int(holder.state[0].nbytes + sum(a.nbytes for a in holder.slots.values()) + self.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes of bookkeeping (index, per-row counters, sketch), besides the rows and slots."""
        meta = self.index.nbytes + self.slot_ids.nbytes * 4 + self.live.nbytes + self.free.nbytes
        meta += self.disk_stamps.nbytes if self.disk_stamps is not None else 0
        return meta + (self.sketch.nbytes if self.sketch is not None else 0)

    def proto_stats(self) -> ps_pb2.DynamicStats:
        """The piece's counters; with a disk tier, its tiers' too."""
        s = self.stats
        out = ps_pb2.DynamicStats(
            rows=len(self),
            capacity=self.config.capacity,
            admitted=s.admitted,
            evicted=s.evicted,
            expired=s.expired,
            dropped_updates=s.dropped_updates,
            initializer_reads=s.initializer_reads,
        )
        tier = self.tier
        if tier is not None:
            t = tier.stats
            memory = self.claimed
            out.MergeFrom(
                ps_pb2.DynamicStats(
                    rows_in_memory=self.hot_len,
                    rows_on_disk=self.cold_len,
                    memory_bytes=memory,
                    disk_bytes=tier.disk_used,
                    memory_rows_max=self.limit,
                    spilled=t.spilled,
                    filled=t.filled,
                    memory_hits=t.hot_hits,
                    disk_hits=t.cold_hits,
                )
            )
        return out

    # -- reads ------------------------------------------------------------------

    def initial_rows(self, ids: np.ndarray) -> np.ndarray:
        c = self.config
        return init_rows(c.table, ids, c.dim, self.dtype, c.initializer)

    def read(self, holder: Holder, ids: np.ndarray) -> np.ndarray:
        """The rows of ids (a copy): their values, or the initializer's row for ids without one."""
        lookup = self.read_begin(holder, ids)
        self.read_cold(lookup)
        return self.read_end(lookup)

    def read_begin(self, holder: Holder, ids: np.ndarray) -> RowRead:
        """``read`` in three steps, as of now: the rows in memory are copied, and the disk tier's are
        read as they are now by ``read_cold`` (in any thread: its ``cold_bytes`` tell whether it is
        worth one), then ``read_end`` gives the rows. Lookups change nothing, so a push meanwhile changes
        none of them. Call ``read_begin`` and ``read_end`` on the event loop."""
        slots = self.index.get(ids)
        have = slots >= 0
        out = holder.state[0][slots] if have.all() else np.empty((ids.size, self.config.dim), self.dtype)
        cold = np.flatnonzero(~have)
        if cold.size:
            out[have] = holder.state[0][slots[have]]
        if self.tier is None:
            return RowRead(self, ids, out, cold, None)
        self.tier.stats.hot_hits += ids.size - cold.size
        if not cold.size:
            return RowRead(self, ids, out, cold, None)
        # cold rows are read (one batched read), not filled
        return RowRead(self, ids, out, cold, self.tier.view(), cold.size * self.tier.record.itemsize)

    def read_cold(self, lookup: RowRead) -> None:
        """Reads ``lookup``'s rows on disk, as they were at its ``read_begin``; any thread."""
        if lookup.view is not None:
            assert self.tier is not None
            found, records, _, cost = self.tier.read(lookup.ids[lookup.cold], remember=True, at=lookup.view)
            lookup.found, lookup.records, lookup.cost = found, records, cost

    def read_end(self, lookup: RowRead) -> np.ndarray:
        """``lookup``'s rows (after its ``read_cold``); ids without one get their initializer's row."""
        out, cold = lookup.out, lookup.cold
        if lookup.view is not None:
            assert self.tier is not None and lookup.found is not None and lookup.records is not None
            lookup.view.close()  # read, or not read (the read failed)
            out[cold[lookup.found]] = lookup.records["value"]
            self.tier.count_read(lookup.cost)
            self.tier.stats.cold_hits += lookup.records.size
            self.tier.stats.cold_reads += lookup.records.size
            cold = cold[~lookup.found]
        if cold.size:
            out[cold] = self.initial_rows(lookup.ids[cold])
            self.stats.initializer_reads += cold.size
        return out

    def scan(self, holder: Holder, after: int | None, n: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """The ``n`` smallest ids with a row that are ``> after``, ascending, with copies of their rows,
        and whether they are the last. One pass over the piece's rows (a selection, not a sort)."""
        ids = self.slot_ids[self.live]
        if after is not None:
            ids = ids[ids > after]
        cold = self._cold_scan(after, n + 1)
        ids = np.concatenate([ids, cold])
        last = ids.size <= n
        if not last:
            ids = np.partition(ids, n - 1)[:n]
        ids = np.sort(ids)
        if not cold.size:
            return ids, holder.state[0][self.index.get(ids)], last
        assert self.tier is not None
        rows = self.index.get(ids)
        out = np.empty((ids.size, self.config.dim), self.dtype)
        hot = rows >= 0
        out[hot] = holder.state[0][rows[hot]]
        _, records = self.tier.get(ids[~hot])
        out[~hot] = records["value"]
        self.tier.stats.cold_reads += records.size
        return ids, out, last

    def _cold_scan(self, after: int | None, n: int) -> np.ndarray:
        """The first ``n`` ids ``> after`` of rows only on disk (older copies of rows in memory skipped)."""
        if self.tier is None:
            return np.zeros(0, np.int64)
        out: list[np.ndarray] = []
        have = 0
        while have < n:
            want = n - have + self.stale
            got = self.tier.scan(after, want)
            if not got.size:
                break
            cold = got[self.index.get(got) < 0][: n - have]
            out.append(cold)
            have += cold.size
            after = int(got[-1])
            if got.size < want:  # the tier has no more
                break
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    # -- a push -----------------------------------------------------------------

    def prepare(
        self,
        holder: Holder,
        ids: np.ndarray,
        now: float,
        optimizer: Any,
        plan: PushPlan | None = None,
        victims: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-5 of a push of distinct ``ids`` (all but the row math): returns ``(rows, keep)``.

        A tiered piece's push runs its ``tier_step`` first.

        ``rows`` are the storage rows to update with the gradients at positions
        ``keep`` of ``ids`` (the others are dropped). No await may separate this
        from ``write``'s storing of the new values. ``plan``: the push's ``plan``,
        made since the last push; ``victims``: the ``plan.evict`` rows
        ``victims_ahead`` picked, which the eviction takes instead of picking again.
        """
        c = self.config
        if plan is not None:
            assert plan.clock == self.clock, "a push came between this push's plan and the push"
        self.clock += 1
        found = plan.found if plan is not None and plan.found is not None else self.index.get(ids)
        present = np.flatnonzero(found >= 0)
        old = found[present]
        self._touch(old, now)
        new_pos = np.flatnonzero(found < 0)
        if new_pos.size and self.sketch is not None:
            admitted = self.sketch.add(ids[new_pos]) >= c.min_count
            self.stats.dropped_updates += int(new_pos.size - np.count_nonzero(admitted))
            new_pos = new_pos[admitted]
        self._sweep(now, protect=old, expired=plan.expired if plan is not None else None)
        if new_pos.size > self.nfree:
            if not c.capacity:
                assert self.tier is None, "the tier step made room for every row of the push"
                self._grow(holder, optimizer, self.hot_len + new_pos.size)
            else:
                n = new_pos.size - self.nfree + c.capacity // _EVICT_SLACK
                ahead = plan is not None and victims is not None and plan.evict == n
                self._evict(n, protect=old, chosen=victims if ahead else None)
                if new_pos.size > self.nfree:  # more new ids than the shard holds: the smallest fit
                    self.stats.dropped_updates += int(new_pos.size - self.nfree)
                    new_pos = new_pos[: self.nfree]
        new = self._take(new_pos.size)
        new_ids = ids[new_pos]
        self.index.insert(new_ids, new)
        self.slot_ids[new] = new_ids
        self.live[new] = True
        self.hits[new] = 0
        self._touch(new, now)
        self.stats.admitted += new.size
        if new.size:
            values, slots = holder.state[0], holder.slots
            rows = self.initial_rows(new_ids)
            values[new] = rows
            fresh = optimizer.init_slots(rows)  # slots as at creation (a moving average: the rows)
            for k, a in fresh.items():
                if a.shape == rows.shape:
                    slots[k][new] = a
        return np.concatenate([old, new]), np.concatenate([present, new_pos])

    def _touch(self, rows: np.ndarray, now: float) -> None:
        self.last_step[rows] = self.clock
        self.hits[rows] += 1
        self.last_time[rows] = now

    def _take(self, n: int) -> np.ndarray:
        rows = self.free[self.nfree - n : self.nfree][::-1].copy()
        self.nfree -= n
        return rows

    def _release(self, rows: np.ndarray) -> None:
        self.index.remove(self.index.positions(self.slot_ids[rows]))
        self.live[rows] = False
        if self.stale:
            self.stale -= int(np.count_nonzero(self.on_disk[rows]))
            self.on_disk[rows] = False
        self.free[self.nfree : self.nfree + rows.size] = rows
        self.nfree += rows.size

    def _sweep_due(self, clock: int, now: float) -> bool:
        c = self.config
        if not (c.ttl_steps or c.ttl_seconds):
            return False
        step, when = self.last_sweep
        return bool(
            (c.ttl_steps and clock - step >= max(1, c.ttl_steps // _SWEEPS_PER_TTL))
            or (c.ttl_seconds and now - when >= c.ttl_seconds / _SWEEPS_PER_TTL)
        )

    def _expired(self, clock: int, now: float, protect: np.ndarray) -> np.ndarray:
        """The rows in memory a sweep at push ``clock`` and time ``now`` removes (not ``protect``)."""
        c, n = self.config, self.limit
        old = np.zeros(n, bool)
        if c.ttl_steps:
            old |= self.last_step[:n] < clock - c.ttl_steps
        if c.ttl_seconds:
            old |= self.last_time[:n] < now - c.ttl_seconds
        old &= self.live[:n]
        old[protect] = False
        return np.flatnonzero(old)

    def _sweep(self, now: float, protect: np.ndarray, expired: np.ndarray | None = None) -> None:
        """Removes expired rows when a sweep is due (every 1/8 of the TTL); ``expired``: those rows, found
        by the push's ``plan``."""
        if not self._sweep_due(self.clock, now):
            return
        self.last_sweep = (self.clock, now)
        rows = self._expired(self.clock, now, protect) if expired is None else expired
        if rows.size:
            self._release(rows)
            self.stats.expired += rows.size

    # -- the disk tier ------------------------------------------------------------

    def tier_step(self, holder: Holder, ids: np.ndarray, now: float) -> Generator[Work, Any, np.ndarray]:
        """A push's tier step, before steps 1-5 (``prepare``): afterwards every row of the push that
        exists is in memory, and there is room in memory for the ids the push admits. Returns each id's
        row now (-1 for a new id), ``plan``'s ``found`` (``prepare`` then does not look them up again).

        One batched read finds the push's cold rows; if memory has too little room
        for them and the admitted new ids, the piece claims more of the shard's
        budget (``_claim``), and if that is not enough, rows not in the push are
        spilled (by the table's eviction policy, ``limit // 64`` extra at once); a due expiry
        sweep runs here, over both tiers: the expired rows in memory go, and the disk
        tier's cut rises (``ColdTier.cut``: reads skip the records before it at once).
        Then one write transaction puts the spilled rows on disk (over their older
        copies) and deletes expired records there: those this push's read found, and
        a batch of at most ``_EXPIRE_BATCH`` from the expiry indexes while any may be
        left (``ColdTier.expiring``), so no push's share of a sweep grows with the
        rows that expire. Filled rows keep their disk copy (``on_disk``) until they
        are spilled again or expire. It is the only step that can fail, and it runs
        before anything changes: a push that fails here leaves the piece's rows (and
        the tier's cut) as they were (it may keep a larger claim on the budget: where
        rows live changes nothing).

        Its disk reads and its write are yielded as ``Work`` on the records'
        bytes (``Store._update`` runs the large ones in a worker thread: the
        event loop turns on while the disk works), and their results sent back. Nothing else changes
        the piece meanwhile (the caller holds its lock); a lookup meanwhile reads
        every row where it was before the step (a row being spilled is still in
        memory until the write is done, a row being filled still on disk), but
        the records the step's sweep expires, which it may already find gone.

        Raises:
            TierFullError: the disk tier cannot take the spilled rows (nothing changed).
            ResourceExhaustedError: the push has more rows than memory holds (nothing changed).
        """
        c, tier = self.config, self.tier
        assert tier is not None
        found = self.index.get(ids)
        hot = found[found >= 0]
        cold_pos = np.flatnonzero(found < 0)
        clock = self.clock + 1
        sweep = self._sweep_due(clock, now)
        cut, expiring = tier.cut, tier.expiring
        if sweep:
            steps = clock - c.ttl_steps if c.ttl_steps else None
            cut = higher_cut(cut, (steps, now - c.ttl_seconds if c.ttl_seconds else None))
        batch_cut = cut if sweep or expiring else None  # then a batch of the expired records on disk
        cold_ids = ids[cold_pos]
        nbytes = cold_ids.size * tier.record.itemsize if len(tier) else 0
        reads = functools.partial(self._tier_reads, cold_ids, batch_cut)
        on_disk, records, dead, cost, batch = yield nbytes, reads
        tier.count_read(cost)
        fill_ids = ids[cold_pos[on_disk]]
        new_ids = ids[cold_pos[~on_disk]]
        tier.stats.hot_hits += hot.size
        tier.stats.cold_hits += fill_ids.size
        admitted = new_ids.size
        if admitted and self.sketch is not None:  # what step 2 admits (``add`` returns estimate + 1)
            admitted = int(
                np.count_nonzero(self.sketch.estimate(new_ids).astype(np.int64) + 1 >= c.min_count)
            )
        expired_hot = expired_cold = ids[:0]
        outdated = hot[:0]  # rows in memory whose older copy on disk has expired: the copy goes
        cold_old = dead
        if sweep:
            expired_hot = self._expired(clock, now, protect=hot)
        if batch is not None:
            expiring = batch.size >= _EXPIRE_BATCH  # the indexes may hold more before the cut
            cold_old = np.union1d(batch, dead)
        if cold_old.size:
            at = self.index.get(cold_old)
            # Older copies: rows in memory decide. The copy is deleted (a later batch need not find it
            # again), unless its row expires now (``gone`` below) or is spilled over it (a victim below).
            outdated = np.setdiff1d(at[at >= 0], expired_hot, assume_unique=True)
            # Rows this push fills are kept (protected): read before the cut rose, they are in memory now.
            expired_cold = np.setdiff1d(cold_old[at < 0], fill_ids, assume_unique=True)
        need = fill_ids.size + admitted
        room = self.nfree + expired_hot.size
        if need > room:  # more of the shard's budget (where rows live changes nothing)
            room += self._claim(need - room + self.limit // _EVICT_SLACK, up_to_fair=True)
        victims = ids[:0]
        if need > room:
            candidates = self.live[: self.limit].copy()
            candidates[hot] = False
            candidates[expired_hot] = False
            if np.count_nonzero(candidates) < need - room:
                raise ResourceExhaustedError(
                    f"table {c.table!r}: a push of {ids.size} ids needs {hot.size + need} rows in memory; "
                    f"this shard's in-memory tier holds {self.limit} of them (raise --table-memory, or push "
                    "fewer ids at once); nothing was applied"
                )
            victims = self._by_id(self._spill_victims(candidates, need - room + self.limit // _EVICT_SLACK))
        gone = self.slot_ids[expired_hot[self.on_disk[expired_hot]]]  # their older copies go too
        if outdated.size and victims.size:
            outdated = np.setdiff1d(outdated, victims, assume_unique=True)
        deletes = (expired_cold, gone, self.slot_ids[outdated])
        if victims.size or any(d.size for d in deletes):
            nbytes = victims.size * tier.record.itemsize + sum(d.nbytes for d in deletes)
            yield nbytes, functools.partial(self._spill, holder, victims, deletes)
        # Nothing below fails.
        tier.cut, tier.expiring = cut, expiring
        self.on_disk[outdated] = False
        self.stale -= outdated.size
        if sweep:
            self.last_sweep = (clock, now)
            if expired_hot.size:
                self._release(expired_hot)
        self.stats.expired += expired_hot.size + expired_cold.size
        if victims.size:
            self._release(victims)
        assert need <= self.nfree, "the claim and the spill made room for every row of the push"
        if fill_ids.size:
            rows = self._take(fill_ids.size)
            self.index.insert(fill_ids, rows)
            self.slot_ids[rows] = fill_ids
            self.live[rows] = True
            self.last_step[rows] = records["last_step"]
            self.hits[rows] = records["hits"]
            self.last_time[rows] = records["last_time"]
            holder.state[0][rows] = records["value"]
            for k, a in holder.slots.items():
                if a.shape == (self.allocated, c.dim):
                    a[rows] = records[f"slot_{k}"]
            self.on_disk[rows] = True
            if self.disk_stamps is not None:
                for k in self.disk_stamps.dtype.names or ():
                    self.disk_stamps[k][rows] = records[k]
            self.stale += fill_ids.size
            tier.stats.filled += fill_ids.size
            found[cold_pos[on_disk]] = rows  # ``index.get``'s own array
        return found  # rows spilled or expired were none of the push's: only the filled ids' rows changed

    def update(
        self,
        holder: Holder,
        ids: np.ndarray,
        values: np.ndarray,
        now: float,
        optimizer: Any,
        step: int,
        regularizer: Any,
    ) -> Generator[Work, Any, tuple[np.ndarray, np.ndarray]]:
        """A push of rows ``values`` to ``ids``: its heavy steps yielded as ``Work`` (``Store._update`` runs
        the large ones in a worker thread), their results sent back; returns the rows the push updates and
        their new values, for the caller to write (with the version, at once). The caller holds the
        piece's lock.

        In order: with a disk tier, its cold rows filled and room made (``tier_step``: disk reads, a
        write); the push's plan (its ids' rows, its sweep's expired rows: a pass over all rows when due);
        an unbounded table's growth (a copy of all its rows) or its id index's rebuild (its tombstones
        dropped); a full table's choice of the rows it evicts (a pass over them); the rows made
        (``prepare``); the optimizer's rule on them (only those rows are touched meanwhile).

        Raises:
            TierFullError: the disk tier cannot take the spilled rows (nothing changed).
            ResourceExhaustedError: the push has more rows than memory holds (nothing changed).
        """
        filled = None
        if self.tier is not None:
            filled = yield from self.tier_step(holder, ids, now)
        plan = yield self.plan_bytes(ids, now), functools.partial(self.plan, ids, now, filled)
        if plan.grow_to:  # before the push changes it
            grow = functools.partial(self.grown, holder, optimizer, plan.grow_to)
            grown = yield holder.state[0].nbytes, grow
            self.adopt(holder, grown)
        elif self.reindex_due(ids.size):
            self.index = yield self.index.nbytes, functools.partial(self.reindexed, ids.size)
        victims = None
        if plan.evict:
            victims = yield self.last_step.nbytes, functools.partial(self.victims_ahead, plan)
        rows, keep = self.prepare(holder, ids, now, optimizer, plan, victims)
        kept = values[keep]
        value = holder.state[0]
        work = functools.partial(optimizer.apply_rows, value, rows, kept, holder.slots, step, regularizer)
        new = yield kept.nbytes, work
        return rows, new

    def _tier_reads(
        self, ids: np.ndarray, batch_cut: Cut | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReadCost, np.ndarray | None]:
        """``tier_step``'s disk reads (it may run in a worker thread): ``ColdTier.read`` of the cold
        ``ids`` (counted by the caller), then, with ``batch_cut``, a batch of the expired records' ids
        (``ColdTier.expired``)."""
        assert self.tier is not None
        batch = None if batch_cut is None else self.tier.expired(*batch_cut, limit=_EXPIRE_BATCH)
        return *self.tier.read(ids), batch

    def _spill(self, holder: Holder, rows: np.ndarray, deletes: tuple[np.ndarray, ...]) -> None:
        """``tier_step``'s write (it may run in a worker thread): ``rows`` in memory go to disk, over
        their older copies, and the ``deletes`` ids' records go, in one transaction (``ColdTier.write``).
        Reads the rows, changes nothing in memory."""
        assert self.tier is not None
        records = self._records(holder, rows)
        self.tier.write(self.slot_ids[rows], records, delete=deletes, older=self._older(rows))

    def _by_id(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` in the order of their ids: a spill's records are then gathered in the disk's key order."""
        return rows[np.argsort(self.slot_ids[rows])]

    def _older(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``ColdTier.write``'s ``older`` for spilling ``rows``: those with an older copy, their stamps."""
        if self.disk_stamps is None:
            return None
        rows = rows[self.on_disk[rows]]
        return self.slot_ids[rows], self.disk_stamps[rows]

    def _records(self, holder: Holder, rows: np.ndarray) -> np.ndarray:
        """The disk tier's records of rows in memory."""
        assert self.tier is not None
        return _gather_records(self.tier.record, self._hot_arrays(holder), rows)

    def _evict(self, n: int, protect: np.ndarray, chosen: np.ndarray | None = None) -> None:
        """Evicts ``n`` rows (fewer if fewer are not protected) by the table's policy (``chosen``: those it
        picks, picked before the push by ``victims_ahead``)."""
        rows = chosen if chosen is not None else self.victims(self._candidates(protect), n)
        if rows.size:
            self._release(rows)
            self.stats.evicted += rows.size

    def _candidates(self, protect: np.ndarray) -> np.ndarray:
        """The live rows but ``protect``: those an eviction may pick."""
        candidates = np.flatnonzero(self.live)
        if protect.size:
            keep = np.ones(self.allocated, bool)
            keep[protect] = False
            candidates = candidates[keep[candidates]]
        return candidates

    def _spill_victims(self, candidates: np.ndarray, n: int) -> np.ndarray:
        """``victims`` of a tiered piece's spill among the rows ``candidates`` (a mask). LRU: from a queue of
        the rows least recently used, chosen ``_VICTIM_QUEUE`` spills ahead in one selection (one pass
        over the rows in memory per spill was a tenth of a tiered step).

        The same rows as ``victims``: a queued row leaves the queue once it changes (released, or touched:
        its last step only grows), and every row not queued was, when the queue was chosen, after all of
        it in LRU order (its push's rows, protected then, are touched by it), and can only move further
        back (rows filled or admitted since are touched by their push)."""
        if self.config.lfu:  # rows admitted later come with one hit: they may go before the queued ones
            return self.victims(np.flatnonzero(candidates), n)
        q = self._victim_queue
        if q is not None:
            rows, ids, steps = q
            valid = self.live[rows] & (self.slot_ids[rows] == ids) & (self.last_step[rows] == steps)
            valid &= rows < candidates.size  # rows past a shrunk limit were spilled by the shrink
            first = int(np.argmax(valid)) if valid.any() else rows.size
            inside = np.minimum(rows[first:], candidates.size - 1)
            usable = np.flatnonzero(valid[first:] & candidates[inside]) + first
            if usable.size >= n:
                keep = slice(first, None)  # the changed rows at its head leave it
                self._victim_queue = (rows[keep], ids[keep], steps[keep])
                return rows[usable[:n]]
        pool = np.flatnonzero(candidates)
        chosen = self.victims(pool, min(pool.size, _VICTIM_QUEUE * n))
        chosen = chosen[np.lexsort([self.slot_ids[chosen], self.last_step[chosen]])]  # in the policy's order
        self._victim_queue = (chosen, self.slot_ids[chosen].copy(), self.last_step[chosen].copy())
        return chosen[:n]

    def victims(self, candidates: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` rows among ``candidates`` the policy evicts first (deterministic: ties by id)."""
        keys = [self.hits, self.last_step] if self.config.lfu else [self.last_step]
        return _smallest(candidates, [*keys, self.slot_ids], n)

    def plan_bytes(self, ids: np.ndarray, now: float) -> int:
        """The bytes ``plan`` reads for a push of ``ids`` at ``now``: every row's when the push's sweep is
        due (``Store._update`` then makes the plan in another thread for a large piece)."""
        if self.tier is None and self._sweep_due(self.clock + 1, now):
            return self.last_step[: self.limit].nbytes + self.live[: self.limit].nbytes
        return ids.nbytes

    def plan(self, ids: np.ndarray, now: float, filled: np.ndarray | None = None) -> PushPlan:
        """What a push of distinct ``ids`` at ``now`` does, worked out as ``prepare`` works it out, before
        the push changes anything: its ids' rows, the rows its due sweep removes, and whether it first
        grows an unbounded piece (``grown``) or evicts from a full one (``victims_ahead``).

        The new rows it needs are the new ids step 2 admits (the sketch's estimate: ``add`` returns it
        + 1); its room, the free rows with those the sweep frees. Reads the piece and changes nothing,
        like ``grown``: it may run in another thread while nothing updates the piece. A tiered piece's
        plan is only ``filled``, the ids' rows its ``tier_step`` returned (the step made room already).
        """
        if self.tier is not None:  # the fill of cold rows (``tier_step``) changed the rows first
            return PushPlan(self.clock, filled)
        c = self.config
        found = self.index.get(ids)
        expired = None
        if self._sweep_due(self.clock + 1, now):
            expired = self._expired(self.clock + 1, now, protect=found[found >= 0])
        if ids.size <= self.nfree:
            return PushPlan(self.clock, found, expired)
        new = ids[found < 0]
        admitted = new.size
        if admitted and self.sketch is not None:
            estimate = self.sketch.estimate(new).astype(np.int64)
            admitted = int(np.count_nonzero(estimate + 1 >= c.min_count))
        room = self.nfree + (expired.size if expired is not None else 0)
        if admitted <= room:
            return PushPlan(self.clock, found, expired)
        if c.capacity:
            return PushPlan(self.clock, found, expired, evict=admitted - room + c.capacity // _EVICT_SLACK)
        return PushPlan(
            self.clock, found, expired, grow_to=max(2 * self.allocated, _pow2(self.hot_len + admitted))
        )

    def victims_ahead(self, plan: PushPlan) -> np.ndarray:
        """The ``plan.evict`` rows ``prepare``'s eviction picks for the push of ``plan``: among the live
        rows, not the push's own nor those its due sweep removes, whose keys the push does not change
        before it evicts. Reads the piece and changes nothing, like ``grown``."""
        assert plan.found is not None, "a tiered piece evicts by spilling, in the push"
        protect = plan.found[plan.found >= 0]
        if plan.expired is not None:
            protect = np.concatenate([protect, plan.expired])
        return self.victims(self._candidates(protect), plan.evict)

    def reindex_due(self, pushed: int) -> bool:
        """Whether a push of ``pushed`` distinct ids could make the id index rebuild itself: ``reindexed``
        first. The push inserts at most that many ids (new rows, and with a disk tier the rows it fills);
        the rows it evicts, expires or spills turn live entries into tombstones, which leaves the count
        the index rebuilds by (``HashIndex.needs_rebuild``) as it was."""
        return self.index.needs_rebuild(pushed)

    def reindexed(self, pushed: int) -> HashIndex:
        """The id index rebuilt (tombstones dropped, grown if need be) for a push of ``pushed`` ids. Reads
        the piece and changes nothing, like ``grown``."""
        return self.index.rebuilt(min(self.index.live + pushed, self.limit))  # never more rows than that

    def grown(self, holder: Holder, optimizer: Any, rows: int) -> Grown:
        """Storage of ``rows`` rows holding every row, slot and counter of the piece, for ``adopt``.

        Reads the piece and changes nothing: it may run in another thread while nothing updates the
        piece (lookups read the old storage meanwhile).
        """
        assert self.tier is None, "a tiered piece claims rows of its mapped arrays (``_claim``)"
        old = self.allocated
        # np.empty, then two assignments: numpy lets go of the GIL for those (not for np.zeros's memset of
        # reused heap memory), so the event loop runs on while another thread grows the piece.
        values, slots = self._storage(optimizer, rows, np.empty)
        for new, now in [(values, holder.state[0]), *((slots[k], a) for k, a in holder.slots.items())]:
            if now.shape == (old, self.config.dim):
                new[:old] = now
                new[old:] = 0
        slots.update({k: a for k, a in holder.slots.items() if a.shape != (old, self.config.dim)})
        arrays = {}
        for name in ("slot_ids", "last_step", "hits", "last_time", "live", "on_disk", "disk_stamps"):
            arr = getattr(self, name)
            if arr is not None:
                arrays[name] = np.empty(rows, arr.dtype)
                arrays[name][:old] = arr
                arrays[name][old:] = 0
        free = np.empty(rows, np.int64)
        free[: rows - old] = np.arange(rows - 1, old - 1, -1)
        free[rows - old : rows - old + self.nfree] = self.free[: self.nfree]
        index = HashIndex(rows)  # sized for the new rows, as a new piece's: no rebuild on the way to them
        index.insert(*self.index.items())
        return Grown(old, values, slots, arrays, free, index)

    def adopt(self, holder: Holder, grown: Grown) -> None:
        """Takes the larger storage ``grown`` made (nothing may have changed the piece since)."""
        assert grown.old == self.allocated, "the piece changed while its larger storage was made"
        for name, arr in grown.arrays.items():
            setattr(self, name, arr)
        rows = grown.values.shape[0]
        self.index = grown.index
        self.free = grown.free
        self.nfree += rows - grown.old
        self.limit = rows
        holder.state = (grown.values, holder.state[1])
        holder.slots = grown.slots

    def _grow(self, holder: Holder, optimizer: Any, rows_needed: int) -> None:
        """Unbounded tables in memory: more rows (at least doubling), keeping every row, slot and counter."""
        self.adopt(holder, self.grown(holder, optimizer, max(2 * self.allocated, _pow2(rows_needed))))

    # -- checkpoints --------------------------------------------------------------

    def export(self, holder: Holder) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Copies of the live rows, by ascending id: ``(values, slots, bookkeeping arrays)``."""
        finish = self.begin_export(holder)
        try:
            return finish()
        finally:
            finish.close()

    def _hot_arrays(self, holder: Holder) -> dict[str, np.ndarray]:
        """The arrays of the rows in memory (up to ``limit``) that an export of a tiered piece copies, by
        record field."""
        dim, n = self.config.dim, self.limit
        out = {name: getattr(self, name)[:n] for name in ("live", "slot_ids", *_RECORD_META)}
        out["value"] = holder.state[0][:n]
        for k, a in holder.slots.items():
            if a.shape == (self.allocated, dim):
                out[f"slot_{k}"] = a[:n]
        return out

    def stage_export(self, holder: Holder) -> dict[str, np.ndarray]:
        """Scratch arrays for ``begin_export``'s copy of the rows in memory, their pages already written.

        Call it before updates are held back: then they wait only for a copy at
        memory speed, not for the page faults of fresh pages. Empty without a tier.

        Raises:
            OSError: the tier's directory cannot hold the scratch files.
        """
        if self.tier is None:
            return {}
        staged = {}
        for name, arr in self._hot_arrays(holder).items():
            staged[name] = self.tier.scratch(arr.shape, arr.dtype)
            staged[name][...] = 0  # the pages are faulted in now
        return staged

    def begin_export(self, holder: Holder, staged: dict[str, np.ndarray] | None = None) -> Export:
        """Starts ``export`` at this instant; the ``Export`` returned makes the arrays, later.

        Call this with the piece's updates held back; the export may run after
        they resume, in another thread, and gives the rows as they are now.
        Without a disk tier the copies are made here. With one, the arrays of
        the rows in memory are copied here as they lie (at memory speed, into
        scratch files: their bytes are bounded by the budget) and a read
        transaction pins the disk tier as it is; the export orders the first by
        id and merges them with the cold rows, read a chunk at a time, into
        arrays in scratch files (``psserver.tier.scratch_array``). So a save of a
        table past memory holds pushes back only for a copy of the budget (into
        ``staged``, ``stage_export``'s arrays, when given), and does not grow the
        shard's memory with the table.

        Raises:
            OSError: the tier's directory cannot hold the scratch files.
        """
        dim = self.config.dim
        row_slots = [k for k, a in holder.slots.items() if a.shape == (self.allocated, dim)]
        other_slots = {k: a.copy() for k, a in holder.slots.items() if k not in row_slots}
        counters = self._counters()
        if self.tier is None or not len(self.tier):
            rows = np.flatnonzero(self.live)
            rows = rows[np.argsort(self.slot_ids[rows], kind="stable")]
            values = holder.state[0][rows]
            slots = {k: holder.slots[k][rows] for k in row_slots}
            meta = self._meta(self.slot_ids[rows], self._records_meta(rows))
            return Export(lambda: (values, {**slots, **other_slots}, meta))
        tier = self.tier
        # Updates are held back only while the rows in memory are copied as they lie (memory speed, into
        # scratch files); ordering them by id and merging them with the cold rows come after.
        staged = staged or {}
        frozen = {}
        for name, arr in self._hot_arrays(holder).items():
            out = staged.get(name)
            if out is None or out.shape != arr.shape or out.dtype != arr.dtype:
                out = tier.scratch(arr.shape, arr.dtype)
            out[...] = arr
            frozen[name] = out
        n = self.hot_len + self.cold_len  # expired records not yet deleted included: at most n rows
        txn, expiry_cut = tier.reader(), tier.cut

        def merge() -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
            hot_rows = np.flatnonzero(frozen["live"])
            hot_rows = hot_rows[np.argsort(frozen["slot_ids"][hot_rows], kind="stable")]
            hot_ids = frozen["slot_ids"][hot_rows]
            values = tier.scratch((n, dim), self.dtype)
            slots = {k: tier.scratch((n, dim), holder.slots[k].dtype) for k in row_slots}
            meta = {k: tier.scratch((n,), tier.record[k]) for k in _RECORD_META}
            ids_out = tier.scratch((n,), np.dtype(np.int64))
            out = 0

            def emit(hot_lo: int, hot_hi: int, ids: np.ndarray, recs: np.ndarray) -> None:
                """Writes hot rows ``[hot_lo, hot_hi)`` (by id) and cold rows ``ids``, merged in id order."""
                nonlocal out
                if hot_hi > hot_lo:
                    hot = _gather_records(tier.record, frozen, hot_rows[hot_lo:hot_hi])
                    ids = np.concatenate([hot_ids[hot_lo:hot_hi], ids])
                    order = np.argsort(ids, kind="stable")
                    ids, recs = ids[order], np.concatenate([hot, recs])[order]
                if out + ids.size > n:
                    raise InternalError(f"table {self.config.table!r}: more rows than {n} to export")
                part = slice(out, out + ids.size)
                ids_out[part] = ids
                values[part] = recs["value"]
                for k in row_slots:
                    slots[k][part] = recs[f"slot_{k}"]
                for k, a in meta.items():
                    a[part] = recs[k]
                out += ids.size

            h = 0  # rows in memory written so far
            for ids, recs in tier.items(txn=txn, cut=expiry_cut):
                at = np.minimum(np.searchsorted(hot_ids, ids), max(hot_ids.size - 1, 0))
                cold = hot_ids[at] != ids if hot_ids.size else np.ones(ids.size, bool)
                ids, recs = ids[cold], recs[cold]  # older copies of rows in memory: skipped
                if not ids.size:
                    continue
                upto, c = int(np.searchsorted(hot_ids, ids[-1])), 0  # the rows in memory below these
                while h < upto:  # at most a chunk of them at a time, with the cold rows below their last
                    hi = min(upto, h + CHUNK_ROWS)
                    cut = int(np.searchsorted(ids, hot_ids[hi - 1])) if hi < upto else ids.size
                    emit(h, hi, ids[c:cut], recs[c:cut])
                    h, c = hi, cut
                if c < ids.size:
                    emit(h, h, ids[c:], recs[c:])
            for lo in range(h, hot_ids.size, CHUNK_ROWS):
                emit(lo, min(hot_ids.size, lo + CHUNK_ROWS), ids_out[:0], np.zeros(0, tier.record))
            if out != n and (out > n or expiry_cut == NO_CUT):
                raise InternalError(f"table {self.config.table!r}: {out} rows exported of the {n} counted")
            if out < n:  # expired records were skipped
                values, ids_out = values[:out], ids_out[:out]
                slots = {k: a[:out] for k, a in slots.items()}
                meta = {k: a[:out] for k, a in meta.items()}
            return values, {**slots, **other_slots}, {"ids": ids_out, **meta, **counters}

        return Export(merge, txn.abort)

    def _records_meta(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return {name: getattr(self, name)[rows] for name in _RECORD_META}

    def _meta(self, ids: np.ndarray, per_row: Any) -> dict[str, np.ndarray]:
        return {
            "ids": ids,
            "last_step": np.ascontiguousarray(per_row["last_step"]),
            "hits": np.ascontiguousarray(per_row["hits"]),
            "last_time": np.ascontiguousarray(per_row["last_time"]),
            **self._counters(),
        }

    def _counters(self) -> dict[str, np.ndarray]:
        """The piece's own bookkeeping arrays (not per row): push count, last sweep, sketch."""
        out = {"clock": np.array(self.clock, np.int64), "last_sweep": np.array(self.last_sweep, np.float64)}
        if self.sketch is not None:
            out["sketch"] = self.sketch.table.copy()
            out["sketch_added"] = np.array(self.sketch.added, np.int64)
        return out

    def load(
        self,
        holder: Holder,
        optimizer: Any,
        values: np.ndarray,
        slots: dict[str, np.ndarray],
        meta: dict[str, np.ndarray],
    ) -> None:
        """Fills an empty piece from ``export``'s arrays (or a checkpoint's, re-cut for this shard).

        Rows beyond the shard's capacity (a restore into fewer shards) are
        evicted by the policy; with a disk tier, the rows beyond memory's share go
        to disk (those the policy would evict first; one write transaction, built
        a chunk at a time, and the choice made a chunk at a time: the arrays may be
        a checkpoint's memory-mapped ones, larger than memory). A sketch of another
        width is folded or tiled into this one's.

        Raises:
            ValueError: arrays that do not match.
            TierFullError: the disk tier cannot take the cold rows.
        """
        ids = np.asarray(meta["ids"], np.int64)
        n = ids.size
        dim = self.config.dim
        if values.shape != (n, dim):
            raise ValueError(f"rows of shape {values.shape} for {n} ids of dim {dim}")
        for k, a in slots.items():
            target = holder.slots.get(k)
            if target is None:
                raise ValueError(f"slot {k!r} is not one of the optimizer's ({sorted(holder.slots)})")
            if target.shape == (self.allocated, dim) and a.shape != (n, dim):
                raise ValueError(f"slot {k!r} has shape {a.shape}, not {(n, dim)}")
        self.clock = int(meta["clock"])
        self._victim_queue = None  # rows with the keys of the arrays loaded
        sweep = np.asarray(meta["last_sweep"], np.float64)
        self.last_sweep = (int(sweep[0]), float(sweep[1]))
        if self.sketch is not None and "sketch" in meta:
            saved = CountMinSketch(meta["sketch"].shape[1])
            saved.table = np.asarray(meta["sketch"], np.uint16).copy()
            saved.added = int(meta.get("sketch_added", 0))
            self.sketch.merged([saved])
        last_step = np.asarray(meta["last_step"], np.int64)
        hits = np.asarray(meta["hits"], np.int64)
        last_time = np.asarray(meta["last_time"], np.float64)
        if self.budget is not None and n > self.nfree:  # up to an equal share of the budget for now
            self._claim(min(n - self.nfree, (self.budget.fair() - self.claimed) // self.row_bytes))
        elif self.tier is None and not self.config.capacity and n > self.allocated:
            self._grow(holder, optimizer, n)
        keys = [hits, last_step, ids] if self.config.lfu else [last_step, ids]
        if n <= self.nfree:
            keep = np.arange(n)
        elif self.tier is None:  # more rows than memory holds: keep those the policy would keep longest
            drop = _smallest(np.arange(n), keys, n - self.nfree)
            self.stats.evicted += drop.size
            mask = np.ones(n, bool)
            mask[drop] = False
            keep = np.flatnonzero(mask)
        else:  # the others go to disk, a chunk at a time: the arrays may be larger than memory
            keep = _largest(n, keys, self.nfree)
            hot = np.zeros(n, bool)
            hot[keep] = True
            fields = {"last_step": last_step, "hits": hits, "last_time": last_time, "value": values}
            fields.update({f"slot_{k}": a for k, a in slots.items()})
            record = self.tier.record

            def cold_chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
                for start in range(0, n, CHUNK_ROWS):
                    sel = start + np.flatnonzero(~hot[start : start + CHUNK_ROWS])
                    yield ids[sel], _gather_records(record, fields, sel)

            self.tier.write_chunks(n - keep.size, cold_chunks())
        rows = self._take(keep.size)
        self.index.insert(ids[keep], rows)
        self.slot_ids[rows] = ids[keep]
        self.last_step[rows] = last_step[keep]
        self.hits[rows] = hits[keep]
        self.last_time[rows] = last_time[keep]
        self.live[rows] = True
        for k, a in slots.items():
            target = holder.slots[k]
            if target.shape != (self.allocated, dim):
                holder.slots[k] = np.array(a, dtype=target.dtype).reshape(target.shape)
        row_slots = [
            (holder.slots[k], a) for k, a in slots.items() if holder.slots[k].shape == (self.allocated, dim)
        ]
        # A chunk at a time: a copy of every kept row at once would be a second budget's worth of memory,
        # which the shard's malloc settings then keep (``pscore.memory.tune_malloc``).
        for start in range(0, keep.size, CHUNK_ROWS):
            part, at = rows[start : start + CHUNK_ROWS], keep[start : start + CHUNK_ROWS]
            holder.state[0][part] = values[at]
            for target, a in row_slots:
                target[part] = a[at]


def _gather_records(record: np.dtype, fields: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """The disk tier's records (dtype ``record``) of ``rows``, each field from the array of its name."""
    out = np.empty(rows.size, record)
    for name in record.names or ():
        out[name] = fields[name][rows]
    return out


def _largest(total: int, keys: list[np.ndarray], n: int) -> np.ndarray:
    """Positions (ascending) of the ``n`` of ``0..total-1`` largest by ``keys``: those ``_smallest`` leaves.

    A tournament over chunks of at least ``n`` positions: it holds about
    ``2 x max(n, _SELECT_CHUNK)`` positions at once, not ``total`` (the keys may be memory
    maps of a checkpoint with more rows than memory holds).
    """
    best = np.zeros(0, np.int64)
    step = max(n, _SELECT_CHUNK)
    for start in range(0, total, step):
        cand = np.concatenate([best, np.arange(start, min(total, start + step))])  # ascending
        if cand.size > n:
            cand = cand[~np.isin(cand, _smallest(cand, keys, cand.size - n), assume_unique=True)]
        best = cand
    return best


def _smallest(candidates: np.ndarray, keys: list[np.ndarray], n: int) -> np.ndarray:
    """The ``n`` candidates smallest by ``keys`` (lexicographic; the last key must be distinct).

    One ``np.partition`` pass per key that has ties at the cut: O(len(candidates)).
    """
    if n <= 0:
        return candidates[:0]
    if n >= candidates.size:
        return candidates
    k = keys[0][candidates]
    cut = np.partition(k, n - 1)[n - 1]
    below = candidates[k < cut]
    tied = candidates[k == cut]
    if below.size + tied.size == n or len(keys) == 1:
        return np.concatenate([below, tied[: n - below.size]])
    return np.concatenate([below, _smallest(tied, keys[1:], n - below.size)])
