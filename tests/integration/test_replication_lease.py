"""Replication in sync and ssp modes, and the lease that keeps two processes from serving at once.

Real processes: each shard is a primary (``--backup-at``) and a backup
(``--backup-of``) on fixed ports (``psload.chaos.ChaosCluster``), so a killed
process restarts with its own command line. A lease of 1 s keeps failovers short.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S
from _support import wait_until

import psclient
from psclient import ctl
from psclient._retry import RetryPolicy
from psload.chaos import ChaosCluster
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster

pytestmark = [pytest.mark.timeout(180)]

# A lease of 1 s; a lost step fails at the barrier (20 s), well before the test's own timeout.
LEASE = ["--lease", "1", "--barrier-timeout", "20"]
SYNC = ["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2", *LEASE]
SSP = ["--mode", "ssp", "--total-replicas", "2", "--staleness", "1", *LEASE]
N = 1 << 14  # 64 KiB per gradient
NO_RETRY = {"retry": RetryPolicy(enabled=False)}


def _status(address: str) -> ps_pb2.GetStatusResponse:
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        return stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=5)


@contextlib.contextmanager
def _frozen(cluster: ChaosCluster, side: int) -> Iterator[None]:
    """SIGSTOP of one process (it reads and answers nothing) until the block ends."""
    proc = cluster.sides[side].procs[0]
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def _kill_mid_update(cluster: ChaosCluster) -> None:
    """``kill -9`` of the primary while its backup is frozen, so that the update in flight is applied on the
    primary and not acknowledged; then the killed process restarts with its own command (it rejoins as the
    backup of the one that takes over)."""
    primary = cluster.primary(0)
    assert primary is not None and cluster.redundant(0)
    with _frozen(cluster, 1 - primary):
        time.sleep(0.3)
        cluster.sides[primary].kill_shard(0)
    cluster.restart(0, primary)


def _run_workers(targets: list[Callable[[], None]]) -> tuple[list[BaseException], list[threading.Thread]]:
    """Starts each target in a thread; returns the list their errors go to, and the threads."""
    errors: list[BaseException] = []

    def run(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    return errors, threads


def _join(threads: list[threading.Thread], errors: list[BaseException]) -> None:
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_sync_training_through_two_primary_kills_applies_every_step_once() -> None:
    """Kill -9 mid-round (two workers), then again after one worker left: every step once, on the survivor.

    SGD with learning rate 1 and gradients of ones: each step subtracts the mean, 1; a step lost leaves the
    count short (and the workers at a barrier the backup never completes), one applied twice adds one.
    """
    steps, left_at = 40, 16
    with ChaosCluster(1, SYNC) as cluster:
        both = cluster.addresses
        with psclient.PSClient(both, "init", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(N, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
        progress = [0, 0]

        def worker(i: int, n: int) -> Callable[[], None]:
            def run() -> None:
                with psclient.PSClient(both, f"w{i}", timeout=TIMEOUT_S) as c:
                    for step in range(n):
                        c.push({"v": np.ones(N, np.float32)}, step=step)  # applied, or already (a retry)
                        progress[i] = step + 1
                    c.leave()  # w1 at step 16: from then on a step needs w0's gradient only

            return run

        errors, threads = _run_workers([worker(0, steps), worker(1, left_at)])
        wait_until(lambda: progress[0] >= 6, "six sync steps")
        _kill_mid_update(cluster)  # a round of two workers in flight
        wait_until(lambda: progress[0] >= left_at + 4, "steps after w1 left", timeout=60)
        cluster.wait_redundant(0, TIMEOUT_S)
        _kill_mid_update(cluster)  # the new primary, after the Leave
        _join(threads, errors)
        with psclient.PSClient(both, "reader", timeout=TIMEOUT_S) as c:
            values, versions = c.pull_with_versions()
    assert versions == {"v": steps}
    np.testing.assert_array_equal(values["v"], np.full(N, -steps, np.float32))


def test_ssp_training_through_a_primary_kill_keeps_every_push_and_the_clocks() -> None:
    """Every push once, and the workers' clocks carry over: without them the backup would hold both
    workers at the staleness bound until the barrier timeout."""
    steps = 30
    with ChaosCluster(1, SSP) as cluster:
        both = cluster.addresses
        with psclient.PSClient(both, "init", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(N, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
        progress = [0, 0]

        def worker(i: int) -> Callable[[], None]:
            def run() -> None:
                with psclient.PSClient(both, f"w{i}", timeout=TIMEOUT_S) as c:
                    for step in range(steps):
                        c.pull(["v"], step=step)  # waits while more than 1 step ahead of the other
                        c.push({"v": np.ones(N, np.float32)}, step=step)
                        progress[i] = step + 1

            return run

        errors, threads = _run_workers([worker(0), worker(1)])
        wait_until(lambda: min(progress) >= 8, "eight ssp steps")
        _kill_mid_update(cluster)
        _join(threads, errors)
        with psclient.PSClient(both, "reader", timeout=TIMEOUT_S) as c:
            values, versions = c.pull_with_versions()
        primary = cluster.primary(0)
        assert primary is not None
        assert _status(cluster.pairs[0][primary]).step == steps  # the slowest clock: both pushed every step
    assert versions == {"v": 2 * steps}
    np.testing.assert_array_equal(values["v"], np.full(N, -2 * steps, np.float32))


def test_a_primary_cut_off_from_its_backup_stops_serving_within_its_lease_and_resumes_with_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGSTOP of the backup stands for a partition between the two: the primary refuses once its lease is
    out (it cannot prove the backup has not taken over), and serves again when the backup answers."""
    with ChaosCluster(1, LEASE) as cluster:
        a, b = cluster.pairs[0]
        ones = {"v": np.ones(4, np.float32)}
        with psclient.PSClient([a], "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            for _ in range(3):
                c.push(ones)
            retried: list[bool] = []
            with _frozen(cluster, 1), psclient.PSClient([a], "w1", timeout=5, **NO_RETRY) as direct:
                # In flight as the backup froze: not acknowledged, so it fails and is retried (applied once).
                pending = threading.Thread(target=lambda: retried.append(c.push(ones)), daemon=True)
                pending.start()
                wait_until(lambda: _status(a).lease_s == 0, "the primary's lease to run out", timeout=10)
                assert _status(a).role == "primary"
                assert ctl.main(["status", a, "--timeout", "30"]) == 0
                assert "primary (no lease)" in capsys.readouterr().out
                with pytest.raises(psclient.UnavailableError, match="holds no lease"):
                    direct.push(ones)  # refused: nothing applied
                with pytest.raises(psclient.UnavailableError, match="holds no lease"):
                    direct.pull(["v"])
            pending.join(timeout=TIMEOUT_S)
            assert len(retried) == 1  # answered once the backup answers again (applied, or already)
            c.push(ones)  # serving again, under a renewed lease
            _, versions = c.pull_with_versions()
        assert versions == {"v": 5}  # 3 + the retried one + 1; none of the refused ones
        status = _status(a)
        assert (status.role, status.peer) == ("primary", b) and status.lease_s > 0
        assert _status(b).role == "backup"  # it never took over
        assert "lost its lease" in cluster.sides[0].log_tail(0, 50)


def test_a_primary_restarted_before_its_backup_noticed_never_serves_and_rejoins_as_its_backup() -> None:
    """The split brain of a fast restart: the backup (frozen here) has not noticed that its primary died
    when the primary's process restarts and finds it still a backup. The restarted primary holds no lease:
    it serves nothing (its checkpoint, or here nothing, is older than the backup's state), and once the
    backup takes over it restarts in-process as that backup's backup."""
    with ChaosCluster(1, LEASE) as cluster:
        a, b = cluster.pairs[0]
        both = cluster.addresses
        ones = {"v": np.ones(4, np.float32)}
        with psclient.PSClient(both, "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            for _ in range(5):
                c.push(ones)
            with _frozen(cluster, 1):
                cluster.sides[0].kill_shard(0)
                cluster.restart(0, 0)  # the same command: --backup-at b, which does not answer
                with psclient.PSClient([a], "w1", timeout=5, **NO_RETRY) as direct:
                    with pytest.raises(psclient.UnavailableError, match="no backup attached"):
                        direct.push(ones)
                    with pytest.raises(psclient.UnavailableError, match="no backup attached"):
                        direct.pull(["v"])
                status = _status(a)
                assert (status.role, status.lease_s, status.pushes) == ("primary", 0.0, 0)
            for _ in range(5):
                c.push(ones)  # through b, once it has taken over
            values, versions = c.pull_with_versions()
        assert versions == {"v": 10}
        np.testing.assert_array_equal(values["v"], np.full(4, -10, np.float32))
        wait_until(lambda: cluster.redundant(0), "a to rejoin as b's backup")
        assert (_status(b).role, _status(b).peer) == ("primary", a)
        assert _status(a).role == "backup"
        log = cluster.sides[0].log_tail(0, 80)
        assert "took over while this primary held no lease" in log and "as the backup of" in log


def test_a_backup_stopped_with_sigterm_resigns_and_its_primary_waits_for_it() -> None:
    with ChaosCluster(1, LEASE) as cluster:
        a, _ = cluster.pairs[0]
        with psclient.PSClient([a], "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            c.push({"v": np.ones(4, np.float32)})
            assert cluster.sides[1].stop_shard(0) == 0  # it will never take over: it says so first
            status = _status(a)
            assert (status.peer, status.lease_s, status.unprotected) == ("", 0.0, False)
            cluster.restart(0, 1)
            c.push({"v": np.ones(4, np.float32)})  # answered once the backup is back: never by one process
            _, versions = c.pull_with_versions()
        assert versions == {"v": 2}
        assert "resigned" in cluster.sides[0].log_tail(0, 20)


def test_with_serve_alone_a_backup_that_resigns_leaves_its_primary_serving_alone() -> None:
    with ChaosCluster(1, [*LEASE, "--serve-alone"]) as cluster:
        a, _ = cluster.pairs[0]
        with psclient.PSClient([a], "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            c.push({"v": np.ones(4, np.float32)})
            assert cluster.sides[1].stop() == [0]
            status = _status(a)
            assert (status.peer, status.lease_s, status.unprotected) == ("", -1.0, True)  # says so
            c.push({"v": np.ones(4, np.float32)})  # answered by the primary alone
            _, versions = c.pull_with_versions()
        assert versions == {"v": 2}
        assert "going on alone (--serve-alone)" in cluster.sides[0].log_tail(0, 20)


def test_a_backup_in_another_mode_than_its_primary_stops_following() -> None:
    with (
        LocalCluster(1, SYNC) as primary,
        LocalCluster(1, ["--backup-of", primary.addresses[0]]) as backup,  # async mode
    ):
        wait_until(lambda: "runs sync mode" in backup.log_tail(0, 20), "the backup to refuse the sync state")
        assert "will not take over" in backup.log_tail(0, 20)
        assert _status(backup.addresses[0]).role == "backup"
        assert _status(primary.addresses[0]).lease_s == -1  # never confirmed: the primary needs no lease
