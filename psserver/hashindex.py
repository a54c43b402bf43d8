"""A hash map from int64 ids to int64 values in numpy arrays, batched (a dynamic table piece's id -> row,
a log-structured disk tier's id -> record position)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pscore.placement import mix64

_MIN_INDEX = 16  # places
# Ids a lookup or an insert works on at once: each takes ~150 bytes of temporaries (its two buckets' keys
# among them), so a rebuild or a restore of millions of ids runs in chunks, not in gigabytes at once.
_CHUNK = 1 << 16
_INDEX_SEED = 1  # hash seeds: the shard rule uses seed 0, the index 1, a dynamic table's sketch rows 2-5
_BUCKET = 8  # places per bucket: 64 bytes of keys, one cache line
_HIGH = np.uint64(32)  # an id's second bucket comes from its hash's high bits
# The key of an empty place. The id of that value has a place of its own, after the buckets (``_alloc``).
EMPTY = np.iinfo(np.int64).min


def _free_tables() -> tuple[np.ndarray, np.ndarray]:
    """By a bucket's free places as a byte (bit j: place j is free): how many are free, and the place of
    the k-th free one (``_BUCKET`` past the last). Numpy counts along a short axis slowly (a cumsum or
    count_nonzero of 8 booleans a row took 0.3 us a row); a lookup in these takes one gather."""
    count = np.zeros(256, np.int64)
    kth = np.full((256, _BUCKET), _BUCKET, np.int64)
    for byte in range(256):
        free = [j for j in range(_BUCKET) if byte >> j & 1]
        count[byte] = len(free)
        kth[byte, : len(free)] = free
    return count, kth


_FREE_COUNT, _KTH_FREE = _free_tables()
_LOWEST_BIT = np.ascontiguousarray(_KTH_FREE[:, 0])  # by a byte: its lowest set bit (8 for none)


# A bucket's 8 booleans (bytes 0 or 1) read as one little-endian uint64, times this, have bit j of their
# top byte set where place j is (each byte's 1 lands on its own bit there, no carries): np.packbits took
# 20 us for 400 ids' two buckets, this one multiply and shift 1 us.
_PACK = np.uint64(0x0102040810204080)
_TOP_BYTE = np.uint64(56)


def _free_bytes(free: np.ndarray) -> np.ndarray:
    """Rows of a bucket's places' booleans (``(..., _BUCKET)``: free ones, or those holding an id) as bytes,
    bit j for place j (``_free_tables``)."""
    bits = np.ascontiguousarray(free).view("<u8")[..., 0]  # a view of ``free``: not changed in place
    return (bits * _PACK) >> _TOP_BYTE


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """What a lookup of a batch read of the table (``HashIndex.lookup``): each id's two buckets and their
    free places then, as bytes (``_free_bytes``). An ``insert`` of some of those ids (absent then) takes
    them instead of reading the buckets again, while the table has only lost entries since (a removed
    entry's place is free all the same: the probe's free places are still free); an insert or a rebuild
    since makes it stale, and ``insert`` reads the buckets itself."""

    both: np.ndarray  # (n, 2): each id's first and second bucket
    free: np.ndarray  # (n, 2): their free places as bytes, when read
    keys: np.ndarray  # the table's keys array then (a rebuild makes another)
    inserts: int  # the table's inserts then
    places: np.ndarray  # each id's place (-1: absent): good while ``keys`` is the table's and it is in


class HashIndex:
    """A hash map from int64 ids to int64 values: buckets of 8 places, two buckets an id, no tombstones.

    Each id may live in either of two buckets (from the high and low bits of
    its hash), and an insert puts it in the emptier one, so buckets fill
    evenly; a lookup of a batch of ids is then one round of a few numpy
    operations: a gather of each id's two buckets (16 places) and a compare.
    A removed entry's place is empty at once (no tombstones: a table that
    churns, a tiered piece's rows filled and spilled every step, probes no
    further than one that does not). In the rare case that both of an id's
    buckets are full it goes to the first bucket after its second one with
    room, and each bucket it passed counts it in ``overflow``; a lookup that
    misses goes on past its second bucket only while the buckets it passes
    count such ids (a removal uncounts them). Kept at most 3/4 full; grown
    (rebuilt) when an insert would pass that. An empty place holds the key
    ``EMPTY`` (so a lookup reads keys only); the id ``EMPTY`` itself has the
    place after the buckets.

    Not thread-safe: the caller serializes changes, and reads beside them.

    >>> index = HashIndex(4)
    >>> index.insert(np.array([10, -7]), np.array([0, 1]))
    >>> index.get(np.array([-7, 3, 10]))
    array([ 1, -1,  0])
    """

    def __init__(self, max_live: int = 0, zeros: Callable[[int, type], np.ndarray] | None = None) -> None:
        self._zeros = zeros or np.zeros  # makes its arrays (a log tier's: in files, the page cache's pages)
        self._alloc(max(_MIN_INDEX, _pow2(2 * max_live)))

    def _alloc(self, size: int) -> None:
        self.keys = self._zeros(size + 1, np.int64)  # the buckets' places, then the place of id ``EMPTY``
        self.keys.fill(EMPTY)
        self.vals = self._zeros(size + 1, np.int64)
        # Per bucket: entries placed after it whose second bucket is it or a bucket before it (see the class)
        self.overflow = self._zeros(size // _BUCKET, np.int64)
        self.mask = size // _BUCKET - 1  # of bucket numbers
        self._keys2 = self.keys[:size].reshape(-1, _BUCKET)
        self.live = 0
        self._inserts = 0  # insert calls (a ``Probe`` read before the last one is stale)
        self.overflowed = 0  # live entries in neither of their buckets
        self.has_empty_id = False  # whether id ``EMPTY`` is in (at place ``size``)

    @property
    def size(self) -> int:
        """Places in the buckets."""
        return self._keys2.size

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes + self.overflow.nbytes

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        """Each id's two buckets, a row ``(first, second)`` per id."""
        h = mix64(ids, _INDEX_SEED)
        mask = np.uint64(self.mask)
        out = np.empty((ids.size, 2), np.int64)
        np.bitwise_and(h, mask, out=out[:, 0], casting="unsafe")
        h >>= _HIGH
        np.bitwise_and(h, mask, out=out[:, 1], casting="unsafe")
        return out

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Where each id is in the table (-1: absent): one gather of each id's two buckets, then, for the
        few ids missing there whose second bucket counts overflowed entries, a bucket at a time after it.
        (A batch's cost is its numpy calls, about 15 for a few thousand ids: no more per call than a
        linear probe's first round.)"""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size > _CHUNK:
            return np.concatenate([self.positions(ids[i : i + _CHUNK]) for i in range(0, ids.size, _CHUNK)])
        return self._find(ids)[0]

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``positions`` of at most ``_CHUNK`` ids (int64, 1-d), each id's two buckets, and the keys of
        those buckets' places (``(n, 2, _BUCKET)``)."""
        n = ids.size
        both = self._buckets(ids)
        # Each of an id's two buckets' places that hold it, as a byte (bit j: place j), whose lowest bit is
        # its place (an argmax over the 16 places and two 2-d gathers took 1.4x as long).
        keys = np.take(self._keys2, both, axis=0)  # (n, 2, _BUCKET)
        bits = _free_bytes(keys == ids[:, None, None])  # (n, 2)
        at = both * _BUCKET + np.take(_LOWEST_BIT, bits)
        in_first = bits[:, 0] != 0
        missed = ~in_first & (bits[:, 1] == 0)
        found = np.where(in_first, at[:, 0], np.where(missed, -1, at[:, 1]))
        if n and ids.min() == EMPTY:  # it matched the empty places: it has its own
            missed[ids == EMPTY] = False
            found[ids == EMPTY] = self.size if self.has_empty_id else -1
        if self.overflowed and n:
            todo = np.flatnonzero(missed)
            at = both[todo, 1]
            for _ in range(self.mask + 1):
                go_on = np.take(self.overflow, at) > 0
                todo, at = todo[go_on], (at[go_on] + 1) & self.mask
                if not todo.size:
                    break
                hit = np.take(self._keys2, at, axis=0) == ids[todo, None]
                first = hit.argmax(axis=1)
                got = hit[np.arange(todo.size), first]
                found[todo[got]] = at[got] * _BUCKET + first[got]
                todo, at = todo[~got], at[~got]
        return found, both, keys

    def positions_hinted(self, ids: np.ndarray, hints: np.ndarray) -> np.ndarray:
        """``positions``, given a hint of each id's place (-1: none; a place read earlier, maybe stale): a
        hint whose place holds the id is its place (an id has one place: no rebuild or removal can make a
        wrong hint pass), and only the ids without a good hint are looked up. One gather and a compare
        where the hints are good, not a hash and two buckets' gather."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        hints = np.asarray(hints, np.int64).reshape(-1)
        places = np.minimum(hints, self.size)  # a hint past a table shrunk by nothing: checked below
        good = (hints >= 0) & (np.take(self.keys, places) == ids)
        # An empty place's key is ``EMPTY``: not that id's place (its own is after the buckets).
        good &= (ids != EMPTY) | ((places == self.size) & self.has_empty_id)
        if good.all():
            return places
        out = np.where(good, places, -1)
        bad = np.flatnonzero(~good)
        out[bad] = self.positions(ids[bad])
        return out

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The value of each id (-1: absent)."""
        pos = self.positions(ids)
        out = np.take(self.vals, pos)
        out[pos < 0] = -1
        return out

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, Probe | None]:
        """``get``, and what it read of the table (``Probe``; None for a batch of more than ``_CHUNK`` ids),
        for an ``insert`` of the absent ones later (a push's new or filled rows) that reads no bucket
        again."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size > _CHUNK:
            return self.get(ids), None
        pos, both, keys = self._find(ids)
        out = np.take(self.vals, pos)
        out[pos < 0] = -1
        return out, Probe(both, _free_bytes(keys == EMPTY), self.keys, self._inserts, pos)

    def insert(
        self, ids: np.ndarray, vals: np.ndarray, probe: Probe | None = None, at: np.ndarray | None = None
    ) -> np.ndarray:
        """Adds distinct ids that are absent, with their values: each in the emptier of its two buckets (the
        other if the batch's own ids fill that one first; past the second if both are full). Returns
        their places (``positions``).

        ``probe``: a ``lookup``'s of ids among which these are ``probe``'s ``at`` (all, in order, without
        ``at``): their buckets as it read them, if still good (``Probe``)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        vals = np.asarray(vals, np.int64).reshape(-1)
        if not ids.size:
            return np.zeros(0, np.int64)
        if self.needs_rebuild(ids.size):
            self._rebuild(self.live + ids.size)
        self._inserts += 1
        if ids.size > _CHUNK:  # distinct ids: one chunk after the other is the same
            chunks = range(0, ids.size, _CHUNK)
            return np.concatenate([self.insert(ids[i : i + _CHUNK], vals[i : i + _CHUNK]) for i in chunks])
        self.live += ids.size
        if probe is not None and (probe.keys is not self.keys or probe.inserts != self._inserts - 1):
            probe = None  # stale: the table changed otherwise than by removals since
        if ids.min() == EMPTY:
            at_empty = ids == EMPTY
            self.vals[self.size] = vals[at_empty][0]
            self.has_empty_id = True
            rest = np.flatnonzero(~at_empty)
            out = np.full(at_empty.size, self.size, np.int64)
            if rest.size:
                out[rest] = self._insert(ids[rest], vals[rest], None, None)
            return out
        return self._insert(ids, vals, probe, at)

    def _insert(
        self, ids: np.ndarray, vals: np.ndarray, probe: Probe | None, at: np.ndarray | None
    ) -> np.ndarray:
        """``insert``'s placing of at most ``_CHUNK`` ids that are not ``EMPTY``; returns their places."""
        out = np.empty(ids.size, np.int64)
        if probe is not None:
            both = probe.both if at is None else probe.both[at]
            free_bytes = probe.free if at is None else probe.free[at]
        else:
            both = self._buckets(ids)
            free_bytes = _free_bytes(np.take(self._keys2, both, axis=0) == EMPTY)  # (n, 2)
        b1, b2 = both[:, 0], both[:, 1]
        free = _FREE_COUNT[free_bytes]
        second = free[:, 1] > free[:, 0]
        first = np.where(second, b2, b1)
        chosen = np.where(second, free_bytes[:, 1], free_bytes[:, 0])
        todo = np.arange(ids.size)[self._place(ids, vals, np.arange(ids.size), first, out, chosen)]
        if todo.size:  # the emptier bucket filled up: the other one
            other = np.where(first[todo] == b1[todo], b2[todo], b1[todo])
            todo = todo[self._place(ids, vals, todo, other, out)]
        at = b2[todo]
        for _ in range(self.mask + 1):  # both full: the buckets after the second, each passed counting it
            if not todo.size:
                break
            np.add.at(self.overflow, at, 1)
            at = (at + 1) & self.mask
            left = self._place(ids, vals, todo, at, out)
            self.overflowed += todo.size - left.size
            todo, at = todo[left], at[left]
        assert not todo.size, "a table at most 3/4 full has room in some bucket"
        return out

    def _place(
        self,
        ids: np.ndarray,
        vals: np.ndarray,
        todo: np.ndarray,
        bucket: np.ndarray,
        out: np.ndarray,
        free_bytes: np.ndarray | None = None,
    ) -> np.ndarray:
        """Puts ``ids[todo]`` (with their values) in the free places of their ``bucket`` (one each), as many
        as a bucket has free places (each one's place into ``out``); returns the indices into ``todo`` of
        those left out. ``free_bytes``:
        each bucket's free places as a byte (``_free_bytes``) if the caller has them (read now)."""
        m = bucket.size
        order = np.argsort(bucket, kind="stable")
        b = bucket[order]
        if free_bytes is None:
            free = _free_bytes(np.take(self._keys2, b, axis=0) == EMPTY)
        else:
            free = free_bytes[order]
        new = np.empty(m, bool)
        new[0] = True
        np.not_equal(b[1:], b[:-1], out=new[1:])
        if new.all():  # one id a bucket: its first free place
            first = _KTH_FREE[free, 0]
            fits = first < _BUCKET
        else:  # the k-th id of a bucket takes its k-th free place
            seq = np.arange(m)
            rank = seq - np.maximum.accumulate(np.where(new, seq, 0))
            fits = rank < _FREE_COUNT[free]
            first = _KTH_FREE[free, np.minimum(rank, _BUCKET - 1)]
        place = b[fits] * _BUCKET + first[fits]
        who = todo[order[fits]]
        self.keys[place] = ids[who]
        out[who] = place
        self.vals[place] = vals[who]
        return order[~fits]

    def remove(self, positions: np.ndarray) -> None:
        """Removes the entries at ``positions`` (from ``positions``; each present, distinct)."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        self.live -= positions.size
        if self.has_empty_id and positions.size and positions.max() == self.size:
            self.has_empty_id = False
            positions = positions[positions != self.size]
        if self.overflowed and positions.size:  # an entry placed past its second bucket is uncounted
            both = self._buckets(self.keys[positions])
            b2 = both[:, 1]
            at = positions // _BUCKET
            far = (at != both[:, 0]) & (at != b2)
            if far.any():
                start, steps = b2[far], (at[far] - b2[far]) & self.mask  # the buckets passed: 1 or more
                ends = np.cumsum(steps)
                passed = start.repeat(steps) + np.arange(ends[-1]) - (ends - steps).repeat(steps)
                np.subtract.at(self.overflow, passed & self.mask, 1)
                self.overflowed -= int(np.count_nonzero(far))
        self.keys[positions] = EMPTY

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """The live ``(ids, values)``."""
        full = self.keys != EMPTY
        full[-1] = self.has_empty_id
        return self.keys[full], self.vals[full]

    def needs_rebuild(self, more: int) -> bool:
        """Whether inserting ``more`` ids would rebuild (grow) the table first (``insert``)."""
        return (self.live + more) * 4 > self.size * 3

    def rebuilt(self, live_after: int) -> HashIndex:
        """A new table of this one's entries, sized for ``live_after`` live entries (the same size while
        half of it holds them). Reads this one and changes nothing: another thread may run it while
        nothing updates this one."""
        keys, vals = self.items()
        size = self.size
        out = HashIndex(0, self._zeros)
        out._alloc(size if 2 * live_after <= size else max(_MIN_INDEX, _pow2(2 * live_after)))
        out.insert(keys, vals)
        return out

    def reserve(self, more: int) -> None:
        """Rebuilds now if inserting ``more`` ids would (``insert`` then changes no array's size): where
        making the arrays can fail, it fails here, before a change."""
        if self.needs_rebuild(more):
            self._rebuild(self.live + more)

    def _rebuild(self, live_after: int) -> None:
        new = self.rebuilt(live_after)
        self.keys, self.vals, self.overflow, self.mask = new.keys, new.vals, new.overflow, new.mask
        self._keys2, self.live, self.overflowed = new._keys2, new.live, new.overflowed
        self.has_empty_id = new.has_empty_id
