"""Client sessions with real shard processes (issue 9): one worker id, two clients; restarts; retries.

A push is applied once per ``(worker_id, session, seq)``. The counter variable
is SGD with learning rate 1 and gradients of ones: its value is minus the
number of pushes applied, so it proves each acknowledged push applied exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from pscore import codec, errors
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster, backups_of

pytestmark = pytest.mark.timeout(120)

ONES = np.ones(4, np.float32)


def _push(address: str, worker: str, session: int, seq: int) -> grpc.Call | ps_pb2.PushResponse:
    """One raw unary Push of ones to ``v``: the response, or the failed call."""
    request = ps_pb2.PushRequest(worker_id=worker, session=session, seq=seq, grads=[codec.encode("v", ONES)])
    with grpc.insecure_channel(address) as channel:
        try:
            return ps_pb2_grpc.ParameterServerStub(channel).Push(request, timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            return err


def _value(addresses: list[str]) -> tuple[float, int]:
    with psclient.PSClient(addresses, "reader", timeout=TIMEOUT_S) as c:
        values, versions = c.pull_with_versions(["v"])
    return float(values["v"][0]), versions["v"]


def _assert_conflict(result: object) -> None:
    assert isinstance(result, grpc.RpcError), result
    assert result.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is used by two clients at once" in result.details()
    assert isinstance(errors.from_rpc_error(result), psclient.WorkerIdConflictError)


# Each wire a push can take: the data port (the default), PushSession, a unary Push (a shard without
# PushSession), a PushStream.
WIRES = {
    "data_port": {},
    "session": {"data_port": False},
    "unary": {"data_port": False},
    "stream": {"data_port": False, "unary_max_bytes": 0},
}


@pytest.mark.parametrize("path", list(WIRES))
async def test_two_clients_with_one_worker_id_one_is_refused_and_no_push_is_dropped(
    cluster: LocalCluster, var_name: str, path: str
) -> None:
    options = WIRES[path]
    async with (
        psclient.AsyncPSClient(cluster.addresses, worker_id=var_name, timeout=TIMEOUT_S, **options) as a,
        psclient.AsyncPSClient(cluster.addresses, worker_id=var_name, timeout=TIMEOUT_S, **options) as b,
    ):
        await a.create(var_name, np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        if path == "unary":
            for c in (a, b):
                for link in c._shards:
                    link.session().supported = False
        acknowledged = {"a": 0, "b": 0}
        refused: dict[str, psclient.WorkerIdConflictError] = {}

        async def pusher(name: str, c: psclient.AsyncPSClient) -> None:
            for _ in range(40):
                try:
                    applied = await c.push({var_name: ONES})
                except psclient.WorkerIdConflictError as err:
                    refused[name] = err
                    return
                assert applied, "a push was dropped as a duplicate"
                acknowledged[name] += 1
                await asyncio.sleep(0)

        async with asyncio.timeout(60):
            await asyncio.gather(pusher("a", a), pusher("b", b))
        values, _ = await a.pull_with_versions([var_name])
    assert len(refused) == 1, (refused, acknowledged)
    (loser,) = refused
    assert "give each worker its own worker_id" in str(refused[loser])
    assert not refused[loser].retryable
    assert acknowledged[loser] < 40 and acknowledged["a" if loser == "b" else "b"] == 40
    np.testing.assert_array_equal(values[var_name], -(acknowledged["a"] + acknowledged["b"]))


def test_a_restarted_client_with_the_same_worker_id_has_every_push_applied(
    cluster: LocalCluster, var_name: str
) -> None:
    for run in range(3):  # each run: a new process's client, numbering its pushes from 1 again
        with psclient.PSClient(cluster.addresses, worker_id=var_name, timeout=TIMEOUT_S) as c:
            if run == 0:
                c.create(var_name, np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
            assert all(c.push({var_name: ONES}) for _ in range(5))
            values, versions = c.pull_with_versions([var_name])
        assert versions == {var_name: 5 * (run + 1)}
        np.testing.assert_array_equal(values[var_name], -5.0 * (run + 1))


def test_a_retried_push_is_applied_once_and_dedup_survives_a_restart_from_checkpoint(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster(num_shards=1, server_args=["--checkpoint-dir", str(tmp_path)])
    (address,) = cluster.addresses
    with psclient.PSClient(cluster.addresses, "setup", timeout=TIMEOUT_S) as c:
        c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
    old, new = 0x1111, 0x2222
    assert _push(address, "w0", old, 1).applied
    retry = _push(address, "w0", old, 1)  # the same session and seq: a retry
    assert not retry.applied and retry.reason == "duplicate"
    assert _push(address, "w0", new, 1).applied  # a restarted worker: seq 1 again, applied
    with psclient.PSClient(cluster.addresses, "setup", timeout=TIMEOUT_S) as c:
        c.save_checkpoint()
    cluster.kill_shard(0)
    cluster.start_shard(0, port=int(address.rpartition(":")[2]))
    assert "restored" in cluster.log_tail(0, 50)
    assert not _push(address, "w0", new, 1).applied  # the retry after the restart: still once
    assert not _push(address, "w0", old, 1).applied
    _assert_conflict(_push(address, "w0", old, 2))  # the newer session still holds the worker id
    assert _push(address, "w0", new, 2).applied
    assert _value(cluster.addresses) == (-3.0, 3)


def test_the_backup_dedups_by_session_after_a_failover() -> None:
    with LocalCluster(1) as primary, backups_of(primary, ["--serve-alone"]) as backup:
        with psclient.PSClient(primary.addresses, "setup", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        old, new = 0x3333, 0x4444
        assert _push(primary.addresses[0], "w0", old, 1).applied
        assert _push(primary.addresses[0], "w0", new, 1).applied  # replicated: the backup has both
        primary.kill_shard(0)
        (address,) = backup.addresses
        deadline = time.monotonic() + 20
        while (result := _push(address, "w0", new, 1)) and isinstance(result, grpc.RpcError):
            assert result.code() == grpc.StatusCode.UNAVAILABLE  # a standby until it sees the primary gone
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not result.applied and result.reason == "duplicate"  # a retry after the failover: once
        _assert_conflict(_push(address, "w0", old, 2))
        assert _push(address, "w0", new, 2).applied
        assert _value(backup.addresses) == (-3.0, 3)
