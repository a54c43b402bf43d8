"""Integration: pushes over gRPC (``data_port=False``, or a shard whose data port cannot be reached):
per-push errors, concurrent pushes, a shard restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(90)

GRPC = {"data_port": False}  # by default pushes take the shards' data port


async def test_a_failed_push_is_raised_and_the_next_one_is_applied(
    cluster: LocalCluster, var_name: str
) -> None:
    async with psclient.AsyncPSClient(cluster.addresses, worker_id="s0", timeout=TIMEOUT_S, **GRPC) as c:
        await c.create(var_name, np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        assert await c.push({var_name: np.ones(4, np.float32)}) is True
        with pytest.raises(psclient.InvalidArgumentError, match="non-finite"):
            await c.push({var_name: np.array([1, np.nan, 1, 1], np.float32)})
        assert await c.push({var_name: np.ones(4, np.float32)}) is True
        values, versions = await c.pull_with_versions([var_name])
    np.testing.assert_array_equal(values[var_name], -2.0)
    assert versions == {var_name: 2}


async def test_concurrent_pushes_of_one_client_are_each_applied_once(
    cluster: LocalCluster, var_name: str
) -> None:
    async with psclient.AsyncPSClient(cluster.addresses, worker_id="s1", timeout=TIMEOUT_S, **GRPC) as c:
        await c.create(var_name, np.zeros(8, np.float32), optimizer=psclient.SGD(1.0))
        results = await asyncio.gather(*(c.push({var_name: np.ones(8, np.float32)}) for _ in range(64)))
        new = await c.push_pull({var_name: np.ones(8, np.float32)})
    assert all(results)
    np.testing.assert_array_equal(new[var_name], -65.0)


def test_pushes_survive_a_shard_restart(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(num_shards=1)
    port = int(cluster.addresses[0].rpartition(":")[2])
    with psclient.PSClient(cluster.addresses, worker_id="s2", timeout=TIMEOUT_S, **GRPC) as c:
        c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        assert c.push({"v": np.ones(4, np.float32)}) is True
        cluster.kill_shard(0)
        cluster.start_shard(0, port=port)  # no checkpoint: the variable is gone
        with pytest.raises(psclient.NotFoundError):
            c.push({"v": np.ones(4, np.float32)})
        c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        assert c.push({"v": np.ones(4, np.float32)}) is True
        np.testing.assert_array_equal(c.pull(["v"])["v"], -1.0)
