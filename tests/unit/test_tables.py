"""Embedding tables without sockets: the row rule, Rows duplicate sums, row-sparse optimizers, the store."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pscore import embedding, placement
from pscore.errors import AlreadyExistsError, InvalidArgumentError, ResourceExhaustedError
from pscore.optimizers import SGD, Adagrad, Adam, Lamb
from psproto.v1 import ps_pb2
from psserver import optimizers, tables
from psserver.store import Store


def test_row_rule_spreads_rows_by_modulo_and_balances_them() -> None:
    ids = np.arange(10)
    np.testing.assert_array_equal(placement.row_shard(ids, 3), ids % 3)
    np.testing.assert_array_equal(placement.local_row(ids, 3), ids // 3)
    for s in range(3):
        mine = ids[ids % 3 == s]
        np.testing.assert_array_equal(placement.global_row(np.arange(mine.size), s, 3), mine)
        assert placement.table_rows(10, s, 3) == mine.size
    assert [placement.table_rows(2, s, 4) for s in range(4)] == [1, 1, 0, 0]  # fewer rows than shards
    pieces = placement.table_pieces("t", 10, 4, "float32", 3)
    assert [(p.stored_name, p.stored_shape, p.table, p.partitioned) for p in pieces] == [
        ("t/rows_0", (4, 4), True, False),
        ("t/rows_1", (3, 4), True, False),
        ("t/rows_2", (3, 4), True, False),
    ]


def test_rows_duplicates_are_summed_in_order() -> None:
    ids, values = embedding.sum_duplicates(
        np.array([5, 1, 5, 5]), np.array([[1.0], [2.0], [10.0], [100.0]], np.float32)
    )
    np.testing.assert_array_equal(ids, [1, 5])
    np.testing.assert_array_equal(values, [[2.0], [111.0]])
    ids, values = embedding.sum_duplicates(np.array([], np.int64), np.zeros((0, 3), np.float32))
    assert ids.size == 0 and values.shape == (0, 3)


def test_initializer_is_a_function_of_table_and_row_only() -> None:
    a = embedding.init_rows("t", np.array([0, 5, 9]), 4, np.float32, "uniform")
    b = embedding.init_rows("t", np.array([9, 5]), 4, np.float32, "uniform")
    np.testing.assert_array_equal(a[[2, 1]], b)
    assert np.abs(a).max() <= 0.05
    assert not np.array_equal(a, embedding.init_rows("u", np.array([0, 5, 9]), 4, np.float32, "uniform"))
    with pytest.raises(ValueError, match="unknown initializer"):
        embedding.init_rows("t", np.array([0]), 4, np.float32, "glorot")


def _slots(opt: optimizers.ServerOptimizer, value: np.ndarray) -> dict[str, np.ndarray]:
    return opt.init_slots(value)


def test_sparse_sgd_is_the_dense_result_on_the_touched_rows() -> None:
    opt = optimizers.from_config(SGD(0.5))
    value = np.arange(8, dtype=np.float32).reshape(4, 2)
    grad = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    new = opt.apply_rows(value, np.array([1, 3]), grad, {}, 0)
    # hand-computed: w - 0.5 * g
    np.testing.assert_array_equal(new, [[2.0 - 0.5, 3.0 - 1.0], [6.0 - 1.5, 7.0 - 2.0]])
    dense = np.zeros_like(value)
    dense[[1, 3]] = grad
    np.testing.assert_array_equal(opt.apply(value, dense, {}, 0)[[1, 3]], new)


def test_sparse_adagrad_is_the_dense_result_on_the_touched_rows() -> None:
    opt = optimizers.from_config(Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7))
    value = np.ones((3, 2), np.float32)
    sparse_slots, dense_slots = _slots(opt, value), _slots(opt, value)
    grad = np.array([[0.5, 1.0]], np.float32)
    dense = np.zeros_like(value)
    dense[2] = grad
    v_sparse, v_dense = value, value
    for step in range(3):
        rows = opt.apply_rows(v_sparse, np.array([2]), grad, sparse_slots, step)
        v_sparse = v_sparse.copy()
        v_sparse[2] = rows
        v_dense = opt.apply(v_dense, dense, dense_slots, step)
    np.testing.assert_array_equal(v_sparse, v_dense)
    np.testing.assert_array_equal(sparse_slots["accumulator"], dense_slots["accumulator"])
    # hand-computed first step of row 2, column 0: acc = 0.1 + 0.25; w = 1 - 0.1 * 0.5 / sqrt(acc + eps)
    first = opt.apply_rows(value, np.array([2]), grad, _slots(opt, value), 0)
    assert first[0, 0] == pytest.approx(1 - 0.1 * 0.5 / np.sqrt(0.35 + 1e-7), rel=1e-6)


def test_lazy_adam_updates_only_the_slots_of_touched_rows() -> None:
    opt = optimizers.from_config(Adam(0.01))
    value = np.ones((4, 2), np.float32)
    slots = _slots(opt, value)
    opt.apply_rows(value, np.array([0, 2]), np.ones((2, 2), np.float32), slots, 0)
    assert slots["momentum"][[0, 2]].all() and not slots["momentum"][[1, 3]].any()
    with pytest.raises(ValueError, match="whole variable"):
        optimizers.from_config(Lamb()).apply_rows(value, np.array([0]), np.ones((1, 2), np.float32), {}, 0)


def _table_spec(name: str, num_rows: int, dim: int, index: int, count: int) -> ps_pb2.VariableSpec:
    rows = placement.table_rows(num_rows, index, count)
    return ps_pb2.VariableSpec(
        name=placement.table_piece_name(name, index),
        dtype=ps_pb2.DTYPE_FLOAT32,
        shape=[rows, dim],
        optimizer=SGD(1.0).to_proto(),
        table=ps_pb2.TableRows(table=name, num_rows=num_rows, dim=dim, index=index, count=count, rows=rows),
    )


async def test_store_applies_rows_in_place_and_refuses_bad_ids() -> None:
    store = Store()
    spec = _table_spec("t", 5, 2, 1, 2)  # rows 1 and 3
    store.create([spec], {spec.name: np.zeros((2, 2), np.float32)})
    var = store.get(spec.name)
    grad = tables.RowGrad(np.array([3, 3]), np.ones((2, 2), np.float32))
    pairs = store.validate_grads({spec.name: grad})
    assert await store.apply(pairs) == [1]
    np.testing.assert_array_equal(var.value, [[0, 0], [-2, -2]])
    for ids, values, message in [
        ([2], np.ones((1, 2)), "id 2 is held by shard 0"),
        ([7], np.ones((1, 2)), "id 7 is out of range"),
        ([-1], np.ones((1, 2)), "id -1 is out of range"),
        ([1.0], np.ones((1, 2)), "not an integer"),
        ([1], np.ones((1, 3)), "values of shape"),
    ]:
        bad = tables.RowGrad(np.array(ids), np.asarray(values, np.float32))
        with pytest.raises(InvalidArgumentError, match=f"table 't'.*{message}"):
            store.validate_grads({spec.name: bad})
    np.testing.assert_array_equal(var.value, [[0, 0], [-2, -2]])
    # A backup replays the same (raw) row gradient to the same result.
    backup = Store()
    backup.create([spec], {spec.name: np.zeros((2, 2), np.float32)})
    await backup.apply_one(backup.get(spec.name), grad)
    np.testing.assert_array_equal(backup.get(spec.name).value, var.value)
    await asyncio.sleep(0)


def test_store_refuses_inconsistent_table_specs() -> None:
    spec = _table_spec("t", 5, 2, 0, 2)
    spec.table.rows = 2
    with pytest.raises(InvalidArgumentError, match="holds 3 of 5 rows"):
        Store().create([spec], {spec.name: np.zeros((3, 2), np.float32)})
    spec = _table_spec("t", 5, 2, 0, 2)
    spec.optimizer.CopyFrom(Lamb().to_proto())
    with pytest.raises(InvalidArgumentError, match="whole variable"):
        Store().create([spec], {spec.name: np.zeros((3, 2), np.float32)})


@pytest.mark.parametrize(
    "init", ["uniform", ("uniform", -1.0, 2.0), "normal", ("normal", 0.5, 3.0), "zeros", "ones"]
)
async def test_a_shard_makes_a_pieces_rows_exactly_as_the_client_would(
    init: embedding.Initializer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tables, "_INIT_BLOCK_ELEMENTS", 7)  # blocks of 2 rows: the block seams are exact
    store = Store(inline_apply_bytes=0)  # make_rows in a thread, as for a large piece
    kind, args = embedding.initializer_args(init)
    specs = [_table_spec("t", 11, 3, i, 3) for i in range(3)]
    for spec in specs:
        spec.table.initializer.CopyFrom(ps_pb2.RowInitializer(name=kind, args=args))
    made = await store.make_rows(specs)
    assert store.create(specs, {}, made) == [True, True, True]
    full = embedding.init_rows("t", np.arange(11), 3, np.float32, init)
    for i, spec in enumerate(specs):
        np.testing.assert_array_equal(store.get(spec.name).value, full[i::3])
    # Without make_rows (a small piece), create makes them itself: the same rows.
    alone = Store()
    assert alone.create(specs[:1], {}) == [True]
    np.testing.assert_array_equal(alone.get(specs[0].name).value, full[0::3])


async def test_a_made_piece_is_updated_in_place_and_its_spec_identity_ignores_the_initializer() -> None:
    store = Store()
    spec = _table_spec("t", 5, 2, 1, 2)
    spec.table.initializer.name = "ones"
    store.create([spec], {})
    var = store.get(spec.name)
    rows = var.value
    pairs = store.validate_grads({spec.name: tables.RowGrad(np.array([3]), np.ones((1, 2), np.float32))})
    await store.apply(pairs)
    assert var.value is rows  # no copy of the whole piece on the first push
    np.testing.assert_array_equal(rows, [[1, 1], [0, 0]])
    other = ps_pb2.VariableSpec()
    other.CopyFrom(spec)
    other.table.initializer.name = "zeros"
    assert store.create([other], {}) == [False]  # the same table: its rows are kept
    np.testing.assert_array_equal(store.get(spec.name).value, [[1, 1], [0, 0]])


async def test_a_piece_with_an_initializer_refuses_values_and_unknown_initializers() -> None:
    spec = _table_spec("t", 5, 2, 0, 2)
    spec.table.initializer.name = "ones"
    with pytest.raises(InvalidArgumentError, match="a value was sent, but its spec names an initializer"):
        Store().create([spec], {spec.name: np.zeros((3, 2), np.float32)})
    spec.table.initializer.name = "glorot"
    with pytest.raises(InvalidArgumentError, match="unknown initializer 'glorot'"):
        await Store().make_rows([spec])
    with pytest.raises(InvalidArgumentError, match="unknown initializer 'glorot'"):
        Store().create([spec], {})
    spec.table.initializer.name = "ones"
    spec.table.rows = 10**12  # checked before anything is allocated
    with pytest.raises(InvalidArgumentError, match="holds 3 of 5 rows"):
        await Store().make_rows([spec])


async def test_a_piece_too_big_for_the_machine_is_refused_before_anything_is_allocated() -> None:
    rows = 2**40  # 4 TiB of rows of dim 1: more than any test machine has
    spec = _table_spec("t", rows, 1, 0, 1)
    spec.table.initializer.name = "zeros"
    with pytest.raises(ResourceExhaustedError, match=r"need 4096\.0 GiB"):
        await Store().make_rows([spec])
    with pytest.raises(ResourceExhaustedError, match="use more shards"):
        Store().create([spec], {})


def test_regularizer_gradient_is_keras_l1_l2() -> None:
    w = np.array([[0.5, -2.0, 0.0]], np.float32)
    # hand-computed: l1 * sign(w) + 2 * l2 * w
    np.testing.assert_allclose(
        embedding.Regularizer(l1=0.1, l2=0.25).gradient(w), [[0.1 + 0.25, -0.1 - 1.0, 0.0]], rtol=1e-6
    )
    for bad in (-1.0, float("nan"), float("inf"), "0.1"):
        with pytest.raises(ValueError, match="finite number >= 0"):
            embedding.Regularizer(l2=bad)  # type: ignore[arg-type]


def test_sparse_rule_adds_the_regularizer_gradient_of_the_touched_rows_before_the_rule() -> None:
    opt = optimizers.from_config(SGD(0.5))
    value = np.arange(8, dtype=np.float32).reshape(4, 2)
    grad = np.ones((1, 2), np.float32)
    new = opt.apply_rows(value, np.array([2]), grad, {}, 0, embedding.Regularizer(l2=0.1))
    # hand-computed: w - 0.5 * (g + 2 * 0.1 * w) for row 2 = [4, 5]
    np.testing.assert_allclose(new, [[4 - 0.5 * (1 + 0.8), 5 - 0.5 * (1 + 1.0)]], rtol=1e-6)


def _regularized(reg: embedding.Regularizer) -> ps_pb2.VariableSpec:
    spec = _table_spec("t", 6, 2, 0, 2)  # rows 0, 2, 4
    spec.table.regularizer.CopyFrom(ps_pb2.RowRegularizer(l1=reg.l1, l2=reg.l2, every_row=reg.every_row))
    return spec


@pytest.mark.parametrize("every_row", [False, True])
async def test_store_applies_a_tables_regularizer_lazily_or_to_every_row(every_row: bool) -> None:
    reg = embedding.Regularizer(l2=0.25, every_row=every_row)
    spec = _regularized(reg)
    start = np.arange(6, dtype=np.float32).reshape(3, 2) + 1
    store = Store()
    store.create([spec], {spec.name: start})
    var = store.get(spec.name)
    grad = tables.RowGrad(np.array([2]), np.ones((1, 2), np.float32))
    await store.apply(store.validate_grads({spec.name: grad}))
    # SGD(1.0): w - (g + 0.5 * w) on the pushed row (local row 1); every_row: -(0.5 * w) on the others too
    expected = start.copy()
    expected[1] = start[1] - (1 + 0.5 * start[1])
    if every_row:
        expected[[0, 2]] = start[[0, 2]] * 0.5
    np.testing.assert_allclose(var.value, expected, rtol=1e-6)
    backup = Store()  # a backup replays it to the same rows
    backup.create([spec], {spec.name: start})
    await backup.apply_one(backup.get(spec.name), grad)
    np.testing.assert_array_equal(backup.get(spec.name).value, var.value)
    # The regularizer is part of the table's identity.
    with pytest.raises(AlreadyExistsError, match="different spec"):
        store.create([_regularized(embedding.Regularizer(l2=0.5, every_row=every_row))], {spec.name: start})


def test_store_refuses_bad_regularizers() -> None:
    spec = _table_spec("t", 6, 2, 0, 2)
    spec.table.regularizer.l2 = -1.0
    with pytest.raises(InvalidArgumentError, match=r"table .t..*finite number >= 0"):
        Store().create([spec], {spec.name: np.zeros((3, 2), np.float32)})


def test_rows_already_distinct_and_sorted_are_returned_as_they_are() -> None:
    values = np.array([[1.0], [2.0], [3.0]], np.float32)
    ids, summed = embedding.sum_duplicates(np.array([1, 4, 9]), values)
    np.testing.assert_array_equal(ids, [1, 4, 9])
    assert summed is values  # no sort, no copy
    ids, summed = embedding.sum_duplicates(np.array([4, 1, 9]), values)  # distinct, not sorted: sorted
    np.testing.assert_array_equal(ids, [1, 4, 9])
    np.testing.assert_array_equal(summed, [[2.0], [1.0], [3.0]])
    ids, summed = embedding.sum_duplicates(np.array([7]), values[:1])
    assert ids.tolist() == [7] and summed is not None and summed.tolist() == [[1.0]]
