"""Sync mode (N-of-M barrier) on real shards: mean update, barrier, stale drops, backups, timeouts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _workers import CALL_TIMEOUT_S, close_all, worker_clients

import psclient


def _sync_args(n: int, m: int, timeout_s: float = 20.0) -> list[str]:
    return ["--mode", "sync", "--replicas-to-aggregate", str(n), "--total-replicas", str(m),
            "--barrier-timeout", str(timeout_s)]  # fmt: skip


async def test_update_is_mean_of_workers_gradients(make_cluster) -> None:
    cluster = make_cluster(num_shards=2, server_args=_sync_args(2, 2))
    w0, w1 = clients = worker_clients(cluster, 2)
    try:
        init = {"a": np.zeros((3, 4), np.float32), "b": np.ones(5, np.float32)}
        await w0.create_many(init, optimizer=psclient.SGD(learning_rate=1.0))
        rng = np.random.default_rng(0)
        g0 = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in init.items()}
        g1 = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in init.items()}
        applied = await asyncio.gather(w0.push(g0, step=0), w1.push(g1, step=0))
        assert applied == [True, True]
        values, versions = await w0.pull_with_versions()
        for k in init:
            np.testing.assert_allclose(values[k], init[k] - (g0[k] + g1[k]) / 2, rtol=1e-6)
        assert set(versions.values()) == {1}  # one update per step, not one per push
    finally:
        await close_all(clients)


async def test_push_is_the_barrier(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_sync_args(2, 2))
    w0, w1 = clients = worker_clients(cluster, 2)
    try:
        await w0.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        first = asyncio.create_task(w0.push({"v": np.ones(4, np.float32)}, step=0))
        await asyncio.sleep(0.5)
        assert not first.done()  # waits for the second gradient of step 0
        np.testing.assert_array_equal((await w1.pull())["v"], np.zeros(4, np.float32))
        assert await w1.push({"v": 3 * np.ones(4, np.float32)}, step=0)
        assert await asyncio.wait_for(first, CALL_TIMEOUT_S)
        np.testing.assert_allclose((await w1.pull())["v"], -2 * np.ones(4, np.float32))
        # step 1 gathers afresh; push_pull returns the values after the step's update
        both = await asyncio.gather(
            w0.push_pull({"v": np.ones(4, np.float32)}, step=1),
            w1.push_pull({"v": np.ones(4, np.float32)}, step=1),
        )
        for values in both:
            np.testing.assert_allclose(values["v"], -3 * np.ones(4, np.float32))
            assert values.applied
        # a gradient for a step already done is dropped: push_pull says so, with the current values
        late = await w0.push_pull({"v": np.ones(4, np.float32)}, step=0)
        assert not late.applied
        np.testing.assert_allclose(late["v"], -3 * np.ones(4, np.float32))
    finally:
        await close_all(clients)


async def test_backups_let_n_of_m_proceed_and_late_gradients_are_dropped(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_sync_args(2, 3))
    w0, w1, w2 = clients = worker_clients(cluster, 3)
    try:
        await w0.create("v", np.zeros(2, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        # the straggler w2 is not needed: 2 of 3 complete step 0
        assert await asyncio.gather(
            w0.push({"v": np.full(2, 2.0, np.float32)}, step=0),
            w1.push({"v": np.full(2, 4.0, np.float32)}, step=0),
        ) == [True, True]
        # its late gradient for step 0 is dropped, and it is told so
        assert await w2.push({"v": np.full(2, 100.0, np.float32)}, step=0) is False
        values, versions = await w2.pull_with_versions()
        np.testing.assert_allclose(values["v"], [-3.0, -3.0])
        assert versions == {"v": 1}  # the current step, for the straggler to resync
        # it rejoins at the current step; any 2 of 3 complete it
        assert await asyncio.gather(
            w2.push({"v": np.full(2, 1.0, np.float32)}, step=1),
            w0.push({"v": np.full(2, 1.0, np.float32)}, step=1),
        ) == [True, True]
        np.testing.assert_allclose((await w1.pull())["v"], [-4.0, -4.0])
    finally:
        await close_all(clients)


async def test_barrier_timeout_names_missing_workers_and_step(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_sync_args(2, 3, timeout_s=1.0))
    w0, w1 = clients = worker_clients(cluster, 2)
    try:
        await w0.create("v", np.zeros(2, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        await w1.pull()  # w1 is known to the shard, but never pushes
        with pytest.raises(psclient.DeadlineExceededError) as info:
            await w0.push({"v": np.ones(2, np.float32)}, step=0)
        message = str(info.value)
        assert "step 0" in message
        assert "w1" in message
        assert "1 of 3 worker(s) never seen" in message
        # nothing half-applied: the value is unchanged, and the shard still serves step 0
        np.testing.assert_array_equal((await w1.pull())["v"], np.zeros(2, np.float32))
        assert await asyncio.gather(
            w0.push({"v": np.ones(2, np.float32)}, step=0), w1.push({"v": np.ones(2, np.float32)}, step=0)
        ) == [True, True]
    finally:
        await close_all(clients)


async def test_a_caller_deadline_below_the_barrier_timeout_names_the_missing_worker(make_cluster) -> None:
    """N = M = 3, two workers push, w2 is alive but never pushes; the clients' deadline (5 s) comes
    before the barrier timeout (60 s): each worker is told the step and who is missing, not just
    that its own deadline passed (a push carries it: a data connection has none, and a PushSession
    stream's is long)."""
    cluster = make_cluster(num_shards=1, server_args=_sync_args(3, 3, timeout_s=60.0))
    clients = [psclient.AsyncPSClient(cluster.addresses, worker_id=f"w{i}", timeout=5.0) for i in range(3)]
    w0, w1, w2 = clients
    try:
        await w0.create("v", np.zeros(2, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        await w2.pull()  # w2 is known to the shard, but never pushes
        results = await asyncio.wait_for(
            asyncio.gather(
                w0.push({"v": np.ones(2, np.float32)}, step=0),
                w1.push({"v": np.ones(2, np.float32)}, step=0),
                return_exceptions=True,
            ),
            CALL_TIMEOUT_S,
        )
        for err in results:
            assert isinstance(err, psclient.DeadlineExceededError), repr(err)
            message = str(err)
            # the missing worker, named (the other pusher, which gave up at the same moment, is told apart)
            assert "no gradient for step 0 from worker(s) w2" in message, message
            assert "deadline" in message, message
        # nothing half-applied: the value is unchanged
        np.testing.assert_array_equal((await w2.pull())["v"], np.zeros(2, np.float32))
    finally:
        await close_all(clients)


async def test_bad_gradient_is_rejected_without_joining_the_barrier(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_sync_args(1, 1))
    (w0,) = clients = worker_clients(cluster, 1)
    try:
        await w0.create("v", np.zeros(2, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        with pytest.raises(psclient.InvalidArgumentError):
            await w0.push({"v": np.ones(3, np.float32)}, step=0)
        assert await w0.push({"v": np.ones(2, np.float32)}, step=0)
        np.testing.assert_allclose((await w0.pull())["v"], [-1.0, -1.0])
    finally:
        await close_all(clients)


async def test_a_worker_that_left_is_not_waited_for(make_cluster) -> None:
    """End of training with uneven step counts: the worker still going completes its steps alone."""
    cluster = make_cluster(num_shards=2, server_args=_sync_args(2, 2, timeout_s=20.0))
    w0, w1 = clients = worker_clients(cluster, 2)
    try:
        await w0.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        assert await asyncio.gather(
            w0.push({"v": np.ones(4, np.float32)}, step=0), w1.push({"v": 3 * np.ones(4, np.float32)}, step=0)
        ) == [True, True]  # mean 2
        waiting = asyncio.create_task(w1.push({"v": np.ones(4, np.float32)}, step=1))  # w0 has no step 1
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await w0.leave()  # w0 is done: step 1 needs only w1's gradient
        assert await asyncio.wait_for(waiting, 5.0)
        assert await asyncio.wait_for(w1.push({"v": np.ones(4, np.float32)}, step=2), 5.0)
        values, versions = await w1.pull_with_versions()
        np.testing.assert_allclose(values["v"], np.full(4, -4, np.float32))  # -2, -1, -1
        assert versions == {"v": 3}
        await w0.leave()  # idempotent
        # a push from w0 counts it in again: step 3 needs both gradients
        both = await asyncio.gather(
            w0.push({"v": np.ones(4, np.float32)}, step=3), w1.push({"v": np.ones(4, np.float32)}, step=3)
        )
        assert both == [True, True]
        assert (await w1.pull_with_versions())[1] == {"v": 4}
    finally:
        await close_all(clients)


async def test_every_shard_push_keeps_one_step_count_across_shards(make_cluster) -> None:
    """Steps that update variables of one shard only (a GAN's two optimizers, frozen layers) still
    advance every shard's step, so a later step that touches the other shard is neither stale nor held."""
    cluster = make_cluster(num_shards=2, server_args=_sync_args(2, 2, timeout_s=5.0))
    w0, w1 = clients = worker_clients(cluster, 2)
    try:
        init = {f"v{i}": np.zeros(4, np.float32) for i in range(4)}
        await w0.create_many(init, optimizer=psclient.SGD(learning_rate=1.0))
        assert [(s.mode, s.step) for s in await w0.status()] == [("sync", 0), ("sync", 0)]
        shard_of = {name: w0.registry.resolve([name])[name][0].shard for name in init}
        assert len(set(shard_of.values())) == 2
        a = next(n for n, s in shard_of.items() if s == 0)
        b = next(n for n, s in shard_of.items() if s == 1)
        one = np.ones(4, np.float32)
        for step in range(3):  # steps that touch shard 0 only
            assert await asyncio.gather(
                w0.push({a: one}, step=step, every_shard=True), w1.push({a: one}, step=step, every_shard=True)
            ) == [True, True]
        assert [s.step for s in await w0.status()] == [3, 3]
        # step 3 touches shard 1: it completes at once (not held for steps 0-2, not stale)
        assert await asyncio.gather(w0.push({b: one}, step=3), w1.push({b: one}, step=3)) == [True, True]
        values = await w0.pull([a, b])
        np.testing.assert_allclose(values[a], -3 * one)
        np.testing.assert_allclose(values[b], -one)
    finally:
        await close_all(clients)
