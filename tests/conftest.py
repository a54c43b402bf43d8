"""Shared fixtures: real ``psserver`` processes on loopback, clients, raw stubs, unique names.

Fixtures (all documented where defined):

``cluster``
    A 2-shard ``LocalCluster`` shared by the whole session (default flags). Tests
    that use it must name their variables uniquely (``var_name``). After each test
    it checks that every shard is still alive, so a test that crashes a shard fails
    by name (and the next test gets a fresh cluster).
``make_cluster``
    Factory for a private cluster with its own flags:
    ``make_cluster(num_shards=1, server_args=["--allow-non-finite"])``. Started
    on call, stopped (SIGTERM) at teardown.
``client`` / ``async_client``
    A ``PSClient`` / ``AsyncPSClient`` on ``cluster``, closed at teardown.
``raw_stubs``
    The generated ``ParameterServerStub`` of each ``cluster`` shard (sync
    channels), for sending malformed requests the clients never build.
``var_name``
    A variable name unique to the test (and valid on the wire).
``net``
    A 3-host cluster in a box (``trainer.netns.NetnsCluster``: network namespaces on a bridge of its
    own), removed at teardown; the test skips with the reason where namespaces cannot be made.

Only process-based tests use these; unit tests need none of them (no sockets, no TF).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from _support import CALL_TIMEOUT_S

from psproto.v1 import ps_pb2_grpc
from trainer.cluster import LocalCluster
from trainer.netns import NetnsCluster, netns_available


@pytest.fixture(scope="session")
def _shared_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster(num_shards=2).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(_shared_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The session's shared 2-shard cluster; asserts after the test that every shard still serves."""
    yield _shared_cluster
    dead = [s for s, p in enumerate(_shared_cluster.procs) if p is None or p.poll() is not None]
    if dead:
        tails = "\n".join(f"--- shard {s} ---\n{_shared_cluster.log_tail(s)}" for s in dead)
        for s in dead:  # leave a working cluster to the tests that follow
            _shared_cluster.start_shard(s)
        pytest.fail(f"shards {dead} died during the test:\n{tails}")


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., LocalCluster]]:
    """Factory: ``make_cluster(num_shards=2, server_args=(), **LocalCluster kwargs)`` -> started cluster.

    Every cluster made is stopped at teardown.
    """
    made: list[LocalCluster] = []

    def factory(num_shards: int = 2, server_args: Sequence[str] = (), **kwargs: Any) -> LocalCluster:
        c = LocalCluster(num_shards=num_shards, server_args=server_args, **kwargs)
        made.append(c)
        return c.start()

    yield factory
    for c in made:
        c.stop()


@pytest.fixture
def var_name(request: pytest.FixtureRequest) -> str:
    """A variable name unique to this test, e.g. ``test_push_sgd[float32]`` -> ``test_push_sgd_float32_``."""
    return re.sub(r"[^A-Za-z0-9_/]", "_", request.node.name)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Any]:
    """A ``psclient.PSClient`` on ``cluster`` (worker id from the test name), closed at teardown."""
    import psclient

    with psclient.PSClient(cluster.addresses, timeout=CALL_TIMEOUT_S) as c:
        yield c


@pytest.fixture
async def async_client(cluster: LocalCluster) -> Any:
    """A ``psclient.AsyncPSClient`` on ``cluster``, on the test's event loop; closed at teardown."""
    import psclient

    async with psclient.AsyncPSClient(cluster.addresses, timeout=CALL_TIMEOUT_S) as c:
        yield c


@pytest.fixture
def raw_stubs(cluster: LocalCluster) -> Iterator[list[ps_pb2_grpc.ParameterServerStub]]:
    """The raw generated stub of every ``cluster`` shard, in shard order (sync channels)."""
    channels = [grpc.insecure_channel(a) for a in cluster.addresses]
    try:
        yield [ps_pb2_grpc.ParameterServerStub(ch) for ch in channels]
    finally:
        for ch in channels:
            ch.close()


@pytest.fixture
def net() -> Iterator[NetnsCluster]:
    """Three hosts on a bridge of their own (``net.hosts``); skips where namespaces cannot be made."""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    with NetnsCluster(3) as cluster:
        yield cluster
