"""A tiered piece's memory budget: the bytes a row and the piece hold in memory, the rows a budget holds,
and the piece's claim on the shard's ``TierBudget`` (claimed as it grows, given back by ``shrink``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from psserver.rows.config import Config, Holder, pow2
from psserver.sketch import SKETCH_ROWS
from psserver.tier import release_rows

# Memory per hot row besides its value and slots: slot_ids, last_step, hits, last_time (8 B each), live (1),
# the free stack (8), the hash index at its fullest (4 entries of 17 B per live row after a rebuild)
# and its tier flag (on_disk: 1) and its older copy's place in the tier's index (disk_place: 4); with a TTL,
# its older copy's stamps (disk_stamps: 8 B per TTL kind).
_ROW_BOOKKEEPING_BYTES = 4 * 8 + 1 + 1 + 4 + 8 + 4 * 17
MIN_HOT_ROWS = 64


class RowBudget:
    """``DynamicRows``' memory: its bytes, and with a disk tier its claim on the shard's budget."""

    @staticmethod
    def memory_cost(config: Config, dtype: np.dtype, optimizer: Any) -> tuple[int, int]:
        """``(bytes per row, bytes besides)`` a tiered piece holds in memory: a row's value, row slots and
        bookkeeping; the admission sketch."""
        dim = config.dim
        row = np.zeros((1, dim), dtype)
        slots = optimizer.init_slots(row)
        per_row = row.nbytes + sum(a.nbytes for a in slots.values() if a.shape == (1, dim))
        per_row += _ROW_BOOKKEEPING_BYTES + 8 * (bool(config.ttl_steps) + bool(config.ttl_seconds))
        sketch = SKETCH_ROWS * pow2(config.sketch_width) * 2 if config.min_count > 1 else 0
        return per_row, sketch

    @staticmethod
    def hot_rows_for(config: Config, dtype: np.dtype, optimizer: Any, memory_bytes: int) -> int:
        """How many rows fit an in-memory budget of ``memory_bytes`` (values, row slots, bookkeeping,
        the admission sketch).

        Raises:
            ValueError: the budget does not hold ``MIN_HOT_ROWS`` rows (the message gives the bytes per row).
        """
        per_row, sketch = RowBudget.memory_cost(config, dtype, optimizer)
        rows = (memory_bytes - sketch) // per_row
        if rows < MIN_HOT_ROWS:
            raise ValueError(
                f"--table-memory {memory_bytes} bytes holds {max(0, rows)} rows of table {config.table!r} "
                f"({per_row} bytes each with slots and bookkeeping, plus {sketch} bytes of sketch); "
                f"at least {MIN_HOT_ROWS} are needed"
            )
        return int(rows)

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
        """Gives ``rows`` rows of the piece's claim back to the budget (keeping ``MIN_HOT_ROWS``): the rows
        in memory above the new limit are spilled (one write transaction) and their pages given back.
        Returns the rows given. Call it with the piece's updates held back (its lock).

        Raises:
            TierFullError: the disk tier cannot take the spilled rows (nothing changed).
        """
        assert self.budget is not None and self.tier is not None
        new = max(MIN_HOT_ROWS, self.limit - rows)
        if new >= self.limit:
            return 0
        tail = self._by_id(new + np.flatnonzero(self.live[new : self.limit]))
        tier_ids, records = self.slot_ids[tail], self._records(holder, tail)
        self.tier.write(tier_ids, records, older=self._older(tail), places=self._places(tail))
        # Nothing below fails.
        self._release(tail)
        free = self.free[: self.nfree]
        free = free[free < new]
        self.free[: free.size] = free
        self.nfree = free.size
        per_row = [self.slot_ids, self.last_step, self.hits, self.last_time, self.live, self.on_disk]
        per_row.append(self.disk_place)
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
