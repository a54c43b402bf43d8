"""Unit tests of push dedup by ``(worker_id, session, seq)``: takeover, conflicts, bounds (issue 9)."""

from __future__ import annotations

import asyncio
import io
import json

import grpc
import numpy as np
import pytest

import psclient
from psclient import _bulk, _retry, _session
from pscore import codec, errors
from pscore.errors import WorkerIdConflictError
from pscore.optimizers import SGD
from psproto.v1 import ps_pb2
from psserver import ckptfile
from psserver.ledger import _RETIRED_SESSIONS
from psserver.modes import AsyncMode, SyncMode
from psserver.store import Store

A, B, C = 0xA1, 0xB2, 0xC3  # session ids


def _store(**values: np.ndarray) -> Store:
    store = Store()
    specs = [
        ps_pb2.VariableSpec(
            name=n, dtype=codec.wire_dtype(v.dtype), shape=v.shape, optimizer=SGD(1.0).to_proto()
        )
        for n, v in values.items()
    ]
    store.create(specs, values)
    return store


def test_a_retry_of_one_session_is_a_duplicate_and_sessions_of_one_worker_do_not_share_seqs() -> None:
    store = Store()
    assert store.ledger.claim("w0", 1, A)
    assert not store.ledger.claim("w0", 1, A)  # a retry
    assert store.ledger.claim("w0", 1, B)  # a restarted worker numbers from 1 again: applied, not a duplicate
    assert store.ledger.claim("w1", 1, A)  # sequence numbers are per worker id


def test_an_older_session_is_refused_once_a_newer_one_took_over_and_nothing_is_recorded() -> None:
    store = Store()
    assert store.ledger.claim("worker0", 1, A) and store.ledger.claim("worker0", 2, A)
    assert store.ledger.claim("worker0", 1, B)  # takes over
    with pytest.raises(
        WorkerIdConflictError, match=r"worker id 'worker0' is used by two clients at once"
    ) as info:
        store.ledger.claim("worker0", 3, A)
    assert f"{A:016x}" in str(info.value) and f"{B:016x}" in str(info.value)
    assert "PSWorker(worker_index=...)" in str(info.value)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not store.ledger.claim("worker0", 2, A)  # a retry of an applied push of A: still a duplicate
    assert dict((s, seen) for s, _, seen in store.ledger.dedup_state()["worker0"]) == {A: [1, 2], B: [1]}
    assert next(reversed(store.ledger.dedup_state()["worker0"]))[0] == B  # B stays current: no ping-pong
    assert store.ledger.claim("worker0", 2, B)


def test_a_session_is_not_refused_for_its_own_unclaimed_push() -> None:
    store = Store()
    assert store.ledger.claim("w", 1, A)
    store.ledger.unclaim("w", 1, A)
    assert store.ledger.claim("w", 1, A)  # the retry of a push that failed before it was applied


def test_old_sessions_are_forgotten_beyond_the_bound() -> None:
    store = Store()
    sessions = list(range(1, _RETIRED_SESSIONS + 4))
    for s in sessions:
        assert store.ledger.claim("w", 1, s)
    kept = [s for s, _, _ in store.ledger.dedup_state()["w"]]
    assert kept == sessions[-(_RETIRED_SESSIONS + 1) :]
    assert store.ledger.claim("w", 7, sessions[0])  # forgotten: it counts as new and takes over


def test_record_never_refuses_and_dedup_state_round_trips() -> None:
    store = Store()
    store.ledger.record("w", 5, B)
    store.ledger.record("w", 9, A)  # a backup replays what its primary applied, in its order
    store.ledger.record("w", 6, B)
    other = Store()
    other.ledger.load_dedup_state(store.ledger.dedup_state())
    assert other.ledger.dedup_state() == store.ledger.dedup_state()
    assert not other.ledger.claim("w", 6, B) and not other.ledger.claim("w", 9, A)
    assert other.ledger.claim("w", 10, A)  # A was recorded last: it is current


async def test_async_mode_refused_push_changes_nothing() -> None:
    store = _store(w=np.zeros(2, np.float32))
    mode = AsyncMode(store)
    grads = {"w": np.ones(2, np.float32)}
    assert (await mode.push("w0", 1, 0, grads, A)).applied
    assert (await mode.push("w0", 1, 0, grads, B)).applied  # restarted worker: applied, not a duplicate
    with pytest.raises(WorkerIdConflictError):
        await mode.push("w0", 2, 0, grads, A)
    assert store.get("w").version == 2
    np.testing.assert_array_equal(store.get("w").value, -2)


async def test_sync_mode_a_newer_session_replaces_the_older_ones_gradient_in_an_open_step() -> None:
    store = _store(w=np.zeros(2, np.float32))
    mode = SyncMode(store, replicas_to_aggregate=2, total_replicas=2, barrier_timeout_s=10)
    async with asyncio.timeout(10):
        old = asyncio.create_task(mode.push("w0", 1, 0, {"w": np.full(2, 100.0, np.float32)}, A))
        await asyncio.sleep(0)
        new = asyncio.create_task(mode.push("w0", 1, 0, {"w": np.full(2, 2.0, np.float32)}, B))
        await asyncio.sleep(0)
        assert (await mode.push("w1", 1, 0, {"w": np.full(2, 4.0, np.float32)}, C)).applied
        assert (await new).applied
        with pytest.raises(WorkerIdConflictError, match="replaced by a newer session"):
            await old
    np.testing.assert_array_equal(store.get("w").value, -3)  # mean of w0's newer and w1's gradients
    assert mode.step == 1 and mode.pending_claims() == []


def _snapshot(dedup: dict) -> ckptfile.Snapshot:
    spec = ps_pb2.VariableSpec(name="v", dtype=ps_pb2.DTYPE_FLOAT32, shape=[2])
    return ckptfile.Snapshot(
        shard=0, num_shards=1, mode="async",
        tensors=[ckptfile.StoredTensor(spec, np.zeros(2, np.float32), 3, {})],
        dedup=dedup, mode_state={},
    )  # fmt: skip


def test_checkpoint_keeps_sessions_and_writes_the_current_window_for_old_readers() -> None:
    buf = io.BytesIO()
    ckptfile.dump(_snapshot({"w": [(A, -1, [1, 2]), (B, -1, [1])]}), buf, ckpt_id=1)
    buf.seek(0)
    back = ckptfile.load(buf, "mem")
    assert back.dedup == {"w": [(A, -1, [1, 2]), (B, -1, [1])]}
    buf.seek(0)
    with np.load(buf) as z:
        manifest = json.loads(bytes(z["manifest"]).decode())
    assert manifest["dedup"] == {"w": [-1, [1]]}


def test_checkpoint_without_sessions_loads_as_session_zero() -> None:
    buf = io.BytesIO()
    ckptfile.dump(_snapshot({"w": [(0, 4, [6, 7])]}), buf, ckpt_id=1)
    with np.load(io.BytesIO(buf.getvalue())) as z:
        arrays = dict(z)
    manifest = json.loads(bytes(arrays["manifest"]).decode())
    del manifest["dedup_sessions"]  # what a psserver from before sessions wrote
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    old = io.BytesIO()
    np.savez(old, **arrays)
    old.seek(0)
    snap = ckptfile.load(old, "old")
    assert snap.dedup == {"w": [(0, 4, [6, 7])]}
    store = Store()
    store.ledger.load_dedup_state(snap.dedup)
    ledger = store.ledger
    assert not ledger.claim("w", 7) and not ledger.claim("w", 3) and ledger.claim("w", 8)  # an old client
    assert store.ledger.claim("w", 1, A)  # a new client takes over


def test_merged_dedup_tables_keep_the_first_tables_current_session() -> None:
    first = _snapshot({"w": [(A, -1, [1]), (B, -1, [2])]})
    second = _snapshot({"w": [(B, -1, [3]), (A, -1, [4])], "u": [(C, -1, [1])]})
    merged = ckptfile._merge_dedup([first, second])
    assert merged == {"w": [(A, -1, [1, 4]), (B, -1, [2, 3])], "u": [(C, -1, [1])]}


class _FailedCall(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, metadata: tuple) -> None:
        super().__init__()
        self._code, self._metadata = code, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "worker id 'w' is used by two clients at once"

    def trailing_metadata(self) -> tuple:
        return self._metadata


def test_client_maps_the_conflict_reason_to_worker_id_conflict_error_and_never_retries_it() -> None:
    reason = ((errors.ERROR_REASON_KEY, errors.WORKER_ID_CONFLICT),)
    err = errors.from_rpc_error(_FailedCall(grpc.StatusCode.FAILED_PRECONDITION, reason), method="Push")
    assert type(err) is psclient.WorkerIdConflictError and not err.retryable
    plain = errors.from_rpc_error(_FailedCall(grpc.StatusCode.FAILED_PRECONDITION, ()))
    assert type(plain) is psclient.FailedPreconditionError
    data_port = _bulk.RequestError(grpc.StatusCode.FAILED_PRECONDITION, "x", errors.WORKER_ID_CONFLICT)
    assert type(errors.from_rpc_error(data_port)) is psclient.WorkerIdConflictError
    assert not _retry.is_retryable(data_port)


def test_client_sessions_are_random_and_nonzero() -> None:
    clients = [psclient.AsyncPSClient(["127.0.0.1:1"], worker_id="w") for _ in range(4)]
    assert len({c.session for c in clients}) == 4 and all(0 < c.session < 2**64 for c in clients)


async def test_a_push_written_after_the_shard_refused_the_stream_falls_back_to_unary() -> None:
    """The shard answered UNIMPLEMENTED (an older psserver) before the reader saw it: the push written
    to the ended stream must still say "unsupported", so the client sends a unary Push instead."""

    class _Refused:
        def __aiter__(self) -> _Refused:
            return self

        async def __anext__(self) -> None:
            await asyncio.Event().wait()  # the reader has not seen the end yet

        async def write(self, request: object) -> None:
            raise asyncio.InvalidStateError("the stream has ended")

        async def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNIMPLEMENTED

        async def details(self) -> str:
            return "Method not implemented!"

        def cancel(self) -> None:
            pass

    session = _session.PushSession(_Refused)
    async with asyncio.timeout(10):
        with pytest.raises(_session.SessionUnsupported):
            await session.push(ps_pb2.PushRequest(worker_id="w", seq=1), 5.0)
        await session.close()
    assert not session.supported
