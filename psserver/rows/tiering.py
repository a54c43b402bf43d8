"""A piece's disk tier: where its rows live (memory or disk, each row in one), a push's fill of its cold
rows and spill of others (``tier_step``), and the rows in memory as the tier's records."""

from __future__ import annotations

import functools
from collections.abc import Generator
from typing import Any

import numpy as np

from pscore.errors import ResourceExhaustedError
from psserver.hashindex import EMPTY, HashIndex
from psserver.rows.budget import MIN_HOT_ROWS
from psserver.rows.config import EVICT_SLACK, Holder, Work
from psserver.tier import (
    Cut,
    ReadCost,
    TierBudget,
    TierConfig,
    TierFullError,
    anonymous_array,
    higher_cut,
    record_dtype,
)

_VICTIM_QUEUE = 8  # a tiered piece chooses the victims of this many spills at once (``_spill_victims``)
_QUEUE_WINDOW = 4096  # the victim queue's rows a spill checks first, at least (``_queued_victims``)
# A spill takes at least this many rows more than it needs (``spill_slack``), or an eighth of memory's if
# fewer: a spill costs about 0.2 ms besides 0.3 us a row (its numpy calls, the store's write and commit),
# and ``limit // EVICT_SLACK`` extra rows made a small piece spill at every push or two.
_SPILL_MIN_ROWS = 2048
_EXPIRE_BATCH = 2048  # expired records a push deletes from the disk tier at most (per expiry index)
RECORD_META = ("last_step", "hits", "last_time")  # a row's bookkeeping, as the disk tier's records hold it
_NO_PLACE = np.iinfo(np.int32).max  # ``disk_place`` holds places below this (a larger one: not kept)
_PLACES_CHUNK = 1 << 18  # the id index's places ``_places_now`` looks at at once


def on_disk_entries(places: np.ndarray | None, n: int) -> np.ndarray:
    """The id index's values for ids whose rows are on disk only, from their places in the disk tier's
    index (-1 or None: not known): ``-3 - place``, so every such value is below -1 (-1: absent)."""
    if places is None:
        return np.full(n, -2, np.int64)
    return -3 - np.maximum(places, -1)


def spill_slack(limit: int) -> int:
    """The rows a push of a piece holding ``limit`` rows in memory claims or spills more than it needs:
    ``limit // EVICT_SLACK``, and at least ``_SPILL_MIN_ROWS`` or an eighth of them."""
    return max(limit // EVICT_SLACK, min(limit // 8, _SPILL_MIN_ROWS))


def disk_places(values: np.ndarray) -> np.ndarray:
    """The disk tier's index places kept in the id index's values (``on_disk_entries``; -1: none)."""
    return np.where(values <= -2, -3 - values, -1)


def keep_disk_places(index: HashIndex, at: np.ndarray, ids: np.ndarray, places: np.ndarray) -> None:
    """Keeps the places a read found ``ids``' records at (``places``) in their id index entries at ``at``
    (places in ``index`` found before the read; -1: none), where those entries are still the ids' and
    still on disk only: a place kept goes stale when the tier's index grows (another table), and the
    next read of the id would look it up again."""
    look = np.where(at >= 0, at, index.size)  # the place after the buckets holds no id but ``EMPTY``'s
    ok = (at >= 0) & (np.take(index.keys, look) == ids) & (np.take(index.vals, look) <= -2)
    index.vals[at[ok]] = on_disk_entries(places[ok], 0)


class TierSteps:
    """``DynamicRows``' disk tier (``attach_tier``): its pushes' fills and spills."""

    def attach_tier(
        self, tier: TierConfig, name: str, holder: Holder, budget: TierBudget, optimizer: Any
    ) -> None:
        """Gives this (new, empty) piece its disk tier (the configured store: the log or LMDB) named after
        piece ``name``, and its first claim on the shard's ``budget``: its sketch and ``MIN_HOT_ROWS`` rows
        (overdrawn if the budget is spent: the pieces over an equal share give it back at the next update).

        Raises:
            ValueError: an equal share of the budget, this piece counted, is less than that (the message
                says what the table needs).
            TierDirError: the environment cannot be created.
        """
        self.row_bytes, sketch = self.memory_cost(self.config, self.dtype, optimizer)
        floor = sketch + MIN_HOT_ROWS * self.row_bytes
        share = budget.total // (budget.pieces + 1)
        if share < floor:
            raise ValueError(
                f"--table-memory {budget.total} bytes shared by {budget.pieces + 1} tables gives each "
                f"{share}, and table {self.config.table!r} needs {floor} to start ({MIN_HOT_ROWS} rows of "
                f"{self.row_bytes} bytes with slots and bookkeeping, plus {sketch} bytes of sketch); raise "
                "--table-memory"
            )
        dim = self.config.dim
        row_slots = {k: a.dtype for k, a in holder.slots.items() if a.shape == (self.allocated, dim)}
        record = record_dtype(dim, self.dtype, row_slots)
        c = self.config
        expiry = [kind for kind, ttl in (("last_step", c.ttl_steps), ("last_time", c.ttl_seconds)) if ttl]
        self.tier = tier.open_piece(name, record, c.table, expiry)
        # One index for both tiers: an id maps to its row in memory (>= 0), or, once spilled, to its record's
        # place in the tier's index (``on_disk_entries``). It holds every id the piece spilled, so its
        # arrays live in files, as the tier's own index does (the page cache's pages, not the budget's).
        self.index = HashIndex(0, self.tier.index_zeros)
        if self.tier.stamps is not None:
            self.disk_stamps = anonymous_array((self.allocated,), self.tier.stamps)
        self.budget = budget
        self.sketch_bytes = budget.claim(sketch, overdraw=True)
        budget.pieces += 1
        self._claim(MIN_HOT_ROWS, up_to_fair=True)

    def close(self) -> None:
        """Closes and removes the disk tier and gives back its claim (the piece is dropped)."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self.budget is not None:
            self.budget.release(self.claimed)
            self.budget.pieces -= 1
            self.budget = None

    def tier_step(self, holder: Holder, ids: np.ndarray, now: float) -> Generator[Work, Any, np.ndarray]:
        """A push's tier step, before steps 1-5 (``prepare``): afterwards every row of the push that
        exists is in memory, and there is room in memory for the ids the push admits. Returns each id's
        row now (-1 for a new id), ``plan``'s ``found`` (``prepare`` then does not look them up again).

        One batched read finds the push's cold rows; if memory has too little room
        for them and the admitted new ids, the piece claims more of the shard's
        budget (``_claim``), and if that is not enough, rows not in the push are
        spilled (by the table's eviction policy, ``spill_slack`` extra at once); a due expiry
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
        if self.index.needs_rebuild(ids.size):  # the push inserts at most its ids: room first, or fail now
            self.index = yield self.index.nbytes, functools.partial(self._index_grown, ids.size)
        if tier.index_epoch != self.places_epoch:  # the tier's index grew: the places kept are stale
            epoch = tier.index_epoch
            yield self.index.nbytes, self._places_now
            self.places_epoch = epoch
        found, probe = self.index.lookup(ids)  # the fill's insert below reads no bucket again
        where = probe.places if probe is not None else self.index.positions(ids)  # each id's place (-1: none)
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
        reads = functools.partial(self._tier_reads, cold_ids, disk_places(found[cold_pos]), batch_cut)
        on_disk, records, dead, cost, places, batch = yield nbytes, reads
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
            room += self._claim(need - room + spill_slack(self.limit), up_to_fair=True)
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
            victims = self._by_id(self._spill_victims(candidates, need - room + spill_slack(self.limit)))
        gone = self.slot_ids[expired_hot[self.on_disk[expired_hot]]]  # their older copies go too
        if outdated.size and victims.size:
            outdated = np.setdiff1d(outdated, victims, assume_unique=True)
        deletes = (expired_cold, gone, self.slot_ids[outdated])
        spilled = None
        if victims.size or any(d.size for d in deletes):
            nbytes = victims.size * tier.record.itemsize + sum(d.nbytes for d in deletes)
            spilled = yield nbytes, functools.partial(self._spill, holder, victims, deletes)
        # Nothing below fails.
        tier.cut, tier.expiring = cut, expiring
        self.on_disk[outdated] = False
        self.stale -= outdated.size
        if sweep:
            self.last_sweep = (clock, now)
            if expired_hot.size:
                self._release(expired_hot)
        self.stats.expired += expired_hot.size + expired_cold.size
        if victims.size:  # their entries now point at their records
            self._release(victims, on_disk=on_disk_entries(spilled, victims.size))
        assert need <= self.nfree, "the claim and the spill made room for every row of the push"
        # Entries found (a removal or a value's change moves no other entry): the push's ids that were on
        # disk once and are no more (expired, deleted) go, as new ids; those filled point at their rows.
        lost = cold_pos[~on_disk]
        lost = lost[where[lost] >= 0]
        if lost.size:
            self.index.remove(where[lost])
            found[lost] = -1
        if expired_cold.size:  # deleted from disk now: their entries go too (the push's own went above)
            left = self.index.positions(expired_cold)
            self.index.remove(left[left >= 0])
        if fill_ids.size:
            rows = self._take(fill_ids.size)
            filled = cold_pos[on_disk]
            known = where[filled] >= 0
            self.index.vals[where[filled[known]]] = rows[known]  # no insert: the value at the place found
            if not known.all():
                self.index.insert(fill_ids[~known], rows[~known], probe, filled[~known])
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
            self.disk_place[rows] = np.where(places < _NO_PLACE, places, -1)  # a hint for their spill
            if self.disk_stamps is not None:
                for k in self.disk_stamps.dtype.names or ():
                    self.disk_stamps[k][rows] = records[k]
            self.stale += fill_ids.size
            tier.stats.filled += fill_ids.size
            found[cold_pos[on_disk]] = rows  # ``index.get``'s own array
        return found  # rows spilled or expired were none of the push's: only the filled ids' rows changed

    def _tier_reads(
        self, ids: np.ndarray, places: np.ndarray, batch_cut: Cut | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReadCost, np.ndarray, np.ndarray | None]:
        """``tier_step``'s disk reads (it may run in a worker thread): ``ColdTier.read`` of the cold
        ``ids`` (at their ``places`` as the id index keeps them; counted by the caller; with the records'
        places in the store's index), then, with ``batch_cut``, a batch of the expired records' ids
        (``ColdTier.expired``)."""
        assert self.tier is not None
        batch = None if batch_cut is None else self.tier.expired(*batch_cut, limit=_EXPIRE_BATCH)
        return *self.tier.read(ids, places=places), batch

    def _places_now(self) -> None:
        """Keeps in the id index's entries of ids on disk only their places in the tier's index now
        (``keep_disk_places``), ``_PLACES_CHUNK`` places at a time (a few MiB of temporaries, whatever the
        ids on disk). Any thread: the push holds the piece; a lookup's ``read_end`` meanwhile only keeps
        places too."""
        assert self.tier is not None
        index = self.index
        for lo in range(0, index.size, _PLACES_CHUNK):
            hi = min(index.size, lo + _PLACES_CHUNK)
            at = lo + np.flatnonzero((index.vals[lo:hi] <= -2) & (index.keys[lo:hi] != EMPTY))
            if at.size:
                on_disk_ids = index.keys[at]
                keep_disk_places(index, at, on_disk_ids, self.tier.places_of(on_disk_ids))

    def _index_grown(self, pushed: int) -> HashIndex:
        """The id index rebuilt for a push of ``pushed`` ids (any thread: it reads the piece).

        Raises:
            TierFullError: the disk cannot hold the larger index (nothing changed).
        """
        try:
            return self.index.rebuilt(self.index.live + pushed)
        except OSError as err:
            raise TierFullError(
                f"table {self.config.table!r}: its id index cannot grow on the disk tier's disk "
                f"({err.strerror or err}); nothing was applied. Free disk space, raise --table-memory, or "
                "add shards"
            ) from None

    def _spill(self, holder: Holder, rows: np.ndarray, deletes: tuple[np.ndarray, ...]) -> np.ndarray | None:
        """``tier_step``'s write (it may run in a worker thread): ``rows`` in memory go to disk, over
        their older copies, and the ``deletes`` ids' records go, in one transaction (``ColdTier.write``,
        whose places it returns). Reads the rows, changes nothing in memory."""
        assert self.tier is not None
        records = self._records(holder, rows)
        return self.tier.write(
            self.slot_ids[rows], records, delete=deletes, older=self._older(rows), places=self._places(rows)
        )

    def _by_id(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` in the order of their ids where the store writes faster so (``ColdTier.key_ordered``): a
        spill's records are then gathered in the disk's key order. The log appends in any order."""
        if self.tier is None or not self.tier.key_ordered:
            return rows
        return rows[np.argsort(self.slot_ids[rows])]

    def _places(self, rows: np.ndarray) -> np.ndarray:
        """``ColdTier.write``'s ``places`` for spilling ``rows``: where the store's index held each older
        copy's id when it was read (-1: no older copy, or not known)."""
        return np.where(self.on_disk[rows], self.disk_place[rows], -1)

    def _older(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``ColdTier.write``'s ``older`` for spilling ``rows``: those with an older copy, their stamps."""
        if self.disk_stamps is None:
            return None
        rows = rows[self.on_disk[rows]]
        return self.slot_ids[rows], self.disk_stamps[rows]

    def _records(self, holder: Holder, rows: np.ndarray) -> np.ndarray:
        """The disk tier's records of rows in memory."""
        assert self.tier is not None
        return gather_records(self.tier.record, self._hot_arrays(holder), rows)

    def _hot_arrays(self, holder: Holder) -> dict[str, np.ndarray]:
        """The arrays of the rows in memory (up to ``limit``) that an export of a tiered piece copies, by
        record field."""
        dim, n = self.config.dim, self.limit
        out = {name: getattr(self, name)[:n] for name in ("live", "slot_ids", *RECORD_META)}
        out["value"] = holder.state[0][:n]
        for k, a in holder.slots.items():
            if a.shape == (self.allocated, dim):
                out[f"slot_{k}"] = a[:n]
        return out

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
            got = self._queued_victims(q, candidates, n)
            if got is not None:
                return got
        pool = np.flatnonzero(candidates)
        chosen = self.victims(pool, min(pool.size, _VICTIM_QUEUE * n))
        chosen = chosen[_lru_order(self.last_step[chosen], self.slot_ids[chosen])]  # in the policy's order
        self._victim_queue = (chosen, self.slot_ids[chosen].copy(), self.last_step[chosen].copy())
        return chosen[:n]

    def _queued_victims(
        self, q: tuple[np.ndarray, np.ndarray, np.ndarray], candidates: np.ndarray, n: int
    ) -> np.ndarray | None:
        """The first ``n`` rows of the victim queue ``q`` still queued (unchanged) and ``candidates``, or
        None if it has fewer. The queue is looked at from its head in windows, each twice the last (a
        spill takes its victims from the head: checking all of the queue's ~8 spills' rows every spill
        was most of its cost); its changed rows at the head leave it."""
        rows, ids, steps = q
        found: list[np.ndarray] = []
        have, first, lo, width = 0, -1, 0, max(2 * n, _QUEUE_WINDOW)
        while have < n and lo < rows.size:
            hi = min(rows.size, lo + width)
            r = rows[lo:hi]
            valid = self.live[r] & (self.slot_ids[r] == ids[lo:hi]) & (self.last_step[r] == steps[lo:hi])
            valid &= r < candidates.size  # rows past a shrunk limit were spilled by the shrink
            if first < 0 and valid.any():
                first = lo + int(np.argmax(valid))
            usable = np.flatnonzero(valid & candidates[np.minimum(r, candidates.size - 1)]) + lo
            found.append(usable)
            have += usable.size
            lo, width = hi, 2 * width
        if have < n:
            return None
        keep = slice(first, None)  # a queue with a usable row has a first valid one
        self._victim_queue = (rows[keep], ids[keep], steps[keep])
        return rows[np.concatenate(found)[:n]]


def _lru_order(steps: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The order of rows by last step, ties by id (distinct): ``np.lexsort([ids, steps])``. Steps within a
    span of 2**15 are sorted as int16 after the ids (numpy's stable sort of 16-bit integers is a radix
    sort): half the CPU of the lexsort for a victim queue of ~15k rows."""
    if steps.size and int(steps.max()) - int(steps.min()) < 1 << 15:
        by_id = np.argsort(ids)
        return by_id[np.argsort((steps[by_id] - steps.min()).astype(np.int16), kind="stable")]
    return np.lexsort([ids, steps])


def gather_records(record: np.dtype, fields: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """The disk tier's records (dtype ``record``) of ``rows`` (rows of the arrays: not checked), each field
    from the array of its name."""
    out = np.empty(rows.size, record)
    for name in record.names or ():  # into the field's (strided) view: no gathered copy in between
        np.take(fields[name], rows, axis=0, out=out[name], mode="clip")  # "raise" would buffer it
    return out
