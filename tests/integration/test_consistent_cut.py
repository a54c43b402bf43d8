"""Consistent cuts (``save_checkpoint(consistent=True)``, ``psctl save --consistent``), real shard processes.

The model is counters: SGD with learning rate 1 and gradients of -1, so a
variable's value and version both count the pushes applied to it, and every
push updates every variable (on every shard). A cut taken under concurrent
pushers is consistent exactly when, after a restore, every variable holds the
same count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import psclient
from pscore import codec
from psproto.v1 import ps_pb2, ps_pb2_grpc
from psserver import ckptfile
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 30.0
COUNTERS = [f"count/{i}" for i in range(6)]


def _port(cluster: LocalCluster, shard: int) -> int:
    return int(cluster.addresses[shard].rpartition(":")[2])


def _kill_and_restart_all(cluster: LocalCluster) -> None:
    """kill -9 every shard (no exit checkpoint: the newest files stay the cut's), then restart them."""
    ports = [_port(cluster, s) for s in range(cluster.num_shards)]
    for s in range(cluster.num_shards):
        cluster.kill_shard(s)
    for s in range(cluster.num_shards):
        cluster.start_shard(s, port=ports[s])


def _create_counters(addresses: list[str]) -> None:
    with psclient.PSClient(addresses, "init", timeout=TIMEOUT_S) as c:
        c.create_many({n: np.zeros(4, np.float32) for n in COUNTERS}, optimizer=psclient.SGD(1.0))
        placed = {info[0].spec.name: i for i, info in enumerate(c.list_variables().values())}
        assert len(placed) == len(COUNTERS)


def _pushers(
    addresses: list[str], count: int, stop: threading.Event
) -> tuple[list[threading.Thread], list[int]]:
    acknowledged = [0] * count
    minus_one = {n: np.full(4, -1.0, np.float32) for n in COUNTERS}

    def run(i: int) -> None:
        with psclient.PSClient(addresses, f"w{i}", timeout=TIMEOUT_S) as c:
            while not stop.is_set():
                c.push(minus_one)
                acknowledged[i] += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads, acknowledged


def _assert_one_version(addresses: list[str]) -> int:
    with psclient.PSClient(addresses, "reader", timeout=TIMEOUT_S) as c:
        values, versions = c.pull_with_versions()
    assert len(set(versions.values())) == 1, versions  # one version of the whole model
    count = versions[COUNTERS[0]]
    for name in COUNTERS:
        np.testing.assert_array_equal(values[name], np.full(4, count, np.float32))
    return count


def test_a_consistent_save_under_concurrent_pushers_restores_one_version(tmp_path: Path) -> None:
    with LocalCluster(3, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        _create_counters(cluster.addresses)
        stop = threading.Event()
        threads, acknowledged = _pushers(cluster.addresses, 3, stop)
        cuts = []
        try:
            with psclient.PSClient(cluster.addresses, "saver", timeout=TIMEOUT_S) as c:
                deadline = time.monotonic() + 60
                while sum(acknowledged) < 30 and time.monotonic() < deadline:
                    time.sleep(0.02)
                for _ in range(10):  # many cuts, each while pushes run on every shard
                    replies = c.save_checkpoint(consistent=True)
                    assert len({r.id for r in replies}) == 1  # one id for the whole set
                    counts = set()
                    for reply in replies:
                        snap = ckptfile.read(reply.path)
                        assert snap.cut is not None and snap.cut["num_shards"] == 3
                        counts |= {t.version for t in snap.tensors}
                    cuts.append(counts)  # every file of the cut must hold the same count
                    time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert all(len(counts) == 1 for counts in cuts), cuts
        _kill_and_restart_all(cluster)
        restored = _assert_one_version(cluster.addresses)
        assert cuts[-1] == {restored}
        assert 0 < restored < sum(acknowledged)  # taken mid-run: later pushes are not in it


def _raw_push(address: str, seq: int, shards: list[int]) -> ps_pb2.PushResponse:
    request = ps_pb2.PushRequest(
        worker_id="raw",
        session=7,
        seq=seq,
        shards=shards,
        grads=[codec.encode(n, np.full(4, -1.0, np.float32)) for n in _on_shard(address)],
    )
    with grpc.insecure_channel(address) as ch:
        return ps_pb2_grpc.ParameterServerStub(ch).Push(request, timeout=TIMEOUT_S)


def _on_shard(address: str) -> list[str]:
    with grpc.insecure_channel(address) as ch:
        listing = ps_pb2_grpc.ParameterServerStub(ch).ListVariables(ps_pb2.ListVariablesRequest(), timeout=10)
    return [v.spec.name for v in listing.variables]


def _assert_not_held(address: str) -> None:
    """No cut holds the shard: a new one can be prepared (and is released at once)."""
    with grpc.insecure_channel(address) as ch:
        stub = ps_pb2_grpc.ParameterServerStub(ch)
        stub.PrepareCut(ps_pb2.PrepareCutRequest(cut_id="probe", hold_s=5), timeout=10)
        assert stub.ReleaseCut(ps_pb2.ReleaseCutRequest(cut_id="probe"), timeout=10).released


def test_a_push_applied_on_one_shard_is_waited_for_and_included_on_the_other(tmp_path: Path) -> None:
    """The commit of shard 1 waits for the piece of a push that shard 0 already applied."""
    with LocalCluster(2, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        _create_counters(cluster.addresses)
        a, b = cluster.addresses
        assert _raw_push(a, seq=1, shards=[0, 1]).applied  # shard 1's piece is late
        late = threading.Timer(0.5, lambda: _raw_push(b, seq=1, shards=[0, 1]))
        late.start()
        with psclient.PSClient(cluster.addresses, "saver", timeout=TIMEOUT_S) as c:
            replies = c.save_checkpoint(consistent=True)
        late.join()
        assert [{t.version for t in ckptfile.read(r.path).tensors} for r in replies] == [{1}, {1}]

        # Never sent to shard 1: the cut cannot be consistent, so it is aborted and nothing is kept.
        assert _raw_push(a, seq=2, shards=[0, 1]).applied
        before = sorted(p.name for p in tmp_path.iterdir())
        with psclient.PSClient(cluster.addresses, "saver2", timeout=TIMEOUT_S) as c:
            with pytest.raises(psclient.ConsistentCutError, match="push 2 of worker raw") as caught:
                c.save_checkpoint(consistent=True, timeout=3)
            assert caught.value.shard == 1
            assert isinstance(caught.value.__cause__, psclient.DeadlineExceededError)
            assert sorted(p.name for p in tmp_path.iterdir()) == before  # shard 0's file was deleted
        for address in cluster.addresses:
            _assert_not_held(address)


def test_a_shard_that_is_down_aborts_the_save_and_holds_nothing(tmp_path: Path) -> None:
    with LocalCluster(2, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        _create_counters(cluster.addresses)
        cluster.kill_shard(1)
        before = sorted(p.name for p in tmp_path.iterdir())
        with psclient.PSClient(cluster.addresses, "saver", timeout=TIMEOUT_S) as c:
            started = time.monotonic()
            with pytest.raises(psclient.ConsistentCutError, match="shard 1") as caught:
                c.save_checkpoint(consistent=True, timeout=2)
            assert time.monotonic() - started < 20  # bounded by its timeout, not the client's
            assert caught.value.retryable
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        _assert_not_held(cluster.addresses[0])


def test_a_hold_ends_by_itself_when_its_coordinator_dies(tmp_path: Path) -> None:
    with LocalCluster(1, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        address = cluster.addresses[0]
        _create_counters([address])
        with grpc.insecure_channel(address) as ch:
            stub = ps_pb2_grpc.ParameterServerStub(ch)
            stub.PrepareCut(ps_pb2.PrepareCutRequest(cut_id="dead", hold_s=1.5), timeout=10)
            with pytest.raises(grpc.RpcError) as other:  # one cut at a time
                stub.PrepareCut(ps_pb2.PrepareCutRequest(cut_id="other", hold_s=1.0), timeout=10)
            assert other.value.code() == grpc.StatusCode.ABORTED and "dead" in other.value.details()
            stub.Pull(ps_pb2.PullRequest(names=[COUNTERS[0]]), timeout=5)  # reads are not held
            started = time.monotonic()
            assert _raw_push(address, seq=1, shards=[]).applied  # waits for the hold to expire
            assert time.monotonic() - started > 0.5
            with pytest.raises(grpc.RpcError) as late:
                stub.CommitCut(ps_pb2.CommitCutRequest(cut_id="dead", checkpoint_id=1), timeout=10)
            assert late.value.code() == grpc.StatusCode.ABORTED and "expired" in late.value.details()
            assert not list(tmp_path.glob("ckpt-*"))
            assert "no commit within 1.5s" in cluster.log_tail(0, 30)


def test_psctl_save_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from psclient import ctl

    with LocalCluster(2, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        _create_counters(cluster.addresses)
        assert ctl.main(["save", "--consistent", "--json", *cluster.addresses]) == 0
        out = capsys.readouterr().out
        assert out.count('"id": 1') == 2
        cluster.kill_shard(1)
        assert ctl.main(["save", "--consistent", "--timeout", "2", *cluster.addresses]) == 1
        assert "consistent save" in capsys.readouterr().err


def test_the_coordinators_deadline_is_checked() -> None:
    async def run() -> None:
        async with psclient.AsyncPSClient(["127.0.0.1:1"], "w") as c:
            with pytest.raises(ValueError, match="timeout"):
                await c.save_checkpoint(consistent=True, timeout=0)

    asyncio.run(run())
