"""A count-min sketch of int64 ids in numpy arrays: a dynamic table's admission counts (``min_count``)."""

from __future__ import annotations

import numpy as np

from pscore.placement import mix64

_SKETCH_SEEDS = (2, 3, 4, 5)  # hash seeds: the shard rule uses 0, the id index 1
SKETCH_ROWS = len(_SKETCH_SEEDS)
MAX_MIN_COUNT = (1 << 16) - 1  # sketch counters are uint16


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class CountMinSketch:
    """Approximate counts of int64 ids (count-min, 4 rows, conservative update, uint16 counters).

    Never under-counts an id added since the last halving; ``age`` halves every
    counter once ``width`` ids were added since the last halving.

    >>> s = CountMinSketch(1024)
    >>> s.add(np.array([5, 9])), s.add(np.array([5]))
    (array([1, 1], dtype=uint16), array([2], dtype=uint16))
    """

    def __init__(self, width: int) -> None:
        self.width = _pow2(width)
        self.table = np.zeros((SKETCH_ROWS, self.width), np.uint16)
        self.added = 0  # ids added since the last halving

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def _cols(self, ids: np.ndarray) -> np.ndarray:
        mask = np.uint64(self.width - 1)
        return np.stack([(mix64(ids, seed) & mask).astype(np.int64) for seed in _SKETCH_SEEDS])

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        cols = self._cols(ids)
        return self.table[np.arange(cols.shape[0])[:, None], cols].min(axis=0)

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Counts one more occurrence of each (distinct) id; returns their counts, this one included."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if not ids.size:
            return np.zeros(0, np.uint16)
        cols = self._cols(ids)
        rows = np.arange(cols.shape[0])[:, None]
        est = self.table[rows, cols].min(axis=0)
        new = np.minimum(est.astype(np.int64) + 1, MAX_MIN_COUNT).astype(np.uint16)
        for r in range(cols.shape[0]):  # conservative update: raise each counter to the new estimate
            np.maximum.at(self.table[r], cols[r], new)
        self.added += ids.size
        if self.added >= self.width:
            self.table >>= 1
            self.added = 0
        return new

    def merged(self, others: list[CountMinSketch]) -> None:
        """Adds ``others``' counters into this one (columns folded or tiled to this width)."""
        for other in others:
            t = other.table
            if t.shape[1] > self.width:  # fold: id column h % w is the sum of its old columns h % W, ...
                t = t.reshape(t.shape[0], -1, self.width).sum(axis=1, dtype=np.int64)
            elif t.shape[1] < self.width:  # tile: h % W == (h % w) for every old column
                t = np.tile(t, (1, self.width // t.shape[1]))
            self.table = np.minimum(self.table.astype(np.int64) + t, MAX_MIN_COUNT).astype(np.uint16)
            self.added = min(self.width - 1, self.added + other.added)
