"""Checkpoints of the optimizers added for issue 9: slots of other shapes (Nadam's scalar u_product,
Adafactor's factored moments), gradient accumulators and schedule specs restore bit-exact."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from pscore import codec
from pscore import optimizers as specs
from psproto.v1 import ps_pb2
from psserver import checkpoint, ckptfile
from psserver.modes import make_mode
from psserver.store import Store

OPTIMIZERS: dict[str, tuple[specs.Optimizer, tuple[int, ...]]] = {
    "nadam": (
        specs.Nadam(learning_rate=specs.CosineDecay(0.01, 10, warmup_target=0.05, warmup_steps=3)),
        (4, 5),
    ),
    "adafactor": (specs.Adafactor(learning_rate=0.1), (3, 4, 2)),
    "adafactor_1d": (specs.Adafactor(), (6,)),
    "accumulating": (specs.Adam(learning_rate=0.01, gradient_accumulation_steps=3, weight_decay=0.01), (5,)),
    "ftrl": (specs.Ftrl(learning_rate=specs.PiecewiseConstantDecay((2, 4), (0.1, 0.05, 0.01))), (2, 3)),
    "lamb": (specs.Lamb(clipnorm=1.0), (3, 3)),
}


def _spec(name: str, opt: specs.Optimizer, shape: tuple[int, ...]) -> ps_pb2.VariableSpec:
    return ps_pb2.VariableSpec(
        name=name, dtype=codec.wire_dtype(np.float32), shape=shape, optimizer=opt.to_proto()
    )


def _new_store(rng: np.random.Generator) -> Store:
    store = Store()
    store.create(
        [_spec(n, opt, shape) for n, (opt, shape) in OPTIMIZERS.items()],
        {n: rng.standard_normal(shape).astype(np.float32) for n, (_, shape) in OPTIMIZERS.items()},
    )
    return store


async def _train(store: Store, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        grads = {n: rng.standard_normal(shape).astype(np.float32) for n, (_, shape) in OPTIMIZERS.items()}
        await store.apply(store.validate_grads(grads))


def _assert_same(a: Store, b: Store) -> None:
    for name in OPTIMIZERS:
        va, vb = a.get(name), b.get(name)
        assert va.version == vb.version
        np.testing.assert_array_equal(va.value, vb.value)
        assert va.slots.keys() == vb.slots.keys()
        for slot in va.slots:
            assert va.slots[slot].shape == vb.slots[slot].shape
            np.testing.assert_array_equal(va.slots[slot], vb.slots[slot])
        assert va.spec == vb.spec


async def _round_trip(store: Store) -> ckptfile.Snapshot:
    snap = await checkpoint.take_snapshot(store, make_mode("async", store), 0, 1)
    buf = io.BytesIO()
    ckptfile.dump(snap, buf, 1)
    buf.seek(0)
    return ckptfile.load(buf, "memory")


async def test_new_optimizers_restore_bit_exact_and_continue_identically() -> None:
    async with asyncio.timeout(30):
        original, reference = _new_store(np.random.default_rng(1)), _new_store(np.random.default_rng(1))
        await _train(original, 5, seed=2)  # mid-accumulation (5 % 3 != 0), mid-warmup, past a boundary
        await _train(reference, 5, seed=2)
        snap = await _round_trip(original)
        assert snap.tensors[0].slots  # slots travel
        u_product = {t.spec.name: t.slots for t in snap.tensors}["nadam"]["u_product"]
        assert u_product.shape == () and u_product != 1.0
        restored = Store()
        checkpoint.load_into(snap, restored, make_mode("async", restored))
        _assert_same(restored, reference)
        assert restored.get("nadam").optimizer.config == OPTIMIZERS["nadam"][0]
        await _train(restored, 4, seed=3)  # uses the restored accumulators, u_product and schedule step
        await _train(reference, 4, seed=3)
        _assert_same(restored, reference)


async def test_reshard_keeps_whole_variables_with_factored_slots() -> None:
    async with asyncio.timeout(30):
        store = _new_store(np.random.default_rng(4))
        await _train(store, 2, seed=5)
        snap = await _round_trip(store)
        pieces = [ckptfile.reshard([snap], shard, 3) for shard in range(3)]
        by_name = {t.spec.name: t for p in pieces for t in p.tensors}
        assert set(by_name) == set(OPTIMIZERS)
        original = {t.spec.name: t for t in snap.tensors}
        for name, t in by_name.items():
            for slot, arr in t.slots.items():
                np.testing.assert_array_equal(arr, original[name].slots[slot])
                assert arr.shape == original[name].slots[slot].shape


def test_a_slot_of_the_wrong_size_is_a_checkpoint_error() -> None:
    store = _new_store(np.random.default_rng(6))
    snap = asyncio.run(_round_trip(store))
    for t in snap.tensors:
        if t.spec.name == "adafactor":
            t.slots["r"] = np.zeros(5, np.float32)
    with pytest.raises(ckptfile.CheckpointError, match="slot 'r' has shape"):
        target = Store()
        checkpoint.load_into(snap, target, make_mode("async", target))


def test_a_partitioned_variable_with_a_whole_variable_rule_is_refused() -> None:
    from pscore.errors import InvalidArgumentError

    spec = _spec("big/part_0", specs.Adafactor(), (6,))
    spec.partition.CopyFrom(ps_pb2.Partition(variable="big", full_shape=[3, 4], index=0, count=2, offset=0))
    with pytest.raises(
        InvalidArgumentError, match=r"'big' is cut into 2 partitions.*needs the whole variable"
    ):
        Store().create([spec], {"big/part_0": np.zeros(6, np.float32)})
    spec.optimizer.CopyFrom(specs.Nadam(clipvalue=1.0).to_proto())  # elementwise: fine
    assert Store().create([spec], {"big/part_0": np.zeros(6, np.float32)}) == [True]
