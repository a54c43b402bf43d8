"""Dynamic embedding tables without sockets: the hash index, the sketch, admission, eviction, expiry."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from pscore import embedding, placement
from pscore.errors import InvalidArgumentError
from pscore.optimizers import SGD, Adagrad, Adam, Optimizer
from psproto.v1 import ps_pb2
from psserver import tables
from psserver.hashindex import HashIndex
from psserver.rows import DynamicRows, PushPlan, select
from psserver.sketch import CountMinSketch
from psserver.store import Store, Variable


def test_hash_index_agrees_with_a_dict_through_inserts_removals_and_rebuilds() -> None:
    rng = np.random.default_rng(0)
    index = HashIndex(64)
    ref: dict[int, int] = {}
    for step in range(300):
        if ref and step % 3 == 2:  # remove some present ids
            gone = rng.choice(np.array(list(ref)), size=min(len(ref), 20), replace=False)
            index.remove(index.positions(gone))
            for g in gone.tolist():
                del ref[g]
        # new ids: wide 64-bit values, negatives, and a narrow range that collides in the table
        fresh = np.unique(np.concatenate([rng.integers(-(2**63), 2**63 - 1, 10), rng.integers(0, 200, 10)]))
        fresh = np.array([i for i in fresh.tolist() if i not in ref], np.int64)
        if len(ref) + fresh.size > 64:
            fresh = fresh[: max(0, 64 - len(ref))]
        vals = rng.integers(0, 1 << 40, fresh.size)
        index.insert(fresh, vals)
        ref.update(zip(fresh.tolist(), vals.tolist(), strict=True))
        probe = np.concatenate([np.array(list(ref), np.int64), rng.integers(-5, 5, 8)])
        want = np.array([ref.get(i, -1) for i in probe.tolist()])
        np.testing.assert_array_equal(index.get(probe), want)
        assert len(index) == len(ref)
    assert index.size == 128  # never grew past 2 x its 64 entries: removals leave no tombstones


def test_hash_index_grows_when_asked_for_more() -> None:
    index = HashIndex(4)
    ids = np.arange(10_000, dtype=np.int64) * 7919
    index.insert(ids, ids + 1)
    np.testing.assert_array_equal(index.get(ids), ids + 1)
    assert index.size >= 2 * ids.size


def test_sketch_never_undercounts_and_halves_with_age() -> None:
    rng = np.random.default_rng(1)
    sketch = CountMinSketch(1 << 10)
    truth: dict[int, int] = {}
    for _ in range(50):  # 500 ids added: below the width, so no halving yet
        ids = np.unique(rng.integers(0, 300, 10))
        counts = sketch.add(ids)
        for i, c in zip(ids.tolist(), counts.tolist(), strict=True):
            truth[i] = truth.get(i, 0) + 1
            assert c >= truth[i]
    exact = sum(sketch.estimate(np.array([i]))[0] == n for i, n in truth.items())
    assert exact >= 0.9 * len(truth)  # 4 rows of 1024 columns for 300 ids: nearly all exact
    before = sketch.estimate(np.arange(300))
    sketch.add(np.arange(10_000, 10_000 + 1024 - sketch.added))  # reaches the width: halves
    assert sketch.added == 0
    assert (sketch.estimate(np.arange(300)) <= (before.astype(int) + 1) // 2 + 1).all()


@pytest.mark.parametrize("other_width", [1 << 8, 1 << 10, 1 << 12])
def test_sketches_merge_into_any_width_without_undercounting(other_width: int) -> None:
    ids = np.arange(0, 700, 7, dtype=np.int64)  # 100 ids: no halving in any of the widths
    a, b = CountMinSketch(other_width), CountMinSketch(other_width)
    a.add(ids[::2])
    a.add(ids[::2])
    b.add(ids[1::2])
    merged = CountMinSketch(1 << 10)
    merged.merged([a, b])
    est = merged.estimate(ids)
    assert (est[::2] >= 2).all() and (est[1::2] >= 1).all()


def _spec(name: str = "t", dim: int = 2, opt: Optimizer | None = None, **kw: Any) -> ps_pb2.VariableSpec:
    init = kw.pop("initializer", ("uniform", -1.0, 1.0))
    kind, *args = (init,) if isinstance(init, str) else init  # unchecked: the shard checks it
    spec = ps_pb2.VariableSpec(
        name=f"{name}/rows_0",
        dtype=ps_pb2.DTYPE_FLOAT32,
        shape=[0, dim],
        optimizer=(opt or SGD(1.0)).to_proto(),
    )
    spec.dynamic.CopyFrom(
        ps_pb2.DynamicTable(
            table=name,
            dim=dim,
            index=0,
            count=1,
            initializer=ps_pb2.RowInitializer(name=kind, args=args),
            **kw,
        )
    )
    return spec


class _Table:
    """A dynamic table piece in a real store (one shard), pushed to like the servicer does."""

    def __init__(self, store: Store | None = None, **kw: Any) -> None:
        self.store = store if store is not None else Store()
        self.spec = _spec(**kw)
        self.store.create([self.spec], {})
        self.var: Variable = self.store.get(self.spec.name)
        self.name = self.spec.dynamic.table
        self.now = 1000.0

    @property
    def rows(self) -> DynamicRows:
        assert self.var.dyn is not None
        return self.var.dyn

    def push(self, ids: Any, value: float = 1.0, *, dt: float = 1.0) -> None:
        ids = np.asarray(ids, np.int64)
        grad = tables.RowGrad(ids, np.full((ids.size, self.var.shape[1]), value, np.float32))
        pairs = self.store.validate_grads({self.spec.name: grad})
        self.now += dt
        asyncio.run(self.store.apply(pairs, self.now))

    def read(self, ids: Any) -> np.ndarray:
        return self.rows.read(self.var, np.asarray(ids, np.int64))

    def init(self, ids: Any) -> np.ndarray:
        return self.rows.initial_rows(np.asarray(ids, np.int64))

    def held(self) -> list[int]:
        return sorted(self.rows.index.items()[0].tolist())


def test_a_row_starts_from_its_initializer_row_on_its_first_push() -> None:
    t = _Table()
    ids = [7, -(2**62), 2**63 - 1]
    np.testing.assert_array_equal(
        t.read(ids), embedding.init_rows("t", np.array(ids), 2, np.float32, ("uniform", -1.0, 1.0))
    )
    assert t.held() == []  # a lookup creates nothing
    assert t.rows.stats.initializer_reads == 3
    t.push([7, 7 + 0, 2**63 - 1], 0.25)  # SGD(1.0); duplicates summed by validate
    np.testing.assert_allclose(t.read([7]), t.init([7]) - 0.5)
    np.testing.assert_allclose(t.read([2**63 - 1]), t.init([2**63 - 1]) - 0.25)
    np.testing.assert_array_equal(t.read([-(2**62)]), t.init([-(2**62)]))
    assert t.held() == [7, 2**63 - 1] and t.rows.stats.admitted == 2 and t.var.version == 1


def test_new_rows_get_fresh_optimizer_slots() -> None:
    t = _Table(opt=Adagrad(0.1), capacity=2, initializer="ones")
    t.push([1, 2], 0.5)
    t.push([3], 0.5)  # evicts 1 (least recent, smallest id); its slot row goes to 3
    acc = np.float32(0.1) + np.float32(0.25)
    expected = np.float32(1.0) - np.float32(0.1) * np.float32(0.5) / np.sqrt(acc + np.float32(1e-7))
    np.testing.assert_allclose(t.read([3]), np.full((1, 2), expected), rtol=1e-6)
    assert t.held() == [2, 3]


def test_a_new_rows_moving_average_starts_from_its_initializer_row() -> None:
    # use_ema: a row admitted after the table's first push averages from its initial row, not from 0.
    t = _Table(opt=SGD(1.0, use_ema=True, ema_momentum=0.5), capacity=2, initializer="ones")
    t.push([1], 1.0)  # the table's first push: average = the new row (0)
    t.push([2], 1.0)  # row 2: 1 -> 0, average 0.5 * 1 + 0.5 * 0
    t.push([3], 1.0)  # evicts 1: row 3 gets 1's storage row, its average starts from 3's initial row
    slot = t.var.slots["average"]
    positions = t.rows.index.get(np.array([2, 3], np.int64))
    np.testing.assert_array_equal(slot[positions], np.full((2, 2), 0.5, np.float32))


def test_min_count_drops_updates_until_an_id_is_admitted() -> None:
    t = _Table(min_count=3)
    t.push([5, 6], 1.0)
    t.push([5], 1.0)
    np.testing.assert_array_equal(t.read([5, 6]), t.init([5, 6]))  # not admitted yet: updates dropped
    assert t.held() == [] and t.rows.stats.dropped_updates == 3
    t.push([5, 6], 1.0)  # 5's third push: admitted, and this update applied
    assert t.held() == [5]
    np.testing.assert_allclose(t.read([5]), t.init([5]) - 1.0)
    t.push([5], 1.0)  # admitted rows are no longer counted
    np.testing.assert_allclose(t.read([5]), t.init([5]) - 2.0)
    assert t.rows.stats.admitted == 1 and t.rows.stats.dropped_updates == 4


def test_lru_evicts_the_least_recently_updated_rows_ties_by_id_never_this_pushs() -> None:
    t = _Table(capacity=4)
    t.push([10, 11])
    t.push([12, 13])
    t.push([10])  # 11 is now the least recent
    t.push([20])
    assert t.held() == [10, 12, 13, 20]
    t.push([21, 22])  # 12 and 13 are tied (step 2): both go
    assert t.held() == [10, 20, 21, 22]
    t.push([10, 20, 21, 30])  # 22 is the only row not in this push
    assert t.held() == [10, 20, 21, 30]
    assert t.rows.stats.evicted == 4 and t.rows.stats.admitted == 8
    np.testing.assert_array_equal(t.read([11, 22]), t.init([11, 22]))  # evicted: back to the initializer


def test_lfu_evicts_the_rows_with_fewest_updates() -> None:
    t = _Table(capacity=3, eviction=ps_pb2.EVICTION_LFU)
    for _ in range(3):
        t.push([1])
    t.push([2, 3])
    t.push([2])
    t.push([4])  # 3 has one update (the fewest)
    assert t.held() == [1, 2, 4]
    t.push([5])  # 4 has 1 update, 2 has 2, 1 has 3
    assert t.held() == [1, 2, 5]


def test_a_push_with_more_new_ids_than_the_capacity_admits_the_smallest() -> None:
    t = _Table(capacity=3)
    t.push([1])
    t.push([9, 8, 7, 1, 6])  # 1 stays (in this push); 3 rows in all: 1 and the two smallest new ids
    assert t.held() == [1, 6, 7]
    assert t.rows.stats.dropped_updates == 2


def test_ttl_steps_expires_rows_not_updated_for_that_many_pushes() -> None:
    t = _Table(ttl_steps=8)  # a sweep every 8 // 8 = 1 push
    t.push([1, 2])
    for _ in range(8):
        t.push([2])
    assert t.held() == [1, 2]  # 1 was updated 8 pushes ago: not older than the TTL yet
    t.push([2])
    assert t.held() == [2] and t.rows.stats.expired == 1


def test_ttl_seconds_expires_rows_by_the_push_time() -> None:
    t = _Table(ttl_seconds=10.0)
    t.push([1, 2], dt=1.0)
    t.push([2], dt=5.0)
    t.push([2], dt=4.5)  # 1 is 9.5 s old
    assert t.held() == [1, 2]
    t.push([2], dt=1.0)  # 10.5 s, but the last sweep was 1 s ago (sweeps every 10 / 8 s)
    assert t.held() == [1, 2]
    t.push([2], dt=0.5)
    assert t.held() == [2] and t.rows.stats.expired == 1


def test_memory_stays_bounded_by_the_capacity_whatever_the_id_stream() -> None:
    t = _Table(capacity=256, dim=4, opt=Adam(0.01))
    allocated = (t.rows.allocated, t.var.value.shape, {k: a.shape for k, a in t.var.slots.items()})
    index_size = t.rows.index.keys.size
    rng = np.random.default_rng(2)
    for _ in range(200):  # 200 x 64 ids out of 100k: far more distinct ids than rows
        t.push(np.unique(rng.integers(0, 100_000, 64)))
    assert len(t.rows) <= 256
    assert (t.rows.allocated, t.var.value.shape, {k: a.shape for k, a in t.var.slots.items()}) == allocated
    assert t.rows.index.keys.size == index_size
    assert t.rows.stats.admitted - t.rows.stats.evicted == len(t.rows)


def test_an_unbounded_table_grows_and_keeps_every_row() -> None:
    t = _Table(opt=Adagrad(0.1))
    ids = np.arange(5000, dtype=np.int64) * 3
    t.push(ids[:10], 0.5)
    before = t.read(ids[:10])
    for start in range(0, ids.size, 1000):
        t.push(ids[start : start + 1000], 0.0)
    assert len(t.rows) == 5000 and t.rows.allocated >= 5000
    # the first 10 rows: one 0.5 push, then one zero-gradient push (Adagrad: no change)
    np.testing.assert_array_equal(t.read(ids[:10]), before)


def test_an_unbounded_table_grows_in_a_worker_thread_before_the_push_changes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Growing copies every row: the copy runs off the event loop (as the optimizer's large updates do),
    before the push changes anything, and the push then finds room. Ids that admission drops, and rows
    a due sweep frees, are not grown for."""
    threads: list[bool] = []
    grown = DynamicRows.grown

    def spy(self: DynamicRows, *args: Any) -> Any:
        threads.append(threading.current_thread() is threading.main_thread())
        return grown(self, *args)

    def never(*args: Any) -> None:
        raise AssertionError("the push grew the table itself, on the event loop")

    monkeypatch.setattr(DynamicRows, "grown", spy)
    monkeypatch.setattr(DynamicRows, "_grow", never)
    t = _Table(Store(inline_apply_bytes=0), dim=4, opt=Adagrad(0.1))  # offload every computation
    twin = _Table(dim=4, opt=Adagrad(0.1), capacity=1 << 16)  # room for every row from the start
    ids = np.arange(20_000, dtype=np.int64) * 7
    for start in range(0, ids.size, 1500):
        for table in (t, twin):
            table.push(ids[start : start + 1500], 0.01 * (start % 7 - 3))
    assert len(threads) >= 4 and not any(threads)  # every growth ran in a worker thread
    assert len(t.rows) == len(twin.rows) == ids.size
    np.testing.assert_array_equal(t.read(ids), twin.read(ids))

    admitting = _Table(dim=4, min_count=2)
    admitting.push(np.arange(100), 1.0)
    admitting.push(np.arange(100), 1.0)  # admitted at their second push
    free, allocated = admitting.rows.nfree, admitting.rows.allocated
    admitting.push(np.arange(1000, 1000 + 4 * free), 1.0)  # first sightings: none admitted
    assert admitting.rows.allocated == allocated and len(admitting.rows) == 100
    expiring = _Table(dim=4, ttl_steps=8)
    expiring.push(np.arange(expiring.rows.nfree), 1.0)  # full
    allocated = expiring.rows.allocated
    for _ in range(8):
        expiring.push(np.arange(2), 1.0)
    expiring.push(np.arange(10_000, 10_500), 1.0)  # the sweep this push runs frees the room it needs
    assert expiring.rows.allocated == allocated and len(expiring.rows) == 502


def test_a_full_tables_id_index_is_never_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicted rows' ids leave the id index at once (no tombstones): a full table whose rows turn over
    every push keeps its index as it is, never rebuilt (on the event loop or off it)."""
    t = _Table(Store(inline_apply_bytes=0), capacity=4096, dim=4, opt=Adagrad(0.1))
    twin = _Table(capacity=4096, dim=4, opt=Adagrad(0.1))

    def never(*args: Any) -> None:
        raise AssertionError("a full table's id index was rebuilt")

    monkeypatch.setattr(HashIndex, "rebuilt", never)
    monkeypatch.setattr(HashIndex, "_rebuild", never)
    size = t.rows.index.keys.size
    rng = np.random.default_rng(4)
    for _ in range(80):
        ids = np.unique(rng.integers(0, 1 << 40, 700))  # mostly new ids: evictions
        for table in (t, twin):
            table.push(ids, 0.1)
    assert t.rows.stats.evicted > 4 * 4096
    assert t.rows.index.keys.size == size  # the same size: a full table's index stays bounded
    assert t.held() == twin.held()
    np.testing.assert_array_equal(t.read(t.held()), twin.read(twin.held()))


def _plan_nothing_ahead(monkeypatch: pytest.MonkeyPatch, twin: _Table) -> None:
    """``twin``'s pushes work everything out inside the push, on the event loop, as before plans."""
    plan = DynamicRows.plan

    def bare(self: DynamicRows, ids: np.ndarray, now: float, filled: np.ndarray | None = None) -> PushPlan:
        return PushPlan(self.clock) if self is twin.rows else plan(self, ids, now, filled)

    monkeypatch.setattr(DynamicRows, "plan", bare)


@pytest.mark.parametrize("capacity", [0, 8192], ids=["unbounded", "capacity"])
def test_a_due_sweep_finds_the_expired_rows_before_the_push_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch, capacity: int
) -> None:
    """Finding a sweep's expired rows is a pass over every row of the piece: the push's plan makes it
    before the push changes anything, off the event loop, and the sweep removes exactly the rows it
    would have found itself (a twin finding them inside its pushes), the push's own rows kept."""
    kw = {"capacity": capacity, "dim": 4, "opt": Adagrad(0.1), "ttl_steps": 8}
    t = _Table(Store(inline_apply_bytes=0), **kw)
    twin = _Table(**kw)
    threads: list[bool] = []
    expired = DynamicRows._expired

    def spy(self: DynamicRows, clock: int, now: float, protect: np.ndarray) -> np.ndarray:
        if self is t.rows:
            threads.append(threading.current_thread() is threading.main_thread())
        return expired(self, clock, now, protect)

    monkeypatch.setattr(DynamicRows, "_expired", spy)
    _plan_nothing_ahead(monkeypatch, twin)
    rng = np.random.default_rng(8)
    old = rng.integers(0, 1 << 40, 3000)
    for step in range(40):
        # a batch of new ids, and every 9 pushes the old ids again, at the push whose sweep would expire
        # them (8 pushes idle, a sweep every push): the push's own rows stay
        ids = old if step % 9 == 0 else rng.integers(0, 1 << 40, 400)
        for table in (t, twin):
            table.push(np.unique(ids), 0.01 * (step % 5 - 2))
    assert t.rows.stats.expired > 3000
    assert len(threads) >= 4 and not any(threads)  # every sweep's pass ran in a worker thread
    assert t.held() == twin.held() and t.rows.stats == twin.rows.stats
    np.testing.assert_array_equal(t.read(t.held()), twin.read(twin.held()))


@pytest.mark.parametrize("eviction", [ps_pb2.EVICTION_LRU, ps_pb2.EVICTION_LFU], ids=["lru", "lfu"])
def test_a_full_table_picks_the_rows_it_evicts_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch, eviction: int
) -> None:
    """Picking victims is a pass over every row of the piece: it runs before the push changes anything,
    off the event loop, and picks exactly the rows the push would have picked (a twin picking them inside
    its pushes), though the push's sweep removes the oldest rows first."""
    kw = {"capacity": 1024, "dim": 4, "opt": Adagrad(0.1), "eviction": eviction, "ttl_steps": 4}
    t = _Table(Store(inline_apply_bytes=0), **kw)
    twin = _Table(**kw)  # picks its victims inside the push, as before
    threads: list[bool] = []
    victims = DynamicRows.victims

    def spy(self: DynamicRows, candidates: np.ndarray, n: int) -> np.ndarray:
        if self is t.rows:
            threads.append(threading.current_thread() is threading.main_thread())
        return victims(self, candidates, n)

    monkeypatch.setattr(DynamicRows, "victims", spy)
    _plan_nothing_ahead(monkeypatch, twin)
    rng = np.random.default_rng(6)
    hot = np.arange(40)
    step = 0
    for _ in range(4):
        # 600 rows, left idle until they expire at the push of 1000 new ids, which also evicts: the rows
        # it evicts are chosen among those its sweep leaves (never the expiring ones, oldest as they are).
        for ids in [rng.integers(100, 1 << 40, 600), *[hot] * 4, rng.integers(100, 1 << 40, 1000)]:
            step += 1
            for table in (t, twin):
                table.push(np.unique(ids), 0.01 * (step % 5 - 2))
    assert t.rows.stats.evicted > 100 and t.rows.stats.expired > 1000
    assert len(threads) >= 5 and not any(threads)  # every eviction picked in a worker thread
    assert t.held() == twin.held() and t.rows.stats == twin.rows.stats
    np.testing.assert_array_equal(t.read(t.held()), twin.read(twin.held()))


def _replay(t: _Table, pushes: list[np.ndarray]) -> None:
    for i, ids in enumerate(pushes):
        t.push(ids, 0.01 * (i % 5 - 2))


def test_a_piece_restored_from_its_export_goes_on_exactly_like_the_original() -> None:
    rng = np.random.default_rng(3)
    pushes = [np.unique(rng.integers(0, 300, 40)) for _ in range(60)]
    kw: dict[str, Any] = {"capacity": 100, "min_count": 2, "ttl_steps": 16, "opt": Adam(0.05)}
    a = _Table(**kw)
    _replay(a, pushes[:30])
    values, slots, meta = a.rows.export(a.var)
    b = _Table(**kw)
    assert b.var.dyn is not None
    b.var.dyn.load(b.var, b.var.optimizer, values, slots, meta)
    b.var.iterations = a.var.iterations
    b.now = a.now
    for t in (a, b):
        _replay(t, pushes[30:])
    assert a.held() == b.held()
    probe = np.arange(300)
    np.testing.assert_array_equal(a.read(probe), b.read(probe))


def test_a_load_into_a_smaller_piece_keeps_the_rows_the_policy_keeps() -> None:
    a = _Table(capacity=10)
    for i in range(10):
        a.push([i])
    values, slots, meta = a.rows.export(a.var)
    small = _Table(capacity=4)
    small.rows.load(small.var, small.var.optimizer, values, slots, meta)
    assert small.held() == [6, 7, 8, 9] and small.rows.stats.evicted == 6
    np.testing.assert_array_equal(small.read([6, 9]), a.read([6, 9]))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"capacity": -1}, "capacity -1 is negative"),
        ({"min_count": 70_000}, "min_count 70000 is out of range"),
        ({"ttl_steps": -2}, "must be >= 0"),
        ({"ttl_seconds": float("nan")}, "must be >= 0"),
        ({"initializer": ("glorot",)}, "unknown initializer"),
        ({"initializer": ("uniform", 1.0)}, "unknown initializer"),
        ({"opt": None, "eviction": 7}, "unknown eviction"),
    ],
)
def test_a_bad_dynamic_spec_is_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Store().create([_spec(**kw)], {})


def test_a_dynamic_piece_refuses_ids_of_other_shards_floats_and_assignments() -> None:
    store = Store()
    spec = _spec()
    spec.dynamic.count = 2
    spec.dynamic.index = 1
    store.create([spec], {})
    var = store.get(spec.name)
    ids = np.arange(10)
    mine = ids[placement.dynamic_row_shard(ids, 2) == 1]
    other = int(ids[placement.dynamic_row_shard(ids, 2) == 0][0])
    assert tables.check_ids(var.spec, mine, "lookup").tolist() == mine.tolist()
    with pytest.raises(InvalidArgumentError, match=f"id {other} is held by shard 0"):
        tables.check_ids(var.spec, np.array([other]), "lookup")
    with pytest.raises(InvalidArgumentError, match="not an integer"):
        tables.check_ids(var.spec, np.array([1.5]), "lookup")
    with pytest.raises(InvalidArgumentError, match="cannot be assigned"):
        store.validate_values({spec.name: np.zeros((0, 2), np.float32)})


def test_scan_pages_through_the_live_ids_in_order() -> None:
    t = _Table()
    ids = np.array([50, -3, 2**62, 7, -(2**63), 0, 9])
    t.push(ids)
    pages, after = [], None
    while True:
        got, rows, last = t.rows.scan(t.var, after, 3)
        np.testing.assert_array_equal(rows, t.read(got))
        pages.append(got.tolist())
        if last:
            break
        after = int(got[-1])
    assert pages == [[-(2**63), -3, 0], [7, 9, 50], [2**62]]
    assert t.rows.scan(t.var, 2**62, 3)[0].size == 0


def test_scan_of_a_fixed_piece_starts_after_any_id() -> None:
    spec = ps_pb2.VariableSpec(
        name="f/rows_1", table=ps_pb2.TableRows(table="f", num_rows=10, dim=1, index=1, count=3, rows=3)
    )
    value = np.array([[1.0], [4.0], [7.0]], np.float32)  # rows 1, 4, 7
    for after, n, want, last in [
        (None, 2, [1, 4], False),
        (1, 5, [4, 7], True),
        (2, 1, [4], False),
        (-(2**63), 9, [1, 4, 7], True),
        (7, 9, [], True),
        (2**63 - 1, 9, [], True),
    ]:
        ids, rows, done = tables.scan_fixed(spec, value, after, n)
        assert ids.tolist() == want and rows[:, 0].tolist() == want and done == last


def test_the_rows_a_restore_keeps_in_memory_are_chosen_in_chunks_as_one_selection_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tiered restore picks the rows the policy keeps longest a chunk of positions at a time (the
    # bookkeeping may be a checkpoint's memory map, larger than memory): the same rows as one selection.
    monkeypatch.setattr(select, "_SELECT_CHUNK", 1 << 14)  # chunks of 16,384 positions (2**20 in use)
    rng = np.random.default_rng(3)
    total, n = 36_000, 4_700  # three chunks
    ids = rng.permutation(total).astype(np.int64) * 3 - total
    last_step = rng.integers(0, 50, total)  # many ties, broken by the next key
    hits = rng.integers(0, 4, total)
    for keys in ([last_step, ids], [hits, last_step, ids]):
        dropped = select.smallest(np.arange(total), keys, total - n)
        want = np.setdiff1d(np.arange(total), dropped)
        np.testing.assert_array_equal(select.largest(total, keys, n), want)
    assert select.largest(10, [ids[:10]], 20).size == 10  # fewer rows than the room: all of them
