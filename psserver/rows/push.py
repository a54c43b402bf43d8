"""A push's plan and its steps 1-5 (see ``psserver.rows``): the rows of its ids, admission, the expiry
sweep, eviction, the rows made; ``update`` runs them in order (after a tiered piece's ``tier_step``),
its heavy steps yielded as ``Work``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Generator
from typing import Any

import numpy as np

from psserver.hashindex import HashIndex
from psserver.rows.config import EVICT_SLACK, Holder, Work, pow2
from psserver.rows.select import smallest

_SWEEPS_PER_TTL = 8  # expiry sweeps per TTL period


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


class PushSteps:
    """``DynamicRows``' push: what it does, worked out ahead (``plan``), and done (``prepare``)."""

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
        an unbounded table's growth (a copy of all its rows) or its id index's growth (a tiered piece's,
        as it holds more rows); a full table's choice of the rows it evicts (a pass over them); the rows made
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
        elif self.tier is None and self.reindex_due(ids.size):  # a tiered piece's ``tier_step`` made room
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
            return PushPlan(self.clock, found, expired, evict=admitted - room + c.capacity // EVICT_SLACK)
        return PushPlan(
            self.clock, found, expired, grow_to=max(2 * self.allocated, pow2(self.hot_len + admitted))
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
        """Whether a push of ``pushed`` distinct ids could make the id index grow itself: ``reindexed``
        first. The push inserts at most that many ids (new rows, and with a disk tier the rows it fills);
        counting the rows it evicts, expires or spills out too would only lower the count the index grows
        by (``HashIndex.needs_rebuild``)."""
        return self.index.needs_rebuild(pushed)

    def reindexed(self, pushed: int) -> HashIndex:
        """The id index rebuilt (grown if need be) for a push of ``pushed`` ids. Reads
        the piece and changes nothing, like ``grown``."""
        return self.index.rebuilt(min(self.index.live + pushed, self.limit))  # never more rows than that

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
                n = new_pos.size - self.nfree + c.capacity // EVICT_SLACK
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

    def victims(self, candidates: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` rows among ``candidates`` the policy evicts first (deterministic: ties by id)."""
        keys = [self.hits, self.last_step] if self.config.lfu else [self.last_step]
        return smallest(candidates, [*keys, self.slot_ids], n)
