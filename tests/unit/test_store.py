"""Unit tests of psserver.store.Store and the async mode: asyncio, but pure (no sockets, no TF)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pscore import codec
from pscore.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from pscore.optimizers import SGD, Adam
from psproto.v1 import ps_pb2
from psserver.ledger import _DEDUP_WINDOW
from psserver.modes import AsyncMode
from psserver.store import Store


def spec(name: str, value: np.ndarray, optimizer: object = None, **partition: object) -> ps_pb2.VariableSpec:
    s = ps_pb2.VariableSpec(
        name=name,
        dtype=codec.wire_dtype(value.dtype),
        shape=value.shape,
        optimizer=(optimizer or SGD(learning_rate=1.0)).to_proto(),
    )
    if partition:
        s.partition.CopyFrom(ps_pb2.Partition(**partition))
    return s


def make(store: Store, **values: np.ndarray) -> list[bool]:
    return store.create([spec(n, v) for n, v in values.items()], values)


def test_store_create_and_lookup() -> None:
    store = Store()
    assert make(store, a=np.arange(3, dtype=np.float32), b=np.zeros((2, 2), np.float64)) == [True, True]
    assert len(store) == 2 and "a" in store and store.total_bytes == 12 + 32
    (a,) = store.lookup(["a"])
    np.testing.assert_array_equal(a.value, [0, 1, 2])
    assert a.version == 0 and not a.value.flags.writeable
    assert [v.name for v in store.lookup([])] == ["a", "b"]


def test_store_create_copies_the_initial_value() -> None:
    store = Store()
    x = np.zeros(3, np.float32)
    make(store, a=x)
    x[:] = 7
    np.testing.assert_array_equal(store.get("a").value, 0)


def test_store_create_is_idempotent_for_an_equal_spec_and_keeps_the_value() -> None:
    store = Store()
    make(store, a=np.zeros(3, np.float32))
    store.assign("a", np.full(3, 5, np.float32), 4)
    assert make(store, a=np.ones(3, np.float32)) == [False]
    np.testing.assert_array_equal(store.get("a").value, 5)
    assert store.get("a").version == 4


@pytest.mark.parametrize(
    "other",
    [
        lambda: spec("a", np.zeros(4, np.float32)),
        lambda: spec("a", np.zeros(3, np.float64)),
        lambda: spec("a", np.zeros(3, np.float32), Adam()),
        lambda: spec("a", np.zeros(3, np.float32), SGD(learning_rate=0.5)),
    ],
    ids=["shape", "dtype", "optimizer", "hyper-parameter"],
)
def test_store_create_with_a_different_spec_raises_already_exists(other) -> None:  # type: ignore[no-untyped-def]
    store = Store()
    make(store, a=np.zeros(3, np.float32))
    s = other()
    value = np.zeros(tuple(s.shape), codec.numpy_dtype(s.dtype))
    with pytest.raises(AlreadyExistsError, match="'a'"):
        store.create([s], {"a": value})
    assert store.get("a").shape == (3,) and store.get("a").dtype == np.float32


def test_store_create_is_all_or_nothing() -> None:
    store = Store()
    good = np.zeros(2, np.float32)
    with pytest.raises(InvalidArgumentError, match="'bad'"):
        store.create([spec("good", good), spec("bad", np.zeros(2, np.float32))], {"good": good})
    assert len(store) == 0


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ([spec("", np.zeros(1, np.float32))], {"": np.zeros(1, np.float32)}), "empty"),
        (lambda: ([spec("a", np.zeros(1, np.float32))] * 2, {"a": np.zeros(1, np.float32)}), "twice"),
        (lambda: ([spec("a", np.zeros(1, np.float32))], {}), "no initial value"),
        (lambda: ([spec("a", np.zeros(1, np.float32))], {"a": np.zeros(2, np.float32)}), "initial value"),
        (lambda: ([spec("a", np.zeros(1, np.float32))], {"a": np.zeros(1, np.int32)}), "initial value"),
        (
            lambda: ([spec("a", np.zeros(1, np.float32))], {"a": np.zeros(1, np.float32), "b": np.zeros(1)}),
            "without a spec",
        ),
        (
            lambda: ([ps_pb2.VariableSpec(name="a", dtype=99, shape=[1])], {"a": np.zeros(1, np.float32)}),
            "wire dtype",
        ),
        (
            lambda: (
                [ps_pb2.VariableSpec(name="a", dtype=ps_pb2.DTYPE_FLOAT32, shape=[-1])],
                {"a": np.zeros(1, np.float32)},
            ),
            "negative",
        ),
        (
            lambda: (
                [
                    ps_pb2.VariableSpec(
                        name="a", dtype=ps_pb2.DTYPE_FLOAT32, shape=[1],
                        optimizer=ps_pb2.OptimizerSpec(name="nope"),
                    )
                ],
                {"a": np.zeros(1, np.float32)},
            ),
            "'a'",
        ),
        (
            lambda: (
                [spec("a/part_0", np.zeros(4, np.float32), variable="a", full_shape=[6], index=0, count=2,
                      offset=4)],
                {"a/part_0": np.zeros(4, np.float32)},
            ),
            "partition",
        ),
    ],
    ids=["empty-name", "twice", "no-value", "value-shape", "value-dtype", "extra-value", "dtype",
         "negative-shape", "optimizer", "partition"],
)  # fmt: skip
def test_store_create_rejects_malformed_specs(build, match: str) -> None:  # type: ignore[no-untyped-def]
    specs, values = build()
    with pytest.raises(InvalidArgumentError, match=match):
        Store().create(specs, values)


def test_store_unknown_names_raise_not_found() -> None:
    store = Store()
    make(store, a=np.zeros(1, np.float32))
    with pytest.raises(NotFoundError, match="'zz'"):
        store.get("zz")
    with pytest.raises(NotFoundError, match="zz"):
        store.lookup(["a", "zz"])
    with pytest.raises(NotFoundError, match="'zz'"):
        store.validate_grads({"zz": np.zeros(1, np.float32)})


@pytest.mark.parametrize(
    ("grad", "match"),
    [
        (np.zeros(4, np.float32), "shape"),
        (np.zeros((3, 1), np.float32), "shape"),
        (np.zeros(3, np.float64), "dtype"),
        (np.array([0, np.nan, 0], np.float32), "non-finite"),
        (np.array([np.inf, 0, -np.inf], np.float32), "2 non-finite"),
    ],
)
def test_store_validate_grads_rejects_bad_gradients_naming_the_variable(grad: np.ndarray, match: str) -> None:
    store = Store()
    make(store, w=np.zeros(3, np.float32))
    with pytest.raises(InvalidArgumentError, match=match) as info:
        store.validate_grads({"w": grad})
    assert "'w'" in str(info.value)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_store_validate_grads_accepts_huge_finite_gradients(dtype: type) -> None:
    """Finite elements whose sum of squares overflows (the quick check's Inf) are accepted; a NaN or
    an Inf among them is not."""
    store = Store()
    big = np.finfo(dtype).max / 2
    make(store, w=np.zeros((2, 2), dtype))
    grad = np.array([[big, -big], [big, 1]], dtype)
    ((_, got),) = store.validate_grads({"w": grad})
    assert got is grad
    for bad in (np.nan, np.inf):
        grad = np.array([[big, -big], [bad, 1]], dtype)
        with pytest.raises(InvalidArgumentError, match="1 non-finite"):
            store.validate_grads({"w": grad})


def test_store_validate_grads_takes_empty_pushes_and_rejects_integer_variables() -> None:
    store = Store()
    make(store, i=np.zeros(3, np.int32))
    assert store.validate_grads({}) == []  # a part of a push in parts with nothing for this shard
    with pytest.raises(InvalidArgumentError, match=r"'i'.*not trainable"):
        store.validate_grads({"i": np.zeros(3, np.int32)})


async def test_store_allow_non_finite_applies_nan() -> None:
    store = Store(allow_non_finite=True)
    make(store, w=np.zeros(2, np.float32))
    await store.apply(store.validate_grads({"w": np.array([np.nan, 1], np.float32)}))
    value = store.get("w").value
    assert np.isnan(value[0]) and value[1] == -1


@pytest.mark.parametrize("inline_apply_bytes", [0, 1 << 30], ids=["in-thread", "inline"])
async def test_store_apply_is_exact_sgd_and_bumps_versions(inline_apply_bytes: int) -> None:
    store = Store(inline_apply_bytes=inline_apply_bytes)
    make(store, w=np.full(5, 10, np.float32), b=np.zeros((), np.float64))
    before = store.get("w").value
    versions = await store.apply(
        store.validate_grads({"w": np.arange(5, dtype=np.float32), "b": np.array(0.25)})
    )
    assert versions == [1, 1]
    np.testing.assert_array_equal(store.get("w").value, [10, 9, 8, 7, 6])
    assert store.get("b").value == -0.25 and store.get("b").value.shape == ()
    np.testing.assert_array_equal(before, 10)  # copy-on-write: a reader's snapshot never changes
    assert store.pushes == 1


async def test_store_concurrent_applies_are_serialised_per_variable() -> None:
    store = Store(inline_apply_bytes=0)  # every update in a worker thread: maximal interleaving
    make(store, w=np.zeros(1000, np.float32))
    ones = np.ones(1000, np.float32)
    await asyncio.gather(*(store.apply(store.validate_grads({"w": ones})) for _ in range(50)))
    np.testing.assert_array_equal(store.get("w").value, -50)
    assert store.get("w").version == 50


async def test_store_zero_element_variable() -> None:
    store = Store()
    make(store, e=np.zeros((0, 4), np.float32))
    await store.apply(store.validate_grads({"e": np.zeros((0, 4), np.float32)}))
    assert store.get("e").value.shape == (0, 4) and store.get("e").version == 1


def test_store_claim_dedups_retries_and_unclaim_forgets() -> None:
    store = Store()
    assert store.ledger.claim("w0", 1)
    assert not store.ledger.claim("w0", 1)
    assert store.ledger.claim("w1", 1)  # sequence numbers are per worker
    store.ledger.unclaim("w0", 1)
    assert store.ledger.claim("w0", 1)


def test_store_dedup_window_remembers_old_sequence_numbers() -> None:
    store = Store()
    last = 3 * _DEDUP_WINDOW
    for seq in range(1, last):
        if seq != 10:  # never pushed
            assert store.ledger.claim("w", seq)
    assert not store.ledger.claim("w", 1)  # fell below the window's floor: still counted as applied
    assert not store.ledger.claim("w", 10)  # below the floor too: that old is refused, not applied late
    assert not store.ledger.claim("w", last - 50)
    state = store.ledger.dedup_state()
    ((_, floor, seen),) = state["w"]
    assert last - 1 - 2 * _DEDUP_WINDOW <= floor < last - 1 - _DEDUP_WINDOW  # memory stays bounded
    assert len(seen) <= 2 * _DEDUP_WINDOW
    other = Store()
    other.ledger.load_dedup_state(state)
    assert not other.ledger.claim("w", 5) and other.ledger.claim("w", last + 1)


async def test_store_async_mode_applies_a_retried_push_once() -> None:
    store = Store()
    make(store, w=np.zeros(2, np.float32))
    mode = AsyncMode(store)
    grads = {"w": np.ones(2, np.float32)}
    assert (await mode.push("w0", 7, 0, grads)).applied
    outcome = await mode.push("w0", 7, 0, grads)
    assert not outcome.applied and outcome.reason == "duplicate"
    np.testing.assert_array_equal(store.get("w").value, -1)


async def test_store_async_mode_invalid_push_changes_nothing_and_can_be_retried() -> None:
    store = Store()
    make(store, w=np.zeros(2, np.float32), v=np.zeros(2, np.float32))
    mode = AsyncMode(store)
    with pytest.raises(InvalidArgumentError, match="'v'"):
        await mode.push("w0", 1, 0, {"w": np.ones(2, np.float32), "v": np.ones(3, np.float32)})
    assert store.get("w").version == 0 and store.get("v").version == 0
    np.testing.assert_array_equal(store.get("w").value, 0)
    assert (await mode.push("w0", 1, 0, {"w": np.ones(2, np.float32)})).applied
