"""Reads of a piece's rows: a lookup (the rows in memory copied at once, those on disk read in a batch,
any thread, as of the lookup's start; the initializer's row for ids without one) and a scan by id."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from pscore.embedding import init_rows
from psserver.rows.config import Holder
from psserver.rows.tiering import disk_places, keep_disk_places
from psserver.tier import ReadCost, TierView

if TYPE_CHECKING:
    from psserver.rows.piece import DynamicRows


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
    places: np.ndarray | None = None  # the cold ones' places in the tier's index, as the id index keeps them
    where: np.ndarray | None = None  # the cold ones' places in the id index then (-1: none)
    keys: np.ndarray | None = None  # the id index's keys array then (``where`` holds while it is the same)
    read_places: np.ndarray | None = (
        None  # the found ones' places in the tier's index, as the read found them
    )


class RowReads:
    """``DynamicRows``' reads: they change no row."""

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
        at = self.index.positions(ids)
        slots = np.take(self.index.vals, at)
        slots[at < 0] = -1
        # One gather: the rows of ids not in memory (-1, clipped to row 0) are overwritten by ``read_end``.
        out = np.take(holder.state[0], slots, axis=0, mode="clip")
        cold = np.flatnonzero(slots < 0)
        if self.tier is None:
            return RowRead(self, ids, out, cold, None)
        self.tier.stats.hot_hits += ids.size - cold.size
        if not cold.size:
            return RowRead(self, ids, out, cold, None)
        # cold rows are read (one batched read), not filled; where they are, as the id index keeps it
        view, nbytes = self.tier.view(), cold.size * self.tier.record.itemsize
        return RowRead(
            self,
            ids,
            out,
            cold,
            view,
            nbytes,
            places=disk_places(slots[cold]),
            where=at[cold],
            keys=self.index.keys,
        )

    def read_cold(self, lookup: RowRead) -> None:
        """Reads ``lookup``'s rows on disk, as they were at its ``read_begin``; any thread."""
        if lookup.view is not None:
            assert self.tier is not None
            found, records, _, cost, places = self.tier.read(
                lookup.ids[lookup.cold], remember=True, at=lookup.view, places=lookup.places
            )
            lookup.found, lookup.records, lookup.cost, lookup.read_places = found, records, cost, places

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
            if lookup.where is not None and lookup.read_places is not None and lookup.keys is self.index.keys:
                assert lookup.places is not None
                found = np.flatnonzero(lookup.found)
                new = lookup.read_places != lookup.places[found]  # only the places the entries lack
                if new.any():
                    found, places = found[new], lookup.read_places[new]
                    keep_disk_places(self.index, lookup.where[found], lookup.ids[cold[found]], places)
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
