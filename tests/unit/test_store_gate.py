"""Unit tests of the Store's update gate (holds, a cut's let-through) and of a shard's cut holds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pscore import codec
from pscore.errors import AbortedError, FailedPreconditionError, InvalidArgumentError
from pscore.optimizers import SGD
from psproto.v1 import ps_pb2
from psserver import checkpoint, ckptfile
from psserver.cut import CutHolds, expand_ranges, seq_ranges
from psserver.modes import AsyncMode, SyncMode
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


async def test_a_held_push_waits_and_is_not_counted_by_a_snapshot() -> None:
    store = _store()
    mode = AsyncMode(store)
    async with asyncio.timeout(10):
        store.gate.hold()
        pushing = asyncio.create_task(mode.push("w0", 1, 0, _grad(), session=5))
        await _settle()
        assert not pushing.done() and store.get("w").version == 0
        assert not store.has_applied("w0", 1, 5)  # claimed, waiting at the gate
        snap = await checkpoint.take_snapshot(store, mode, 0, 1)  # nests with the hold
        assert snap.dedup["w0"] == [(5, -1, [])]  # a restore must let its retry apply it
        store.gate.release()
        assert (await pushing).applied
        assert store.has_applied("w0", 1, 5) and store.get("w").version == 1


async def test_let_through_passes_a_held_gate_but_never_a_snapshot() -> None:
    store = _store()
    mode = AsyncMode(store)
    async with asyncio.timeout(10):
        store.gate.hold()
        first = asyncio.create_task(mode.push("w0", 1, 0, _grad(), session=5))
        second = asyncio.create_task(mode.push("w0", 2, 0, _grad(), session=5))
        await _settle()
        async with store.gate.quiesced():  # a snapshot being read: nothing passes, not even a let-through
            store.gate.let_through([("w0", 5, 1)])
            await _settle()
            assert store.get("w").version == 0
        assert (await first).applied
        await _settle()
        assert not second.done() and store.get("w").version == 1
        store.gate.release()
        assert (await second).applied
        with pytest.raises(RuntimeError):
            store.gate.release()


def test_pushes_sent_to_several_shards_are_remembered_by_session_and_shards() -> None:
    store = _store()
    for seq in (1, 2, 3, 5):
        assert store.ledger.claim("w0", seq, 9)
        store.ledger.note_sent("w0", seq, 9, [0, 2])
    assert store.ledger.claim("w0", 6, 9)
    store.ledger.note_sent("w0", 6, 9, [1])  # one shard: nothing another shard must match
    assert store.ledger.sent_pushes() == [("w0", 9, 0b101, [1, 2, 3, 5])]
    assert store.ledger.sent_pushes(window_s=-1) == []  # older than the window: forgotten
    assert seq_ranges([1, 2, 3, 5]) == [1, 3, 5, 5]
    assert expand_ranges([1, 3, 5, 5]) == [1, 2, 3, 5]
    for bad in ([1], [3, 1], [0, 10]):
        with pytest.raises(InvalidArgumentError):
            expand_ranges(bad, limit=5)


async def test_a_cut_holds_reports_and_releases(tmp_path: object) -> None:
    store = _store()
    mode = AsyncMode(store)
    ckpt = checkpoint.Checkpointer(tmp_path, store, mode, shard=0, num_shards=2)  # type: ignore[arg-type]
    cuts = CutHolds(store, mode, ckpt, shard=0, num_shards=2)
    async with asyncio.timeout(10):
        assert store.ledger.claim("w0", 1, 3)
        store.ledger.note_sent("w0", 1, 3, [0, 1])
        report = await cuts.prepare("c1", 5.0, None)
        assert store.gate.held and cuts.active == "c1"
        assert [(k.worker_id, k.session, list(k.seq_ranges), list(k.shards)) for k in report.applied] == [
            ("w0", 3, [1, 1], [0, 1])
        ]
        assert await cuts.prepare("c1", 5.0, None) is report  # a retry
        with pytest.raises(AbortedError, match="c1"):
            await cuts.prepare("c2", 5.0, None)
        reply = await cuts.commit(ps_pb2.CommitCutRequest(cut_id="c1", checkpoint_id=7), None)
        assert not store.gate.held and reply.id == 7 and ckpt.next_id == 8
        assert ckptfile.read(reply.path).cut == {"id": "c1", "num_shards": 2}
        assert await cuts.commit(ps_pb2.CommitCutRequest(cut_id="c1", checkpoint_id=7), None) == reply
        assert cuts.release("c1", discard=True) == (False, True)
        assert not list(tmp_path.glob("ckpt-*"))  # type: ignore[attr-defined]
        with pytest.raises(AbortedError, match="ended"):
            await cuts.prepare("c1", 5.0, None)
        await cuts.prepare("c3", 0.05, None)  # expires by itself
        await asyncio.sleep(0.2)
        assert not store.gate.held and cuts.active is None
        with pytest.raises(AbortedError, match="expired"):
            await cuts.commit(ps_pb2.CommitCutRequest(cut_id="c3", checkpoint_id=9), None)
    with pytest.raises(FailedPreconditionError):
        await CutHolds(store, mode, None, shard=0, num_shards=1).prepare("c", 1.0, None)
    for bad in ("", "x"):
        with pytest.raises(InvalidArgumentError):
            await cuts.prepare(bad, -1.0 if bad else 1.0, None)


async def test_a_sync_cut_lets_held_steps_through_up_to_its_step(tmp_path: object) -> None:
    store = _store()
    mode = SyncMode(store, replicas_to_aggregate=1, total_replicas=1, barrier_timeout_s=10)
    ckpt = checkpoint.Checkpointer(tmp_path, store, mode, shard=0, num_shards=2)  # type: ignore[arg-type]
    cuts = CutHolds(store, mode, ckpt, shard=0, num_shards=2)
    async with asyncio.timeout(10):
        report = await cuts.prepare("s", 5.0, None)
        assert report.step == 0
        step0 = asyncio.create_task(mode.push("w0", 1, 0, _grad(), session=1))
        await _settle()
        assert not step0.done() and mode.current_step() == 0  # held at the gate
        reply = await cuts.commit(ps_pb2.CommitCutRequest(cut_id="s", step=1, checkpoint_id=1), None)
        assert (await step0).applied
        snap = ckptfile.read(reply.path)
        assert snap.mode_state["step"] == 1 and snap.tensors[0].version == 1


def test_a_restart_restores_the_newest_cut_every_shard_holds(tmp_path: object) -> None:
    def write(shard: int, ckpt_id: int, step: int) -> None:
        snap = ckptfile.Snapshot(
            shard=shard, num_shards=2, mode="sync", tensors=[], dedup={}, mode_state={"step": step},
            cut={"step": step},
        )  # fmt: skip
        ckptfile.write(snap, tmp_path, ckpt_id)  # type: ignore[arg-type]

    def chosen(shard: int) -> int:
        store = Store()
        ckpt = checkpoint.Checkpointer(tmp_path, store, AsyncMode(store), shard=shard, num_shards=2)  # type: ignore[arg-type]
        snap = ckpt.choose()
        assert snap is not None
        return int(snap.mode_state["step"])

    write(0, 1, 5)
    write(1, 1, 5)
    write(0, 2, 10)  # the cluster stopped before shard 1 wrote step 10
    assert (chosen(0), chosen(1)) == (5, 5)
    # A restore from step 5 removes shard 0's step 10 file: training goes on from step 5, and that file
    # belongs to a timeline that no longer exists (kept, it would pair with shard 1's step 10 of the new one).
    store = Store()
    mode = SyncMode(store, replicas_to_aggregate=1, total_replicas=1, barrier_timeout_s=5.0)
    ckpt = checkpoint.Checkpointer(tmp_path, store, mode, shard=0, num_shards=2)  # type: ignore[arg-type]
    assert asyncio.run(ckpt.restore())
    assert sorted((f.shard, f.id) for f in ckptfile.list_files(tmp_path)) == [(0, 1), (1, 1)]
    write(0, 2, 10)
    write(1, 2, 10)
    assert (chosen(0), chosen(1)) == (10, 10)
