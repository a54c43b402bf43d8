"""The id index (``psserver.hashindex``): against a dict through random inserts and removals, its
invariants (each entry in one of its two buckets, or counted by the buckets it passed), and a churn that
never grows it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pscore.placement import mix64
from psserver import hashindex
from psserver.hashindex import _BUCKET, _INDEX_SEED, EMPTY, HashIndex


def _check(index: HashIndex, ref: dict[int, int]) -> None:
    """The index holds exactly ``ref``; no id twice; each entry in one of its buckets, or past its second
    one with every bucket from there to its own counting it in ``overflow``, and nothing else counted."""
    ids, vals = index.items()
    assert len(index) == len(ref) == ids.size == np.unique(ids).size
    assert dict(zip(ids.tolist(), vals.tolist(), strict=True)) == ref
    pos = np.flatnonzero(index.keys[: index.size] != EMPTY)
    h = mix64(index.keys[pos], _INDEX_SEED)
    buckets = index.mask + 1
    b1 = (h & np.uint64(index.mask)).astype(np.int64)
    b2 = ((h >> np.uint64(32)) & np.uint64(index.mask)).astype(np.int64)
    at = pos // _BUCKET
    far = (at != b1) & (at != b2)
    want = np.zeros(buckets, np.int64)
    for start, end in zip(b2[far].tolist(), at[far].tolist(), strict=True):
        b = start
        while b != end:
            want[b] += 1
            b = (b + 1) % buckets
    np.testing.assert_array_equal(index.overflow, want)
    assert index.overflowed == int(np.count_nonzero(far))
    assert index.has_empty_id == (EMPTY in ref)
    probe = np.concatenate([np.array(list(ref), np.int64), np.arange(-3, 3), [EMPTY]])
    np.testing.assert_array_equal(index.get(probe), [ref.get(i, -1) for i in probe.tolist()])


def _colliding(buckets: int, n: int) -> np.ndarray:
    """``n`` ids whose two buckets (in a table of ``buckets`` buckets) are both bucket 0: they overflow."""
    cand = np.arange(1, 400_000 * buckets, dtype=np.int64)
    h = mix64(cand, _INDEX_SEED)
    mask = np.uint64(buckets - 1)
    hit = cand[((h & mask) == 0) & (((h >> np.uint64(32)) & mask) == 0)]
    assert hit.size >= n
    return hit[:n]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 2**32 - 1)), min_size=1, max_size=40)
)
def test_hash_index_matches_a_dict_and_keeps_its_invariants(ops: list[tuple[bool, int, int]]) -> None:
    """Random batches of inserts (wide, negative and crowded ids) and removals, each followed by the
    invariants' check."""
    index = HashIndex(8)
    ref: dict[int, int] = {}
    for insert, n, seed in ops:
        rng = np.random.default_rng(seed)
        if insert or not ref:
            fresh = np.concatenate([rng.integers(-(2**63), 2**63 - 1, n), rng.integers(-50, 50, n), [EMPTY]])
            fresh = np.array([i for i in np.unique(fresh).tolist() if i not in ref], np.int64)
            vals = rng.integers(0, 1 << 40, fresh.size)
            index.insert(fresh, vals)
            ref.update(zip(fresh.tolist(), vals.tolist(), strict=True))
        else:
            gone = rng.choice(np.array(list(ref), np.int64), size=min(n, len(ref)), replace=False)
            index.remove(index.positions(gone))
            for g in gone.tolist():
                del ref[g]
        _check(index, ref)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1), st.integers(1, 60), st.sampled_from(["removed", "inserted", "rebuilt", "none"])
)
def test_an_insert_takes_a_lookups_probe_while_the_table_only_lost_entries(
    seed: int, n: int, between: str
) -> None:
    """A push looks its ids up (``lookup``), the piece loses rows (spilled, expired), then the absent ids
    are inserted with the lookup's probe: the buckets it read, their free places then. The result is the
    dict's, invariants kept, whatever changed between: removals (the probe's free places are still
    free), an insert or a rebuild (the probe is stale: the buckets are read again). Crowded ids (both
    buckets one bucket) overflow past it."""
    rng = np.random.default_rng(seed)
    index = HashIndex(64)
    crowd = _colliding(index.mask + 1, 12)
    old = np.unique(np.concatenate([rng.integers(-(2**40), 2**40, 3 * n), crowd[:6]]))
    index.insert(old, np.arange(old.size))  # values >= 0: -1 means absent
    ref = dict(zip(old.tolist(), range(old.size), strict=True))
    fresh = np.unique(np.concatenate([rng.integers(-(2**40), 2**40, n), crowd[6:], [EMPTY]]))
    fresh = fresh[~np.isin(fresh, old)]
    batch = rng.permutation(np.concatenate([rng.choice(old, min(n, old.size), replace=False), fresh]))
    found, probe = index.lookup(batch)
    np.testing.assert_array_equal(found, [ref.get(i, -1) for i in batch.tolist()])
    gone = rng.choice(old, old.size // 2, replace=False)
    index.remove(index.positions(gone))
    for g in gone.tolist():
        del ref[g]
    if between == "inserted":
        extra = np.array([i for i in range(1 << 45, (1 << 45) + n)], np.int64)
        index.insert(extra, extra)
        ref.update(zip(extra.tolist(), extra.tolist(), strict=True))
    elif between == "rebuilt":
        index.reserve(index.size)  # grows: another keys array
    absent = np.flatnonzero(found < 0)
    take = absent[rng.random(absent.size) < 0.7]  # some of the absent ones (the admitted, the filled)
    index.insert(batch[take], take + 100, probe, take)
    ref.update(zip(batch[take].tolist(), (take + 100).tolist(), strict=True))
    _check(index, ref)


def test_ids_whose_buckets_are_full_overflow_and_are_uncounted_when_removed() -> None:
    """Ids that all share both buckets fill them and go on to the buckets after; lookups find them, and
    removals (in any order, with reinserts) leave the counts exactly those of the entries left."""
    index = HashIndex(64)  # 256 places: 32 buckets
    buckets = index.mask + 1
    crowd = _colliding(buckets, 3 * _BUCKET + 3)
    ref: dict[int, int] = {}
    for part in np.array_split(crowd, 3):  # in batches: conflicts inside a batch and across them
        index.insert(part, part * 2)
        ref.update(zip(part.tolist(), (part * 2).tolist(), strict=True))
        _check(index, ref)
    assert index.overflowed == crowd.size - _BUCKET and index.overflow[0] == crowd.size - _BUCKET
    rng = np.random.default_rng(1)
    for _ in range(20):
        gone = rng.choice(np.array(list(ref), np.int64), size=min(5, len(ref)), replace=False)
        index.remove(index.positions(gone))
        for g in gone.tolist():
            del ref[g]
        _check(index, ref)
        back = gone[:3]
        index.insert(back, back + 1)
        ref.update(zip(back.tolist(), (back + 1).tolist(), strict=True))
        _check(index, ref)


def test_a_churning_index_never_grows_and_never_rebuilds() -> None:
    """A tiered piece's rows fill and spill every step: as many ids removed as inserted. Without
    tombstones the table keeps its size, and a lookup stays one round (no overflow at its load)."""
    rng = np.random.default_rng(2)
    index = HashIndex(10_000)
    live = rng.choice(1 << 50, 10_000, replace=False).astype(np.int64)
    index.insert(live, np.arange(live.size))
    size = index.size
    ref = dict(zip(live.tolist(), range(live.size), strict=True))
    for step in range(200):
        out = rng.choice(live.size, 300, replace=False)
        index.remove(index.positions(live[out]))
        for i in live[out].tolist():
            del ref[i]
        new = (1 << 51) + step * 300 + np.arange(300, dtype=np.int64)
        index.insert(new, new)
        ref.update(zip(new.tolist(), new.tolist(), strict=True))
        live[out] = new
    assert index.size == size
    _check(index, ref)


def test_a_rebuilt_index_is_another_table_with_the_same_entries() -> None:
    index = HashIndex(16)
    ids = np.arange(12, dtype=np.int64) * 1_000_003
    index.insert(ids, ids + 5)
    bigger = index.rebuilt(1000)
    assert bigger.size >= 2000 and index.size == 32
    _check(bigger, dict(zip(ids.tolist(), (ids + 5).tolist(), strict=True)))
    _check(index, dict(zip(ids.tolist(), (ids + 5).tolist(), strict=True)))
    assert not index.needs_rebuild(12) and index.needs_rebuild(13)


def test_large_batches_run_in_chunks_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch over ``_CHUNK`` ids (a rebuild, a restore) is looked up and inserted a chunk at a time (its
    temporaries bounded), with the same entries as one batch."""
    monkeypatch.setattr(hashindex, "_CHUNK", 64)
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(-(2**40), 2**40, 1000))
    index = HashIndex(8)
    index.insert(ids, ids * 3)
    ref = dict(zip(ids.tolist(), (ids * 3).tolist(), strict=True))
    _check(index, ref)
    gone = ids[::3]
    index.remove(index.positions(gone))
    for g in gone.tolist():
        del ref[g]
    _check(index, ref)
    _check(index.rebuilt(5000), ref)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 80), st.sampled_from(["removed", "reinserted", "rebuilt"]))
def test_positions_with_hints_are_positions_whatever_the_hints(seed: int, n: int, between: str) -> None:
    """A spill's ids come with the places their reads found (``positions_hinted``): the answer is
    ``positions``' for good hints, hints gone stale (the id removed, removed and inserted again
    elsewhere, the table rebuilt), another id's place, an empty place, a place past the table, none
    (-1), and for the id ``EMPTY`` (every empty place's key) and crowded ids past their buckets."""
    rng = np.random.default_rng(seed)
    index = HashIndex(64)
    crowd = _colliding(index.mask + 1, 12)
    ids = np.unique(np.concatenate([rng.integers(-(2**40), 2**40, 3 * n), crowd, [EMPTY]]))
    index.insert(ids, np.arange(ids.size))
    hints = index.positions(ids)
    gone = rng.choice(ids, ids.size // 3, replace=False)
    index.remove(index.positions(gone))
    if between == "reinserted":
        index.insert(gone[::2], np.arange(gone[::2].size))
    elif between == "rebuilt":
        index.reserve(index.size)  # another table: most places moved
    # Some hints wrong on purpose: another id's place, an empty place, past the table, none.
    wrong = rng.random(ids.size)
    hints = np.where(wrong < 0.1, np.roll(hints, 1), hints)
    empty = np.flatnonzero(index.keys[: index.size] == EMPTY)
    hints = np.where((wrong >= 0.1) & (wrong < 0.15), empty[rng.integers(0, empty.size, ids.size)], hints)
    hints = np.where((wrong >= 0.15) & (wrong < 0.2), index.size + 7, hints)
    hints = np.where((wrong >= 0.2) & (wrong < 0.25), -1, hints)
    np.testing.assert_array_equal(index.positions_hinted(ids, hints), index.positions(ids))
    np.testing.assert_array_equal(index.positions_hinted(ids, index.positions(ids)), index.positions(ids))
