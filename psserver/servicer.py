"""The ParameterServer gRPC servicer: translates protos to store and mode calls, and errors to statuses.

Handlers stay thin: they raise ``pscore.errors`` exceptions, and ``_translated``
(one place, ``_status``) turns a ``PSError`` into its status code and reason, and a
malformed tensor (``CodecError``) into INVALID_ARGUMENT; anything else propagates
and gRPC reports UNKNOWN (and logs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from pscore import codec, embedding, rpc
from pscore.errors import (
    ERROR_REASON_KEY,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    PSError,
    UnavailableError,
    status_number,
)
from psproto.v1 import ps_pb2
from psserver import tables
from psserver.backup import Backup
from psserver.checkpoint import Checkpointer, CheckpointError
from psserver.cut import CutHolds, StepCuts
from psserver.modes import Mode
from psserver.replication import BACKUP_ADDRESS_KEY, Primary
from psserver.store import Store, Variable

if TYPE_CHECKING:
    from psserver.dataport import DataPortServer

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB per streamed message: large enough to amortise per-message cost
_MIN_CHUNK_BYTES = 64 << 10  # the smallest chunk a client may ask for
_SCAN_MAX_BYTES = 32 << 20  # a ScanRows page at most: well inside a client's 64 MiB receive limit


def _status(err: PSError | codec.CodecError) -> tuple[grpc.StatusCode, str]:
    """The one place a server error becomes a status: its code and reason (``ps-error-reason``).

    A ``PSError`` carries both; a malformed tensor (``CodecError``) is INVALID_ARGUMENT.
    """
    if isinstance(err, PSError):
        return err.code, err.reason
    return grpc.StatusCode.INVALID_ARGUMENT, ""


_Handler = Callable[..., Awaitable[Any]]
_StreamHandler = Callable[..., AsyncIterator[Any]]


def _translated(handler: _Handler) -> _Handler:
    """Wraps a unary-response handler: a ``PSError`` or ``CodecError`` it raises aborts the call."""

    @functools.wraps(handler)
    async def translated(
        self: ParameterServerServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            return await handler(self, request, context)
        except (PSError, codec.CodecError) as err:
            await self._abort(context, err)

    return translated


def _translated_stream(handler: _StreamHandler) -> _StreamHandler:
    """Wraps a stream-response handler as ``_translated`` does (before or after its first message)."""

    @functools.wraps(handler)
    async def translated(
        self: ParameterServerServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            async for message in handler(self, request, context):
                yield message
        except (PSError, codec.CodecError) as err:
            await self._abort(context, err)

    return translated


def _chunk_of(var_name: str, value: np.ndarray, start: int = 0, stop: int | None = None) -> codec.WireChunk:
    # A zero-copy view of the (immutable, copy-on-write) stored value: its bytes
    # are copied once, into the outgoing message, when gRPC serializes it.
    return codec.WireChunk.of(var_name, value, start, stop)


def _pullable(variables: Iterable[Variable], named: bool = True) -> list[Variable]:
    """The variables a pull reads. A dynamic table piece named is refused (InvalidArgumentError); a pull
    of every variable (``named`` False) leaves them out."""
    if not named:
        variables = [v for v in variables if v.dyn is None]
    for v in variables:
        if v.dyn is not None:
            raise InvalidArgumentError(
                f"{v.name!r} is a piece of dynamic table {v.dyn.config.table!r}, a hash table that cannot "
                "be pulled whole; read its rows with Lookup"
            )
    return list(variables)


def _snapshot(variables: Iterable[Variable], named: bool = True) -> list[tuple[str, np.ndarray, int]]:
    """What a pull returns: each variable's value and version (see ``_pullable``)."""
    return [(v.name, *v.stable_value()) for v in _pullable(variables, named)]


async def _averages(variables: Iterable[Variable], named: bool = True) -> list[tuple[str, np.ndarray, int]]:
    """What a pull with ``ema`` returns: each variable's moving average (a copy, read under its lock,
    between two updates) and version. A variable named that keeps none is refused (InvalidArgumentError);
    a pull of every variable leaves those out."""
    if not named:
        variables = [v for v in variables if "average" in v.slots]
    out = []
    for v in _pullable(variables, named):
        if "average" not in v.slots:
            raise InvalidArgumentError(
                f"{v.name!r} keeps no moving average: its optimizer {v.optimizer.config!r} does not have "
                "use_ema=True"
            )
        async with v.lock:
            out.append((v.name, v.slots["average"].copy(), v.version))
    return out


def _rows(var: Variable, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """The rows of global ids ``ids`` of table piece ``var`` (a copy), and its version, in one instant."""
    if var.dyn is not None:  # ids without a row: their initializer's row
        return var.dyn.read(var, ids), var.version
    value, version = var.state
    return value[tables.local_rows(var.spec, ids)], version


def _looked_up(lookups: list[tuple[Variable, np.ndarray]]) -> list[tuple[str, np.ndarray, int]]:
    """The rows of a push's ``lookup_ids`` (checked by ``_lookups``), named ``<piece>\\0lookup``."""
    return [(embedding.lookup_name(var.name), *_rows(var, ids)) for var, ids in lookups]


def _stream_values(
    snapshot: list[tuple[str, np.ndarray, int]], chunk_bytes: int
) -> Iterator[tuple[list[codec.WireChunk], list[int]]]:
    """Packs a snapshot into messages of about ``chunk_bytes`` of tensor data each, with the versions
    of the tensors that start in each message."""
    versions = {name: version for name, _, version in snapshot}
    for batch in codec.wire_batches([(name, value) for name, value, _ in snapshot], chunk_bytes):
        yield batch, [versions[c.name] for c in batch if c.offset == 0]


def deadline_of(context: grpc.aio.ServicerContext | None, timeout_s: float = 0.0) -> float | None:
    """The caller's deadline (``time.monotonic()`` clock): the call's own, or sooner the push's ``timeout_s``.

    A PushSession stream has one long deadline for all its pushes; each push
    carries the time its caller still waits (``PushRequest.timeout_s``).
    """
    now = time.monotonic()
    left = context.time_remaining() if context is not None else None
    if timeout_s > 0:
        left = timeout_s if left is None else min(left, timeout_s)
    return None if left is None else now + left


def _header_ok(worker_id: str) -> None:
    if not worker_id:
        raise InvalidArgumentError("push needs a worker_id (it makes retried pushes idempotent)")


class ParameterServerServicer:
    """Serves one shard's store."""

    def __init__(
        self,
        store: Store,
        mode: Mode,
        *,
        shard: int,
        num_shards: int,
        checkpointer: Checkpointer | None = None,
        primary: Primary | None = None,
        backup: Backup | None = None,
    ) -> None:
        self.store = store
        self.mode = mode
        self.shard = shard
        self.num_shards = num_shards
        self.checkpointer = checkpointer
        self.primary = primary  # forwards updates to an attached backup
        self.backup = backup  # set when this process started as a backup (--backup-of)
        self.cuts = CutHolds(store, mode, checkpointer, shard=shard, num_shards=num_shards)
        self.step_cuts: StepCuts | None = None  # sync mode with a checkpoint dir: periodic checkpoints
        self.data_port: DataPortServer | None = None  # the raw-TCP data port (psserver.dataport), if served
        self.stopping = False  # drain() began: idle PushSession streams end, barriers give up
        self._idle_sessions: set[asyncio.Task[Any]] = set()  # PushSession handlers waiting for a push
        self._updating = 0  # calls changing state right now (pushes, creates, assigns, optimizer updates)
        self._quiet = asyncio.Event()  # set while _updating == 0
        self._quiet.set()

    @contextlib.contextmanager
    def _update(self) -> Iterator[None]:
        """Marks a state-changing call in progress (``drain`` waits for it before detaching a backup)."""
        self._updating += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._updating -= 1
            if not self._updating:
                self._quiet.set()

    async def drain(self, grace_s: float) -> None:
        """Shutdown (SIGTERM), once the server takes no new calls: ends what would hold it open.

        Idle ``PushSession`` streams end at once with UNAVAILABLE (a busy one
        after the push it is applying), sync barriers and ssp waits give up
        with UNAVAILABLE, and once no update is in flight (at most ``grace_s``
        seconds) the backup's ``Replicate`` stream ends, so that every update
        acknowledged to a client is on the backup too. Clients retry (or fail
        over) as for any UNAVAILABLE.
        """
        self.stopping = True
        self.cuts.abort("the shard is shutting down")
        self.mode.shutdown()
        for task in list(self._idle_sessions):
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self._quiet.wait()
        if self.primary is not None:
            self.primary.close("this shard is shutting down")

    def _serving(self, what: str) -> None:
        """Raises UnavailableError unless this process may serve a client now.

        A standby backup refuses (clients then go to the primary); so does a
        replicated primary without its lease (``psserver.replication``). Called
        again, in the same event-loop step, right before a call reads state it
        waited for, so that what it returns was read while the lease held.
        """
        if self.backup is not None:
            self.backup.check_serving(what)
        if self.primary is not None:
            self.primary.check(what)

    def failure(self, err: PSError | codec.CodecError) -> tuple[grpc.StatusCode, str, str]:
        """What a call that raised ``err`` answers: its status code, message and reason."""
        code, reason = _status(err)
        return code, f"shard {self.shard}: {err}", reason

    async def _abort(self, context: grpc.aio.ServicerContext, err: PSError | codec.CodecError) -> None:
        code, message, reason = self.failure(err)
        trailing = ((ERROR_REASON_KEY, reason),) if reason else ()
        await context.abort(code, message, trailing_metadata=trailing)

    @_translated
    async def CreateVariables(
        self,
        request_iterator: AsyncIterator[ps_pb2.CreateVariablesRequest],
        context: grpc.aio.ServicerContext,
    ) -> ps_pb2.CreateVariablesResponse:
        specs: list[ps_pb2.VariableSpec] = []
        values = codec.Assembler()
        async for req in request_iterator:
            specs.extend(req.variables)
            for chunk in req.values:
                values.add(chunk)
        self._serving("CreateVariables")
        tensors = values.result()
        made = await self.store.make_rows(specs)  # rows the shard makes: neither sent nor forwarded
        with self._update():
            created = self.store.create(specs, tensors, made)
            if self.primary is not None:
                await self.primary.forward_create(
                    [s for s, c in zip(specs, created, strict=True) if c], tensors
                )
        return ps_pb2.CreateVariablesResponse(created=created)

    @_translated
    async def ListVariables(
        self, request: ps_pb2.ListVariablesRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ListVariablesResponse:
        self._serving("ListVariables")
        wanted = set(request.names)
        infos = [
            ps_pb2.VariableInfo(
                spec=v.spec,
                version=v.version,
                iterations=v.iterations,
                dynamic=v.dyn.proto_stats(v) if v.dyn is not None else None,
            )
            for v in self.store.variables()
            if not wanted
            or v.name in wanted
            or (v.spec.HasField("partition") and v.spec.partition.variable in wanted)
            or (v.is_table and tables.table_name(v.spec) in wanted)
        ]
        return ps_pb2.ListVariablesResponse(variables=infos, shard=self.shard, num_shards=self.num_shards)

    @_translated
    async def Pull(
        self, request: ps_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.PullResponse:
        snapshot = await self.pull_snapshot(request, deadline_of(context, request.timeout_s))
        return codec.WireMessage(
            ps_pb2.PullResponse(versions=[version for _, _, version in snapshot]),
            "values",
            [_chunk_of(name, value) for name, value, _ in snapshot],
        )

    @_translated_stream
    async def PullStream(
        self, request: ps_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.PullResponse]:
        snapshot = await self.pull_snapshot(request, deadline_of(context, request.timeout_s), "PullStream")
        # At least 64 KiB a message: a tiny (or negative) request would make the stream crawl.
        wanted = request.max_chunk_bytes
        chunk_bytes = max(wanted, _MIN_CHUNK_BYTES) if wanted else DEFAULT_CHUNK_BYTES
        for chunks, versions in _stream_values(snapshot, chunk_bytes):
            yield codec.WireMessage(ps_pb2.PullResponse(versions=versions), "values", chunks)

    async def pull_snapshot(
        self, request: ps_pb2.PullRequest, deadline: float | None, what: str = "Pull"
    ) -> list[tuple[str, np.ndarray, int]]:
        """What a pull returns (Pull, PullStream, the data port): each named variable's value (with
        ``ema``: its moving average) and version.

        Raises:
            PSError: as Pull (NOT_FOUND, a standby backup's UNAVAILABLE, an ssp wait's DEADLINE_EXCEEDED).
        """
        self._serving(what)
        await self.mode.before_pull(request.worker_id, request.step, deadline)
        self._serving(what)  # the values are read while the lease holds
        variables = self.store.lookup(request.names)
        if request.ema:
            snapshot = await _averages(variables, bool(request.names))
            self._serving(what)  # read between awaits: the lease still holds
        else:
            snapshot = _snapshot(variables, bool(request.names))
        self.store.pulls += 1
        return snapshot

    async def _push(
        self, header: ps_pb2.PushRequest, grads: dict[str, tables.Grad], deadline: float | None
    ) -> ps_pb2.PushResponse:
        _header_ok(header.worker_id)
        self._serving("Push")
        with self._update():
            return await self._push_updating(header, grads, deadline)

    async def _push_updating(
        self, header: ps_pb2.PushRequest, grads: dict[str, tables.Grad], deadline: float | None
    ) -> ps_pb2.PushResponse:
        if self.step_cuts is not None and header.checkpoint_step:  # before the push can complete a step
            self.step_cuts.learn(header.checkpoint_step)
        outcome = await self.mode.push(
            header.worker_id, header.seq, header.step, grads, header.session, deadline
        )
        if outcome.applied and len(header.shards) > 1:  # in the same tick as the update: a cut sees both
            self.store.note_sent(header.worker_id, header.seq, header.session, header.shards)
        if outcome.forward and self.primary is not None:  # answered once the backup has it too
            await self.primary.forward_push(
                header.worker_id,
                header.seq,
                grads,
                outcome.versions,
                session=header.session,
                time_unix=outcome.time_unix,
                shards=header.shards,
                step=header.step,
            )
        elif outcome.reason == "duplicate" and self.primary is not None:
            # A retry: "already applied" only once the original is on the backup too.
            await self.primary.wait_settled((header.worker_id, header.session, header.seq))
        if header.return_values or header.lookup_ids:  # push_pull: what the worker reads for step + 1
            await self.mode.before_pull(header.worker_id, header.step + 1, deadline)
        return ps_pb2.PushResponse(
            applied=outcome.applied,
            reason=outcome.reason,
            checkpoint_step=self.step_cuts.announced if self.step_cuts is not None else 0,
        )

    @_translated
    async def Push(
        self, request: ps_pb2.PushRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.PushResponse:
        return await self.push_one(request, deadline_of(context, request.timeout_s))

    async def push_one(
        self, request: ps_pb2.PushRequest | codec.WireMessage, deadline: float | None
    ) -> ps_pb2.PushResponse | codec.WireMessage:
        """One whole push (Push, a message of PushSession, the data port). Raises: PSError, CodecError."""
        grads = codec.Assembler()
        for chunk in request.grads:
            grads.add(chunk)
        tensors = tables.pair(grads.result())
        lookups = self._lookups(request.lookup_ids, "lookup with a push")
        response = await self._push(request, tensors, deadline)
        if request.return_values or lookups:
            self._serving("Push")  # the values are read while the lease holds
            snapshot = self._after_push(tensors, request.omit_values) if request.return_values else []
            snapshot += _looked_up(lookups)
            response.versions.extend(version for _, _, version in snapshot)
            return codec.WireMessage(
                response, "values", [_chunk_of(name, value) for name, value, _ in snapshot]
            )
        return response

    def _lookups(self, chunks: Iterable[Any], what: str) -> list[tuple[Variable, np.ndarray]]:
        """The table pieces and checked ids of a Lookup (or a push's lookup_ids), every id checked before
        any row is read or anything applied. Raises: NotFoundError, InvalidArgumentError, CodecError."""
        checked = []
        for chunk in chunks:
            var = self.store.get(chunk.name)
            checked.append((var, tables.check_ids(var.spec, codec.decode(chunk), what)))
        return checked

    def _after_push(
        self, grads: dict[str, tables.Grad], omit: Iterable[str] = ()
    ) -> list[tuple[str, np.ndarray, int]]:
        """What push_pull returns: dense variables' values; a row gradient's distinct ids and their rows;
        nothing for the names in ``omit``."""
        out = []
        skip = set(omit)
        for name, grad in grads.items():
            if name in skip:
                continue
            var = self.store.get(name)
            if isinstance(grad, tables.RowGrad):
                ids = np.unique(grad.ids.astype(np.int64))
                rows, version = _rows(var, ids)
                out.append((embedding.ids_name(name), ids, version))
                out.append((embedding.values_name(name), rows, version))
            else:
                out.append((name, *var.stable_value()))
        return out

    @_translated
    async def Lookup(
        self, request: ps_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.LookupResponse:
        return await self.lookup_rows(request, deadline_of(context))

    async def lookup_rows(self, request: ps_pb2.LookupRequest, deadline: float | None) -> codec.WireMessage:
        """A Lookup's answer (the Lookup call, the data port): the rows of each piece's ids.

        Raises:
            PSError: as Lookup (NOT_FOUND, INVALID_ARGUMENT for a bad id, an ssp wait's
                DEADLINE_EXCEEDED, a standby backup's UNAVAILABLE); CodecError.
        """
        self._serving("Lookup")
        checked = self._lookups(request.ids, "lookup")
        await self.mode.before_pull(request.worker_id, request.step, deadline)
        self._serving("Lookup")
        rows = [(var.name, *_rows(var, ids)) for var, ids in checked]
        self.store.pulls += 1
        return codec.WireMessage(
            ps_pb2.LookupResponse(versions=[version for _, _, version in rows]),
            "values",
            [_chunk_of(name, value) for name, value, _ in rows],
        )

    @_translated
    async def ScanRows(
        self, request: ps_pb2.ScanRowsRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ScanRowsResponse:
        self._serving("ScanRows")
        var = self.store.get(request.name)
        if not var.is_table:
            raise InvalidArgumentError(f"ScanRows: variable {request.name!r} is not an embedding table piece")
        if request.max_rows < 0:
            raise InvalidArgumentError(f"ScanRows: max_rows {request.max_rows} is negative")
        row_bytes = max(1, var.dtype.itemsize * int(var.shape[1]))
        wanted = request.max_rows or max(1, DEFAULT_CHUNK_BYTES // row_bytes)
        n = max(1, min(wanted, _SCAN_MAX_BYTES // row_bytes))
        after = request.after if request.HasField("after") else None
        # No await from here to the answer: the ids, rows and version are one instant's.
        if var.dyn is not None:
            ids, rows, done = var.dyn.scan(var, after, n)
            held = len(var.dyn)
        else:
            ids, rows, done = tables.scan_fixed(var.spec, var.value, after, n)
            held = int(var.shape[0])
        header = ps_pb2.ScanRowsResponse(done=done, version=var.version, rows=held)
        chunks = [
            _chunk_of(embedding.ids_name(var.name), ids),
            _chunk_of(embedding.values_name(var.name), rows),
        ]
        return codec.WireMessage(header, "values", chunks)

    async def PushSession(
        self, request_iterator: AsyncIterator[ps_pb2.PushRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.PushResponse | codec.WireMessage]:
        # One push per message, answered in order; a failed push is reported in
        # its response (code, message) and the stream goes on. On shutdown the
        # stream ends with UNAVAILABLE as soon as it is idle (``drain``).
        task = asyncio.current_task()
        assert task is not None
        requests = aiter(request_iterator)
        while not self.stopping:
            self._idle_sessions.add(task)
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self.stopping:  # the call itself was cancelled
                    raise
                task.uncancel()  # drain() ended the wait for a push that may never come
                break
            finally:
                self._idle_sessions.discard(task)
            try:
                response = await self.push_one(request, deadline_of(context, request.timeout_s))
            except (PSError, codec.CodecError) as err:
                code, message, reason = self.failure(err)
                response = ps_pb2.PushResponse(code=status_number(code), message=message, reason=reason)
            yield response
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, f"shard {self.shard} is shutting down; retry on its restart"
        )

    @_translated_stream
    async def PushStream(
        self, request_iterator: AsyncIterator[ps_pb2.PushRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.PushResponse]:
        header: ps_pb2.PushRequest | None = None
        grads = codec.Assembler()
        async for req in request_iterator:
            if header is None:
                header = ps_pb2.PushRequest(
                    worker_id=req.worker_id,
                    seq=req.seq,
                    session=req.session,
                    step=req.step,
                    return_values=req.return_values,
                    timeout_s=req.timeout_s,
                    shards=req.shards,
                    checkpoint_step=req.checkpoint_step,
                    omit_values=req.omit_values,
                    lookup_ids=req.lookup_ids,
                )
            for chunk in req.grads:
                grads.add(chunk)
        if header is None:
            raise InvalidArgumentError("push stream carried no messages")
        tensors = tables.pair(grads.result())
        lookups = self._lookups(header.lookup_ids, "lookup with a push")
        response = await self._push(header, tensors, deadline_of(context, header.timeout_s))
        if header.return_values or lookups:
            self._serving("PushStream")
        snapshot = self._after_push(tensors, header.omit_values) if header.return_values else []
        snapshot += _looked_up(lookups)
        if not snapshot:
            yield response
            return
        for chunks, versions in _stream_values(snapshot, DEFAULT_CHUNK_BYTES):
            response.versions.extend(versions)
            yield codec.WireMessage(response, "values", chunks)
            response = ps_pb2.PushResponse(applied=response.applied, reason=response.reason)

    @_translated
    async def Leave(
        self, request: ps_pb2.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.LeaveResponse:
        self._serving("Leave")
        if not request.worker_id:
            raise InvalidArgumentError("leave needs a worker_id")
        with self._update():
            await self.mode.leave(request.worker_id)
            if self.primary is not None and self.mode.name != "async":  # async mode keeps no workers
                await self.primary.forward_leave(request.worker_id)
        return ps_pb2.LeaveResponse()

    @_translated
    async def UpdateOptimizer(
        self, request: ps_pb2.UpdateOptimizerRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.UpdateOptimizerResponse:
        self._serving("UpdateOptimizer")
        spec = request.optimizer if request.HasField("optimizer") else None
        pending = None
        with self._update():
            async with self.store.update_optimizer(
                request.names, dict(request.params), spec, reset=request.reset
            ) as changed:
                if self.primary is not None:  # queued with the locks held: no update overtakes it
                    pending = self.primary.send_optimizer_update(changed, reset=request.reset)
            if pending is not None:
                await pending
        return ps_pb2.UpdateOptimizerResponse(names=[v.name for v in changed])

    @_translated
    async def Assign(
        self, request_iterator: AsyncIterator[ps_pb2.AssignRequest], context: grpc.aio.ServicerContext
    ) -> ps_pb2.AssignResponse:
        values = codec.Assembler()
        async for req in request_iterator:
            for chunk in req.values:
                values.add(chunk)
        self._serving("Assign")
        tensors = values.result()
        # Not through the mode: applied at once, outside sync barriers and ssp clocks.
        with self._update():
            versions = await self.store.set_values(self.store.validate_values(tensors))
            if self.primary is not None:  # answered once the backup has it too
                await self.primary.forward_assign(tensors, versions)
        return ps_pb2.AssignResponse(names=list(tensors), versions=versions)

    async def GetStatus(
        self, request: ps_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.GetStatusResponse:
        return ps_pb2.GetStatusResponse(
            shard=self.shard,
            num_shards=self.num_shards,
            mode=self.mode.name,
            num_variables=len(self.store),
            total_bytes=self.store.total_bytes,
            pushes=self.store.pushes,
            pulls=self.store.pulls,
            uptime_s=time.monotonic() - self.store.started,
            role=self.role,
            peer=self._peer(),
            step=self.mode.current_step(),
            lease_s=self.primary.lease_left() if self.primary is not None and self.role == "primary" else 0.0,
        )

    @property
    def role(self) -> str:
        """``primary``, ``backup`` or ``orphaned`` (see ``psserver.replication``)."""
        return self.backup.role if self.backup is not None else "primary"

    def _peer(self) -> str:
        if self.backup is not None and self.backup.role != "primary":
            return self.backup.primary
        return self.primary.backup if self.primary is not None else ""

    @_translated
    async def SaveCheckpoint(
        self, request: ps_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.SaveCheckpointResponse:
        self._serving("SaveCheckpoint")
        if self.checkpointer is None:
            raise FailedPreconditionError("no checkpoint directory (start it with --checkpoint-dir)")
        try:
            result = await self.checkpointer.save()
        except (CheckpointError, TimeoutError) as err:
            raise InternalError(f"checkpoint failed: {err}") from err
        return ps_pb2.SaveCheckpointResponse(
            path=str(result.path),
            id=result.id,
            num_variables=result.num_variables,
            bytes=result.nbytes,
            seconds=result.seconds,
        )

    @_translated
    async def PrepareCut(
        self, request: ps_pb2.PrepareCutRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.PrepareCutResponse:
        self._serving("PrepareCut")
        if self.stopping:
            raise UnavailableError("the shard is shutting down")
        return await self.cuts.prepare(request.cut_id, request.hold_s, deadline_of(context))

    @_translated
    async def CommitCut(
        self, request: ps_pb2.CommitCutRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.SaveCheckpointResponse:
        self._serving("CommitCut")
        try:
            return await self.cuts.commit(request, deadline_of(context))
        except CheckpointError as err:
            raise InternalError(f"checkpoint failed: {err}") from err

    async def ReleaseCut(
        self, request: ps_pb2.ReleaseCutRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ReleaseCutResponse:
        released, discarded = self.cuts.release(request.cut_id, discard=request.discard)
        return ps_pb2.ReleaseCutResponse(released=released, discarded=discarded)

    @_translated_stream
    async def Replicate(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.ReplicateResponse | codec.WireMessage]:
        if self.backup is not None and self.backup.role == "orphaned":
            self.backup.check_serving("Replicate")  # its old primary is back as its backup: promote
        if self.primary is None or self.role != "primary":
            raise FailedPreconditionError(
                f"this shard is a {self.role}, not a primary: it cannot take a backup"
            )
        metadata = dict(context.invocation_metadata() or ())
        peer = str(metadata.get(BACKUP_ADDRESS_KEY) or context.peer())
        async for message in self.primary.serve(request_iterator, peer):
            yield message

    @_translated
    async def DataPort(
        self, request: ps_pb2.ShardDataPortRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ShardDataPortResponse:
        self._serving("DataPort")
        if self.data_port is None:
            raise FailedPreconditionError("this shard serves no data port (psserver --no-data-port)")
        return ps_pb2.ShardDataPortResponse(port=self.data_port.port, nonce=self.data_port.issue_nonce())


def add_to_server(servicer: ParameterServerServicer, server: grpc.aio.Server) -> None:
    """Registers ``servicer`` for every method of ``ParameterServer`` with ``codec`` framing (``pscore.rpc``).

    Responses may be ``codec.WireMessage`` s (pulled values are sent without
    protobuf copies); tensor-carrying requests are parsed with ``codec.parse``.
    ``Replicate`` gets raw bytes: ``psserver.replication`` parses its acks in the task that reads them.
    """
    handlers = rpc.method_handlers(servicer, raw_requests={"Replicate"})
    name = rpc.service_name()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
