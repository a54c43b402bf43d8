"""SSP mode (bounded staleness) on real shards: a fast worker waits in its pull; timeouts name the slowest."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _workers import CALL_TIMEOUT_S, close_all, worker_clients

import psclient


def _ssp_args(m: int, s: int, timeout_s: float = 20.0) -> list[str]:
    return [
        "--mode",
        "ssp",
        "--total-replicas",
        str(m),
        "--staleness",
        str(s),
        "--barrier-timeout",
        str(timeout_s),
    ]


async def test_fast_worker_waits_in_pull_until_the_slowest_catches_up(make_cluster) -> None:
    cluster = make_cluster(num_shards=2, server_args=_ssp_args(2, 1))
    fast, slow = clients = worker_clients(cluster, 2)
    try:
        await fast.create_many({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)})
        grads = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}
        # pushes are applied on arrival (async updates)
        assert await fast.push(grads, step=0)
        assert await fast.push(grads, step=1)
        await fast.pull(step=1)  # 1 ahead of the slow worker (clock 0): allowed with S=1
        held = asyncio.create_task(fast.pull(step=2))  # 2 ahead: waits
        await asyncio.sleep(0.5)
        assert not held.done()
        assert await slow.push(grads, step=0)  # slowest clock 1: step 2 is 1 ahead
        values = await asyncio.wait_for(held, CALL_TIMEOUT_S)
        np.testing.assert_allclose(values["a"], np.full(3, -0.03, np.float32), rtol=1e-6)  # 3 SGD(0.01) steps
        # push_pull gates the values it returns the same way (they are the pull of step + 1)
        gated = asyncio.create_task(fast.push_pull(grads, step=2))
        await asyncio.sleep(0.5)
        assert not gated.done()
        assert await slow.push(grads, step=1)
        await asyncio.wait_for(gated, CALL_TIMEOUT_S)
    finally:
        await close_all(clients)


async def test_pull_timeout_names_the_slowest_worker(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_ssp_args(3, 1, timeout_s=1.0))
    w0, w1, _ = clients = worker_clients(cluster, 3)
    try:
        await w0.create("v", np.zeros(2, np.float32))
        g = {"v": np.ones(2, np.float32)}
        for step in range(3):
            await w0.push(g, step=step)
        await w1.push(g, step=0)
        with pytest.raises(psclient.DeadlineExceededError) as info:
            await w0.pull(step=3)
        message = str(info.value)
        assert "w0 at step 3" in message
        assert "1 of 3 worker(s) have not pushed yet" in message
        await clients[2].push(g, step=1)
        await clients[2].push(g, step=2)
        with pytest.raises(psclient.DeadlineExceededError, match="slowest: w1"):
            await w0.pull(step=3)
        await w1.push(g, step=1)
        assert (await w0.pull(step=3))["v"].shape == (2,)
    finally:
        await close_all(clients)


async def test_plain_pull_never_waits(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_ssp_args(2, 0, timeout_s=1.0))
    (w0,) = clients = worker_clients(cluster, 1)
    try:
        await w0.create("v", np.zeros(2, np.float32))
        await w0.push({"v": np.ones(2, np.float32)}, step=0)
        assert (await w0.pull())["v"].shape == (2,)  # step 0: an evaluator's read
    finally:
        await close_all(clients)


async def test_a_worker_that_left_holds_nobody_back(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_ssp_args(2, 1))
    done, busy = clients = worker_clients(cluster, 2)
    try:
        await done.create("v", np.zeros(2, np.float32))
        g = {"v": np.ones(2, np.float32)}
        assert await done.push(g, step=0)  # `done` trains one step (fewer examples) and finishes
        for step in range(2):
            assert await busy.push(g, step=step)
        held = asyncio.create_task(busy.pull(step=3))  # 2 ahead of `done`'s clock 1 with S=1: waits
        await asyncio.sleep(0.5)
        assert not held.done()
        await done.leave()
        await asyncio.wait_for(held, CALL_TIMEOUT_S)
        for step in range(2, 6):  # and it runs on to the end alone
            assert await busy.push(g, step=step)
            await asyncio.wait_for(busy.pull(step=step + 1), CALL_TIMEOUT_S)
    finally:
        await close_all(clients)
