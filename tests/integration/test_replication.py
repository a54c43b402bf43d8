"""Primary-backup replication with real processes: kill -9 of a primary loses no acknowledged push.

Each shard here is a primary process and a backup process (``psserver
--backup-of PRIMARY``); clients get ``PRIMARY|BACKUP`` and fail over with no
code of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from _logreg import train
from _support import CALL_TIMEOUT_S as TIMEOUT_S
from _support import wait_until

import psclient
from psclient._retry import RetryPolicy
from psload.chaos import ChaosCluster
from psproto.v1 import ps_pb2, ps_pb2_grpc
from psserver.config import ConfigError, ServerConfig
from psserver.rows import DynamicRows
from psserver.server import start
from trainer.cluster import LocalCluster, backups_of

pytestmark = [pytest.mark.timeout(180)]

# A backup takes over about 1 s after its primary dies (the default lease is 2 s). These tests kill a
# primary and go on with its backup alone (--serve-alone: a single fault loses nothing acknowledged either
# way); the default, which serves only once the killed process is back as the backup, is tested by
# test_a_restarted_primary_rejoins_as_the_backup_of_its_promoted_backup, the lease tests and
# tests/integration/test_replication_faults.py.
LEASE = ["--lease", "1", "--serve-alone"]
ALONE = ["--serve-alone"]  # a backup's: it may serve alone once promoted


@contextlib.contextmanager
def _pair(primary_args: tuple[str, ...] = ()) -> Iterator[tuple[LocalCluster, LocalCluster]]:
    """One shard as a primary process and its backup process (started once the primary serves)."""
    with LocalCluster(1, [*LEASE, *primary_args]) as primary, backups_of(primary, ALONE) as backup:
        yield primary, backup


def _status(address: str, token: str | None = None) -> ps_pb2.GetStatusResponse:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        return stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=5, metadata=metadata)


def _wait_role(
    address: str, role: str, peer: str | None = None, timeout_s: float = 20.0, token: str | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:  # bounded: the backup attaches within a second
        status = _status(address, token)
        if status.role == role and (peer is None or status.peer == peer):
            return
        time.sleep(0.05)
    raise AssertionError(f"{address} did not become {role} (peer {peer}): {status}")


def _both(primary: LocalCluster, backup: LocalCluster) -> list[str]:
    return [f"{primary.addresses[0]}|{backup.addresses[0]}"]


def test_kill_9_of_the_primary_loses_no_acknowledged_push() -> None:
    # SGD, learning rate 1, gradients of ones: the value is -(pushes applied), its version their count.
    n = 1 << 18  # 1 MiB
    with _pair() as (primary, backup):
        addresses = _both(primary, backup)
        with psclient.PSClient(addresses, "init", timeout=TIMEOUT_S) as c:
            c.create_many(
                {"a": np.zeros(n, np.float32), "b": np.zeros(16, np.float32)},
                optimizer=psclient.SGD(1.0, momentum=0.0),
            )
        acknowledged = [0] * 3
        grads = {"a": np.ones(n, np.float32), "b": np.ones(16, np.float32)}

        def push(i: int) -> None:
            with psclient.PSClient(addresses, f"w{i}", timeout=TIMEOUT_S) as c:
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and (
                    acknowledged[i] < 40 or primary.procs[0].poll() is None
                ):
                    c.push(grads)  # applied, or a duplicate of one applied before the kill: once either way
                    acknowledged[i] += 1

        threads = [threading.Thread(target=push, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        # Freeze the backup: pushes from here on cannot be acknowledged (a primary that answered
        # without its backup's acknowledgement would lose them to the kill); then kill the primary.
        backup.procs[0].send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        primary.kill_shard(0)
        backup.procs[0].send_signal(signal.SIGCONT)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        with psclient.PSClient(addresses, "reader", timeout=TIMEOUT_S) as c:
            values, versions = c.pull_with_versions()
        total = sum(acknowledged)
        assert versions == {"a": total, "b": total}
        np.testing.assert_array_equal(values["a"], np.full(n, -total, np.float32))
        np.testing.assert_array_equal(values["b"], np.full(16, -total, np.float32))
        status = _status(backup.addresses[0])
        assert status.role == "primary"
        assert "promoted to primary" in backup.log_tail(0, 50)


def _hammer(addresses: list[str], worker: str, names: list[str], shapes: dict[str, int], pushes: int) -> None:
    rng = np.random.default_rng(abs(hash(worker)) % 2**32)
    with psclient.PSClient(addresses, worker, timeout=TIMEOUT_S) as c:
        for _ in range(pushes):
            picked = rng.choice(names, size=rng.integers(1, len(names) + 1), replace=False)
            c.push({str(k): rng.standard_normal(shapes[str(k)]).astype(np.float32) for k in picked})


def test_the_backup_is_bit_identical_after_concurrent_pushes() -> None:
    """Adam, variables pushed concurrently in varying orders: the backup replays each one in order."""
    shapes = {"big": 3 << 20, "mid": 4096, "small": 8}  # "big": 12 MiB, in 2 partitions, 4 MiB messages
    names = sorted(shapes)
    with _pair() as (primary, backup):
        addresses = _both(primary, backup)
        with psclient.PSClient(addresses, "init", timeout=TIMEOUT_S) as c:
            c.create_many(
                {k: np.zeros(s, np.float32) for k, s in shapes.items()}, optimizer=psclient.Adam(0.01)
            )
        threads = [
            threading.Thread(target=_hammer, args=(addresses, f"w{i}", names, shapes, 40)) for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        with psclient.PSClient(primary.addresses, "reader", timeout=TIMEOUT_S) as c:
            on_primary, primary_versions = c.pull_with_versions()
        primary.kill_shard(0)
        with psclient.PSClient(addresses, "reader2", timeout=TIMEOUT_S) as c:
            on_backup, backup_versions = c.pull_with_versions()
    assert backup_versions == primary_versions
    assert sum(primary_versions.values()) > 3 * 40  # every worker pushed 1-3 variables 40 times
    for k in names:
        np.testing.assert_array_equal(on_backup[k], on_primary[k])  # bit for bit: values and Adam's slots


def test_empty_parts_of_a_push_in_parts_reach_the_backup_as_applied_pushes() -> None:
    """An async shard answers the empty parts of ``push_pull(parts=P)`` (it holds fewer tensors than P) as
    applied pushes; with a backup they are forwarded as any push, and the backup ends bit-identical."""
    shapes = {"a": 1000, "b": 8}
    with _pair() as (primary, backup):
        addresses = _both(primary, backup)
        with psclient.PSClient(addresses, "w0", timeout=TIMEOUT_S) as c:
            c.create_many(
                {k: np.zeros(s, np.float32) for k, s in shapes.items()}, optimizer=psclient.Adam(0.01)
            )
            for step in range(3):  # 2 tensors in 4 parts: two of each step's parts are empty
                grads = {k: np.full(s, step + 1.0, np.float32) for k, s in shapes.items()}
                assert c.push_pull(grads, step=step, parts=4).applied
        with psclient.PSClient(primary.addresses, "reader", timeout=TIMEOUT_S) as c:
            on_primary, primary_versions = c.pull_with_versions()
        primary.kill_shard(0)
        with psclient.PSClient(addresses, "reader2", timeout=TIMEOUT_S) as c:
            on_backup, backup_versions = c.pull_with_versions()
    assert primary_versions == backup_versions == {"a": 3, "b": 3}
    for k in shapes:
        np.testing.assert_array_equal(on_backup[k], on_primary[k])


def test_the_backups_moving_averages_are_bit_identical() -> None:
    """use_ema: the backup replays the pushes with the same code, so its ``average`` slots match too."""
    shapes = {"mid": 4096, "small": 8}
    names = sorted(shapes)
    opt = psclient.Adam(0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)
    with _pair() as (primary, backup):
        addresses = _both(primary, backup)
        with psclient.PSClient(addresses, "init", timeout=TIMEOUT_S) as c:
            c.create_many({k: np.zeros(s, np.float32) for k, s in shapes.items()}, optimizer=opt)
        _hammer(addresses, "w0", names, shapes, 10)
        with psclient.PSClient(primary.addresses, "reader", timeout=TIMEOUT_S) as c:
            on_primary = c.pull(ema=True)
        primary.kill_shard(0)
        with psclient.PSClient(addresses, "reader2", timeout=TIMEOUT_S) as c:
            on_backup = c.pull(ema=True)
    for k in names:
        np.testing.assert_array_equal(on_backup[k], on_primary[k])


async def test_a_backup_slow_to_apply_an_update_goes_on_acknowledging_its_primarys_heartbeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An update whose replay takes longer than the lease (an unbounded table's growth, which copies every
    row: seconds for a table of gigabytes) holds back only the updates after it. The backup's event loop
    still reads and acknowledges heartbeats, so its primary keeps its lease and serves; the push is
    answered once the backup has it, and the backup then serves the same rows.

    The backup runs in this process, so that its growth can be held up (for 3 leases) in the worker thread
    it runs in; a thread of its own watches the primary's lease all along, whatever this event loop does.
    """
    lease_s, hold_s = 1.0, 3.0
    held, release = threading.Event(), threading.Event()
    grown_on: list[threading.Thread] = []
    real_grown = DynamicRows.grown

    def slow_grown(self: DynamicRows, *args: object, **kwargs: object) -> object:
        grown_on.append(threading.current_thread())
        held.set()
        release.wait(10 * hold_s)  # bounded: the watch below releases it after hold_s
        return real_grown(self, *args, **kwargs)  # type: ignore[arg-type]

    leases: list[float] = []

    def watch_lease(address: str) -> None:
        try:
            if held.wait(TIMEOUT_S):
                deadline = time.monotonic() + hold_s
                while time.monotonic() < deadline:  # bounded by hold_s
                    leases.append(_status(address).lease_s)
                    time.sleep(0.05)
        finally:
            release.set()

    monkeypatch.setattr(DynamicRows, "grown", slow_grown)  # in this process: the backup's, not the primary's
    ids = np.arange(4096, dtype=np.int64)  # an unbounded table starts with 1024 rows: this push grows it
    grads = np.random.default_rng(0).standard_normal((ids.size, 8)).astype(np.float32)
    with LocalCluster(1, ["--lease", str(lease_s)]) as primary:
        config = ServerConfig(
            shard=0, port=0, backup_of=primary.addresses[0], inline_apply_bytes=0, serve_alone=True
        )
        backup = await start(config)
        watch = threading.Thread(target=watch_lease, args=(primary.addresses[0],), daemon=True)
        try:
            await asyncio.to_thread(
                wait_until, lambda: _status(primary.addresses[0]).lease_s > 0, "the backup to confirm"
            )
            addresses = [f"{primary.addresses[0]}|{backup.address}"]
            async with psclient.AsyncPSClient(addresses, "w0", timeout=TIMEOUT_S) as c:
                await c.create_embedding("t", None, 8, optimizer=psclient.Adagrad(0.1), initializer="zeros")
                watch.start()
                assert await c.push({"t": psclient.Rows(ids, grads)}) is True
                on_primary = await c.lookup("t", ids)
                await asyncio.to_thread(watch.join, TIMEOUT_S)
                assert not watch.is_alive()
                assert len(leases) > 10 and min(leases) > 0, f"the primary lost its lease: {leases}"
                assert grown_on and threading.main_thread() not in grown_on  # off the backup's event loop
                await asyncio.to_thread(primary.stop)  # SIGTERM: the backup takes over at once
                on_backup = await c.lookup("t", ids)
        finally:
            release.set()
            await backup.stop()
    np.testing.assert_array_equal(on_backup, on_primary)


def test_a_standby_backup_refuses_clients_and_names_its_primary() -> None:
    with _pair() as (primary, backup):
        with psclient.PSClient(primary.addresses, "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(4, np.float32))
        no_retry = {"retry": RetryPolicy(enabled=False)}
        with psclient.PSClient(backup.addresses, "w1", timeout=5, **no_retry) as direct:
            with pytest.raises(
                psclient.UnavailableError, match=f"standby backup of primary {primary.addresses[0]}"
            ):
                direct.push({"v": np.ones(4, np.float32)})
            with pytest.raises(psclient.UnavailableError, match="standby"):
                direct.pull(["v"])
        status = _status(backup.addresses[0])
        assert (status.role, status.peer) == ("backup", primary.addresses[0])
        assert status.num_variables == 1  # it follows the primary all the same
        assert _status(primary.addresses[0]).pushes == 0  # the refused push went nowhere


def test_a_primary_whose_backup_died_refuses_until_a_new_backup_confirms() -> None:
    """Without its backup a replicated primary cannot prove the backup has not taken over: it refuses."""
    with _pair() as (primary, backup):
        with psclient.PSClient(primary.addresses, "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(1000, np.float32), optimizer=psclient.RMSprop(0.01))
            for i in range(10):
                c.push({"v": np.full(1000, i + 1, np.float32)})
            backup.kill_shard(0)
            wait_until(lambda: _status(primary.addresses[0]).lease_s == 0, "the primary to drop its lease")
            no_retry = {"retry": RetryPolicy(enabled=False)}
            with psclient.PSClient(primary.addresses, "w1", timeout=5, **no_retry) as direct:
                with pytest.raises(psclient.UnavailableError, match="no backup attached"):
                    direct.push({"v": np.ones(1000, np.float32)})
                with pytest.raises(psclient.UnavailableError, match="no backup attached"):
                    direct.pull(["v"])
            backup.start_shard(0)  # a fresh backup: catches up from the primary's snapshot, confirms
            _wait_role(primary.addresses[0], "primary", peer=backup.addresses[0])
            for i in range(10):
                c.push({"v": np.full(1000, -i, np.float32)})
            expected, versions = c.pull_with_versions()
        assert versions == {"v": 20}  # the refused push was not applied
        assert "refusing client calls until a backup confirms" in primary.log_tail(0, 50)
        primary.kill_shard(0)
        with psclient.PSClient(_both(primary, backup), "w2", timeout=TIMEOUT_S) as c:
            values, after = c.pull_with_versions()
        assert after == versions
        np.testing.assert_array_equal(values["v"], expected["v"])


def test_sigterm_of_the_primary_hands_over_to_the_backup() -> None:
    # Grace 30 s, longer than LocalCluster waits before SIGKILL (15 s): the open data connections and
    # Replicate stream must end at once for the exit status to be 0.
    with _pair(("--grace", "30")) as (primary, backup):
        with psclient.PSClient(_both(primary, backup), "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(8, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            c.push({"v": np.ones(8, np.float32)})
            assert primary.stop() == [0]  # graceful: the backup's stream ends, it takes over
            c.push({"v": np.ones(8, np.float32)})
            values, versions = c.pull_with_versions()
        assert versions == {"v": 2}
        np.testing.assert_array_equal(values["v"], np.full(8, -2, np.float32))


def test_a_backup_of_a_backup_is_refused() -> None:
    with _pair() as (_, backup), LocalCluster(1, ["--backup-of", backup.addresses[0]]) as second:
        assert _status(second.addresses[0]).role == "backup"
        wait_until(lambda: "refuses a backup" in second.log_tail(0, 20), "the backup's refusal in its log")
        assert "not a primary" in second.log_tail(0, 20)


def test_a_second_backup_is_refused_each_try_and_leaves_no_task_behind() -> None:
    # Each refused try ends a Replicate call whose acknowledgements were still awaited: the task gRPC
    # reads them in must end with it, not be left pending and destroyed at a later garbage collection
    # (ten tries make one likely: it came at the attach, with an error logged per try, for a backup
    # restarted under the nemesis while its primary still held the dead one).
    with _pair() as (primary, first), LocalCluster(1, ["--backup-of", primary.addresses[0]]) as second:
        wait_until(
            lambda: second.log_tail(0, 200).count("already has a backup") >= 10,
            "the second backup's tenth refused try",
            timeout=30,
        )
        first.kill_shard(0)  # the second backup attaches once the primary has dropped the first
        _wait_role(primary.addresses[0], "primary", peer=second.addresses[0], timeout_s=30)
        assert second.stop_shard(0) == 0
        log = second.log_path(0).read_text(errors="replace")
    for trace in ("never retrieved", "destroyed but it is pending", "asynchronous generator"):
        assert trace not in log, log


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lease_s": 0.0}, "--lease must be > 0"),
        ({"backup_of": "nowhere"}, "HOST:PORT"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "with TLS needs --tls-ca"),
        ({"replication_timeout_s": 0.0}, "--replication-timeout"),
        ({"backup_at": "127.0.0.1:2"}, "exclude each other"),
        ({"backup_of": None, "backup_at": "x"}, "--backup-at must be HOST:PORT"),
    ],
)
def test_backup_flags_are_checked(changes: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"shard": 0, "backup_of": "127.0.0.1:1", **changes}
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**settings)  # type: ignore[arg-type]


def test_psctl_status_shows_the_roles(capsys: pytest.CaptureFixture[str]) -> None:
    from psclient import ctl

    with _pair() as (primary, backup):
        p, b = primary.addresses[0], backup.addresses[0]
        assert ctl.main(["status", p, b, "--timeout", "30"]) == 0
        out = capsys.readouterr().out
        assert "ROLE" in out and "primary+backup" in out
        assert f"backed up by {b}" in out and f"backup of {p}" in out


def test_replication_with_token_auth(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    auth = ["--auth-token-file", str(token)]
    with (
        LocalCluster(1, [*LEASE, *auth]) as primary,
        LocalCluster(1, [*auth, *ALONE, "--backup-of", primary.addresses[0]]) as backup,
    ):
        addresses = _both(primary, backup)
        _wait_role(primary.addresses[0], "primary", peer=backup.addresses[0], token="s3cret-token")
        with psclient.PSClient(addresses, "w0", timeout=TIMEOUT_S, auth_token="s3cret-token") as c:
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            c.push({"v": np.ones(4, np.float32)})  # acknowledged by the backup too
            primary.kill_shard(0)
            c.push({"v": np.ones(4, np.float32)})
            values, versions = c.pull_with_versions()
        assert versions == {"v": 2}
        np.testing.assert_array_equal(values["v"], np.full(4, -2, np.float32))
        assert "caught up" in backup.log_tail(0, 50)


def test_a_restarted_primary_rejoins_as_the_backup_of_its_promoted_backup() -> None:
    """The old primary comes back with its usual flags (``--backup-at``) and defers to the newer state.

    The default (no --serve-alone): b, promoted, acknowledges nothing until a is back as its backup, so
    that no acknowledged push is ever on one process only.
    """
    with ChaosCluster(
        1, ["--lease", "1"]
    ) as cluster:  # a: --backup-at b (a plain restart serves older state)
        first, second = cluster.sides
        (a, b), both = cluster.pairs[0], cluster.addresses
        with psclient.PSClient(both, "w0", timeout=TIMEOUT_S) as c:
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            c.push({"v": np.ones(4, np.float32)})
            first.kill_shard(0)  # a fails; b takes over on the next call, and waits for a backup
            no_retry = {"retry": RetryPolicy(enabled=False)}
            with psclient.PSClient([b], "w9", timeout=5, **no_retry) as direct:

                def refusal() -> str:
                    with pytest.raises(psclient.UnavailableError) as refused:
                        direct.push({"v": np.ones(4, np.float32)})
                    return str(refused.value)

                wait_until(lambda: "has no backup yet" in refusal(), "b to take over and wait for a backup")
            status = _status(b)
            assert (status.role, status.term, status.lease_s) == ("primary", 2, 0.0)
            cluster.restart(0, 0)  # same flags as before: --backup-at b
            c.push({"v": np.ones(4, np.float32)})  # answered once a has caught up as b's backup
            _wait_role(b, "primary", peer=a)  # a caught up from b instead of serving its own state
            assert "took over as primary" in first.log_tail(0, 50)
            assert _status(a).term == 2
        with psclient.PSClient(both, "w1", timeout=TIMEOUT_S) as fresh:  # starts with a, is sent to b
            values, versions = fresh.pull_with_versions()
            assert versions == {"v": 2}  # the pushes b refused were not applied
            second.kill_shard(0)  # and a, now b's backup, has every update
            cluster.restart(0, 1)  # a serves once b is back as its backup
            fresh.push({"v": np.ones(4, np.float32)})
            values, versions = fresh.pull_with_versions()
        assert versions == {"v": 3}
        np.testing.assert_array_equal(values["v"], np.full(4, -3, np.float32))


def test_replication_over_mutual_tls(tmp_path: Path) -> None:
    from _certs import make_pki  # tests/_certs.py

    pki = make_pki(tmp_path)
    tls = pki.shard_flags()
    with (
        LocalCluster(1, [*LEASE, *tls]) as primary,
        LocalCluster(
            1, [*tls, *ALONE, "--backup-of", primary.addresses[0]]
        ) as backup,  # trusts --tls-client-ca
    ):
        tls_client = pki.client_options()
        with psclient.PSClient(_both(primary, backup), "w0", timeout=TIMEOUT_S, **tls_client) as c:
            wait_until(lambda: "caught up" in backup.log_tail(0, 50), "the backup to catch up")
            c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0, momentum=0.0))
            c.push({"v": np.ones(4, np.float32)})
            primary.kill_shard(0)
            c.push({"v": np.ones(4, np.float32)})
            values, versions = c.pull_with_versions()
        assert versions == {"v": 2}, backup.log_tail(0, 30)
        np.testing.assert_array_equal(values["v"], np.full(4, -2, np.float32))


def test_training_through_two_primary_kills_ends_bit_identical_to_a_fault_free_run() -> None:
    """With backups, kill -9 of a primary loses nothing: one worker's run equals the fault-free one."""
    with LocalCluster(2) as ref:
        reference_accuracy, reference = train(ref.addresses, "ref")
    with LocalCluster(2, LEASE) as primaries:
        p = primaries.addresses
        with backups_of(primaries, ALONE) as backups:
            addresses = [f"{p[i]}|{backups.addresses[i]}" for i in range(2)]
            faults = {60: lambda: primaries.kill_shard(0), 150: lambda: primaries.kill_shard(1)}
            accuracy, params = train(addresses, "faulty", faults)
            roles = [_status(b).role for b in backups.addresses]
    assert roles == ["primary", "primary"]  # both backups took over
    assert accuracy == reference_accuracy >= 0.85
    for name, value in reference.items():
        np.testing.assert_array_equal(params[name], value)
