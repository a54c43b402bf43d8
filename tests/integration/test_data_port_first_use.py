"""First data connections under contention: two workers in one event loop open theirs at sync step 0.

A full-suite run once saw such a step end in "Deadline Exceeded" after 30 s
(``test_dynamic_embedding``'s sync test, issue 19). Each scenario here opens
every data connection of both workers at once, while the step's barrier on a
shard holds one worker's push until the other's arrives, and bounds every wait
far below the call deadline: plaintext and TLS; a shard stalled (SIGSTOP, a
real stop of its process) before the ``DataPort`` negotiation; a shard stalled
between the negotiation and the connection's handshake for longer than a
firewalled port is given to accept (``psclient._bulk.CONNECT_TIMEOUT_S``); a
second worker that connects while the first one's push already waits at the
barrier.

The clients use the defaults: every pull and push over the data port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psclient
from psclient import _bulk
from psproto.v1 import ps_pb2
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)

CALL_S = 10.0  # each call's deadline: far above what a step takes, far below the 30 s of the incident
STEP_S = 15.0  # bound of one step of both workers (a stalled shard included)
STALL_S = 1.5  # a stall shorter than the bounds above
LONG_STALL_S = _bulk.CONNECT_TIMEOUT_S + 1.5  # longer than a firewalled port is given to accept
SYNC = ["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2", "--barrier-timeout", "20"]
TABLE = "table"
DENSE = "dense"


@contextlib.contextmanager
def _stalled(cluster: LocalCluster, shard: int, seconds: float) -> Iterator[None]:
    """Stops ``shard``'s process (SIGSTOP); it goes on after ``seconds`` (SIGCONT, at the latest on exit)."""
    pid = cluster.procs[shard].pid
    os.kill(pid, signal.SIGSTOP)
    timer = asyncio.get_running_loop().call_later(seconds, os.kill, pid, signal.SIGCONT)
    try:
        yield
    finally:
        timer.cancel()
        os.kill(pid, signal.SIGCONT)


def _tls(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Shard flags and client options for mutual TLS with fresh certificates."""
    pytest.importorskip("cryptography")
    from _certs import make_pki

    pki = make_pki(tmp_path)
    return pki.shard_flags(), pki.client_options()


async def _workers(cluster: LocalCluster, tls: dict[str, str]) -> list[psclient.AsyncPSClient]:
    """Two workers with the variables created (over gRPC: no data connection is open yet)."""
    workers = [psclient.AsyncPSClient(cluster.addresses, f"w{i}", timeout=CALL_S, **tls) for i in range(2)]
    for w in workers:
        await w.create_embedding(
            TABLE, None, 2, key_type="string", optimizer=psclient.SGD(1.0), initializer="zeros"
        )
        await w.create(DENSE, np.zeros(8, np.float32), optimizer=psclient.SGD(1.0))
    assert not any(link.data_links for w in workers for link in w._shards)
    return workers


def _grads(i: int) -> dict[str, Any]:
    keys = [["a", "b"], ["b", "c"]][i]
    return {
        TABLE: psclient.Rows(keys, np.full((2, 2), 2.0 * (i + 1), np.float32)),
        DENSE: np.full(8, 2.0 * (i + 1), np.float32),
    }


async def _step_0(workers: list[psclient.AsyncPSClient]) -> None:
    """Both workers push step 0 at once; the step completes within ``STEP_S``."""
    async with asyncio.timeout(STEP_S):
        applied = await asyncio.gather(*(w.push(_grads(i), step=0) for i, w in enumerate(workers)))
    assert applied == [True, True]


async def _check(workers: list[psclient.AsyncPSClient], num_shards: int) -> None:
    """The step's mean was applied once, and every worker reaches every shard over its data port."""
    async with asyncio.timeout(STEP_S):
        values = await workers[1].pull([DENSE])
        rows = await workers[0].lookup(TABLE, ["a", "b", "c", "d"])
    np.testing.assert_array_equal(values[DENSE], -3.0)  # the mean of 2 and 4
    np.testing.assert_array_equal(rows, -np.array([[1, 1], [3, 3], [2, 2], [0, 0]], np.float32))
    for w in workers:
        links = {shard: w._shards[shard].data_links.get(0) for shard in range(num_shards)}
        assert all(link is not None and link.usable and link._idle for link in links.values()), (
            w.worker_id,
            links,
        )


async def _close(workers: list[psclient.AsyncPSClient]) -> None:
    for w in workers:
        await w.close()


@pytest.mark.parametrize("security", ["plain", "tls"])
@pytest.mark.parametrize("stall", ["none", "before_negotiation"])
async def test_two_workers_open_their_first_data_connections_at_sync_step_0(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, security: str, stall: str
) -> None:
    flags, tls = _tls(tmp_path) if security == "tls" else ([], {})
    cluster = make_cluster(num_shards=2, server_args=[*SYNC, *flags])
    workers = await _workers(cluster, tls)
    try:
        with _stalled(cluster, 1, STALL_S) if stall != "none" else contextlib.nullcontext():
            await _step_0(workers)
        await _check(workers, 2)
    finally:
        await _close(workers)


@pytest.mark.parametrize("security", ["plain", "tls"])
async def test_a_shard_that_stalls_during_the_first_handshake_keeps_its_data_port(
    make_cluster: Callable[..., LocalCluster],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    security: str,
) -> None:
    """The shard stops right after it gave a worker its port and nonce, for longer than a firewalled port
    is given to accept: the kernel accepted the connection, so the port is reachable and the shard only
    slow (as it would be over gRPC). The step completes once it goes on; nobody turns its data port off."""
    flags, tls = _tls(tmp_path) if security == "tls" else ([], {})
    cluster = make_cluster(num_shards=2, server_args=[*SYNC, *flags])
    workers = await _workers(cluster, tls)
    stalls: list[contextlib.ExitStack] = []

    def stall_after(negotiate: Callable[[float], Awaitable[ps_pb2.ShardDataPortResponse]]) -> Any:
        async def negotiated(timeout: float) -> ps_pb2.ShardDataPortResponse:
            reply = await negotiate(timeout)
            if not stalls:  # the first reply of shard 1: stop it before the connection's handshake
                stack = contextlib.ExitStack()
                stack.enter_context(_stalled(cluster, 1, LONG_STALL_S))
                stalls.append(stack)
            return reply

        return negotiated

    for w in workers:
        link = w._shards[1].data_link()
        assert link is not None
        link._data_port = stall_after(link._data_port)
    try:
        with caplog.at_level(logging.INFO, logger="psclient._bulk"):
            await _step_0(workers)
        assert stalls, "no DataPort call went to shard 1"
        await _check(workers, 2)
        assert "cannot be reached" not in caplog.text
    finally:
        for stack in stalls:
            stack.close()
        await _close(workers)


async def test_a_worker_connects_while_the_other_ones_push_waits_at_the_barrier(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """w0's step-0 pushes hold both shards' barriers before w1 has a data connection: w1's DataPort calls
    and handshakes are answered while those pushes wait, and its pushes complete the step."""
    cluster = make_cluster(num_shards=2, server_args=SYNC)
    workers = await _workers(cluster, {})
    try:
        async with asyncio.timeout(STEP_S):
            first = asyncio.ensure_future(workers[0].push(_grads(0), step=0))
            await asyncio.sleep(0.5)  # w0 connects and sends its pushes (2 x 80 bytes) to both barriers
            assert not first.done()  # held: the step needs w1
            assert not any(link.data_links for link in workers[1]._shards)
            assert await workers[1].push(_grads(1), step=0)
            assert await first
        await _check(workers, 2)
    finally:
        await _close(workers)
