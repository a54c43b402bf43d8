"""Choosing rows by the eviction policy's keys in one pass: the ``n`` smallest of some rows (the victims
of an eviction or a spill), and the ``n`` largest of more rows than memory holds (a load's rows kept in
memory)."""

from __future__ import annotations

import numpy as np

_SELECT_CHUNK = 1 << 20  # positions a selection over more rows than memory holds takes at once (largest)
_COUNT_FROM = 4096  # values from which a selection's cut among integers of a small span is counted


def largest(total: int, keys: list[np.ndarray], n: int) -> np.ndarray:
    """Positions (ascending) of the ``n`` of ``0..total-1`` largest by ``keys``: those ``smallest`` leaves.

    A tournament over chunks of at least ``n`` positions: it holds about
    ``2 x max(n, _SELECT_CHUNK)`` positions at once, not ``total`` (the keys may be memory
    maps of a checkpoint with more rows than memory holds).
    """
    best = np.zeros(0, np.int64)
    step = max(n, _SELECT_CHUNK)
    for start in range(0, total, step):
        cand = np.concatenate([best, np.arange(start, min(total, start + step))])  # ascending
        if cand.size > n:
            cand = cand[~np.isin(cand, smallest(cand, keys, cand.size - n), assume_unique=True)]
        best = cand
    return best


def smallest(candidates: np.ndarray, keys: list[np.ndarray], n: int) -> np.ndarray:
    """The ``n`` candidates smallest by ``keys`` (lexicographic; the last key must be distinct).

    One ``np.partition`` pass per key that has ties at the cut: O(len(candidates)).
    """
    if n <= 0:
        return candidates[:0]
    if n >= candidates.size:
        return candidates
    k = keys[0][candidates]
    cut = _nth_smallest(k, n - 1)
    below = candidates[k < cut]
    tied = candidates[k == cut]
    if below.size + tied.size == n or len(keys) == 1:
        return np.concatenate([below, tied[: n - below.size]])
    return np.concatenate([below, smallest(tied, keys[1:], n - below.size)])


def _nth_smallest(values: np.ndarray, i: int) -> np.ndarray | int:
    """The ``i``-th smallest of ``values`` (0-based): ``np.partition(values, i)[i]``. Integers whose span is
    at most twice their number (a policy's steps and hits) are counted instead, one bincount and a cumsum:
    a tiered piece's spill chose its victim queue by a partition of ~113k last steps, 1.6 ms of CPU, this
    0.2 ms."""
    if values.dtype.kind == "i" and values.size >= _COUNT_FROM:
        lo, hi = int(values.min()), int(values.max())
        if hi - lo <= 2 * values.size:
            at_most = np.cumsum(np.bincount(values - lo))  # [j]: how many are <= lo + j
            return lo + int(np.searchsorted(at_most, i + 1))
    return np.partition(values, i)[i]
