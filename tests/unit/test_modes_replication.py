"""Unit tests of what replication asks of the modes and the store (no sockets).

A sync step is answered once replicated, the lease ends waits, a backup replays its
primary's mode state, a retry waits for its original, and so does a worker's second
push of a sync step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from pscore import codec
from pscore.errors import DeadlineExceededError, FailedPreconditionError, UnavailableError
from pscore.optimizers import SGD
from psproto.v1 import ps_pb2
from psserver import checkpoint, lease
from psserver.modes import AsyncMode, SSPMode, StepUpdate, SyncMode
from psserver.store import Store


def _store() -> Store:
    store = Store()
    spec = ps_pb2.VariableSpec(name="w", dtype=codec.wire_dtype(np.dtype(np.float32)), shape=[2])
    spec.optimizer.CopyFrom(SGD(1.0).to_proto())
    store.create([spec], {"w": np.zeros(2, np.float32)})
    return store


def _grad() -> dict[str, np.ndarray]:
    return {"w": np.full(2, -1.0, np.float32)}


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _sync(store: Store, n: int = 2) -> SyncMode:
    return SyncMode(store, replicas_to_aggregate=n, total_replicas=n, barrier_timeout_s=10.0)


async def test_a_sync_step_is_answered_once_its_backup_acknowledged_it() -> None:
    store = _store()
    mode = _sync(store)
    handed: list[StepUpdate] = []
    acknowledged = asyncio.get_running_loop().create_future()

    async def wait_ack() -> None:
        await acknowledged

    def replicate(step: StepUpdate) -> object:
        handed.append(step)
        return wait_ack()

    mode.replicate_step = replicate  # type: ignore[assignment]
    async with asyncio.timeout(10):
        pushes = [asyncio.create_task(mode.push(f"w{i}", 1, 0, _grad(), session=i + 1)) for i in range(2)]
        await _settle()
        # Applied here, the mode's state with it (a snapshot now is at step 1), not answered yet.
        assert store.get("w").version == 1 and mode.step == 1
        assert [(s.step, list(s.versions), sorted(s.claims)) for s in handed] == [
            (0, [1], [("w0", 1, 1), ("w1", 2, 1)])
        ]
        assert not any(p.done() for p in pushes)
        late = asyncio.create_task(mode.push("w2", 1, 0, _grad(), session=9))  # for the same step
        await _settle()
        assert not late.done()  # "stale" only once the step is on the backup too
        acknowledged.set_result(None)
        assert [(await p).applied for p in pushes] == [True, True]
        assert (await late).reason == "stale"


async def test_a_sync_step_waiting_for_its_backup_times_out_naming_the_backup_not_the_workers() -> None:
    store = _store()
    mode = SyncMode(store, replicas_to_aggregate=2, total_replicas=2, barrier_timeout_s=0.2)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def silent_backup() -> None:
        await never

    mode.replicate_step = lambda step: silent_backup()
    async with asyncio.timeout(10):
        pushes = [asyncio.create_task(mode.push(f"w{i}", 1, 0, _grad(), session=i + 1)) for i in range(2)]
        for p in pushes:
            with pytest.raises(DeadlineExceededError, match="step 0 is applied here, but its backup") as e:
                await p
            assert "no gradient" not in str(e.value)  # every worker pushed: none is blamed
    never.cancel()


async def test_a_sync_step_its_backup_did_not_acknowledge_fails_its_pushes() -> None:
    store = _store()
    mode = _sync(store)

    async def refused() -> None:
        raise UnavailableError("no lease")

    mode.replicate_step = lambda step: refused()
    async with asyncio.timeout(10):
        pushes = [asyncio.create_task(mode.push(f"w{i}", 1, 0, _grad(), session=i + 1)) for i in range(2)]
        for p in pushes:
            with pytest.raises(UnavailableError, match="no lease"):
                await p
        # Applied here: a retry is a duplicate (the servicer then waits for the backup to have it).
        assert store.get("w").version == 1 and mode.step == 1
        assert (await mode.push("w0", 1, 0, _grad(), session=1)).reason == "duplicate"


async def test_losing_the_lease_ends_sync_and_ssp_waits_and_applies_nothing() -> None:
    store = _store()
    sync = _sync(store)
    holding = [True]

    def check() -> None:
        if not holding[0]:
            raise UnavailableError("holds no lease")

    sync.lease_check = check
    async with asyncio.timeout(10):
        waiting = asyncio.create_task(sync.push("w0", 1, 0, _grad(), session=1))
        await _settle()
        holding[0] = False
        sync.interrupt(UnavailableError("lease lost"))
        with pytest.raises(UnavailableError, match="lease lost"):
            await waiting
        assert sync.pending_claims() == [] and not store.has_applied("w0", 1, 1)  # withdrawn
        with pytest.raises(UnavailableError, match="holds no lease"):
            await sync.push("w1", 1, 0, _grad(), session=2)
        holding[0] = True
        pushes = [sync.push(f"w{i}", 1, 0, _grad(), session=i + 1) for i in range(2)]
        assert [o.applied for o in await asyncio.gather(*pushes)] == [True, True]  # the retry applies it
        assert store.get("w").version == 1

        ssp = SSPMode(_store(), total_replicas=2, staleness=0, barrier_timeout_s=10.0)
        await ssp.push("w0", 1, 0, _grad())
        pulling = asyncio.create_task(ssp.before_pull("w0", 1))  # waits for w1's step 0
        await _settle()
        ssp.interrupt(UnavailableError("lease lost"))
        with pytest.raises(UnavailableError, match="lease lost"):
            await pulling
        await ssp.before_pull("w0", 0)  # a later wait is not ended by the past interrupt


def test_a_backup_replays_its_primarys_mode_state() -> None:
    sync = _sync(_store())
    sync.replay_leave("w1")
    sync.replay_step(0, ["w0"])
    sync.replay_step(1, ["w1"])  # w1 pushed again: counted in again
    assert (sync.step, sync.left, sync.resuming) == (2, set(), False)
    ssp = SSPMode(_store(), total_replicas=2, staleness=1, barrier_timeout_s=10.0)
    ssp.replay_push("w0", 4)
    ssp.replay_push("w0", 2)  # replayed out of order: a clock never goes back
    ssp.replay_leave("w1")
    assert (ssp.clocks, ssp.left) == ({"w0": 5}, {"w1"})
    # A backup takes the primary's live state; a checkpoint restore resumes (the workers may be anywhere).
    state = sync.state_dict()
    follower, restored = _sync(_store()), _sync(_store())
    follower.load_state_dict(state, restored=False)
    restored.load_state_dict(state)
    assert (follower.step, follower.resuming, restored.resuming) == (2, False, True)


async def test_a_retry_waits_for_its_original_being_applied() -> None:
    store = _store()
    mode = AsyncMode(store)
    async with asyncio.timeout(10):
        store.gate.hold()
        original = asyncio.create_task(mode.push("w0", 1, 0, _grad(), session=5))
        retry = asyncio.create_task(mode.push("w0", 1, 0, _grad(), session=5))
        await _settle()
        assert not retry.done()  # not "duplicate" while the original is not applied
        store.gate.release()
        assert (await original).applied and (await retry).reason == "duplicate"
        assert store.get("w").version == 1

        # An original that fails leaves the update to its retry.
        store.gate.hold()
        failing = asyncio.create_task(store.apply_once("w0", 2, 5, [(store.get("w"), _grad()["w"])]))
        await _settle()
        retried = asyncio.create_task(mode.push("w0", 2, 0, _grad(), session=5))
        await _settle()
        failing.cancel()  # the original's call went away before its update was applied
        store.gate.release()
        with pytest.raises(asyncio.CancelledError):
            await failing
        assert (await retried).applied and store.get("w").version == 2


async def test_a_sync_push_of_a_step_its_worker_already_pushed_waits_for_the_step() -> None:
    # The worker's first push lost its answer (a link went silent) and the worker pushed the step
    # again: answered at once, it would read the step before its update.
    store = _store()
    mode = _sync(store)
    async with asyncio.timeout(10):
        first = asyncio.create_task(mode.push("w0", 1, 0, _grad(), session=1))
        await _settle()
        again = asyncio.create_task(mode.push("w0", 2, 0, {"w": np.full(2, -3.0, np.float32)}, session=1))
        await _settle()
        assert not again.done() and not first.done() and store.get("w").version == 0
        first.cancel()  # the first push's call goes away: the step keeps the worker's latest gradient
        with pytest.raises(asyncio.CancelledError):
            await first
        assert mode.pending_claims() == [("w0", 1, 2)]
        assert (await mode.push("w1", 1, 0, _grad(), session=2)).applied
        assert (await again).applied and mode.step == 1
        np.testing.assert_allclose(store.get("w").value, [2.0, 2.0])  # the mean of -3 and -1, once
        assert (await mode.push("w0", 2, 0, _grad(), session=1)).reason == "duplicate"


async def test_a_backup_loads_a_snapshot_again_after_clearing_its_store() -> None:
    primary = _store()
    mode = _sync(primary)
    await asyncio.gather(*(mode.push(f"w{i}", 1, 0, _grad(), session=i + 1) for i in range(2)))
    snap = await checkpoint.take_snapshot(primary, mode, 0, 1)
    backup, follower = Store(), _sync(Store())
    checkpoint.load_into(snap, backup, follower, restored=False)
    backup.clear()  # a new attempt to attach starts over
    checkpoint.load_into(snap, backup, follower, restored=False)
    assert backup.get("w").version == 1 and follower.step == 1 and not follower.resuming
    assert backup.has_applied("w0", 1, 1)


@pytest.mark.parametrize("lease_s", [0.1, 1.0, 2.0, 30.0])
def test_the_backup_waits_out_the_lease_under_the_drift_bound(lease_s: float) -> None:
    rho = lease.MAX_CLOCK_DRIFT
    # The primary's lease ends at most lease / (1 - rho) after the send, in real time; the backup waits at
    # least backup_wait / (1 + rho) after a later read.
    assert lease.backup_wait(lease_s) / (1 + rho) > lease_s / (1 - rho)
    # A silent primary is suspected only after more than two heartbeats' time (one late or lost is no death),
    # and declared gone about when its backup may take over: clients of a silent primary wait no longer.
    assert lease.silence_limit(lease_s) > 2 * lease.heartbeat_every(lease_s)
    assert lease.silence_limit(lease_s) + lease.heartbeat_every(lease_s) <= lease.backup_wait(lease_s)
    assert lease.heartbeat_every(lease_s) < lease_s


async def _silent() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()  # a backup that acknowledges nothing
    yield b""


async def test_the_same_backup_attaching_again_replaces_its_dead_stream_and_another_is_refused() -> None:
    # A backup that gave up on its stream across a partition or a pause attaches again before the word of
    # its cancel reached the primary: the old stream ends, the new one gets a snapshot. A third process is
    # refused (two processes per shard).
    from psserver.replication import Primary

    store = _store()
    primary = Primary(store, AsyncMode(store), shard=0, num_shards=1)
    first = primary.serve(_silent(), "b:1")
    assert (await anext(first)).snapshot_done
    second = primary.serve(_silent(), "b:1")
    assert (await anext(second)).snapshot_done
    with pytest.raises(StopAsyncIteration):
        await anext(first)  # detached: its stream ends
    with pytest.raises(FailedPreconditionError, match=r"already has a backup \(b:1\)"):
        await anext(primary.serve(_silent(), "c:1"))
    await second.aclose()
