"""A push applied by a primary (``Store.apply``) and replayed by its backup (``Store.apply_one``): one result.

Dense variables, fixed table pieces (lazily and every-row regularized) and a
dynamic table piece (capacity, expiry by the push's time), with duplicate row
ids and int32 ids as a client sends them; the primary's update in a worker
thread (``inline_apply_bytes=0``) or inline.
"""

from __future__ import annotations

import numpy as np
import pytest

from pscore import codec, placement
from pscore.optimizers import Adam
from psproto.v1 import ps_pb2
from psserver import tables
from psserver.store import Store, Variable


def _specs() -> list[ps_pb2.VariableSpec]:
    opt = Adam(0.01, use_ema=True).to_proto()
    dense = ps_pb2.VariableSpec(name="w", dtype=codec.wire_dtype(np.dtype(np.float32)), shape=[3, 2])
    dense.optimizer.CopyFrom(opt)
    out = [dense]
    for name, every_row in [("t", False), ("r", True)]:
        rows = placement.table_rows(7, 1, 2)  # rows 1, 3, 5
        spec = ps_pb2.VariableSpec(
            name=placement.table_piece_name(name, 1),
            dtype=ps_pb2.DTYPE_FLOAT32,
            shape=[rows, 2],
            optimizer=opt,
            table=ps_pb2.TableRows(table=name, num_rows=7, dim=2, index=1, count=2, rows=rows),
        )
        spec.table.regularizer.CopyFrom(ps_pb2.RowRegularizer(l1=0.01, l2=0.1, every_row=every_row))
        out.append(spec)
    dyn = ps_pb2.VariableSpec(name="d/rows_0", dtype=ps_pb2.DTYPE_FLOAT32, shape=[0, 2], optimizer=opt)
    dyn.dynamic.CopyFrom(
        ps_pb2.DynamicTable(
            table="d",
            dim=2,
            index=0,
            count=1,
            capacity=4,
            ttl_seconds=2.5,
            initializer=ps_pb2.RowInitializer(name="uniform", args=[-1.0, 1.0]),
        )
    )
    out.append(dyn)
    return out


def _store(inline_apply_bytes: int = 1 << 20) -> Store:
    store = Store(inline_apply_bytes=inline_apply_bytes)
    rng = np.random.default_rng(0)
    values = {s.name: rng.standard_normal(tuple(s.shape)).astype(np.float32) for s in _specs()[:3]}
    store.create(_specs(), values)
    return store


def _pushes() -> list[dict[str, tables.Grad]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(6):
        t_ids = rng.choice([1, 3, 5], size=4).astype(np.int32)  # duplicates, as a client sends them
        d_ids = rng.integers(0, 9, size=5)
        out.append(
            {
                "w": rng.standard_normal((3, 2)).astype(np.float32),
                "t/rows_1": tables.RowGrad(t_ids, rng.standard_normal((4, 2)).astype(np.float32)),
                "r/rows_1": tables.RowGrad(t_ids[:2], rng.standard_normal((2, 2)).astype(np.float32)),
                "d/rows_0": tables.RowGrad(d_ids, rng.standard_normal((5, 2)).astype(np.float32)),
            }
        )
    return out


def _state(var: Variable) -> dict[str, object]:
    out: dict[str, object] = {
        "value": var.value.copy(),
        "version": var.version,
        "iterations": var.iterations,
        **{f"slot {k}": v.copy() for k, v in var.slots.items()},
    }
    if var.dyn is not None:
        ids, positions = var.dyn.index.items()
        order = np.argsort(ids)
        out["ids"], out["positions"] = ids[order], positions[order]
    return out


@pytest.mark.parametrize("inline_apply_bytes", [0, 1 << 20], ids=["threads", "inline"])
async def test_a_backup_replaying_pushes_ends_bit_identical_to_its_primary(inline_apply_bytes: int) -> None:
    primary, backup = _store(inline_apply_bytes), _store()
    for i, grads in enumerate(_pushes()):
        now = 1000.0 + i
        versions = await primary.apply(primary.validate_grads(grads), now)
        # What the backup gets: the raw gradients the primary forwarded (``tables.wire_tensors``).
        replayed = [await backup.apply_one(backup.get(name), grad, now) for name, grad in grads.items()]
        assert replayed == versions == [i + 1] * len(grads)
    for name in ["w", "t/rows_1", "r/rows_1", "d/rows_0"]:
        want, got = _state(primary.get(name)), _state(backup.get(name))
        assert sorted(want) == sorted(got), name
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{name}: {key}")


async def test_a_push_applied_now_equals_the_one_applied_through_the_gate() -> None:
    """``apply_once_now`` (no await: the data port's common case) and ``apply_once``: one result; a retry of
    either is a duplicate, and pushes the store cannot apply inline are refused by ``applies_now``."""
    now_store, gated = _store(), _store()
    for seq, grads in enumerate(_pushes(), start=1):
        fixed = {n: grads[n] for n in ("w", "t/rows_1")}  # a dense variable, a fixed table's rows: inline
        pairs = now_store.validate_grads(fixed)
        assert now_store.applies_now(("w0", 7, seq), pairs)
        assert now_store.apply_once_now("w0", seq, 7, pairs, 1000.0) == [seq] * 2
        assert await gated.apply_once("w0", seq, 7, gated.validate_grads(fixed), 1000.0) == [seq] * 2
        assert now_store.apply_once_now("w0", seq, 7, pairs, 1000.0) is None  # a retry
    for name in ["w", "t/rows_1"]:
        want, got = _state(gated.get(name)), _state(now_store.get(name))
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{name}: {key}")
    store = _store()
    dense = store.validate_grads({"w": np.ones((3, 2), np.float32)})
    for name in ["d/rows_0", "r/rows_1"]:  # a dynamic piece; a regularizer of every row (a pass over all)
        assert not store.applies_now(("w0", 0, 1), store.validate_grads({name: _pushes()[0][name]}))
    store.gate.hold()
    assert not store.applies_now(("w0", 0, 1), dense)  # updates held back (a cut, a snapshot)
    store.gate.release()
    key = ("w0", 0, 1)
    await store.gate.enter(key, (key,))  # this push's original being applied: its retry waits for it
    assert not store.applies_now(key, dense)
    store.gate.leave((key,))
    async with store.get("w").lock:  # an update of it in progress
        assert not store.applies_now(("w0", 0, 1), dense)
    assert store.applies_now(("w0", 0, 1), dense)
    assert not Store(inline_apply_bytes=8).applies_now(("w0", 0, 1), dense)  # a computation not small


async def test_a_push_that_fails_while_applied_now_is_forgotten_and_its_retry_applies_it() -> None:
    from pscore.optimizers import SGD

    store = Store()
    spec = ps_pb2.VariableSpec(
        name="m", dtype=ps_pb2.DTYPE_FLOAT32, shape=[4], optimizer=SGD(0.1, momentum=0.9).to_proto()
    )
    store.create([spec], {"m": np.zeros(4, np.float32)})
    var = store.get("m")
    var.slots["momentum"].flags.writeable = False  # the optimizer refuses to update it
    pairs = store.validate_grads({"m": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="read-only"):
        store.apply_once_now("w0", 1, 0, pairs, 1000.0)
    assert (var.version, store.has_applied("w0", 1, 0)) == (0, False)
    var.slots["momentum"].flags.writeable = True
    assert store.apply_once_now("w0", 1, 0, pairs, 1000.0) == [1]
    np.testing.assert_array_equal(var.value, np.full(4, -0.1, np.float32))
