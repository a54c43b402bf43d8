"""One dynamic table piece (``DynamicRows``): its state, the id -> row map and the per-row bookkeeping,
and the free rows; the jobs on it are the mixins' it is made of, one module each."""

from __future__ import annotations

import numpy as np

from psproto.v1 import ps_pb2
from psserver.hashindex import HashIndex
from psserver.rows.budget import RowBudget
from psserver.rows.config import Config, Stats
from psserver.rows.export import Exports
from psserver.rows.growth import Growth
from psserver.rows.push import PushSteps
from psserver.rows.reads import RowReads
from psserver.rows.tiering import TierSteps
from psserver.sketch import CountMinSketch
from psserver.tier import ColdTier, TierBudget, anonymous_array

_INITIAL_ROWS = 1024  # an unbounded table's first allocation (rows per shard); it doubles when full


class DynamicRows(RowReads, PushSteps, TierSteps, Growth, Exports, RowBudget):
    """The hash table and bookkeeping of one dynamic table piece (see ``psserver.rows``).

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
        # Where the disk tier's index held that copy's id when the fill read it (``ColdTier.read``'s places;
        # -1: not known): its next spill's hint (``ColdTier.write``), checked there.
        self.disk_place = zeros(rows, np.int32)
        self.places_epoch = 0  # the disk tier's ``index_epoch`` when the index's entries took their places
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

    def _take(self, n: int) -> np.ndarray:
        rows = self.free[self.nfree - n : self.nfree][::-1].copy()
        self.nfree -= n
        return rows

    def _release(self, rows: np.ndarray, on_disk: np.ndarray | None = None) -> None:
        """Frees ``rows``: their ids leave the index, or, spilled (``on_disk``: their index values now,
        ``tiering.on_disk_entries``), stay in it pointing at their records."""
        at = self.index.positions(self.slot_ids[rows])
        if on_disk is None:
            self.index.remove(at)
        else:
            self.index.vals[at] = on_disk
        self.live[rows] = False
        if self.stale:
            self.stale -= int(np.count_nonzero(self.on_disk[rows]))
            self.on_disk[rows] = False
        self.free[self.nfree : self.nfree + rows.size] = rows
        self.nfree += rows.size
