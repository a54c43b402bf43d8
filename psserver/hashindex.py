"""A hash map from int64 ids to int64 values in numpy arrays, batched (a dynamic table piece's id -> row,
a log-structured disk tier's id -> record position)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pscore.placement import mix64

_MIN_INDEX = 16
_INDEX_SEED = 1  # hash seeds: the shard rule uses seed 0, the index 1, a dynamic table's sketch rows 2-5

_EMPTY, _FULL, _TOMB = 0, 1, 2
_PROBE_WINDOW = 16  # places a probe reads per round (``HashIndex.positions``, ``insert``)
_NARROW_ABOVE = 4096  # a later round of more ids than this reads one place each, as every first round


def _next_width(probing: int) -> int:
    """A later probe round's window for ``probing`` ids (``HashIndex.positions``)."""
    return 1 if probing > _NARROW_ABOVE else _PROBE_WINDOW


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class HashIndex:
    """A hash map from int64 ids to int64 values (open addressing, linear probing, tombstones).

    Each operation takes a batch of ids and runs in probe rounds, each round a
    few numpy operations over the ids still probing; the table is kept at most
    3/4 full (live entries and tombstones), so rounds are few. Rebuilt (and
    grown as needed) when it would pass that.

    >>> index = HashIndex(4)
    >>> index.insert(np.array([10, -7]), np.array([0, 1]))
    >>> index.get(np.array([-7, 3, 10]))
    array([ 1, -1,  0])
    """

    def __init__(self, max_live: int = 0, zeros: Callable[[int, type], np.ndarray] | None = None) -> None:
        self._zeros = zeros or np.zeros  # makes its arrays (a log tier's: in files, the page cache's pages)
        self._alloc(max(_MIN_INDEX, _pow2(2 * max_live)))

    def _alloc(self, size: int) -> None:
        self.keys = self._zeros(size, np.int64)
        self.vals = self._zeros(size, np.int64)
        self.state = self._zeros(size, np.uint8)
        self.mask = size - 1
        self.live = 0
        self.tombs = 0

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes + self.state.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids, _INDEX_SEED) & np.uint64(self.mask)).astype(np.int64)

    def _window(self, p: np.ndarray, width: int) -> np.ndarray:
        """A probe round's places: the ``width`` places from each of ``p`` on (wrapping), a row per id."""
        return (p[:, None] + np.arange(width)) & self.mask

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Where each id is in the table (-1: absent).

        Each round reads a window of ``_PROBE_WINDOW`` places per id still probing (a 2-D gather):
        a probe ends at its id or at an empty place, the first of either in its window. Probes run
        long when a table that churns (a tiered piece's fills and spills) holds many tombstones: one
        place per round took 14-35 rounds and 330-700 us for 400 ids in a 262,144-place table. The
        first round, and a round of more than ``_NARROW_ABOVE`` ids (a rebuild, a restore), read one
        place each: in a table without many tombstones most probes end at their home place, and a
        window would read 16 places for each (a piece in memory took 10-30 % longer a step so).
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        found = np.full(ids.size, -1, np.int64)
        todo = np.arange(ids.size)
        p = self._home(ids)
        want = ids
        width = 1  # the first round: most probes end at their home place
        while todo.size:
            window = self._window(p, width)
            st = self.state[window]
            hit = (st == _FULL) & (self.keys[window] == want[:, None])
            stop = hit | (st == _EMPTY)
            first = stop.argmax(axis=1)  # the first place the probe ends at (0 where none in the window)
            rows = np.arange(todo.size)
            ended = stop[rows, first]
            got = hit[rows, first]
            found[todo[got]] = window[rows[got], first[got]]
            go_on = ~ended
            todo, want = todo[go_on], want[go_on]
            p = (p[go_on] + width) & self.mask
            width = _next_width(todo.size)
        return found

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The value of each id (-1: absent)."""
        pos = self.positions(ids)
        out = np.full(pos.size, -1, np.int64)
        have = pos >= 0
        out[have] = self.vals[pos[have]]
        return out

    def insert(self, ids: np.ndarray, vals: np.ndarray) -> None:
        """Adds distinct ids that are absent, with their values."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        vals = np.asarray(vals, np.int64).reshape(-1)
        if not ids.size:
            return
        if (self.live + self.tombs + ids.size) * 4 > self.keys.size * 3:
            self._rebuild(self.live + ids.size)
        todo = np.arange(ids.size)
        p = self._home(ids)
        width = 1
        while todo.size:  # each round: the first free place in each id's window (as ``positions``)
            window = self._window(p, width)
            free = self.state[window] != _FULL
            first = free.argmax(axis=1)
            rows = np.arange(todo.size)
            has = free[rows, first]
            cand = rows[has]
            taken, pick = np.unique(window[cand, first[cand]], return_index=True)  # one id per free place
            winners = cand[pick]
            self.tombs -= int(np.count_nonzero(self.state[taken] == _TOMB))
            self.state[taken] = _FULL
            self.keys[taken] = ids[todo[winners]]
            self.vals[taken] = vals[todo[winners]]
            placed = np.zeros(todo.size, bool)
            placed[winners] = True
            # An id that lost its place to another looks at the same window again; one whose window
            # had no free place, at the next window.
            p = np.where(has, p, (p + width) & self.mask)
            todo, p = todo[~placed], p[~placed]
            width = _next_width(todo.size)
        self.live += ids.size

    def remove(self, positions: np.ndarray) -> None:
        """Removes the entries at ``positions`` (from ``positions``; each present, distinct)."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        self.state[positions] = _TOMB
        self.live -= positions.size
        self.tombs += positions.size

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """The live ``(ids, values)``."""
        full = self.state == _FULL
        return self.keys[full], self.vals[full]

    def needs_rebuild(self, more: int) -> bool:
        """Whether inserting ``more`` ids would rebuild the table first (``insert``)."""
        return (self.live + self.tombs + more) * 4 > self.keys.size * 3

    def rebuilt(self, live_after: int) -> HashIndex:
        """A new table of this one's entries without its tombstones, sized for ``live_after`` live entries
        (the same size while half of it holds them). Reads this one and changes nothing: another thread
        may run it while nothing updates this one."""
        keys, vals = self.items()
        size = self.keys.size
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
        self.keys, self.vals, self.state, self.mask = new.keys, new.vals, new.state, new.mask
        self.live, self.tombs = new.live, new.tombs
