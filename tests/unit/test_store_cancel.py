"""A push whose caller is cancelled while its update runs (a gRPC call cancelled, its deadline passed) is
applied whole, once: the other variables of the push are not left out, and its retry applies nothing; one
cancelled while it waits at the gate is not applied, and its retry applies it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from pscore import codec
from pscore.optimizers import SGD
from psproto.v1 import ps_pb2
from psserver.store import Store


def _spec(name: str) -> ps_pb2.VariableSpec:
    spec = ps_pb2.VariableSpec(name=name, dtype=codec.wire_dtype(np.dtype(np.float32)), shape=[4])
    spec.optimizer.CopyFrom(SGD(1.0).to_proto())
    return spec


async def test_a_push_cancelled_in_its_update_is_applied_whole_and_its_retry_applies_nothing() -> None:
    store = Store(inline_apply_bytes=0)  # every update's math in a worker thread: a cancel can land there
    store.create([_spec("a"), _spec("b")], {n: np.zeros(4, np.float32) for n in "ab"})
    b = store.get("b")
    started, release = threading.Event(), threading.Event()
    apply = b.optimizer.apply

    def held(*args, **kwargs):  # b's update waits in its thread until the caller was cancelled
        started.set()
        assert release.wait(10)
        return apply(*args, **kwargs)

    b.optimizer.apply = held  # type: ignore[method-assign]
    grads = {n: np.ones(4, np.float32) for n in "ab"}
    pairs = store.validate_grads(grads)
    push = asyncio.create_task(store.apply_once("w", 0, 1, pairs))
    for _ in range(200):  # a's update is done; b's runs in its thread
        if started.is_set():
            break
        await asyncio.sleep(0.01)
    assert started.is_set()
    push.cancel()
    await asyncio.sleep(0.05)
    assert not push.done()  # the caller waits for the update it began
    release.set()
    # The caller goes on as if cancelled after the call: what follows an applied push in the shard (its
    # ledger entry, its forwarding to the backup) is not cut off either.
    async with asyncio.timeout(10):
        assert await push == [1, 1]
    assert not push.cancelled()
    np.testing.assert_array_equal(store.get("b").value, -np.ones(4, np.float32))
    assert await store.apply_once("w", 0, 1, store.validate_grads(grads)) is None  # the retry: applied
    assert (store.get("a").version, store.get("b").version) == (1, 1)
    np.testing.assert_array_equal(store.get("a").value, -np.ones(4, np.float32))


async def test_a_push_cancelled_before_its_update_began_is_not_applied_and_its_retry_applies_it() -> None:
    store = Store(inline_apply_bytes=0)
    store.create([_spec("a"), _spec("b")], {n: np.zeros(4, np.float32) for n in "ab"})
    grads = {n: np.ones(4, np.float32) for n in "ab"}
    store.gate.hold()  # a checkpoint snapshot holds updates back: the push waits at the gate
    push = asyncio.create_task(store.apply_once("w", 0, 1, store.validate_grads(grads)))
    await asyncio.sleep(0.05)
    push.cancel()
    with pytest.raises(asyncio.CancelledError):
        await push
    store.gate.release()
    assert (store.get("a").version, store.get("b").version) == (0, 0)
    assert await store.apply_once("w", 0, 1, store.validate_grads(grads)) == [1, 1]  # the retry applies it
