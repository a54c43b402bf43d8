"""A stopped primary (issue 46): SIGSTOP, what a long GC pause, swapping, a VM migration or a debugger does.

A stopped process keeps its sockets (its kernel accepts connections and acknowledges bytes), so neither a
TCP timeout nor a broken connection tells the client; before ``psclient._stall``, every push waited its
whole deadline and failed, and the backup, which no call reached, never took over. Now a call that has
waited a second asks the replica for its status; a process that does not answer within a second is
stalled, and the call fails over to the backup. A live primary busy in a worker thread answers, and is not
failed over.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest
from _support import wait_until

import psclient
from psserver.config import ServerConfig
from psserver.optimizers import ServerSGD
from psserver.server import start
from trainer.cluster import LocalCluster, backups_of

pytestmark = [pytest.mark.timeout(180)]

STOP_S = 6.0  # longer than the lease (2 s) and the stall check (about 2 s); shorter than the deadline
DEADLINE_S = 8.0
MODES = {
    "async": [],
    "sync": ["--mode", "sync", "--replicas-to-aggregate", "1", "--total-replicas", "1"],
    "ssp": ["--mode", "ssp", "--total-replicas", "1", "--staleness", "1"],
}


def _push_through_a_stop(
    mode: str, wire: str, serve_alone: bool
) -> tuple[list[tuple[float, float, bool]], tuple[float, float], dict[str, int], str]:
    """One client pushes ones (SGD, learning rate 1) while the primary is stopped for STOP_S; returns each
    call's (start, end, acknowledged), the stop's (start, end), the versions read after the primary resumed
    and rejoined, and the stopped process's log."""
    alone = ["--serve-alone"] if serve_alone else []
    args = [*MODES[mode], *alone]
    calls: list[tuple[float, float, bool]] = []
    with LocalCluster(1, args) as primary, backups_of(primary, args) as backup:
        both = [f"{primary.addresses[0]}|{backup.addresses[0]}"]
        small = 0 if wire == "data_port" else 1 << 30
        with psclient.PSClient(both, "w0", timeout=DEADLINE_S, data_port_min_bytes=small) as c:
            c.create("v", np.zeros(256, np.float32), optimizer=psclient.SGD(1.0))
            step = 0
            stop_at = resume_at = 0.0
            deadline = time.monotonic() + 60  # bounded: the loop ends once pushes went on after the resume
            while time.monotonic() < deadline:
                if step == 10 and not stop_at:
                    os.kill(primary.procs[0].pid, signal.SIGSTOP)
                    stop_at = time.monotonic()
                if stop_at and not resume_at and time.monotonic() - stop_at > STOP_S:
                    os.kill(primary.procs[0].pid, signal.SIGCONT)
                    resume_at = time.monotonic()
                if resume_at and sum(1 for s, _, ok in calls if ok and s > resume_at + 1.0) >= 5:
                    break
                began = time.monotonic()
                try:
                    c.push({"v": np.ones(256, np.float32)}, step=step)
                    calls.append((began, time.monotonic(), True))
                    step += 1
                except psclient.PSError:
                    calls.append((began, time.monotonic(), False))
            if stop_at and not resume_at:
                os.kill(primary.procs[0].pid, signal.SIGCONT)
            assert stop_at and resume_at, "the loop ended before the primary was stopped and resumed"
            # The old primary rejoins as the backup of the one that took over (term 2 on both).
            wait_until(lambda: _roles(primary, backup) == ("backup", "primary"), "the old primary to rejoin")
            _, versions = c.pull_with_versions()
            log = primary.log_tail(0, 80)
    return calls, (stop_at, resume_at), versions, log


def _roles(primary: LocalCluster, backup: LocalCluster) -> tuple[str, str]:
    from psclient import admin

    statuses = asyncio.run(admin.cluster_status([primary.addresses[0], backup.addresses[0]], variables=False))
    return statuses[0].role, statuses[1].role


def _exactly_once(calls: list[tuple[float, float, bool]], versions: dict[str, int]) -> None:
    acked = sum(ok for _, _, ok in calls)
    failed = sum(not ok for _, _, ok in calls)
    assert acked <= versions["v"] <= acked + failed, (acked, failed, versions)


@pytest.mark.parametrize(("mode", "wire"), [("async", "data_port"), ("sync", "grpc"), ("ssp", "data_port")])
def test_with_serve_alone_a_stopped_primary_fails_over_to_its_backup(mode: str, wire: str) -> None:
    calls, (stop_at, resume_at), versions, _ = _push_through_a_stop(mode, wire, serve_alone=True)
    during = [end for began, end, ok in calls if ok and stop_at < began and end < resume_at]
    assert during, f"no push acknowledged while the primary was stopped: {calls[-12:]}"
    _exactly_once(calls, versions)


def test_by_default_a_stopped_primary_stops_the_shard_and_loses_nothing() -> None:
    # The backup takes over but acknowledges nothing while it is the only copy: the shard answers again
    # once the primary resumed and caught up as its backup.
    calls, (stop_at, resume_at), versions, log = _push_through_a_stop("async", "data_port", False)
    assert not [c for c in calls if c[2] and stop_at + 0.5 < c[0] and c[1] < resume_at], calls
    assert any(ok and began > resume_at for began, _, ok in calls)
    _exactly_once(calls, versions)
    assert "restarting on port" in log and "took over while this primary held no lease" in log


async def test_a_live_primary_busy_in_a_worker_thread_is_not_failed_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An update that runs 5 s in a worker thread, its event loop free: the status checks are answered,
    the lease is renewed, no takeover, no refusal, and the push is acknowledged once."""
    real_apply = ServerSGD.apply
    slow: list[threading.Thread] = []

    def slow_apply(self: ServerSGD, *args: object, **kwargs: object) -> object:
        if not slow:  # the first update only
            slow.append(threading.current_thread())
            time.sleep(5.0)
        return real_apply(self, *args, **kwargs)  # type: ignore[arg-type]

    config = ServerConfig(shard=0, port=0, inline_apply_bytes=0, lease_s=1.0)  # every update in a thread
    primary = await start(config)
    try:
        with LocalCluster(1, ["--backup-of", primary.address]) as backup:
            await asyncio.to_thread(
                wait_until, lambda: primary.primary is not None and primary.primary.backup, "the backup"
            )
            both = [f"{primary.address}|{backup.addresses[0]}"]
            async with psclient.AsyncPSClient(both, "w0", timeout=30.0, data_port_min_bytes=0) as c:
                await c.create("v", np.zeros(256, np.float32), optimizer=psclient.SGD(1.0))
                monkeypatch.setattr(ServerSGD, "apply", slow_apply)  # in this process: the primary's
                assert await c.push({"v": np.ones(256, np.float32)}) is True
                _, versions = await c.pull_with_versions()
            assert versions == {"v": 1}
            assert slow and threading.main_thread() not in slow
            assert primary.service is not None and primary.service.role == "primary"
            assert primary.service.term == 1  # nobody took over
            assert "stopped answering" not in backup.log_tail(0, 50)
    finally:
        await primary.stop()
