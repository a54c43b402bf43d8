"""The disk tier of dynamic tables without sockets: spill and fill exactness, full disks, restores, scans."""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _support import small_disk as mounted_tmpfs

from pscore.errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from pscore.optimizers import Adagrad, Adam, Optimizer
from psproto.v1 import ps_pb2
from psserver import ckptfile, tables
from psserver import tier as tier_module
from psserver.rows import DynamicRows, tiering
from psserver.rows import export as export_module
from psserver.store import Store, Variable
from psserver.tier import CHUNK_ROWS, TierConfig, TierDirError, TierFullError, parse_bytes

_SKETCH_BYTES = 4 * (1 << 20) * 2  # an unbounded table's admission sketch (min_count > 1)
_STORE = tier_module.DEFAULT_STORE  # the store every test of this module runs on (``store``)


@pytest.fixture(autouse=True, params=tier_module.STORES)
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs on each disk tier store: the log-structured one and the LMDB one."""
    monkeypatch.setattr(sys.modules[__name__], "_STORE", request.param)
    return str(request.param)


def _tier(directory: str, memory_bytes: int, **kw: Any) -> TierConfig:
    return TierConfig(directory=directory, memory_bytes=memory_bytes, store=_STORE, **kw)


def _disk(path: Path, record: np.dtype, disk_bytes: int, name: str, **kw: Any) -> tier_module.ColdTier:
    """A piece's store on its own (``_STORE``)."""
    return _tier(str(path.parent), 1 << 20, disk_bytes=disk_bytes).open_piece(name, record, name, **kw)


def _spec(dim: int, opt: Optimizer, **kw: Any) -> ps_pb2.VariableSpec:
    spec = ps_pb2.VariableSpec(
        name="t/rows_0", dtype=ps_pb2.DTYPE_FLOAT32, shape=[0, dim], optimizer=opt.to_proto()
    )
    spec.dynamic.CopyFrom(
        ps_pb2.DynamicTable(
            table="t",
            dim=dim,
            index=0,
            count=1,
            initializer=ps_pb2.RowInitializer(name="uniform", args=[-1.0, 1.0]),
            **kw,
        )
    )
    return spec


class _Table:
    """A dynamic table piece in a real store, tiered when ``tier`` is given."""

    def __init__(
        self,
        tier: TierConfig | None = None,
        dim: int = 16,
        opt: Optimizer | None = None,
        inline_apply_bytes: int = 1 << 20,
        **kw: Any,
    ) -> None:
        self.store = Store(tier=tier, inline_apply_bytes=inline_apply_bytes)
        self.spec = _spec(dim, opt or Adagrad(0.1), **kw)
        self.store.create([self.spec], {})
        self.var: Variable = self.store.get(self.spec.name)
        self.now = 1000.0

    @property
    def rows(self) -> DynamicRows:
        assert self.var.dyn is not None
        return self.var.dyn

    def push(self, ids: np.ndarray, seed: int) -> None:
        ids = np.asarray(ids, np.int64)
        values = np.random.default_rng(seed).standard_normal((ids.size, self.var.shape[1]), np.float32)
        pairs = self.store.validate_grads({self.spec.name: tables.RowGrad(ids, values)})
        self.now += 1.0
        asyncio.run(self.store.apply(pairs, self.now))

    def export(self) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        return self.rows.export(self.var)


def _stream(n_pushes: int, ids_per_push: int, id_space: int, seed: int = 0) -> list[np.ndarray]:
    """Power-law ids (a few hot, a long tail), distinct per push."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_pushes):
        ranks = np.floor(id_space * rng.random(ids_per_push) ** 3).astype(np.int64)
        out.append(np.unique(ranks * 7919 - 50_000))  # negative ids too
    return out


def _assert_same(a: _Table, b: _Table) -> None:
    va, sa, ma = a.export()
    vb, sb, mb = b.export()
    np.testing.assert_array_equal(ma["ids"], mb["ids"])
    np.testing.assert_array_equal(va, vb)  # bit-equal: the same float32 math on the same rows
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k])
    for k in ("last_step", "hits", "last_time", "clock", "last_sweep"):
        np.testing.assert_array_equal(ma[k], mb[k])
    probe = np.concatenate([ma["ids"], np.arange(-5, 5)])
    np.testing.assert_array_equal(a.rows.read(a.var, probe), b.rows.read(b.var, probe))
    assert len(a.rows) == len(b.rows)


@pytest.mark.parametrize(
    ("opt", "kw"),
    [
        (Adagrad(0.1), {}),
        (Adam(0.01), {"eviction": ps_pb2.EVICTION_LFU, "ttl_steps": 40, "min_count": 2}),
        (Adagrad(0.1), {"ttl_steps": 56, "ttl_seconds": 30.5}),
    ],
    ids=["adagrad-lru", "adam-lfu-ttl-admission", "adagrad-lru-ttl-steps-and-seconds"],
)
def test_tier_spills_and_fills_to_the_same_rows_as_an_in_memory_table(
    tmp_path: Path, opt: Optimizer, kw: dict[str, Any]
) -> None:
    sketch = _SKETCH_BYTES if kw.get("min_count", 0) > 1 else 0
    tier = _tier(str(tmp_path), sketch + (96 << 10))
    tiered, plain = _Table(tier, opt=opt, **kw), _Table(None, opt=opt, **kw)
    for step, ids in enumerate(_stream(120, 120, 4000)):
        for t in (tiered, plain):
            if step % 2:  # as psclient.keras does: a lookup of the ids, then their push
                t.rows.read(t.var, ids)
            t.push(ids, seed=step)
        assert tiered.rows.hot_len <= tiered.rows.hot_rows
        if step % 10 == 0 and tiered.rows.tier is not None:
            tiered.rows.tier.check()  # the expiry indexes hold one entry per record, from its stamps
    st = tiered.rows.tier.stats if tiered.rows.tier is not None else None
    assert st is not None and st.spilled > 500 and st.filled > 100  # both directions were exercised
    assert tiered.rows.stale > 0  # filled rows whose older copy is still on disk (skipped by reads)
    assert len(tiered.rows.tier or ()) > 0 and tiered.rows.hot_rows < len(plain.rows)
    if kw.get("ttl_steps"):
        assert plain.rows.stats.expired > 0 and tiered.rows.stats.expired == plain.rows.stats.expired
    _assert_same(tiered, plain)


def _assert_one_index(t: _Table) -> None:
    """The piece's id index is the one index of both tiers: each row in memory under its id, each id on
    disk only (not in memory) with an entry below -1 (``tiering.on_disk_entries``), and no other entry;
    on the log store, the places those entries keep are the ids' places in the log's index where they
    hold (``HashIndex.positions_hinted`` checks them), and all of them since the push after the log's
    index last grew."""
    rows, disk = t.rows, t.rows.tier
    assert disk is not None
    ids, vals = rows.index.items()
    hot = vals >= 0
    np.testing.assert_array_equal(rows.slot_ids[vals[hot]], ids[hot])
    assert rows.live[vals[hot]].all() and np.count_nonzero(hot) == rows.hot_len
    on_disk = np.concatenate([c[0] for c in disk.items(cut=tier_module.NO_CUT)] or [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(np.sort(ids[~hot]), np.setdiff1d(on_disk, ids[hot]))
    assert np.all(vals[~hot] <= -2)
    places = tiering.disk_places(vals[~hot])
    if _STORE == "lmdb":
        assert np.all(places == -1)
        return
    index = disk._index  # type: ignore[attr-defined]
    good = (places >= 0) & (index.keys[np.maximum(places, 0)] == ids[~hot])
    np.testing.assert_array_equal(places[good], index.positions(ids[~hot][good]))
    if disk.index_epoch == rows.places_epoch:  # the push after the log's index grows finds them again
        assert good.all()


@pytest.mark.parametrize("ttl", [0, 30], ids=["no-ttl", "ttl"])
def test_one_index_for_both_tiers_a_fill_and_a_spill_change_values_not_entries(
    tmp_path: Path, ttl: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiered piece's index maps each id to its row in memory or to its record on disk. Once every id
    of a stream has been pushed, pushes of the same ids fill and spill rows without an insert or a
    removal (the index keeps its size and its arrays); with a TTL the ids whose records expire leave it.
    Lookups and pushes give what the same table in memory gives."""
    monkeypatch.setattr(tiering, "_PLACES_CHUNK", 64)  # places found again in many chunks
    kw = {"ttl_steps": ttl} if ttl else {}
    tiered, plain = _Table(_tier(str(tmp_path), 96 << 10), **kw), _Table(None, **kw)
    stream = _stream(80, 120, 4000)
    for step, ids in enumerate(stream):
        for t in (tiered, plain):
            t.rows.read(t.var, ids)
            t.push(ids, seed=step)
        if step % 20 == 0:
            _assert_one_index(tiered)
    _assert_one_index(tiered)
    _assert_same(tiered, plain)
    if ttl:
        return
    seen = np.unique(np.concatenate(stream))
    index = tiered.rows.index
    assert len(index) == seen.size == len(tiered.rows)
    keys, filled = index.keys, tiered.rows.tier.stats.filled  # type: ignore[union-attr]
    for step, ids in enumerate(_stream(30, 120, 4000, seed=1)):
        known = np.intersect1d(ids, seen)
        for t in (tiered, plain):
            t.push(known, seed=1000 + step)
        assert len(tiered.rows.index) == seen.size and tiered.rows.index.keys is keys
    assert tiered.rows.tier.stats.filled > filled  # type: ignore[union-attr]
    _assert_one_index(tiered)
    _assert_same(tiered, plain)
    # A lookup keeps the places its read found in the entries of the ids it read from disk.
    ids, vals = index.items()
    cold = ids[vals < 0]
    tiered.rows.read(tiered.var, cold)
    kept = tiering.disk_places(index.get(cold))
    if _STORE == "log":
        np.testing.assert_array_equal(kept, tiered.rows.tier._index.positions(cold))  # type: ignore[union-attr]


@pytest.mark.parametrize("cancelled", [False, True], ids=["awaited", "its-caller-cancelled"])
def test_a_push_reads_and_writes_the_disk_in_a_worker_thread_while_lookups_go_on(
    tmp_path: Path, cancelled: bool
) -> None:
    tier = _tier(str(tmp_path), 96 << 10)
    tiered, plain = _Table(tier, inline_apply_bytes=1024), _Table(None)  # disk work on > 1 KiB: in a thread
    stream = _stream(41, 120, 4000)
    for step, ids in enumerate(stream[:-1]):
        for t in (tiered, plain):
            t.push(ids, seed=step)
    disk = tiered.rows.tier
    assert disk is not None and len(disk) > 0
    main = threading.get_ident()
    entered, release = threading.Event(), threading.Event()
    threads: list[tuple[str, int]] = []
    read, write = disk.read, disk.write

    def reading(*args: Any, **kw: Any) -> Any:
        threads.append(("read", threading.get_ident()))
        return read(*args, **kw)

    def writing(*args: Any, **kw: Any) -> Any:  # the push's write waits here until the lookups are done
        threads.append(("write", threading.get_ident()))
        entered.set()
        assert release.wait(10)
        return write(*args, **kw)

    disk.read, disk.write = reading, writing  # type: ignore[method-assign]
    last, probe = stream[-1], np.concatenate([stream[-1], np.arange(-5, 5)])
    before = tiered.rows.read(tiered.var, probe)

    async def push_while_looking_up() -> None:
        pairs = tiered.store.validate_grads(
            {tiered.spec.name: tables.RowGrad(last, np.ones((last.size, 16), np.float32))}
        )
        push = asyncio.create_task(tiered.store.apply(pairs, tiered.now + 1.0))
        for _ in range(500):  # bounded: the write begins in its thread
            if entered.is_set():
                break
            await asyncio.sleep(0.01)
        assert entered.is_set() and not push.done()
        # The event loop turns while the disk works: lookups answer, with the rows as before the push.
        np.testing.assert_array_equal(tiered.rows.read(tiered.var, probe), before)
        if cancelled:  # its caller gives up (a cancelled call): the update still ends whole
            push.cancel()
            await asyncio.sleep(0)
        release.set()
        try:
            await push
        except asyncio.CancelledError:
            assert cancelled
        for _ in range(500):  # bounded: a cancelled caller's update finishes in its own task
            if tiered.var.version == plain.var.version + 1:
                break
            await asyncio.sleep(0.01)

    asyncio.run(push_while_looking_up())
    # The push's read and write ran in worker threads (the lookups' reads on the event loop).
    assert [kind for kind, ident in threads if ident != main] == ["read", "write"]
    assert ("write", main) not in threads
    plain.now = tiered.now
    pairs = plain.store.validate_grads(
        {plain.spec.name: tables.RowGrad(last, np.ones((last.size, 16), np.float32))}
    )
    asyncio.run(plain.store.apply(pairs, plain.now + 1.0))
    disk.check()
    _assert_same(tiered, plain)


def test_a_lookup_begun_at_an_instant_reads_the_disk_as_it_was_then_in_another_thread(tmp_path: Path) -> None:
    t = _Table(_tier(str(tmp_path), 96 << 10))
    for step, ids in enumerate(_stream(30, 120, 4000)):
        t.push(ids, seed=step)
    disk = t.rows.tier
    assert disk is not None
    cold = np.array([i for i in range(-50_000, 4000 * 7919, 7919) if t.rows.index.get(np.array([i]))[0] < 0])
    cold = cold[disk.get(cold)[0]][:20]  # ids with a row on disk only
    assert cold.size == 20
    probe = np.concatenate([cold, np.arange(-3, 3)])
    expected = t.rows.read(t.var, probe)
    lookup = t.rows.read_begin(t.var, probe)
    assert lookup.cold_bytes >= cold.size * disk.record.itemsize
    t.push(cold, seed=100)  # filled and trained: the disk still holds their old records
    for step in range(30):  # new ids push them out again: the disk now holds their new values
        t.push(np.arange(10**9 + step * 120, 10**9 + (step + 1) * 120), seed=200 + step)
    assert np.all(t.rows.index.get(cold) < 0), "the filled rows were spilled again"
    assert not np.array_equal(t.rows.read(t.var, probe), expected)
    reader = threading.Thread(target=t.rows.read_cold, args=(lookup,))
    reader.start()
    reader.join(10)
    np.testing.assert_array_equal(t.rows.read_end(lookup), expected)  # as at its instant, not as now


def test_hundreds_of_lookups_waiting_for_a_worker_thread_each_hold_their_instant(tmp_path: Path) -> None:
    t = _Table(_tier(str(tmp_path), 96 << 10))
    for step, ids in enumerate(_stream(30, 120, 4000)):
        t.push(ids, seed=step)
    probe = np.arange(-50_000, 4000 * 7919, 7919)[:300]
    expected = t.rows.read(t.var, probe)
    lookups = [t.rows.read_begin(t.var, probe) for _ in range(300)]  # 300 read transactions open at once
    assert all(lookup.view is not None for lookup in lookups)
    for lookup in lookups:
        t.rows.read_cold(lookup)
        np.testing.assert_array_equal(t.rows.read_end(lookup), expected)


def test_a_batched_read_gives_each_id_its_own_record_in_any_order_with_missing_and_remembered_ids(
    tmp_path: Path,
) -> None:
    disk = _disk(tmp_path / "t", tier_module.record_dtype(4, np.dtype(np.float32), {}), 1 << 24, "t")
    rng = np.random.default_rng(3)
    stored = np.unique(rng.integers(-(2**62), 2**62, 3000))  # negative ids too: key order is id order
    records = np.zeros(stored.size, disk.record)
    records["value"] = rng.standard_normal((stored.size, 4)).astype(np.float32)
    records["last_step"] = np.arange(stored.size)
    disk.write(stored, records)
    truth = dict(zip(stored.tolist(), range(stored.size), strict=True))
    disk.get(stored[::7], remember=True)  # some of the next reads' ids are answered from memory
    for seed in range(3):
        r = np.random.default_rng(seed)
        absent = r.integers(-(2**62), 2**62, 60)
        ids = np.unique(np.concatenate([r.choice(stored, 500, replace=False), absent]))
        ids = ids[r.permutation(ids.size)]  # distinct, in no order
        found, got = disk.get(ids)
        assert found.tolist() == [i in truth for i in ids.tolist()]
        want = records[[truth[i] for i in ids[found].tolist()]]
        np.testing.assert_array_equal(got["value"], want["value"])
        np.testing.assert_array_equal(got["last_step"], want["last_step"])
    found, got = disk.get(np.array([stored[0] + 1, stored[-1] + 1]))  # none found
    assert not found.any() and got.size == 0
    disk.close()


def test_the_last_lookups_records_answer_the_push_after_the_next_lookup_without_the_disk(
    tmp_path: Path,
) -> None:
    """A worker looks up batch 2 before it pushes batch 1: the push's read finds batch 1's records in
    memory, as those of each of the last ``_REMEMBER_READS`` lookups; a write drops the ids it changes."""
    disk = _disk(tmp_path / "t", tier_module.record_dtype(4, np.dtype(np.float32), {}), 1 << 24, "t")
    ids = np.arange(1000, dtype=np.int64)
    records = np.zeros(ids.size, disk.record)
    records["value"] = np.arange(ids.size * 4, dtype=np.float32).reshape(-1, 4)
    disk.write(ids, records)
    batches = [ids[i::5] for i in range(tier_module._REMEMBER_READS + 1)]  # disjoint
    for batch in batches:
        disk.get(batch[::-1], remember=True)
    reads = disk.stats.reads
    for batch in batches[1:]:  # the last lookups' (not the first's: one too many)
        mixed = np.random.default_rng(0).permutation(batch)
        found, got = disk.get(mixed)
        assert found.all() and disk.stats.reads == reads  # no disk read
        np.testing.assert_array_equal(got["value"], records["value"][mixed])
    both = np.concatenate([batches[1][:50], batches[-1][:50], batches[0][:50], [5000]])  # some not kept
    found, got = disk.get(both)
    assert found.tolist() == [True] * 150 + [False] and disk.stats.reads == reads + 1
    np.testing.assert_array_equal(got["value"], records["value"][both[:150]])
    changed = batches[-1][:10]
    newer = records[changed].copy()
    newer["value"] += 1
    disk.write(changed, newer)  # the remembered copies of these go
    found, got = disk.get(batches[-1][:20])
    assert found.all() and disk.stats.reads == reads + 2
    np.testing.assert_array_equal(got["value"][:10], newer["value"])
    np.testing.assert_array_equal(got["value"][10:], records["value"][batches[-1][10:20]])
    disk.close()


def test_a_lookup_that_a_write_overlaps_keeps_none_of_its_records_for_the_next_read(tmp_path: Path) -> None:
    disk = _disk(tmp_path / "t", tier_module.record_dtype(4, np.dtype(np.float32), {}), 1 << 24, "t")
    ids = np.arange(10, dtype=np.int64)
    disk.write(ids, np.zeros(ids.size, disk.record))
    entered, release = threading.Event(), threading.Event()
    hook = "_reserve" if _STORE == "lmdb" else "_room"  # each store's step before it writes
    reserve = getattr(disk, hook)

    def held(*args: Any) -> Any:  # the deletion of id 3 waits here, before its transaction
        entered.set()
        assert release.wait(10)
        return reserve(*args)

    setattr(disk, hook, held)
    deleting = threading.Thread(target=disk.write, args=(ids[:0], np.zeros(0, disk.record), [ids[3:4]]))
    deleting.start()
    try:
        assert entered.wait(10)
        found, _ = disk.get(ids[3:4], remember=True)  # before the write's commit: still there
        assert found.all()
    finally:
        release.set()
        deleting.join(10)
    assert not deleting.is_alive()
    found, _ = disk.get(ids[2:5])
    assert found.tolist() == [True, False, True]  # not answered from what the overlapped read saw
    disk.close()


def _records(tier: tier_module.ColdTier, steps: np.ndarray, times: np.ndarray) -> np.ndarray:
    records = np.zeros(steps.size, tier.record)
    records["last_step"], records["last_time"] = steps, times
    return records


def test_expired_reads_the_expiry_indexes_up_to_the_cut_exactly(tmp_path: Path) -> None:
    record = tier_module.record_dtype(4, np.dtype(np.float32), {})
    tier = _disk(tmp_path / "t", record, 1 << 30, "t", expiry=("last_step", "last_time"))
    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(-(1 << 62), 1 << 62, 3000))
    steps = rng.integers(-5, 400, ids.size)  # negative stamps order below zero
    times = rng.choice([-1e9, -2.5, -0.0, 0.0, 1e-300, 7.25, 1.7e9, 1.7e9 + 0.5], ids.size)
    tier.write(ids, _records(tier, steps, times))
    # Rewritten rows: their older entries go, the new stamps count.
    again = np.arange(0, ids.size, 3)
    older = _records(tier, steps[again], times[again])[["last_step", "last_time"]]
    steps[again] += 100
    times[again] = 1.8e9
    tier.write(ids[again], _records(tier, steps[again], times[again]), older=(ids[again], older))
    tier.check()
    for cut in (-6, -5, 0, 99, 100, 250, 1000):
        np.testing.assert_array_equal(tier.expired(cut, None), ids[steps < cut])
    for cut in (-1e9, -2.5, 0.0, 7.25, 1.7e9 + 0.5, 1.8e9, 1.9e9):
        np.testing.assert_array_equal(tier.expired(None, cut), ids[times < cut])
    np.testing.assert_array_equal(tier.expired(200, 7.25), ids[(steps < 200) | (times < 7.25)])
    # Deleted rows leave both indexes.
    gone = ids[steps < 100]
    tier.write(ids[:0], _records(tier, steps[:0], times[:0]), delete=[gone])
    tier.check()
    keep = steps >= 100
    np.testing.assert_array_equal(tier.expired(300, 1.9e9), ids[keep & ((steps < 300) | (times < 1.9e9))])
    no_index = _disk(tmp_path / "u", record, 1 << 30, "u")
    with pytest.raises(InternalError, match="no expiry index"):
        no_index.expired(1, None)
    tier.close()
    no_index.close()


@pytest.mark.parametrize("kw", [{"ttl_steps": 48}, {"ttl_seconds": 48.5}], ids=["ttl-steps", "ttl-seconds"])
def test_a_mass_expiry_leaves_the_disk_a_batch_a_push_and_reads_skip_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any]
) -> None:
    """Most of a table expires at one sweep. The tiered piece deletes its expired records a bounded batch
    per push, and meanwhile reads, scans, pushes and exports skip them: bit for bit the in-memory twin,
    which drops them at once. Once the batches are done, the counts agree too."""
    batch = 64
    monkeypatch.setattr(tiering, "_EXPIRE_BATCH", batch)
    tiered = _Table(_tier(str(tmp_path), 256 << 10), **kw)
    plain = _Table(None, **kw)
    early = np.arange(3000, dtype=np.int64) * 13 - 9000  # pushed once, early: they expire together
    steady = np.arange(-40, 0, dtype=np.int64)  # pushed at every step: they never expire
    seed = 0

    def push(ids: np.ndarray) -> None:
        nonlocal seed
        seed += 1
        for t in (tiered, plain):
            t.push(ids, seed=seed)

    def same() -> None:
        probe = np.concatenate([early, steady])
        np.testing.assert_array_equal(tiered.rows.read(tiered.var, probe), plain.rows.read(plain.var, probe))
        _, rows, last = tiered.rows.scan(tiered.var, None, 10_000)
        ids, _, plain_last = plain.rows.scan(plain.var, None, 10_000)
        assert last and plain_last
        np.testing.assert_array_equal(rows, plain.rows.read(plain.var, ids))
        va, _, ma = tiered.export()
        vb, _, mb = plain.export()
        np.testing.assert_array_equal(ma["ids"], mb["ids"])
        np.testing.assert_array_equal(va, vb)

    for part in np.array_split(early, 6):  # within one sweep's interval (1/8 of the TTL)
        push(np.concatenate([part, steady]))
    tier = tiered.rows.tier
    assert tier is not None and len(tier) > 1500  # most of them are on disk
    expired_before = plain.rows.stats.expired
    # Steps go by (and seconds: a push is a second here) until sweeps have expired nearly all of them.
    for _ in range(100):
        if plain.rows.stats.expired - expired_before > 2500:
            break
        on_disk = len(tier)
        push(steady)
        assert len(tier) >= on_disk - batch  # the rows in memory expire at once, the disk a batch a push
    assert plain.rows.stats.expired - expired_before > 2500
    assert tier.expiring and len(tier) > 1000  # the sweeps deleted a batch a push; reads skip the rest
    same()
    # Ids pushed again start afresh, as in the twin, though their expired records are still on disk:
    # the push deletes those (the index entries of a record go with it: ``check``).
    again = early[-200::7]
    push(np.concatenate([again, steady]))
    tier.check()
    same()
    pushes = 0
    while tier.expiring:
        push(steady)
        pushes += 1
        assert pushes < 3000 // batch + 5
    tier.check()
    same()
    assert tiered.rows.stats.expired == plain.rows.stats.expired
    assert len(tiered.rows) == len(plain.rows)


def test_a_full_disk_tier_refuses_the_push_and_leaves_the_table_unchanged(tmp_path: Path) -> None:
    tier = _tier(str(tmp_path), 64 << 10, disk_bytes=1 << 20)
    t = _Table(tier, dim=64)
    before = None
    with pytest.raises(TierFullError, match="disk tier is full") as caught:
        for step in range(400):  # 64 new rows a push, 64-dim: the 1 MiB tier fills within a few dozen
            before = t.export(), t.rows.clock, t.var.version, len(t.rows), t.rows.hot_len
            t.push(np.arange(step * 64, (step + 1) * 64), seed=step)
    assert isinstance(caught.value, ResourceExhaustedError)
    assert before is not None
    (values, slots, meta), clock, version, n, hot = before
    assert (t.rows.clock, t.var.version, len(t.rows), t.rows.hot_len) == (clock, version, n, hot)
    v2, s2, m2 = t.export()
    np.testing.assert_array_equal(m2["ids"], meta["ids"])
    np.testing.assert_array_equal(v2, values)
    for k in slots:
        np.testing.assert_array_equal(s2[k], slots[k])
    held = meta["ids"][t.rows.index.get(meta["ids"]) >= 0]
    assert held.size >= 10
    t.push(held[:10], seed=1)  # rows already in memory still train (no spill needed)


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 4 MiB tmpfs: a disk that fills (needs root and mount: skipped elsewhere)."""
    with mounted_tmpfs(tmp_path / "small", "4m") as mnt:
        yield mnt


def test_a_full_disk_is_a_typed_error_before_the_write_never_a_crash(small_disk: Path) -> None:
    # In a child process: the tier writes through a memory map, and a write to a block the disk cannot
    # allocate would be a SIGBUS; it must be a TierFullError before the write, the table unchanged.
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]
        import test_tier
        from test_tier import _Table, _tier
        from psserver.tier import TierFullError
        test_tier._STORE = {_STORE!r}
        t = _Table(_tier({str(small_disk)!r}, 64 << 10), dim=64)
        try:
            for step in range(1000):
                pushed = np.arange((step + 1) * 64)
                before = t.rows.read(t.var, pushed), len(t.rows)
                t.push(pushed[-64:], seed=step)
        except TierFullError as err:
            assert "No space left on device" in str(err), err
            assert np.array_equal(t.rows.read(t.var, pushed), before[0]) and len(t.rows) == before[1]
            held = pushed[t.rows.index.get(pushed) >= 0][:10]
            assert held.size == 10
            t.push(held, seed=1)  # still serving: rows in memory train (a log tier appends a fill's spills)
            try:  # an export's scratch files cannot be allocated either: an error, not a SIGBUS
                t.export()
            except OSError as err:
                assert err.errno == 28, err
            print("full after", step, "pushes")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "full after" in proc.stdout and int(proc.stdout.split()[2]) > 10  # it filled the disk first


def test_a_push_with_more_rows_than_memory_holds_is_refused_unchanged(tmp_path: Path) -> None:
    t = _Table(_tier(str(tmp_path), 64 << 10))
    t.push(np.arange(10), seed=0)
    before = t.export()
    with pytest.raises(ResourceExhaustedError, match="raise --table-memory"):
        t.push(np.arange(t.rows.hot_rows + 1), seed=1)
    np.testing.assert_array_equal(t.export()[0], before[0])
    assert t.rows.clock == 1


def test_an_export_restores_into_a_tiered_or_an_in_memory_piece_and_goes_on_alike(tmp_path: Path) -> None:
    pushes = _stream(80, 100, 3000, seed=5)
    small = _tier(str(tmp_path / "a"), 64 << 10)
    a = _Table(small)
    for i, ids in enumerate(pushes[:40]):
        a.push(ids, seed=i)
    assert a.rows.tier is not None and len(a.rows.tier) > 0
    values, slots, meta = a.export()
    restored = [
        _Table(_tier(str(tmp_path / "b"), 80 << 10)),  # another budget
        _Table(None),
    ]
    for t in restored:
        t.rows.load(t.var, t.var.optimizer, values, slots, meta)
        t.var.iterations, t.now = a.var.iterations, a.now
    assert restored[0].rows.tier is not None and len(restored[0].rows.tier) > 0
    for i, ids in enumerate(pushes[40:], start=40):
        for t in (a, *restored):
            t.push(ids, seed=i)
    _assert_same(a, restored[1])
    _assert_same(restored[0], restored[1])


@pytest.mark.parametrize("chunk", [None, 7], ids=["chunks-of-64k", "chunks-of-7"])
def test_an_export_begun_at_an_instant_gives_that_instants_rows_in_files_while_pushes_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    # A save pins the rows as they are (updates held back only while the rows in memory are copied), then
    # reads the cold ones while pushes spill and fill again; its arrays live in files, not in the process.
    # With chunks of 7 rows, the merge interleaves many chunks of rows in memory and on disk.
    if chunk:
        monkeypatch.setattr(export_module, "CHUNK_ROWS", chunk)
        monkeypatch.setattr(tier_module, "CHUNK_ROWS", chunk)
    pushes = _stream(90, 120, 4000, seed=9)
    tiered = _Table(_tier(str(tmp_path), 64 << 10), opt=Adam(0.01))
    plain = _Table(None, opt=Adam(0.01))
    for t in (tiered, plain):
        for i, ids in enumerate(pushes[:50]):
            t.push(ids, seed=i)
    assert tiered.rows.tier is not None and tiered.rows.stale > 0
    assert tiered.rows.cold_len > tiered.rows.hot_len
    # With chunks of 7 also into staged arrays (``stage_export``: pages written before updates are held).
    export = tiered.rows.begin_export(tiered.var, tiered.rows.stage_export(tiered.var) if chunk else None)
    spilled = tiered.rows.tier.stats.spilled
    for i, ids in enumerate(pushes[50:], start=50):
        tiered.push(ids, seed=i)
    assert tiered.rows.tier.stats.spilled > spilled  # the tier changed under the pinned export
    try:
        values, slots, meta = export()
    finally:
        export.close()
    want_values, want_slots, want_meta = plain.export()
    np.testing.assert_array_equal(meta["ids"], want_meta["ids"])
    np.testing.assert_array_equal(values, want_values)
    assert slots.keys() == want_slots.keys()
    for k in slots:
        np.testing.assert_array_equal(slots[k], want_slots[k])
    for k in ("last_step", "hits", "last_time", "clock", "last_sweep"):
        np.testing.assert_array_equal(meta[k], want_meta[k])
    for arr in (values, slots["momentum"], meta["ids"], meta["last_time"]):
        assert _in_a_file(arr)  # a scratch file's pages, not the heap's
    assert not [p for p in tiered.rows.tier.path.parent.iterdir() if p.name.startswith(".scratch")]  # removed


def test_a_restore_writes_the_cold_rows_in_chunks_into_full_pages(tmp_path: Path) -> None:
    # More rows than one chunk of the restore's write, into a small budget: appended in id order.
    n = CHUNK_ROWS + 5000
    ids = np.arange(n, dtype=np.int64) * 3 - n
    src = _Table(None, dim=8)
    src.push(ids, seed=0)
    values, slots, meta = src.export()
    t = _Table(_tier(str(tmp_path), 64 << 10), dim=8)
    t.rows.load(t.var, t.var.optimizer, values, slots, meta)
    assert t.rows.tier is not None and t.rows.cold_len == n - t.rows.hot_len and t.rows.hot_len > 0
    _assert_same(t, src)
    # Appended in id order, the records fill their pages (keys and headers besides): not half-full pages;
    # the log's segments hold its records and ids, and one segment's room for more.
    tier = t.rows.tier
    used = (int(tier.env.info()["last_pgno"]) + 1) * 4096 if _STORE == "lmdb" else tier.disk_used
    room = 0 if _STORE == "lmdb" else 256 << 10
    assert used < 1.5 * t.rows.cold_len * tier.record.itemsize + room


def _in_a_file(arr: np.ndarray) -> bool:
    base = arr.base
    while isinstance(base, np.ndarray | memoryview):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return isinstance(base, mmap.mmap)


def test_a_checkpoint_of_a_tiered_piece_reads_back_mapped_and_reshards_into_scratch_files(
    tmp_path: Path,
) -> None:
    t = _Table(_tier(str(tmp_path / "a"), 64 << 10))
    for i, ids in enumerate(_stream(40, 100, 3000, seed=3)):
        t.push(ids, seed=i)
    values, slots, meta = t.export()
    stored = ckptfile.StoredTensor(
        t.spec, values, t.var.version, slots, iterations=t.var.iterations, rows=meta
    )
    snap = ckptfile.Snapshot(shard=0, num_shards=1, mode="async", tensors=[stored], dedup={}, mode_state={})
    path = ckptfile.write(snap, tmp_path / "ckpt", 1)
    back = ckptfile.read(path).tensors[0]
    assert back.rows is not None and _in_a_file(back.value) and _in_a_file(back.rows["ids"])
    assert not back.value.flags.writeable  # the file's pages, read as used
    np.testing.assert_array_equal(back.value, values)
    np.testing.assert_array_equal(back.slots["accumulator"], slots["accumulator"])
    np.testing.assert_array_equal(back.rows["last_time"], meta["last_time"])
    # Re-cut for 2 shards into a tier's scratch files: every row exactly once, with its slots.
    scratch = _tier(str(tmp_path / "b"), 64 << 10).scratch
    pieces = [ckptfile.reshard([ckptfile.read(path)], i, 2, scratch).tensors[0] for i in range(2)]
    assert all(p.rows is not None and _in_a_file(p.value) for p in pieces)
    got = np.concatenate([p.rows["ids"] for p in pieces if p.rows is not None])
    order = np.argsort(got)
    np.testing.assert_array_equal(got[order], meta["ids"])
    np.testing.assert_array_equal(np.concatenate([p.value for p in pieces])[order], values)
    np.testing.assert_array_equal(
        np.concatenate([p.slots["accumulator"] for p in pieces])[order], slots["accumulator"]
    )
    # A flipped byte of a mapped array fails its CRC check, as one read into memory does.
    data = bytearray(path.read_bytes())
    data[bytes(data).index(values.tobytes()[:64]) + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ckptfile.CheckpointError, match="CRC"):
        ckptfile.read(path)


def test_scan_pages_through_rows_in_memory_and_on_disk_in_id_order(tmp_path: Path) -> None:
    t = _Table(_tier(str(tmp_path), 64 << 10))
    plain = _Table(None)
    for i, ids in enumerate(_stream(30, 150, 5000, seed=2)):
        t.push(ids, seed=i)
        plain.push(ids, seed=i)
    assert t.rows.tier is not None and len(t.rows.tier) > 0
    seen, after = [], None
    while True:
        ids, rows, last = t.rows.scan(t.var, after, 97)
        seen.append(ids)
        np.testing.assert_array_equal(rows, plain.rows.read(plain.var, ids))
        if last:
            break
        after = int(ids[-1])
    got = np.concatenate(seen)
    np.testing.assert_array_equal(got, plain.export()[2]["ids"])
    # Past the last id, on disk or in memory: nothing (not the scan over again from the first record).
    assert t.rows.scan(t.var, int(got[-1]), 97)[0].size == 0
    on_disk = t.rows.tier.scan(None, len(t.rows.tier))
    assert on_disk.size and t.rows.tier.scan(int(on_disk[-1]), 5).size == 0


def test_tier_directory_errors_are_clear(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TierDirError, match="cannot hold the disk tier"):
        _tier(str(blocker / "sub"), 1 << 20).open()
    ok = _tier(str(tmp_path / "d"), 1 << 20)
    fd = ok.open()
    try:
        with pytest.raises(TierDirError, match="in use by another shard process"):
            ok.open()
        other = TierConfig(directory=ok.directory, memory_bytes=1 << 20, owner="shard-backup")
        os.close(other.open())  # another process role shares the directory, in its own subdirectory
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="at least 64 KiB"):
        _tier(str(tmp_path), 100)


@pytest.mark.parametrize("inline", [False, True], ids=["primary", "backup"])
def test_the_tables_of_a_shard_share_its_budget_and_train_like_tables_in_memory(
    tmp_path: Path, inline: bool
) -> None:
    """Two tables in one store claim the shard's one budget as they grow: together within it, each
    bit-for-bit its twin in memory. The first, alone, claims nearly all of it; when the second grows, the
    first gives back down to an equal share. A third table starts on an overdraft the others give back at
    the next push; a table whose equal share would not hold its first rows is refused. ``backup``: the
    store applies each variable's update alone (``apply_one``), as a backup replays its primary's."""
    budget = 160 << 10
    store = Store(tier=_tier(str(tmp_path), budget))
    twins = Store()
    specs = [_spec(16, Adagrad(0.1)), _spec(8, Adam(0.01), ttl_steps=30)]
    specs[1].name, specs[1].dynamic.table = "u/rows_0", "u"
    store.create(specs, {})
    twins.create(specs, {})
    rows = [store.get(sp.name).dyn for sp in specs]
    assert all(r is not None and r.limit > 0 for r in rows)
    now = 1000.0
    for step, ids in enumerate(_stream(160, 100, 3000, seed=4)):
        # The first table grows alone for a while, then both push: it claims the larger share.
        names = [specs[0].name] if step < 40 else [sp.name for sp in specs]
        for s in (store, twins):
            grads = {}
            for name in names:
                dim = s.get(name).shape[1]
                grads[name] = tables.RowGrad(
                    ids, np.random.default_rng(step).standard_normal((ids.size, dim), np.float32)
                )
            if inline and s is store:
                for var, grad in s.validate_grads(grads):
                    asyncio.run(s.apply_one(var, grad, now))
            else:
                asyncio.run(s.apply(s.validate_grads(grads), now))
        now += 1.0
        claimed = sum(r.claimed for r in rows if r is not None)
        assert claimed <= budget and store.tier_budget is not None and store.tier_budget.claimed == claimed
        assert all(r is not None and r.hot_len <= r.limit for r in rows)
        if step == 39:
            alone = rows[0].claimed if rows[0] is not None else 0
            assert alone > budget * 3 // 4
    a, b = rows
    assert a is not None and b is not None and a.tier is not None and b.tier is not None
    assert len(a.tier) > 0 and len(b.tier) > 0  # both spilled: the budget holds neither table whole
    fair = budget // 2
    assert store.tier_budget.free < a.row_bytes  # the budget is spent
    assert fair - a.row_bytes < a.claimed <= fair + a.row_bytes < alone  # it gave back to an equal share
    assert fair - 2 * b.row_bytes < b.claimed
    for sp in specs:
        mine, twin = store.get(sp.name), twins.get(sp.name)
        assert mine.dyn is not None and twin.dyn is not None
        va, sa, ma = mine.dyn.export(mine)
        vb, sb, mb = twin.dyn.export(twin)
        np.testing.assert_array_equal(ma["ids"], mb["ids"])
        np.testing.assert_array_equal(va, vb)
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k])
    late = _spec(16, Adagrad(0.1))
    late.name, late.dynamic.table = "v/rows_0", "v"
    store.create([late], {})
    assert store.tier_budget.owed > 0 and store.tier_budget.pieces == 3
    ids = np.arange(10)
    grads = {late.name: tables.RowGrad(ids, np.ones((ids.size, 16), np.float32))}
    asyncio.run(store.apply(store.validate_grads(grads), now))
    assert store.tier_budget.owed == 0 and store.tier_budget.claimed <= budget
    wide = _spec(128, Adagrad(0.1))
    wide.name, wide.dynamic.table = "w/rows_0", "w"
    with pytest.raises(InvalidArgumentError, match="shared by 4 tables gives each"):
        store.create([wide], {})
    assert "w/rows_0" not in store and store.tier_budget.pieces == 3
    store.clear()  # the pieces are dropped: their claims come back
    assert store.tier_budget.claimed == 0 and store.tier_budget.pieces == 0


def test_a_budget_too_small_for_the_table_is_refused_at_creation(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="--table-memory"):
        _Table(_tier(str(tmp_path), 64 << 10), dim=1024)


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("1.5G") == 3 << 29
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_a_small_piece_spills_an_eighth_of_its_rows_at_once_not_a_sixty_fourth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spill's fixed cost (its numpy calls, the store's write and commit) is paid once for every
    ``spill_slack`` rows a piece spills beyond what a push needs: a piece of a few hundred rows in memory
    spills an eighth of them at once (a 64th of them made it spill at nearly every push). The rows stay
    bit-exact with the table in memory."""
    spills: list[tuple[int, int]] = []  # (rows spilled, the piece's rows in memory then)
    chosen = DynamicRows._spill_victims

    def counted(self: DynamicRows, candidates: np.ndarray, n: int) -> np.ndarray:
        got = chosen(self, candidates, n)
        spills.append((got.size, self.limit))
        return got

    monkeypatch.setattr(DynamicRows, "_spill_victims", counted)
    tiered, plain = _Table(_tier(str(tmp_path), 96 << 10)), _Table(None)
    stream = _stream(120, 40, 6000, seed=4)
    for step, ids in enumerate(stream):
        for t in (tiered, plain):
            t.push(ids, seed=step)
    limit = tiered.rows.limit
    assert 100 < limit < 8 * 2048 and len(spills) > 10
    assert all(n > lim // 8 for n, lim in spills)  # each spill: what the push needs, and an eighth more
    assert len(spills) < len(stream) // 2  # not at every push
    _assert_same(tiered, plain)


@pytest.mark.parametrize("window", [None, 1], ids=["window", "small-windows"])
@pytest.mark.parametrize(
    "kw", [{}, {"eviction": ps_pb2.EVICTION_LFU}, {"ttl_steps": 30}], ids=["lru", "lfu", "lru-ttl"]
)
def test_a_spill_evicts_exactly_the_rows_the_policy_orders_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any], window: int | None
) -> None:
    """An LRU piece takes its spills' victims from a queue chosen several spills ahead: each spill's rows
    are still the ones a selection over every row in memory picks (also when the queue is looked at in
    several windows: ``small-windows``)."""
    if window is not None:
        monkeypatch.setattr(tiering, "_QUEUE_WINDOW", window)
    chosen = DynamicRows._spill_victims
    spills = []

    def checked(self: DynamicRows, candidates: np.ndarray, n: int) -> np.ndarray:
        got = chosen(self, candidates, n)
        want = self.victims(np.flatnonzero(candidates), n)
        np.testing.assert_array_equal(np.sort(got), np.sort(want))
        spills.append(n)
        return got

    monkeypatch.setattr(DynamicRows, "_spill_victims", checked)
    t = _Table(_tier(str(tmp_path), 96 << 10), **kw)
    for step, ids in enumerate(_stream(150, 150, 6000, seed=3)):
        if step % 2:
            t.rows.read(t.var, ids)
        t.push(ids, seed=step)
    assert len(spills) > 50
