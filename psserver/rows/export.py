"""A piece's export and load: its rows, slots and bookkeeping as arrays by ascending id, taken at one
instant while pushes go on (checkpoints, backups, ``ExportTable``), and an empty piece filled from them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pscore.errors import InternalError
from psserver.rows.config import Holder
from psserver.rows.select import largest, smallest
from psserver.rows.tiering import RECORD_META, gather_records
from psserver.sketch import CountMinSketch
from psserver.tier import CHUNK_ROWS, NO_CUT


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


class Exports:
    """``DynamicRows``' export and load."""

    def export(self, holder: Holder) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Copies of the live rows, by ascending id: ``(values, slots, bookkeeping arrays)``."""
        finish = self.begin_export(holder)
        try:
            return finish()
        finally:
            finish.close()

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
            meta = {k: tier.scratch((n,), tier.record[k]) for k in RECORD_META}
            ids_out = tier.scratch((n,), np.dtype(np.int64))
            out = 0

            def emit(hot_lo: int, hot_hi: int, ids: np.ndarray, recs: np.ndarray) -> None:
                """Writes hot rows ``[hot_lo, hot_hi)`` (by id) and cold rows ``ids``, merged in id order."""
                nonlocal out
                if hot_hi > hot_lo:
                    hot = gather_records(tier.record, frozen, hot_rows[hot_lo:hot_hi])
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
        return {name: getattr(self, name)[rows] for name in RECORD_META}

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
            drop = smallest(np.arange(n), keys, n - self.nfree)
            self.stats.evicted += drop.size
            mask = np.ones(n, bool)
            mask[drop] = False
            keep = np.flatnonzero(mask)
        else:  # the others go to disk, a chunk at a time: the arrays may be larger than memory
            keep = largest(n, keys, self.nfree)
            hot = np.zeros(n, bool)
            hot[keep] = True
            fields = {"last_step": last_step, "hits": hits, "last_time": last_time, "value": values}
            fields.update({f"slot_{k}": a for k, a in slots.items()})
            record = self.tier.record

            def cold_chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
                for start in range(0, n, CHUNK_ROWS):
                    sel = start + np.flatnonzero(~hot[start : start + CHUNK_ROWS])
                    yield ids[sel], gather_records(record, fields, sel)

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
