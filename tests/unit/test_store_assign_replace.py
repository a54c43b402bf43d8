"""Unit tests of Store assignments and optimizer replacement, and the optimizer step count in checkpoints."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest

from pscore import codec
from pscore.errors import InvalidArgumentError, NotFoundError
from pscore.optimizers import SGD, Adam, Lamb
from psproto.v1 import ps_pb2
from psserver import checkpoint, ckptfile
from psserver.modes import AsyncMode
from psserver.store import Store


def _store(optimizer: object = None, **values: np.ndarray) -> Store:
    store = Store()
    specs = [
        ps_pb2.VariableSpec(
            name=n,
            dtype=codec.wire_dtype(v.dtype),
            shape=v.shape,
            optimizer=(optimizer or SGD(0.1, momentum=0.9)).to_proto(),
        )
        for n, v in values.items()
    ]
    store.create(specs, values)
    return store


async def test_store_set_values_keeps_slots_and_step_and_bumps_the_version() -> None:
    store = _store(w=np.zeros(3, np.float32))
    await store.apply(store.validate_grads({"w": np.ones(3, np.float32)}))
    var = store.get("w")
    momentum = var.slots["momentum"].copy()
    new = np.array([1, 2, 3], np.float32)
    assert await store.set_values(store.validate_values({"w": new})) == [2]
    new[:] = 0  # the store holds its own copy
    np.testing.assert_array_equal(var.value, [1, 2, 3])
    assert not var.value.flags.writeable
    assert (var.version, var.iterations) == (2, 1)
    np.testing.assert_array_equal(var.slots["momentum"], momentum)


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ({}, InvalidArgumentError, "no values"),
        ({"nope": np.zeros(3, np.float32)}, NotFoundError, "nope"),
        ({"w": np.zeros(4, np.float32)}, InvalidArgumentError, "shape"),
        ({"w": np.zeros(3, np.float64)}, InvalidArgumentError, "dtype"),
        ({"w": np.array([0, np.nan, np.inf], np.float32)}, InvalidArgumentError, "2 non-finite"),
    ],
)
def test_store_validate_values_rejects_bad_values(values: dict, error: type, match: str) -> None:  # type: ignore[type-arg]
    store = _store(w=np.zeros(3, np.float32))
    with pytest.raises(error, match=match):
        store.validate_values(values)


async def test_store_replacing_the_optimizer_resets_slots_and_step() -> None:
    store = _store(w=np.zeros(3, np.float32), i=np.zeros(2, np.int32))
    await store.apply(store.validate_grads({"w": np.ones(3, np.float32)}))
    async with store.update_optimizer(["w", "i"], {}, Adam(0.01).to_proto(), reset=True) as changed:
        assert [v.name for v in changed] == ["w", "i"]
    var = store.get("w")
    assert var.optimizer.name == "adam" and var.spec.optimizer.name == "adam"
    assert sorted(var.slots) == ["momentum", "velocity"] and not any(s.any() for s in var.slots.values())
    assert (var.version, var.iterations) == (1, 0)
    assert store.get("i").slots == {}  # not trainable: no slots, whatever the optimizer


async def test_store_replacement_needs_a_spec_and_names_and_keeps_whole_variable_rules() -> None:
    store = _store(w=np.zeros(3, np.float32))
    with pytest.raises(InvalidArgumentError, match="reset needs"):
        async with store.update_optimizer([], {}, Adam().to_proto(), reset=True):
            pass
    with pytest.raises(InvalidArgumentError, match="either params or"):
        async with store.update_optimizer(["w"], {}, None, reset=True):
            pass
    part = Store()
    spec = ps_pb2.VariableSpec(
        name="p/part0", dtype=ps_pb2.DTYPE_FLOAT32, shape=[3], optimizer=SGD().to_proto()
    )
    spec.partition.CopyFrom(ps_pb2.Partition(variable="p", full_shape=[6], index=0, count=2, offset=0))
    part.create([spec], {"p/part0": np.zeros(3, np.float32)})
    with pytest.raises(InvalidArgumentError, match="needs the whole variable"):
        async with part.update_optimizer(["p/part0"], {}, Lamb().to_proto(), reset=True):
            pass
    assert part.get("p/part0").optimizer.name == "sgd"


async def test_store_a_snapshot_waits_for_an_assignment_and_a_replacement() -> None:
    store = _store(w=np.zeros(3, np.float32))
    mode = AsyncMode(store)
    async with asyncio.timeout(10):
        async with store.gate.quiesced():
            assigning = asyncio.create_task(
                store.set_values(store.validate_values({"w": np.ones(3, np.float32)}))
            )
            await asyncio.sleep(0.01)
            assert not assigning.done() and store.get("w").version == 0
        assert await assigning == [1]
        snap = await checkpoint.take_snapshot(store, mode, 0, 1)
    assert snap.tensors[0].version == 1 and snap.tensors[0].iterations == 0


def _manifest_roundtrip(snap: ckptfile.Snapshot, drop_iterations: bool) -> ckptfile.Snapshot:
    buf = io.BytesIO()
    ckptfile.dump(snap, buf, ckpt_id=1)
    buf.seek(0)
    with np.load(buf) as z:
        arrays = {k: z[k] for k in z.files}
    manifest = json.loads(bytes(arrays["manifest"]).decode())
    if drop_iterations:  # as written before optimizers could be replaced
        for entry in manifest["variables"]:
            del entry["iterations"]
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    out = io.BytesIO()
    np.savez(out, **arrays)  # type: ignore[arg-type]
    out.seek(0)
    return ckptfile.load(out, "mem")


@pytest.mark.parametrize("drop_iterations", [False, True], ids=["current", "older-file"])
async def test_checkpoint_keeps_the_step_count_and_old_files_load_it_as_the_version(
    drop_iterations: bool,
) -> None:
    store = _store(w=np.zeros(3, np.float32))
    for _ in range(3):
        await store.apply(store.validate_grads({"w": np.ones(3, np.float32)}))
    async with store.update_optimizer(["w"], {}, Adam().to_proto(), reset=True):
        pass
    await store.apply(store.validate_grads({"w": np.ones(3, np.float32)}))
    snap = await checkpoint.take_snapshot(store, AsyncMode(store), 0, 1)
    back = _manifest_roundtrip(snap, drop_iterations)
    restored = Store()
    checkpoint.load_into(back, restored, AsyncMode(restored))
    var = restored.get("w")
    assert var.version == 4
    assert var.iterations == (4 if drop_iterations else 1)
    resharded = ckptfile.reshard([back], 0, 1)
    assert resharded.tensors[0].step == (4 if drop_iterations else 1)
