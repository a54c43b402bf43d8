"""Integration: small pushes over the PushSession stream (per-push errors, ordering, restarts, fallback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from psserver.config import ServerConfig
from psserver.server import start
from psserver.servicer import ParameterServerServicer
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(90)

GRPC = {"data_port": False}  # by default pushes take the shards' data port; PushSession is gRPC's way


async def test_a_failed_push_is_raised_and_the_session_goes_on(cluster: LocalCluster, var_name: str) -> None:
    async with psclient.AsyncPSClient(cluster.addresses, worker_id="s0", timeout=TIMEOUT_S, **GRPC) as c:
        await c.create(var_name, np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        assert await c.push({var_name: np.ones(4, np.float32)}) is True
        session = c._shards[0].session()
        stream = session._call
        with pytest.raises(psclient.InvalidArgumentError, match="non-finite"):
            await c.push({var_name: np.array([1, np.nan, 1, 1], np.float32)})
        assert await c.push({var_name: np.ones(4, np.float32)}) is True
        assert c._shards[0].session() is session and session._call is stream  # one stream carried all three
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
        cluster.start_shard(0, port=port)  # no checkpoint: the variable is gone, the stream too
        with pytest.raises(psclient.NotFoundError):
            c.push({"v": np.ones(4, np.float32)})
        c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        assert c.push({"v": np.ones(4, np.float32)}) is True
        np.testing.assert_array_equal(c.pull(["v"])["v"], -1.0)


class _NoSession(ParameterServerServicer):
    """A shard from before PushSession existed."""

    async def PushSession(  # type: ignore[override]
        self, request_iterator: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        yield  # an async generator, as the real handler is


async def test_a_shard_without_push_session_gets_unary_pushes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("psserver.server.ParameterServerServicer", _NoSession)
    shard = await start(ServerConfig(shard=0, port=0))
    try:
        async with psclient.AsyncPSClient([shard.address], worker_id="s3", timeout=TIMEOUT_S, **GRPC) as c:
            await c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
            assert await c.push({"v": np.ones(4, np.float32)}) is True
            assert await c.push({"v": np.ones(4, np.float32)}) is True
            assert not c._shards[0].session().supported
            np.testing.assert_array_equal((await c.pull(["v"]))["v"], -2.0)
    finally:
        await shard.stop(0)


async def test_a_push_on_a_stream_that_already_ended_fails_with_a_retryable_status() -> None:
    """The shard went away before the push was written: an UNAVAILABLE RpcError (retried, failed over),
    not asyncio's InvalidStateError (which escaped the retry policy)."""
    from _support import free_addresses

    from psclient import _session
    from psclient._retry import is_retryable
    from pscore import codec, rpc
    from psproto.v1 import ps_pb2

    (nowhere,) = free_addresses(1)  # nothing listens there
    async with grpc.aio.insecure_channel(nowhere) as channel:
        call = rpc.Stub(channel).PushSession(timeout=TIMEOUT_S, wait_for_ready=False)
        with pytest.raises(grpc.RpcError):
            async for _ in call:  # bounded: the connection is refused at once
                pass
        assert call.done()
        session = _session.PushSession(lambda: call)
        request = codec.WireMessage(ps_pb2.PushRequest(worker_id="w", seq=1), "grads", [])
        with pytest.raises(grpc.RpcError) as caught:
            await session.push(request, TIMEOUT_S)
        await session.close()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and is_retryable(caught.value)
