"""The shards' raw-TCP data port (``psserver.dataport``, ``psclient._bulk``) with real shard processes.

Big pulls and pushes go over it, and must behave exactly as over gRPC: the same
values bit for bit, the same idempotence, modes, replication, metrics and statuses.
The clients here set ``data_port_min_bytes=0`` so that small tensors take it too
(fast tests). Wire-level checks speak the protocol by hand (``pscore.bulk``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S, free_port

import psclient
from psclient import _bulk
from pscore import bulk, codec, transport
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster, backups_of

pytestmark = pytest.mark.timeout(180)

TOKEN = "data-port-token_0123"
WIRE = {"data_port_min_bytes": 0, "partition_bytes": 64 << 10}  # everything over the data port
GRPC = {"data_port": False, "partition_bytes": 64 << 10}


def _used_data_port(client: psclient.AsyncPSClient) -> bool:
    """Whether the client has open data connections (private: they are not part of the API)."""
    return any(data._idle for link in client._shards for data in link.data_links.values())


# -- speaking the protocol by hand ----------------------------------------------------


def _credentials(ca: Path, cert: Path, key: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())


@contextlib.asynccontextmanager
async def _stub(
    address: str, token: str | None = None, creds: grpc.ChannelCredentials | None = None
) -> AsyncIterator[Any]:
    """``call(method, request)`` on the shard at ``address`` (raw generated stub, aio)."""
    channel = grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
    async with channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()

        async def call(method: str, request: Any) -> Any:
            return await getattr(stub, method)(request, timeout=CALL_TIMEOUT_S, metadata=metadata)

        yield call


async def _open(address: str) -> bulk.BulkConnection:
    """A data connection to the (plaintext, tokenless) shard at ``address``, set up as psclient does."""
    async with _stub(address) as call:
        reply = await call("DataPort", ps_pb2.ShardDataPortRequest())
    conn = await transport.dial("127.0.0.1", reply.port, magic=bulk.MAGIC, nonce=reply.nonce)
    return bulk.BulkConnection(conn, address)


async def _request(
    link: bulk.BulkConnection, kind: int, head: Any, payload: list[Any] | tuple[()] = ()
) -> tuple[bulk.Frame, bytes]:
    """Sends a request; returns the answer and its payload."""
    async with asyncio.timeout(CALL_TIMEOUT_S):
        await link.send(bulk.Frame(kind, head), payload)
        frame, rest = await link.recv()
    return frame, bytes(rest or b"")


def _push_head(worker: str, seq: int, grads: dict[str, np.ndarray], session: int = 7) -> ps_pb2.PushRequest:
    return ps_pb2.PushRequest(
        worker_id=worker, seq=seq, session=session, grads=[bulk.describe(n, g) for n, g in grads.items()]
    )


async def _push(link: bulk.BulkConnection, worker: str, seq: int, grads: dict[str, np.ndarray]) -> bulk.Frame:
    frame, _ = await _request(
        link, bulk.PUSH, _push_head(worker, seq, grads), bulk.payload_of(grads.values())
    )
    return frame


async def _closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Whether the peer closes the connection (a FIN, or a reset when it left bytes unread) unanswered."""
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            return await reader.read(1) == b""
    except ConnectionResetError:
        return True


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _shard_of(cluster: LocalCluster, name: str, value: np.ndarray) -> str:
    """Creates ``name`` (SGD, learning rate 1) and returns the address of the shard that holds it."""
    async with psclient.AsyncPSClient(cluster.addresses, "setup", timeout=CALL_TIMEOUT_S) as c:
        await c.create(name, value, optimizer=psclient.SGD(1.0))
        (piece,) = c.registry.pieces[name]
    return cluster.addresses[piece.shard]


# -- the same results as gRPC -----------------------------------------------------------


async def test_pull_push_and_push_pull_equal_the_grpc_path_bit_for_bit(
    cluster: LocalCluster, var_name: str
) -> None:
    """Adam on a variable partitioned over both shards, an Adagrad embedding table, an int32 variable."""
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((96, 512)).astype(np.float32)  # 192 KiB: a partition on each shard
    ints = np.arange(1000, dtype=np.int32)
    async with (
        psclient.AsyncPSClient(cluster.addresses, "w-tcp", timeout=CALL_TIMEOUT_S, **WIRE) as tcp,
        psclient.AsyncPSClient(cluster.addresses, "w-grpc", timeout=CALL_TIMEOUT_S, **GRPC) as rpc,
    ):
        for c, tag in ((tcp, "tcp"), (rpc, "grpc")):
            await c.create(f"{var_name}{tag}/d", dense, optimizer=psclient.Adam(0.01))
            await c.create(f"{var_name}{tag}/i", ints)
            await c.create_embedding(  # "zeros": the default initializer depends on the name
                f"{var_name}{tag}/t", 300, 8, optimizer=psclient.Adagrad(0.1), initializer="zeros"
            )
        assert len(tcp.registry.pieces[f"{var_name}tcp/d"]) == 2
        returned = {}
        for step in range(3):
            g = rng.standard_normal(dense.shape).astype(np.float32)
            ids = rng.integers(0, 300, 40)
            rows = rng.standard_normal((40, 8)).astype(np.float32)
            for c, tag in ((tcp, "tcp"), (rpc, "grpc")):
                grads = {f"{var_name}{tag}/d": g, f"{var_name}{tag}/t": psclient.Rows(ids, rows)}
                if step == 1:
                    returned[tag] = await c.push_pull(grads)
                else:
                    assert await c.push(grads)
        values = {}
        for c, tag in ((tcp, "tcp"), (rpc, "grpc")):
            names = [f"{var_name}{tag}/{k}" for k in ("d", "i", "t")]
            values[tag] = await c.pull_with_versions(names)
        assert _used_data_port(tcp) and not any(
            link.data_links for link in rpc._shards
        )  # data_port=False: not even tried
    for k in ("d", "i", "t"):
        np.testing.assert_array_equal(
            values["tcp"][0][f"{var_name}tcp/{k}"], values["grpc"][0][f"{var_name}grpc/{k}"]
        )
        assert values["tcp"][1][f"{var_name}tcp/{k}"] == values["grpc"][1][f"{var_name}grpc/{k}"]
    np.testing.assert_array_equal(values["tcp"][0][f"{var_name}tcp/i"], ints)
    np.testing.assert_array_equal(returned["tcp"][f"{var_name}tcp/d"], returned["grpc"][f"{var_name}grpc/d"])
    got, want = returned["tcp"][f"{var_name}tcp/t"], returned["grpc"][f"{var_name}grpc/t"]
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.values, want.values)


async def test_a_large_partitioned_variable_round_trips_exactly(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(num_shards=2)
    x = np.random.default_rng(1).random((2048, 2048), dtype=np.float32)  # 16 MiB, 2 partitions
    async with psclient.AsyncPSClient(cluster.addresses, "big", timeout=CALL_TIMEOUT_S) as c:
        await c.create("big", x, optimizer=psclient.SGD(0.5))
        np.testing.assert_array_equal((await c.pull(["big"]))["big"], x)
        g = np.full_like(x, 2.0)
        assert await c.push({"big": g})
        new = (await c.push_pull({"big": g}))["big"]
        assert _used_data_port(c)  # 8 MiB per shard: above data_port_min_bytes
    want = (x - np.float32(1.0)) - np.float32(1.0)
    np.testing.assert_array_equal(new, want)


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="the system has no TCP_NOTSENT_LOWAT")
async def test_a_large_request_leaves_unsent_what_the_link_carries_in_a_moment(
    make_cluster: Callable[..., LocalCluster], var_name: str
) -> None:
    """On loopback (gigabytes a second) the limit on a large request's unsent bytes is megabytes: the
    push is queued at once, instead of the sender waking for every 256 KiB the shard reads. A small
    request leaves the limit as it is (no system calls)."""
    big = np.zeros(256 << 10, np.float32)  # 1 MiB
    small = np.zeros(16, np.float32)
    cluster = make_cluster(num_shards=1)
    async with psclient.AsyncPSClient(cluster.addresses, "w-unsent", timeout=CALL_TIMEOUT_S, **WIRE) as c:
        await c.create(f"{var_name}/big", big, optimizer=psclient.SGD(1.0))
        await c.create(f"{var_name}/small", small, optimizer=psclient.SGD(1.0))

        def limits() -> list[int]:  # private: a data connection's socket is not part of the API
            return sorted(
                conn._conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
                for link in c._shards
                for data in link.data_links.values()
                for conn in data._idle
                if conn._conn is not None
            )

        await c.push({f"{var_name}/small": np.ones_like(small)})
        assert set(limits()) <= {0}  # none until a large request
        taken: list[int] = []
        for _ in range(20):  # the kernel's measured rate follows the acknowledged bytes (a loaded machine's
            await c.push({f"{var_name}/big": np.ones_like(big)})  # samples vary: bounded tries)
            taken = limits()
            assert taken and min(taken) >= _bulk.NOTSENT_LOWAT, taken
            if min(taken) > _bulk.NOTSENT_LOWAT:
                break
        assert min(taken) > _bulk.NOTSENT_LOWAT, taken
        await c.push({f"{var_name}/small": np.ones_like(small)})
        assert limits() == taken


async def test_a_retried_push_is_applied_once_whichever_path_carries_it(
    cluster: LocalCluster, var_name: str
) -> None:
    address = await _shard_of(cluster, var_name, np.zeros(1000, np.float32))
    grads = {var_name: np.ones(1000, np.float32)}
    link = await _open(address)
    try:
        first = await _push(link, "dup", 1, grads)
        again = await _push(link, "dup", 1, grads)
        assert (first.kind, first.head.applied) == (bulk.PUSHED, True)
        assert (again.kind, again.head.applied, again.head.reason) == (bulk.PUSHED, False, "duplicate")
        async with _stub(address) as call:
            push = ps_pb2.PushRequest(
                worker_id="dup", seq=1, session=7, grads=[codec.encode(var_name, grads[var_name])]
            )
            over_grpc = await call("Push", push)
            pulled_grpc = await call("Pull", ps_pb2.PullRequest(names=[var_name]))
        assert (over_grpc.applied, over_grpc.reason) == (False, "duplicate")
        pulled, payload = await _request(link, bulk.PULL, ps_pb2.PullRequest(names=[var_name]))
        assert pulled.kind == bulk.PULLED and list(pulled.head.versions) == [1] == list(pulled_grpc.versions)
        assert payload == pulled_grpc.values[0].data
        np.testing.assert_array_equal(np.frombuffer(payload, np.float32), -1.0)
    finally:
        link.reset()


async def test_failures_are_answered_with_the_status_and_message_of_the_grpc_call(
    cluster: LocalCluster, var_name: str
) -> None:
    address = await _shard_of(cluster, var_name, np.zeros(8, np.float32))
    bad = {
        "unknown": {f"{var_name}/nope": np.ones(8, np.float32)},
        "shape": {var_name: np.ones(9, np.float32)},
        "dtype": {var_name: np.ones(8, np.float64)},
        "nan": {var_name: np.full(8, np.nan, np.float32)},
    }
    link = await _open(address)
    try:
        async with _stub(address) as call:
            for seq, (what, grads) in enumerate(bad.items(), start=1):
                answer = await _push(link, "bad", seq, grads)
                assert answer.kind == bulk.ERROR, what
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    chunks = [codec.encode(n, g) for n, g in grads.items()]
                    await call(
                        "Push", ps_pb2.PushRequest(worker_id="bad", seq=100 + seq, session=7, grads=chunks)
                    )
                assert answer.head.code == err.value.code().value[0], what
                assert answer.head.message == err.value.details(), what
            no_worker, _ = await _request(link, bulk.PUSH, _push_head("", 1, {}))
            assert no_worker.kind == bulk.ERROR and "worker_id" in no_worker.head.message
            unknown, _ = await _request(link, bulk.PULL, ps_pb2.PullRequest(names=[f"{var_name}/nope"]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call("Pull", ps_pb2.PullRequest(names=[f"{var_name}/nope"]))
            assert (unknown.head.code, unknown.head.message) == (
                err.value.code().value[0],
                err.value.details(),
            )
            pulled = await call("Pull", ps_pb2.PullRequest(names=[var_name]))
        assert list(pulled.versions) == [0]  # nothing refused was applied
        np.testing.assert_array_equal(np.frombuffer(pulled.values[0].data, np.float32), 0.0)
    finally:
        link.reset()
    async with (
        psclient.AsyncPSClient(cluster.addresses, "twin", timeout=CALL_TIMEOUT_S, **WIRE) as old,
        psclient.AsyncPSClient(cluster.addresses, "twin", timeout=CALL_TIMEOUT_S, **WIRE) as new,
    ):
        with pytest.raises(psclient.InvalidArgumentError, match="non-finite"):
            await old.push(bad["nan"])
        assert await old.push({var_name: np.ones(8, np.float32)})
        assert await new.push({var_name: np.ones(8, np.float32)})  # a newer session takes over
        with pytest.raises(psclient.WorkerIdConflictError):
            await old.push({var_name: np.ones(8, np.float32)})
        assert _used_data_port(old)


async def test_lookups_over_the_data_port_equal_the_lookup_call(cluster: LocalCluster, var_name: str) -> None:
    """Every lookup goes over the data port (whatever its size); rows, errors as the Lookup call's."""
    table = f"{var_name}/t"
    ids = np.array([[7, 0, 3], [3, 299, 8]])
    async with (
        psclient.AsyncPSClient(cluster.addresses, "l-tcp", timeout=CALL_TIMEOUT_S) as tcp,  # the defaults
        psclient.AsyncPSClient(cluster.addresses, "l-grpc", timeout=CALL_TIMEOUT_S, **GRPC) as rpc,
    ):
        await tcp.create_embedding(table, 300, 8, optimizer=psclient.SGD(1.0), initializer="normal")
        await tcp.push({table: psclient.Rows(np.array([3, 8]), np.ones((2, 8), np.float32))})
        got, want = await tcp.lookup(table, ids), await rpc.lookup(table, ids)
        assert got.shape == (2, 3, 8)
        np.testing.assert_array_equal(got, want)
        assert _used_data_port(tcp) and not any(link.data_links for link in rpc._shards)
        # A lookup with a push, where a shard holds rows to read and none of the gradients.
        _, rows = await tcp.push_pull_lookup(
            {table: psclient.Rows(np.array([3]), np.ones((1, 8), np.float32))}, {table: [0, 3]}
        )
        np.testing.assert_array_equal(rows[table], await rpc.lookup(table, [0, 3]))
    piece = f"{table}/rows_0"  # even ids
    link = await _open(cluster.addresses[0])
    try:
        async with _stub(cluster.addresses[0]) as call:
            for what, asked in (("other shard", [3]), ("range", [400]), ("unknown", None)):
                name = piece if asked is not None else f"{var_name}/nope/rows_0"
                request = ps_pb2.LookupRequest(ids=[codec.encode(name, np.array(asked or [0]))])
                answer, _ = await _request(link, bulk.LOOKUP, request)
                assert answer.kind == bulk.ERROR, what
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call("Lookup", request)
                assert (answer.head.code, answer.head.message) == (
                    err.value.code().value[0],
                    err.value.details(),
                ), what
            request = ps_pb2.LookupRequest(ids=[codec.encode(piece, np.array([8, 0]))])
            answer, payload = await _request(link, bulk.LOOKUP, request)
            assert answer.kind == bulk.LOOKED_UP and [v.name for v in answer.head.values] == [piece]
            direct = await call("Lookup", request)
            np.testing.assert_array_equal(
                np.frombuffer(payload, np.float32).reshape(2, 8), codec.decode(direct.values[0])
            )
    finally:
        link.reset()


# -- modes ------------------------------------------------------------------------------


async def test_sync_mode_barrier_stale_push_and_timeout(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(
        num_shards=1,
        server_args=["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2",
                     "--barrier-timeout", "30"],
    )  # fmt: skip
    clients = [
        psclient.AsyncPSClient(cluster.addresses, f"s{i}", timeout=CALL_TIMEOUT_S, **WIRE) for i in range(2)
    ]
    try:
        await clients[0].create("v", np.zeros(64, np.float32), optimizer=psclient.SGD(1.0))
        both = await asyncio.gather(
            *(c.push({"v": np.full(64, i + 1.0, np.float32)}, step=0) for i, c in enumerate(clients))
        )
        assert both == [True, True]  # the push is the barrier: both return once the step is applied
        assert not await clients[0].push({"v": np.ones(64, np.float32)}, step=0)  # stale: dropped
        # Nobody else comes: the barrier gives up just before the push's own deadline (sent with it). The
        # margin it leaves the answer is a tenth of the time left (0.25-1 s): 6 s leave 0.6 s, where 2 s left
        # 0.25 s, which a loaded machine's answer once outlasted (the client's own deadline fired first).
        async with psclient.AsyncPSClient(cluster.addresses, "late", timeout=6.0, **WIRE) as late:
            with pytest.raises(psclient.DeadlineExceededError, match=r"sync barrier for step 1.*deadline"):
                await late.push({"v": np.ones(64, np.float32)}, step=1)
        values, versions = await clients[1].pull_with_versions(["v"])
        assert all(_used_data_port(c) for c in clients)
    finally:
        for c in clients:
            await c.close()
    assert versions == {"v": 1}
    np.testing.assert_array_equal(values["v"], -1.5)  # the mean of 1 and 2


async def test_ssp_mode_pull_waits_for_the_slowest_worker(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(
        num_shards=1,
        server_args=["--mode", "ssp", "--total-replicas", "2", "--staleness", "0", "--barrier-timeout", "30"],
    )
    async with (
        psclient.AsyncPSClient(cluster.addresses, "fast", timeout=CALL_TIMEOUT_S, **WIRE) as fast,
        psclient.AsyncPSClient(cluster.addresses, "slow", timeout=CALL_TIMEOUT_S, **WIRE) as slow,
    ):
        await fast.create("v", np.zeros(64, np.float32), optimizer=psclient.SGD(1.0))
        assert await fast.push({"v": np.ones(64, np.float32)}, step=0)
        # "slow" has not pushed step 0: the wait gives up just before the pull's own deadline (6 s: as above).
        async with psclient.AsyncPSClient(cluster.addresses, "fast", timeout=6.0, **WIRE) as hasty:
            with pytest.raises(psclient.DeadlineExceededError, match=r"ssp wait timed out.*deadline"):
                await hasty.pull(["v"], step=1)
        assert await slow.push({"v": np.ones(64, np.float32)}, step=0)
        values = await fast.pull(["v"], step=1)
        assert _used_data_port(fast)
    np.testing.assert_array_equal(values["v"], -2.0)


# -- replication, metrics ------------------------------------------------------------------


def test_pushes_over_the_data_port_reach_the_backup() -> None:
    n = 1 << 16
    with LocalCluster(1) as primary, backups_of(primary, ["--serve-alone"]) as backup:
        addresses = [f"{primary.addresses[0]}|{backup.addresses[0]}"]
        with psclient.PSClient(addresses, "w0", timeout=CALL_TIMEOUT_S, **WIRE) as c:
            c.create("r", np.zeros(n, np.float32), optimizer=psclient.Adam(0.1))
            for _ in range(5):
                assert c.push({"r": np.ones(n, np.float32)})
            on_primary, versions = c.pull_with_versions(["r"])
            assert _used_data_port(c._async)
            primary.kill_shard(0)
            on_backup, backup_versions = c.pull_with_versions(["r"])  # fails over to the backup
    assert backup_versions == versions == {"r": 5}
    np.testing.assert_array_equal(on_backup["r"], on_primary["r"])


async def test_metrics_count_data_port_requests_as_pushes_and_pulls() -> None:
    from test_metrics import scrape, value  # the helpers of the metrics tests

    from psserver.config import ServerConfig
    from psserver.server import start

    shard = await start(ServerConfig(shard=0, port=0, metrics_port=0))
    try:
        assert shard.metrics is not None and shard.metrics.port and shard.data_port is not None
        async with psclient.AsyncPSClient([shard.address], "w0", timeout=CALL_TIMEOUT_S, **WIRE) as c:
            await c.create("w", np.zeros((16, 8), np.float32), optimizer=psclient.SGD(0.1))
            await c.pull()
            for _ in range(3):
                await c.push({"w": np.ones((16, 8), np.float32)})
            await c.push_pull({"w": np.ones((16, 8), np.float32)})
            with pytest.raises(psclient.InvalidArgumentError):
                await c.push({"w": np.full((16, 8), np.inf, np.float32)})
            assert _used_data_port(c)
        after = await asyncio.to_thread(scrape, f"127.0.0.1:{shard.metrics.port}")
    finally:
        await shard.stop(0)
    assert value(after, "psserver_pushes_total", shard="0", outcome="applied") == 4
    assert value(after, "psserver_pulls_total", shard="0") == 1
    assert value(after, "psserver_push_bytes_total") == 5 * 16 * 8 * 4
    assert value(after, "psserver_pull_bytes_total") == 2 * 16 * 8 * 4
    assert value(after, "psserver_rpc_latency_seconds_count", rpc="Push") == 5
    assert value(after, "psserver_rpc_latency_seconds_count", rpc="Pull") == 1
    assert value(after, "psserver_rpc_errors_total", rpc="Push", code="INVALID_ARGUMENT") == 1
    assert value(after, "psserver_push_staleness_sum") == 0 + 1 + 2 + 3 + 0  # the refused one after a read


# -- security ------------------------------------------------------------------------------


async def test_the_data_port_needs_the_token_and_a_fresh_nonce(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    (tmp_path / "token").write_text(TOKEN)
    fixed = free_port()  # --data-port: a port a firewall can be opened for
    cluster = make_cluster(
        num_shards=1, server_args=["--auth-token-file", str(tmp_path / "token"), "--data-port", str(fixed)]
    )
    address = cluster.addresses[0]
    async with psclient.AsyncPSClient(
        cluster.addresses, "w0", auth_token=TOKEN, timeout=CALL_TIMEOUT_S, **WIRE
    ) as c:
        await c.create("v", np.arange(100, dtype=np.float32), optimizer=psclient.SGD(1.0))
        assert await c.push({"v": np.ones(100, np.float32)})
        np.testing.assert_array_equal((await c.pull(["v"]))["v"], np.arange(100) - 1.0)
        assert _used_data_port(c)
    async with _stub(address) as call:  # no token: no port, no nonce
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call("DataPort", ps_pb2.ShardDataPortRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with _stub(address, TOKEN) as call:
        reply = await call("DataPort", ps_pb2.ShardDataPortRequest())
    assert reply.port == fixed
    hello = bulk.MAGIC + os.urandom(16) + bytes(4)  # a forged nonce
    reader, writer = await asyncio.open_connection("127.0.0.1", reply.port)
    writer.write(hello)
    assert await _closed_by_peer(reader)  # closed without the acknowledgement
    await _close(writer)
    conn = await transport.dial("127.0.0.1", reply.port, magic=bulk.MAGIC, nonce=reply.nonce)
    conn.close()
    with pytest.raises(ConnectionError):  # a nonce opens one connection only
        await transport.dial("127.0.0.1", reply.port, magic=bulk.MAGIC, nonce=reply.nonce)


async def test_mutual_tls_on_the_data_port(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from _certs import make_pki

    pki = make_pki(tmp_path)
    cluster = make_cluster(num_shards=1, server_args=pki.shard_flags())
    tls = pki.client_options()
    x = np.random.default_rng(3).random(50_000).astype(np.float32)
    async with psclient.AsyncPSClient(cluster.addresses, "w0", timeout=CALL_TIMEOUT_S, **tls, **WIRE) as c:
        await c.create("v", x, optimizer=psclient.SGD(1.0))
        np.testing.assert_array_equal((await c.pull(["v"]))["v"], x)
        assert _used_data_port(c)
    creds = _credentials(pki.ca, pki.client_cert, pki.client_key)
    async with _stub(cluster.addresses[0], creds=creds) as call:
        replies = [await call("DataPort", ps_pb2.ShardDataPortRequest()) for _ in range(2)]
    # Plaintext, even with a valid nonce: refused.
    reader, writer = await asyncio.open_connection("127.0.0.1", replies[0].port)
    writer.write(bulk.MAGIC + replies[0].nonce + bytes(4))
    assert await _closed_by_peer(reader)
    await _close(writer)
    # TLS without a client certificate: refused.
    with pytest.raises((OSError, TimeoutError)):
        context = transport.client_context(str(pki.ca), None, None)
        conn = await transport.dial(
            "127.0.0.1", replies[1].port, magic=bulk.MAGIC, nonce=replies[1].nonce, tls=context, timeout=10
        )
        conn.close()


# -- falling back, failures, garbage ----------------------------------------------------------


class _Proxy:
    """Forwards ``127.0.0.2:PORT`` to a shard's gRPC address: the data port on 127.0.0.1 is then out of reach
    for the client, as behind a firewall that lets only the gRPC port through."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.address = ""

    async def __aenter__(self) -> _Proxy:
        host, _, port = self.target.rpartition(":")
        writers: set[asyncio.StreamWriter] = set()
        self.writers = writers

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            await _close(w)

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            r2, w2 = await asyncio.open_connection(host, int(port))
            writers.update((w, w2))
            await asyncio.gather(pipe(r, w2), pipe(r2, w))

        self.server = await asyncio.start_server(handle, "127.0.0.2", 0)
        self.address = f"127.0.0.2:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            await _close(w)
        await self.server.wait_closed()


async def test_an_unreachable_data_port_falls_back_to_grpc_and_says_so_once(
    cluster: LocalCluster, var_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    x = np.arange(5000, dtype=np.float32)
    async with contextlib.AsyncExitStack() as stack:
        proxies = [await stack.enter_async_context(_Proxy(a)) for a in cluster.addresses]
        with caplog.at_level(logging.INFO, logger="psclient._bulk"):
            async with psclient.AsyncPSClient(
                [p.address for p in proxies], "w0", timeout=CALL_TIMEOUT_S, **WIRE
            ) as c:
                await c.create(var_name, x, optimizer=psclient.SGD(1.0))
                for _ in range(3):
                    assert await c.push({var_name: np.ones_like(x)})
                    await c.pull([var_name])
                values = await c.pull([var_name])
                assert not _used_data_port(c)
    np.testing.assert_array_equal(values[var_name], x - 3)
    said = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    holder = c.registry.pieces[var_name][0].shard
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text  # once, by its shard
    assert proxies[holder].address in said[0].getMessage()


async def test_a_shard_without_a_data_port_is_served_over_grpc(
    make_cluster: Callable[..., LocalCluster], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = make_cluster(num_shards=1, server_args=["--no-data-port"])
    with caplog.at_level(logging.INFO, logger="psclient._bulk"):
        async with psclient.AsyncPSClient(cluster.addresses, "w0", timeout=CALL_TIMEOUT_S, **WIRE) as c:
            await c.create("v", np.zeros(300, np.float32), optimizer=psclient.SGD(1.0))
            for _ in range(2):
                assert await c.push({"v": np.ones(300, np.float32)})
            values = await c.pull(["v"])
            assert not _used_data_port(c)
    np.testing.assert_array_equal(values["v"], -2.0)
    assert sum("serves no data port" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_a_shard_killed_during_big_pushes_retries_each_push_once_or_gives_a_typed_error(
    tmp_path: Path,
) -> None:
    """16 MiB pushes while the shard is killed and restarted (from a checkpoint of before them): push i
    adds -1 at element i, so a push applied twice shows as -2, and one lost as a gap.

    The pushes acknowledged after the restart are applied once each, and the one in flight at the kill
    is retried onto the restarted shard; with the shard gone for good, a typed error names it."""
    n = 4 << 20
    with LocalCluster(1, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        address = cluster.addresses[0]
        with psclient.PSClient(cluster.addresses, "w0", timeout=CALL_TIMEOUT_S) as c:
            c.create("v", np.zeros(n, np.float32), optimizer=psclient.SGD(1.0))
            c.save_checkpoint()
            done = threading.Event()
            acknowledged = 0

            def push() -> None:
                nonlocal acknowledged
                while not done.is_set():
                    grad = np.zeros(n, np.float32)
                    grad[acknowledged] = 1.0
                    assert c.push({"v": grad})
                    acknowledged += 1

            pusher = threading.Thread(target=push, daemon=True)
            pusher.start()
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while acknowledged < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            cluster.kill_shard(0)  # most likely in the middle of a push's bytes or its update
            at_kill = acknowledged
            cluster.start_shard(0, port=int(address.rpartition(":")[2]))  # state of the checkpoint
            while acknowledged < at_kill + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            done.set()
            pusher.join(timeout=CALL_TIMEOUT_S)
            assert not pusher.is_alive() and acknowledged >= at_kill + 2
            values, versions = c.pull_with_versions(["v"])
        v = values["v"]
        applied = np.flatnonzero(v)
        assert set(np.unique(v)) <= {0.0, -1.0}  # nothing applied twice
        assert versions["v"] == len(applied) >= 2
        # What the restarted shard holds is a gap-free run of pushes ending with the last acknowledged.
        assert list(applied) == list(range(acknowledged - len(applied), acknowledged))
        # The push in flight at the kill was retried onto the restarted shard (+ 1: the kill may fall
        # between a push's acknowledgement by the old shard and the count going up).
        assert acknowledged - len(applied) <= at_kill + 1
        cluster.kill_shard(0)
    with (
        psclient.PSClient([address], "w1", timeout=2.0, data_port_min_bytes=0) as gone,
        pytest.raises((psclient.UnavailableError, psclient.DeadlineExceededError)) as err,
    ):
        gone.pull(["v"])
    assert address in str(err.value)


async def test_garbage_on_the_data_port_drops_that_connection_and_the_shard_serves_on(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(num_shards=1)
    address = cluster.addresses[0]
    garbage = [
        os.urandom(64),
        b"\x09" + bytes(15),  # an unknown kind
        bytes([bulk.PULL, 0, 0, 0]) + (1 << 31).to_bytes(4, "little") + bytes(8),  # a 2 GiB head
        bytes([bulk.PUSH, 0, 0, 0]) + (5).to_bytes(4, "little") + bytes(8) + b"\xff" * 5,  # not a message
    ]
    for junk in garbage:
        async with _stub(address) as call:
            reply = await call("DataPort", ps_pb2.ShardDataPortRequest())
        conn = await transport.dial("127.0.0.1", reply.port, magic=bulk.MAGIC, nonce=reply.nonce)
        reader, writer = await asyncio.open_connection(sock=conn.sock)
        writer.write(junk)
        assert await _closed_by_peer(reader), junk
        await _close(writer)
    # A head that announces other tensors than its payload: dropped too.
    link = await _open(address)
    head = _push_head("g", 1, {"v": np.ones(4, np.float32)})
    await link.send(bulk.Frame(bulk.PUSH, head), [b"\x00" * 8])
    with pytest.raises(psclient.PSError):
        await link.recv()
    async with psclient.AsyncPSClient(cluster.addresses, "w0", timeout=CALL_TIMEOUT_S, **WIRE) as c:
        await c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        assert await c.push({"v": np.ones(4, np.float32)})
        np.testing.assert_array_equal((await c.pull(["v"]))["v"], -1.0)
        assert _used_data_port(c)
    assert cluster.stop_shard(0) == 0  # SIGTERM with data connections open: a clean exit
