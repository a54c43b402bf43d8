"""The ParameterServer gRPC servicer: a thin adapter from gRPC calls to ``psserver.service.ShardService``.

Each handler reads its request (assembling streamed chunks), takes the call's
deadline from its context (``deadline_of``), calls the service, and frames the
answer (streams split into chunks of about ``DEFAULT_CHUNK_BYTES``). Errors:
``_translated`` (one place) turns a ``PSError`` or ``CodecError`` the service
raises into the status, message and reason of ``ShardService.failure``;
anything else propagates and gRPC reports UNKNOWN (and logs it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from pscore import codec, rpc
from pscore.errors import (
    ERROR_REASON_KEY,
    FailedPreconditionError,
    InvalidArgumentError,
    PSError,
    status_number,
)
from psproto.v1 import ps_pb2
from psserver.replication import BACKUP_ADDRESS_KEY, BACKUP_TERM_KEY
from psserver.service import DEFAULT_CHUNK_BYTES, ShardService, Snapshot, chunk_of, deadline_of

if TYPE_CHECKING:
    from psserver.dataport import DataPortServer

log = logging.getLogger(__name__)

_MIN_CHUNK_BYTES = 64 << 10  # the smallest chunk a client may ask for


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


def _stream_values(snapshot: Snapshot, chunk_bytes: int) -> Iterator[tuple[list[codec.WireChunk], list[int]]]:
    """Packs a snapshot into messages of about ``chunk_bytes`` of tensor data each, with the versions
    of the tensors that start in each message."""
    versions = {name: version for name, _, version in snapshot}
    for batch in codec.wire_batches([(name, value) for name, value, _ in snapshot], chunk_bytes):
        yield batch, [versions[c.name] for c in batch if c.offset == 0]


def _push_header(message: ps_pb2.PushRequest | codec.WireMessage) -> ps_pb2.PushRequest:
    """A streamed push's header: the whole of its first message but the gradients (every field, so
    that one added to ``PushRequest`` reaches the push as it does on ``Push``)."""
    header = ps_pb2.PushRequest()
    header.CopyFrom(message.header if isinstance(message, codec.WireMessage) else message)
    header.ClearField("grads")
    return header


class ParameterServerServicer:
    """The gRPC face of one shard's ``ShardService`` (handlers keep the generated PascalCase names).

    Args:
        service: the shard's operations.
    """

    def __init__(self, service: ShardService) -> None:
        self.service = service
        self.data_port: DataPortServer | None = None  # the raw-TCP data port (psserver.dataport), if served
        self._idle_sessions: set[asyncio.Task[Any]] = set()  # PushSession handlers waiting for a push

    async def drain(self, grace_s: float) -> None:
        """Shutdown (SIGTERM), once the server takes no new calls: ends what would hold it open.

        Idle ``PushSession`` streams end at once with UNAVAILABLE (a busy one
        after the push it is applying), sync barriers and ssp waits give up
        with UNAVAILABLE, and once no update is in flight (at most ``grace_s``
        seconds) the backup's ``Replicate`` stream ends, so that every update
        acknowledged to a client is on the backup too. Clients retry (or fail
        over) as for any UNAVAILABLE.
        """
        self.service.begin_drain()
        for task in list(self._idle_sessions):
            task.cancel()
        await self.service.finish_drain(grace_s)

    async def _abort(self, context: grpc.aio.ServicerContext, err: PSError | codec.CodecError) -> None:
        code, message, reason = self.service.failure(err)
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
        return await self.service.create_variables(specs, values)

    @_translated
    async def ListVariables(
        self, request: ps_pb2.ListVariablesRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ListVariablesResponse:
        return self.service.list_variables(request)

    @_translated
    async def Pull(
        self, request: ps_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.PullResponse:
        snapshot = await self.service.pull_snapshot(request, deadline_of(context, request.timeout_s))
        return codec.WireMessage(
            ps_pb2.PullResponse(versions=[version for _, _, version in snapshot]),
            "values",
            [chunk_of(name, value) for name, value, _ in snapshot],
        )

    @_translated_stream
    async def PullStream(
        self, request: ps_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.PullResponse]:
        snapshot = await self.service.pull_snapshot(
            request, deadline_of(context, request.timeout_s), "PullStream"
        )
        # At least 64 KiB a message: a tiny (or negative) request would make the stream crawl.
        wanted = request.max_chunk_bytes
        chunk_bytes = max(wanted, _MIN_CHUNK_BYTES) if wanted else DEFAULT_CHUNK_BYTES
        for chunks, versions in _stream_values(snapshot, chunk_bytes):
            yield codec.WireMessage(ps_pb2.PullResponse(versions=versions), "values", chunks)

    @_translated
    async def Push(
        self, request: ps_pb2.PushRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.PushResponse:
        return await self.service.push_one(request, deadline_of(context, request.timeout_s))

    @_translated
    async def Lookup(
        self, request: ps_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.LookupResponse:
        return await self.service.lookup_rows(request, deadline_of(context))

    @_translated
    async def ScanRows(
        self, request: ps_pb2.ScanRowsRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ScanRowsResponse:
        return self.service.scan_rows(request)

    async def PushSession(
        self, request_iterator: AsyncIterator[ps_pb2.PushRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.PushResponse | codec.WireMessage]:
        # One push per message, answered in order; a failed push is reported in
        # its response (code, message) and the stream goes on. On shutdown the
        # stream ends with UNAVAILABLE as soon as it is idle (``drain``).
        service = self.service
        task = asyncio.current_task()
        assert task is not None
        requests = aiter(request_iterator)
        while not service.stopping:
            self._idle_sessions.add(task)
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not service.stopping:  # the call itself was cancelled
                    raise
                task.uncancel()  # drain() ended the wait for a push that may never come
                break
            finally:
                self._idle_sessions.discard(task)
            try:
                response = await service.push_one(request, deadline_of(context, request.timeout_s))
            except (PSError, codec.CodecError) as err:
                code, message, reason = service.failure(err)
                response = ps_pb2.PushResponse(code=status_number(code), message=message, reason=reason)
            yield response
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, f"shard {service.shard} is shutting down; retry on its restart"
        )

    @_translated_stream
    async def PushStream(
        self, request_iterator: AsyncIterator[ps_pb2.PushRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.PushResponse]:
        # The first message carries the header; the gradients' chunks may be spread over all of them.
        header: ps_pb2.PushRequest | None = None
        grads = codec.Assembler()
        async for req in request_iterator:
            if header is None:
                header = _push_header(req)
            for chunk in req.grads:
                grads.add(chunk)
        if header is None:
            raise InvalidArgumentError("push stream carried no messages")
        deadline = deadline_of(context, header.timeout_s)
        response, snapshot = await self.service.push(header, grads.result(), deadline, "PushStream")
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
        return await self.service.leave(request)

    @_translated
    async def UpdateOptimizer(
        self, request: ps_pb2.UpdateOptimizerRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.UpdateOptimizerResponse:
        return await self.service.update_optimizer(request)

    @_translated
    async def Assign(
        self, request_iterator: AsyncIterator[ps_pb2.AssignRequest], context: grpc.aio.ServicerContext
    ) -> ps_pb2.AssignResponse:
        values = codec.Assembler()
        async for req in request_iterator:
            for chunk in req.values:
                values.add(chunk)
        return await self.service.assign(values)

    async def GetStatus(
        self, request: ps_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.GetStatusResponse:
        return self.service.status()

    @_translated
    async def SaveCheckpoint(
        self, request: ps_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.SaveCheckpointResponse:
        return await self.service.save_checkpoint()

    @_translated
    async def PrepareCut(
        self, request: ps_pb2.PrepareCutRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.PrepareCutResponse:
        return await self.service.prepare_cut(request, deadline_of(context))

    @_translated
    async def CommitCut(
        self, request: ps_pb2.CommitCutRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.SaveCheckpointResponse:
        return await self.service.commit_cut(request, deadline_of(context))

    async def ReleaseCut(
        self, request: ps_pb2.ReleaseCutRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ReleaseCutResponse:
        return self.service.release_cut(request)

    @_translated_stream
    async def Replicate(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ps_pb2.ReplicateResponse | codec.WireMessage]:
        metadata = dict(context.invocation_metadata() or ())
        peer = str(metadata.get(BACKUP_ADDRESS_KEY) or context.peer())
        term = str(metadata.get(BACKUP_TERM_KEY) or "0")
        if not term.isdigit():
            raise InvalidArgumentError(f"bad {BACKUP_TERM_KEY} metadata {term!r}: a term is a whole number")
        async for message in self.service.replicate(request_iterator, peer, int(term)):
            yield message

    @_translated
    async def DataPort(
        self, request: ps_pb2.ShardDataPortRequest, context: grpc.aio.ServicerContext
    ) -> ps_pb2.ShardDataPortResponse:
        self.service.check_serving("DataPort")
        if self.data_port is None:
            raise FailedPreconditionError("this shard serves no data port (psserver --no-data-port)")
        return ps_pb2.ShardDataPortResponse(
            port=self.data_port.port, nonce=self.data_port.issue_nonce(), batches=True
        )


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
