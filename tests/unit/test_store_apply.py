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
