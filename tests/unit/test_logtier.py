"""The log-structured disk tier on its own: against a model in memory, compaction, instants, a full disk."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _support import small_disk

from psserver import logtier
from psserver.logtier import LogTier
from psserver.tier import NO_CUT, TierFullError, record_dtype

_RECORD = record_dtype(4, np.dtype(np.float32), {"accumulator": np.dtype(np.float32)})


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of 16 KiB, blocks allocated 8 KiB ahead, and compaction steps of 2 KiB: many of each in a
    small test."""
    monkeypatch.setattr(logtier, "_REGION_MIN_BYTES", 16 << 10)
    monkeypatch.setattr(logtier, "_REGION_MAX_BYTES", 16 << 10)
    monkeypatch.setattr(logtier, "_ALLOC_STEP_BYTES", 8 << 10)
    monkeypatch.setattr(logtier, "_COMPACT_STEP_BYTES", 2048)


def _records(ids: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros(ids.size, _RECORD)
    out["value"] = rng.standard_normal((ids.size, 4)).astype(np.float32)
    out["slot_accumulator"] = rng.random((ids.size, 4)).astype(np.float32)
    out["last_step"] = seed
    out["hits"] = ids
    out["last_time"] = 1000.0 + seed
    return out


def _assert_holds(tier: LogTier, model: dict[int, np.void], walk: bool = True) -> None:
    """The tier holds exactly the model's records: by batched reads, by an id-ordered walk, by a scan."""
    ids = np.array(sorted(model), np.int64)
    assert len(tier) == ids.size
    probe = np.concatenate([ids, np.array([-(2**62), 2**62], np.int64)])
    want = np.array([model[i] for i in ids.tolist()], _RECORD) if ids.size else np.zeros(0, _RECORD)
    order = np.random.default_rng(0).permutation(probe.size)
    found, got = tier.get(probe[order])
    assert found.tolist() == (order < ids.size).tolist()
    assert got.tobytes() == want[order[order < ids.size]].tobytes()
    np.testing.assert_array_equal(tier.scan(None, ids.size + 5), ids)
    if not walk:
        tier.check()
        return
    walked = list(tier.items(chunk=97, cut=NO_CUT))
    got_ids = np.concatenate([w[0] for w in walked]) if walked else np.zeros(0, np.int64)
    got_recs = np.concatenate([w[1] for w in walked]) if walked else np.zeros(0, _RECORD)
    np.testing.assert_array_equal(got_ids, ids)
    assert got_recs.tobytes() == want.tobytes()  # bit-exact, every field
    np.testing.assert_array_equal(tier.scan(None, ids.size + 5), ids)
    tier.check()


def test_random_writes_and_deletes_read_back_bit_exact_with_compaction_under_way(tmp_path: Path) -> None:
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t", expiry=("last_step",))
    model: dict[int, np.void] = {}
    rng = np.random.default_rng(1)
    for step in range(300):
        ids = np.unique(rng.integers(-500, 1500, rng.integers(1, 120)))
        gone = np.unique(rng.integers(-500, 1500, rng.integers(0, 30)))
        gone = np.setdiff1d(gone, ids)
        records = _records(ids, step)
        order = rng.permutation(ids.size)  # in no order
        tier.write(ids[order], records[order], delete=[gone])
        for i in gone.tolist():
            model.pop(i, None)
        for i, r in zip(ids.tolist(), records, strict=True):
            model[i] = r.copy()
        if step % 50 == 0:
            _assert_holds(tier, model)
    _wait_compacted(tier)
    assert tier.compaction.segments > 10 and tier.compaction.moved > 0
    _assert_holds(tier, model)
    # Compacted, the segments hold at most about twice the live records' bytes (plus the active one).
    live_bytes = len(tier) * tier.slot.itemsize
    assert tier.disk_used <= 2 * live_bytes + 2 * (1 << 16)
    tier.close()
    assert not (tmp_path / "t").exists()


def _wait_compacted(tier: LogTier) -> None:
    for _ in range(500):  # bounded: the thread's steps are short
        thread = tier._compactor
        if thread is None:
            break
        thread.join(0.02)
    tier.compact_now()


def test_compaction_keeps_every_live_row_and_gives_the_space_back(tmp_path: Path) -> None:
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t")
    ids = np.arange(4000, dtype=np.int64)
    tier.write(ids, _records(ids, 0))
    full = tier.disk_used
    model = {i: r.copy() for i, r in zip(ids.tolist(), _records(ids, 0), strict=True)}
    for step in range(1, 8):  # most rows rewritten, a few deleted: most records in the early segments die
        again = ids[(ids % 8) != step]
        tier.write(again, _records(again, step), delete=[ids[ids % 97 == step]])
        for i in ids[ids % 97 == step].tolist():  # deleted first, then written
            model.pop(i, None)
        model.update(zip(again.tolist(), (r.copy() for r in _records(again, step)), strict=True))
    _wait_compacted(tier)
    _assert_holds(tier, model)
    assert tier.compaction.segments > 0
    assert tier.disk_used <= 2 * full + 2 * (1 << 16)
    assert len(tier._segs) < tier.compaction.segments  # the regions of compacted segments were reused


def test_compaction_waits_for_the_space_and_moves_fewer_records_than_compacting_at_half_live(
    tmp_path: Path,
) -> None:
    """The same random rewrites on two tiers, each compacting in the writer's thread after each write: one
    as the compaction thread does (a segment below half live only once the segments hold more than twice
    the live records), one compacting every segment below half live at once. Both hold every record,
    bit-exact; the first stays within twice the live records (plus the segment under compaction and the
    active one) and moves fewer records (with every segment compacted at half live, as many as it frees)."""
    tiers = {kind: LogTier(tmp_path / kind, _RECORD, 1 << 30, "t") for kind in ("when-wanted", "at-half")}
    for kind, tier in tiers.items():
        eager = kind == "at-half"

        def inline(tier: LogTier = tier, eager: bool = eager) -> None:  # the writer's lock is held
            while tier._compact_step(eager=eager):
                pass

        tier._start_compaction = inline  # type: ignore[method-assign]
    ids = np.arange(3000, dtype=np.int64)
    model = {i: r.copy() for i, r in zip(ids.tolist(), _records(ids, 0), strict=True)}
    for tier in tiers.values():
        tier.write(ids, _records(ids, 0))
    rng = np.random.default_rng(5)
    lazy = tiers["when-wanted"]
    for step in range(1, 200):
        again = np.unique(rng.integers(0, ids.size, 150))
        records = _records(again, step)
        for tier in tiers.values():
            tier.write(again, records)
        model.update(zip(again.tolist(), (r.copy() for r in records), strict=True))
        held = sum(seg.used for seg in lazy._current())
        assert held <= 2 * len(lazy) + 2 * lazy.segment_rows
    for tier in tiers.values():
        _assert_holds(tier, model, walk=False)
        assert tier.compaction.segments > 5
    assert lazy.compaction.moved < 0.6 * tiers["at-half"].compaction.moved
    lazy.compact_now()  # compacted now: every segment at least half live, as before
    assert all(s.live >= s.rows // 2 for s in lazy._current() if s.used == s.rows and s is not lazy._active)
    _assert_holds(lazy, model)
    for tier in tiers.values():
        tier.close()


@pytest.mark.parametrize("limit", ["size-cap", "full-disk"])
def test_near_its_limit_or_a_full_disk_a_tier_compacts_at_half_live_again(tmp_path: Path, limit: str) -> None:
    """A tier whose live records take over a third of its limit, or of a small disk (2x of them would pass
    ``_EAGER_NEAR_LIMIT`` of it): there the compaction (in the writer's thread here) takes every segment
    below half live, as before; the writes near the limit never compact a whole segment themselves, and
    none fails on the small disk."""
    if limit == "full-disk":  # a 1 MiB tmpfs, the index's files in it too
        with small_disk(tmp_path / "small", "1m") as disk:
            _rewrite_near_the_limit(LogTier(disk / "t", _RECORD, 1 << 30, "t"), 6000)
    else:
        _rewrite_near_the_limit(LogTier(tmp_path / "t", _RECORD, 1 << 20, "t"), 7500)


def _rewrite_near_the_limit(tier: LogTier, rows: int) -> None:
    tier._start_compaction = lambda: _compact_all(tier)  # type: ignore[method-assign]
    own = 0
    for_room = tier._compact_for_room

    def counted() -> bool:
        nonlocal own
        own += 1
        return for_room()

    tier._compact_for_room = counted  # type: ignore[method-assign]
    ids = np.arange(rows, dtype=np.int64)  # 56 bytes a record
    model = {i: r.copy() for i, r in zip(ids.tolist(), _records(ids, 0), strict=True)}
    tier.write(ids, _records(ids, 0))
    rng = np.random.default_rng(7)
    peak = 0.0
    for step in range(1, 120):
        again = np.unique(rng.integers(0, ids.size, 300))
        records = _records(again, step)
        tier.write(again, records)
        model.update(zip(again.tolist(), (r.copy() for r in records), strict=True))
        peak = max(peak, tier.disk_fill())
        if tier.disk_fill() > logtier._EAGER_NEAR_LIMIT:
            full = [s for s in tier._current() if s.used == s.rows and s is not tier._active]
            assert all(s.live >= s.rows * logtier._COMPACT_BELOW for s in full)
    assert peak > 0.7 and own == 0  # it came near the limit, and no write compacted
    _assert_holds(tier, model, walk=False)
    tier.close()


def _compact_all(tier: LogTier) -> None:
    """The compaction thread's steps, in the writer's thread (which holds the writer's lock)."""
    while tier._compact_step():
        pass


def test_a_view_and_a_snapshot_read_their_instant_while_writes_and_compaction_go_on(tmp_path: Path) -> None:
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t")
    ids = np.arange(-1000, 1000, dtype=np.int64)
    first = _records(ids, 0)
    tier.write(ids, first)
    view = tier.view()
    snapshot = tier.reader()
    before_disk = tier.disk_used
    for step in range(1, 12):  # every row rewritten many times, half of them deleted at the end
        tier.write(ids, _records(ids, step))
    tier.write(ids[:0], first[:0], delete=[ids[::2]])
    tier.compact_now()
    assert tier.compaction.segments > 0
    # The segments the pinned instant may read stay mapped (their space counted) until it is closed.
    assert tier.disk_used >= before_disk
    found, got, _, _, _ = tier.read(ids[::-1], at=view)
    assert found.all() and got.tobytes() == first[::-1].tobytes()
    walked = list(tier.items(chunk=333, txn=snapshot, cut=NO_CUT))
    np.testing.assert_array_equal(np.concatenate([w[0] for w in walked]), ids)
    assert np.concatenate([w[1] for w in walked]).tobytes() == first.tobytes()
    snapshot.abort()
    found, got = tier.get(ids)
    assert found.tolist() == [bool(i % 2) for i in range(ids.size)]
    assert got.tobytes() == _records(ids, 11)[1::2].tobytes()
    tier.compact_now()
    live_bytes = len(tier) * tier.slot.itemsize
    assert tier.disk_used <= 2 * live_bytes + 2 * (1 << 16)  # the space came back with the last view
    tier.close()


def test_a_lookup_in_another_thread_reads_one_instant_while_a_writer_rewrites(tmp_path: Path) -> None:
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t")
    ids = np.arange(3000, dtype=np.int64)
    tier.write(ids, _records(ids, 0))
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        step = 0
        try:
            while not stop.is_set() and step < 400:  # bounded
                step += 1
                tier.write(ids, _records(ids, step))
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(60):
            found, got = tier.get(ids)
            assert found.all()
            steps = np.unique(got["last_step"])
            assert steps.size == 1, f"one read saw the records of writes {steps.tolist()}"
            assert got.tobytes() == _records(ids, int(steps[0])).tobytes()
    finally:
        stop.set()
        thread.join(30)
    assert not errors and not thread.is_alive()
    tier.compact_now()
    tier.check()
    tier.close()


@pytest.mark.parametrize("limit", ["size-cap", "full-disk"])
def test_a_full_tier_refuses_a_write_whole_and_compacts_to_make_room_first(
    tmp_path: Path, limit: str
) -> None:
    if limit == "full-disk":  # a 1 MiB tmpfs: the disk refuses a segment's blocks
        with small_disk(tmp_path / "small", "1m") as disk:
            _fill(LogTier(disk / "t", _RECORD, 1 << 30, "t"), "No space left on device")
    else:
        _fill(LogTier(tmp_path / "t", _RECORD, 1 << 20, "t"), "--table-disk-limit")


def _fill(tier: LogTier, why: str) -> None:
    """Dead records first (rows rewritten, the compaction thread held back), then new rows until the tier
    is full: the writes near the limit compact the dead records away, and the one that finds no room
    changes nothing."""
    tier._start_compaction = lambda: None  # type: ignore[method-assign]
    base = np.arange(-2000, 0, dtype=np.int64)
    for step in range(4):
        tier.write(base, _records(base, step))
    model = {i: r.copy() for i, r in zip(base.tolist(), _records(base, 3), strict=True)}
    before = (0, 0)
    with pytest.raises(TierFullError, match="disk tier is full") as caught:
        for step in range(1, 10_000):  # new ids each write, a few deleted
            ids = np.arange(step * 100, step * 100 + 100, dtype=np.int64)
            before = len(tier), tier.disk_used
            gone = np.array(sorted(model)[:5], np.int64)
            tier.write(ids, _records(ids, step), delete=[gone])
            for i in gone.tolist():
                del model[i]
            model.update(zip(ids.tolist(), (r.copy() for r in _records(ids, step)), strict=True))
    assert why in str(caught.value)
    assert (len(tier), tier.disk_used) == before  # nothing applied: no record, no segment
    assert tier.compaction.segments > 0  # dead records were compacted away to make room
    _assert_holds(tier, model, walk=why == "--table-disk-limit")  # a full disk has no room for a walk's ids
    if why == "--table-disk-limit":  # the tier filled with live records: more than half of the limit
        assert len(tier) * tier.slot.itemsize > tier.disk_bytes // 2
    tier.close()


def test_a_restore_of_many_chunks_is_visible_whole_or_not_at_all(tmp_path: Path) -> None:
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 20, "t")
    ids = np.arange(20_000, dtype=np.int64)

    def chunks() -> Any:
        for lo in range(0, ids.size, 1000):
            yield ids[lo : lo + 1000], _records(ids[lo : lo + 1000], 1)

    with pytest.raises(TierFullError):  # 20,000 records of 56 bytes do not fit in 1 MiB
        tier.write_chunks(ids.size, chunks())
    assert len(tier) == 0 and tier.disk_used == 0
    small = ids[:5000]
    recs = _records(small, 1)
    tier.write_chunks(
        small.size, ((small[lo : lo + 700], recs[lo : lo + 700]) for lo in range(0, small.size, 700))
    )
    _assert_holds(tier, dict(zip(small.tolist(), (r.copy() for r in recs), strict=True)))
    tier.close()


def test_expired_finds_the_live_records_before_a_cut_from_the_stamps_in_memory(tmp_path: Path) -> None:
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t", expiry=("last_step", "last_time"))
    ids = np.arange(2000, dtype=np.int64)
    for step in range(10):
        part = ids[ids % 10 >= step]  # ids with a larger last digit are rewritten for longer
        tier.write(part, _records(part, step))
    tier.compact_now()
    last = ids % 10  # each id's last write
    np.testing.assert_array_equal(tier.expired(5, None), ids[last < 5])
    np.testing.assert_array_equal(tier.expired(None, 1003.0), ids[last < 3])
    got = tier.expired(5, None, limit=100)
    assert got.size == 100 and np.all(np.isin(got, ids[last < 5]))
    tier.close()


def test_expiry_batches_match_a_model_through_writes_deletes_and_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``expired`` against a model: rising cuts drained in batches while records are written (some stamped
    before the cut), deleted, left (a push may keep what a batch named) and compacted. Each batch names only
    live records before the cut, at most ``limit``, and a short batch names every one of them. Blocks of 8
    records: the walk's place, its bounds raised past dead records and moved back by late writes."""
    monkeypatch.setattr(logtier, "_EXPIRY_BLOCK", 8)
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t", expiry=("last_step", "last_time"))
    stamps: dict[int, int] = {}  # id -> its live record's last_step (last_time is 1000 + it)
    rng = np.random.default_rng(7)
    cut = 0
    for step in range(400):
        ids = np.unique(rng.integers(0, 3000, rng.integers(0, 90)))
        records = _records(ids, step)
        records["last_step"] = rng.integers(max(0, step - 60), step + 1, ids.size)  # some before the cut
        records["last_time"] = 1000.0 + records["last_step"]
        gone = np.setdiff1d(np.unique(rng.integers(0, 3000, rng.integers(0, 20))), ids)
        tier.write(ids, records, delete=[gone])
        for i in gone.tolist():
            stamps.pop(i, None)
        stamps.update(zip(ids.tolist(), records["last_step"].tolist(), strict=True))
        if step % 37 == 0:
            tier.compact_now()
        if step % 25 == 0:
            cut = step - int(rng.integers(10, 40))  # sometimes lower than the last: a walk starts afresh
        by_step, by_time = (cut, None) if step % 2 else (None, 1000.0 + cut)
        limit = int(rng.integers(1, 60))
        got = tier.expired(by_step, by_time, limit=limit)
        want = np.array(sorted(i for i, s in stamps.items() if s < cut), np.int64)
        assert got.size <= limit and np.all(got[1:] > got[:-1])
        assert np.all(np.isin(got, want)), step
        if got.size < limit:
            np.testing.assert_array_equal(got, want)
        drop = got[rng.random(got.size) < 0.8]  # a push deletes most of a batch
        tier.write(ids[:0], _records(ids[:0], 0), delete=[drop])
        for i in drop.tolist():
            stamps.pop(i)
        if step % 50 == 0:
            tier.check()
    np.testing.assert_array_equal(
        tier.expired(cut, None), np.array(sorted(i for i, s in stamps.items() if s < cut), np.int64)
    )
    tier.check()
    tier.close()


def test_an_expiry_drains_in_batches_and_finds_records_written_meanwhile(tmp_path: Path) -> None:
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t", expiry=("last_step",))
    ids = np.arange(5000, dtype=np.int64)
    tier.write(ids, _records(ids, 1))
    fresh = ids[ids % 5 == 0]
    tier.write(fresh, _records(fresh, 9))  # rewritten after the cut: not expired
    batches = [tier.expired(5, None, limit=300)]
    late = np.array([10**6, 10**6 + 1], np.int64)
    tier.write(late, _records(late, 2))  # written while the expiry drains, stamped before its cut
    while batches[-1].size:  # bounded: each batch is deleted, as a push does
        tier.write(ids[:0], _records(ids[:0], 0), delete=[batches[-1]])
        batches.append(tier.expired(5, None, limit=300))
        assert len(batches) < 30
    gone = np.concatenate(batches)
    np.testing.assert_array_equal(np.sort(gone), np.union1d(ids[ids % 5 != 0], late))
    assert len(tier) == fresh.size
    tier.check()
    tier.close()


def test_reads_give_their_records_places_and_a_write_takes_them_as_hints_checked(tmp_path: Path) -> None:
    """A read gives, with its records, where the index held their ids (``places``: what a piece keeps per
    filled row for its spill, ``DynamicRows.disk_place``), from the disk or from remembered records. A
    write with those hints gives what a write without them gives, bit-exact, however stale the hints:
    after compaction moved the records, after the index grew (another table), after an id was deleted
    and written again, and with hints that are plainly wrong (another id's place): each is checked
    against the index's keys before it is used."""
    tier = LogTier(tmp_path / "t", _RECORD, 1 << 30, "t", expiry=("last_step",))
    twin = LogTier(tmp_path / "u", _RECORD, 1 << 30, "u", expiry=("last_step",))
    model: dict[int, np.void] = {}
    rng = np.random.default_rng(3)
    kept: dict[int, int] = {}  # id -> the place its last read gave
    for step in range(200):
        ids = np.unique(rng.integers(0, 3000 + 40 * step, rng.integers(1, 150)))  # the index grows
        gone = np.setdiff1d(np.unique(rng.integers(0, 3000, rng.integers(0, 20))), ids)
        records = _records(ids, step)
        hints = np.array([kept.get(i, -1) for i in ids.tolist()], np.int64)
        if step % 7 == 0:  # plainly wrong hints: another id's
            hints = np.roll(hints, 1)
        tier.write(ids, records, delete=[gone], places=hints)
        twin.write(ids, records, delete=[gone])
        for i in gone.tolist():
            model.pop(i, None)
        model.update(zip(ids.tolist(), (r.copy() for r in records), strict=True))
        probe = np.unique(rng.integers(0, 3000 + 40 * step, 200))
        remember = step % 2 == 0  # from the disk (its places now), or from remembered records (then)
        found, got, dead, _, places = tier.read(probe, remember=remember)
        assert not dead.size and places.size == got.size
        if remember:
            np.testing.assert_array_equal(places, tier._index.positions(probe[found]))
        kept.update(zip(probe[found].tolist(), places.tolist(), strict=True))
        if step % 40 == 0:
            tier.compact_now()
            _assert_holds(tier, model, walk=False)
    _wait_compacted(tier)
    _wait_compacted(twin)
    assert tier.compaction.moved > 0
    _assert_holds(tier, model)
    probe = np.array(sorted(model), np.int64)
    assert tier.get(probe)[1].tobytes() == twin.get(probe)[1].tobytes()
    tier.close()
    twin.close()
