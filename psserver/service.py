"""The shard's operations without a transport: ``ShardService`` answers the gRPC servicer and the data port.

Every operation takes plain ``psproto`` requests (or their ``codec.WireMessage``
form) and the caller's deadline (``deadline_of``, on the ``time.monotonic()``
clock), and raises ``pscore.errors`` exceptions (a malformed tensor:
``codec.CodecError``); ``ShardService.failure`` is the one place such an error
becomes the status code, message and reason a caller answers with. Nothing here
knows about ``grpc.aio.ServicerContext`` or sockets: ``psserver.servicer`` (gRPC)
and ``psserver.dataport`` (raw TCP) are thin adapters over it.

Not thread-safe: used from the shard's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from pscore import codec, embedding
from pscore.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    PSError,
    UnavailableError,
)
from psproto.v1 import ps_pb2
from psserver import tables
from psserver.backup import Backup
from psserver.checkpoint import Checkpointer
from psserver.ckptfile import CheckpointError
from psserver.cut import CutHolds, StepCuts
from psserver.modes import Mode
from psserver.replication import Primary
from psserver.rows import RowRead
from psserver.store import Store, Variable

DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB per streamed message: large enough to amortise per-message cost
_SCAN_MAX_BYTES = 32 << 20  # a ScanRows page at most: well inside a client's 64 MiB receive limit

Snapshot = list[tuple[str, np.ndarray, int]]  # (name, value, version) of each tensor a call returns


def deadline_of(context: Any | None, timeout_s: float = 0.0) -> float | None:
    """The caller's deadline (``time.monotonic()`` clock): the call's own, or sooner the push's ``timeout_s``.

    ``context`` is anything with gRPC's ``time_remaining()`` (a servicer
    context), or None where the call has no deadline of its own (the data port).
    A PushSession stream has one long deadline for all its pushes, and the data
    port none: each push carries the time its caller still waits
    (``PushRequest.timeout_s``).
    """
    now = time.monotonic()
    left = context.time_remaining() if context is not None else None
    if timeout_s > 0:
        left = timeout_s if left is None else min(left, timeout_s)
    return None if left is None else now + left


def _status(err: PSError | codec.CodecError) -> tuple[grpc.StatusCode, str]:
    """The one place a server error becomes a status: its code and reason (``ps-error-reason``).

    A ``PSError`` carries both; a malformed tensor (``CodecError``) is INVALID_ARGUMENT.
    """
    if isinstance(err, PSError):
        return err.code, err.reason
    return grpc.StatusCode.INVALID_ARGUMENT, ""


def chunk_of(var_name: str, value: np.ndarray, start: int = 0, stop: int | None = None) -> codec.WireChunk:
    """A zero-copy view of the (immutable, copy-on-write) stored ``value``: its bytes are copied once,
    into the outgoing message, when it is serialized."""
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


def _snapshot(variables: Iterable[Variable], named: bool = True) -> Snapshot:
    """What a pull returns: each variable's value and version (see ``_pullable``)."""
    return [(v.name, *v.stable_value()) for v in _pullable(variables, named)]


async def _averages(variables: Iterable[Variable], named: bool = True) -> Snapshot:
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


class _Reads(list[tuple[str, "np.ndarray | RowRead", int]]):
    """What a call returns, read at one instant (no await between the ``value`` and ``rows`` calls): a
    list of ``(name, value, version)``, then the rows of dynamic table pieces on disk, as they were then
    (``result``). Where no dynamic piece is read, the list is the snapshot itself (made with no call of
    its own: ``list``'s)."""

    dynamic = False  # whether an item is a dynamic piece's RowRead (set on the instance)

    def value(self, name: str, value: np.ndarray, version: int) -> None:
        self.append((name, value, version))

    def rows(self, name: str, var: Variable, ids: np.ndarray) -> None:
        """The rows of global ids ``ids`` of table piece ``var`` (copies; the ids of a dynamic piece
        without a row get their initializer's row), and its version, under ``name``."""
        if var.dyn is not None:
            self.append((name, var.dyn.read_begin(var, ids), var.version))
            self.dynamic = True
        else:
            value, version = var.state
            self.append((name, value[tables.local_rows(var.spec, ids)], version))

    async def result(self, inline_bytes: int) -> Snapshot:
        """The values and rows; the disk reads in a worker thread when more than ``inline_bytes``."""
        if not self.dynamic:  # arrays only: nothing to read or to end
            return self  # type: ignore[return-value]
        reads = [read for _, read, _ in self if isinstance(read, RowRead)]
        if sum(read.cold_bytes for read in reads) > inline_bytes:
            await asyncio.to_thread(_read_cold, reads)
        else:
            _read_cold(reads)
        return [(n, r.piece.read_end(r) if isinstance(r, RowRead) else r, v) for n, r, v in self]


def _read_cold(reads: list[RowRead]) -> None:
    for read in reads:
        read.piece.read_cold(read)


def _header_ok(worker_id: str) -> None:
    if not worker_id:
        raise InvalidArgumentError("push needs a worker_id (it makes retried pushes idempotent)")


class ShardService:
    """One shard's store, mode, replication and checkpoints, behind transport-free operations.

    Methods may be called concurrently from the shard's event loop (each
    call is a task); a state-changing call is counted (``_update``) so that
    ``finish_drain`` can wait for the ones in flight.
    """

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
        self.stopping = False  # begin_drain() ran: sessions end, barriers give up
        self._updating = 0  # calls changing state right now (pushes, creates, assigns, optimizer updates)
        self._quiet: asyncio.Event | None = None  # made by finish_drain; set once _updating == 0

    # -- lifecycle ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _update(self) -> Iterator[None]:
        """Marks a state-changing call in progress (``finish_drain`` waits for it to detach a backup)."""
        self._updating += 1
        try:
            yield
        finally:
            self._updated()

    def _updated(self) -> None:
        """A state-changing call ended (``_update``'s end)."""
        self._updating -= 1
        if not self._updating and self._quiet is not None:
            self._quiet.set()
            self._quiet = None

    def begin_drain(self) -> None:
        """Shutdown, first half: sync barriers, ssp waits and held cuts give up with UNAVAILABLE."""
        self.stopping = True
        self.cuts.abort("the shard is shutting down")
        self.mode.shutdown()

    async def finish_drain(self, grace_s: float) -> None:
        """Shutdown, second half: once no update is in flight (at most ``grace_s`` seconds), ends the
        backup's ``Replicate`` stream, so that every update acknowledged to a client is on the backup too."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                while self._updating:
                    if self._quiet is None:
                        self._quiet = asyncio.Event()
                    await self._quiet.wait()
        if self.primary is not None:
            self.primary.close("this shard is shutting down")

    def serves_alone(self) -> bool:
        """Whether a request is served now without waiting for another request or a peer (async mode, no
        backup attached): requests that came together may then be served one after the other
        (``psserver.dataport``'s batches)."""
        primary = self.primary
        return (
            self.mode.name == "async" and self.backup is None and (primary is None or not primary.forwarding)
        )

    def check_serving(self, what: str) -> None:
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

    # -- variables ---------------------------------------------------------------------------------

    async def create_variables(
        self, specs: list[ps_pb2.VariableSpec], values: codec.Assembler
    ) -> ps_pb2.CreateVariablesResponse:
        """Creates ``specs`` with the initial ``values`` (an identical spec again is a no-op).

        Raises: PSError (ALREADY_EXISTS, INVALID_ARGUMENT, a standby's UNAVAILABLE); CodecError.
        """
        self.check_serving("CreateVariables")
        tensors = values.result()
        made = await self.store.make_rows(specs)  # rows the shard makes: neither sent nor forwarded
        with self._update():
            created = self.store.create(specs, tensors, made)
            if self.primary is not None:
                await self.primary.forward_create(
                    [s for s, c in zip(specs, created, strict=True) if c], tensors
                )
        return ps_pb2.CreateVariablesResponse(created=created)

    def list_variables(self, request: ps_pb2.ListVariablesRequest) -> ps_pb2.ListVariablesResponse:
        """The specs, versions and table stats of the variables named (all without names)."""
        self.check_serving("ListVariables")
        wanted = set(request.names)
        infos = [
            ps_pb2.VariableInfo(
                spec=v.spec,
                version=v.version,
                iterations=v.iterations,
                dynamic=v.dyn.proto_stats() if v.dyn is not None else None,
            )
            for v in self.store.variables()
            if not wanted
            or v.name in wanted
            or (v.spec.HasField("partition") and v.spec.partition.variable in wanted)
            or (v.is_table and tables.table_name(v.spec) in wanted)
        ]
        return ps_pb2.ListVariablesResponse(variables=infos, shard=self.shard, num_shards=self.num_shards)

    async def assign(self, values: codec.Assembler) -> ps_pb2.AssignResponse:
        """Sets variables' values at once, outside sync barriers and ssp clocks.

        Raises: PSError, CodecError.
        """
        self.check_serving("Assign")
        tensors = values.result()
        with self._update():
            versions = await self.store.set_values(self.store.validate_values(tensors))
            if self.primary is not None:  # answered once the backup has it too
                await self.primary.forward_assign(tensors, versions)
        return ps_pb2.AssignResponse(names=list(tensors), versions=versions)

    async def update_optimizer(
        self, request: ps_pb2.UpdateOptimizerRequest
    ) -> ps_pb2.UpdateOptimizerResponse:
        """Changes (or resets) the optimizer of the variables named. Raises: PSError."""
        self.check_serving("UpdateOptimizer")
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

    # -- pulls and lookups -------------------------------------------------------------------------

    async def pull_snapshot(
        self, request: ps_pb2.PullRequest, deadline: float | None, what: str = "Pull"
    ) -> Snapshot:
        """What a pull returns (Pull, PullStream, the data port): each named variable's value (with
        ``ema``: its moving average) and version.

        Raises:
            PSError: as Pull (NOT_FOUND, a standby backup's UNAVAILABLE, an ssp wait's DEADLINE_EXCEEDED).
        """
        self.check_serving(what)
        await self.mode.before_pull(request.worker_id, request.step, deadline)
        self.check_serving(what)  # the values are read while the lease holds
        variables = self.store.lookup(request.names)
        if request.ema:
            snapshot = await _averages(variables, bool(request.names))
            self.check_serving(what)  # read between awaits: the lease still holds
        else:
            snapshot = _snapshot(variables, bool(request.names))
        self.store.pulls += 1
        return snapshot

    def _lookups(self, chunks: Iterable[Any], what: str) -> list[tuple[Variable, np.ndarray]]:
        """The table pieces and checked ids of a Lookup (or a push's lookup_ids), every id checked before
        any row is read or anything applied. Raises: NotFoundError, InvalidArgumentError, CodecError."""
        checked = []
        for chunk in chunks:
            var = self.store.get(chunk.name)
            checked.append((var, tables.check_ids(var.spec, codec.decode(chunk), what)))
        return checked

    async def lookup_rows(self, request: ps_pb2.LookupRequest, deadline: float | None) -> codec.WireMessage:
        """A Lookup's answer (the Lookup call, the data port): the rows of each piece's ids.

        Raises:
            PSError: as Lookup (NOT_FOUND, INVALID_ARGUMENT for a bad id, an ssp wait's
                DEADLINE_EXCEEDED, a standby backup's UNAVAILABLE); CodecError.
        """
        self.check_serving("Lookup")
        checked = self._lookups(request.ids, "lookup")
        await self.mode.before_pull(request.worker_id, request.step, deadline)
        self.check_serving("Lookup")
        reads = _Reads()
        for chunk, (var, ids) in zip(request.ids, checked, strict=True):
            reads.rows(chunk.name, var, ids)  # the piece's name (var.name, without its property)
        rows = await reads.result(self.store.inline_apply_bytes)
        self.store.pulls += 1
        versions, chunks = [], []  # loops, not comprehensions: no call per lookup
        for name, value, version in rows:
            versions.append(version)
            chunks.append(codec.WireChunk.of(name, value))  # chunk_of, inline
        return codec.WireMessage(ps_pb2.LookupResponse(versions=versions), "values", chunks)

    def scan_rows(self, request: ps_pb2.ScanRowsRequest) -> codec.WireMessage:
        """One page of a table piece's rows after ``request.after``, read in one instant. Raises: PSError."""
        self.check_serving("ScanRows")
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
            chunk_of(embedding.ids_name(var.name), ids),
            chunk_of(embedding.values_name(var.name), rows),
        ]
        return codec.WireMessage(header, "values", chunks)

    # -- pushes ------------------------------------------------------------------------------------

    async def push_one(
        self, request: ps_pb2.PushRequest | codec.WireMessage, deadline: float | None
    ) -> ps_pb2.PushResponse | codec.WireMessage:
        """One whole push in one message (Push, a message of PushSession, the data port): ``push``, with
        the values it returns (if any) as the response's ``values``. Raises: PSError, CodecError."""
        grads = codec.Assembler()
        for chunk in request.grads:
            grads.add(chunk)
        header = request.header if isinstance(request, codec.WireMessage) else request  # fields read directly
        response, snapshot = await self.push(header, grads.result(), deadline)
        if snapshot is None:
            return response
        response.versions.extend(version for _, _, version in snapshot)
        return codec.WireMessage(response, "values", [chunk_of(name, value) for name, value, _ in snapshot])

    async def push(
        self,
        request: ps_pb2.PushRequest | codec.WireMessage,
        grads: dict[str, np.ndarray],
        deadline: float | None,
        what: str = "Push",
    ) -> tuple[ps_pb2.PushResponse, Snapshot | None]:
        """The one push routine (every transport's pushes): applies ``grads`` (assembled; ``request.grads``
        is not read) as the header ``request`` says, through the mode, the backup and the cuts.

        Returns:
            The response, and what the push reads back (with ``return_values`` or ``lookup_ids``:
            values and looked-up rows, read while the lease holds), else None.

        Raises: PSError, CodecError (as Push).
        """
        tensors = tables.pair(grads)
        lookups = self._lookups(request.lookup_ids, "lookup with a push") if request.lookup_ids else []
        response = await self._push(request, tensors, deadline)
        if not (request.return_values or lookups):
            return response, None
        self.check_serving(what)  # the values are read while the lease holds
        reads = _Reads()
        if request.return_values:
            self._after_push(tensors, request.omit_values, reads)
        for var, ids in lookups:
            reads.rows(embedding.lookup_name(var.name), var, ids)
        return response, await reads.result(self.store.inline_apply_bytes)

    def push_now(
        self, request: ps_pb2.PushRequest, grads: dict[str, np.ndarray]
    ) -> tuple[ps_pb2.PushResponse, Snapshot | None] | None:
        """``push``'s common case served with no await: a push or push_pull (no lookup) that waits for
        nothing (async mode, no backup attached nor required: ``Mode.push_now``). What ``push`` returns,
        or None where it is not so (nothing done: serve it with ``push``). Nothing awaits from the checks
        to the answer, so it is not counted in progress (``finish_drain`` sees nothing of it).

        Raises: PSError, CodecError (as ``push``; nothing applied).
        """
        primary = self.primary
        if (
            not self.mode.pushes_now
            or request.lookup_ids
            or self.backup is not None
            or (primary is not None and (primary.forwarding or primary.required))
        ):
            return None
        worker_id = request.worker_id
        if not worker_id:
            _header_ok(worker_id)
        if primary is not None:  # ``check_serving``, inline: no backup here
            primary.check("Push")
        seq, session = request.seq, request.session
        tensors = grads  # dense gradients only (the common case): as they are, ``tables.pair`` 's copy
        for name in grads:
            if "\x00" in name:  # a table's rows: paired into RowGrads
                tensors = tables.pair(grads)
                break
        applied = self.mode.push_now(worker_id, seq, session, tensors)
        if applied is None:
            return None
        if not applied:  # a retry (``Primary.wait_settled``, no backup attached nor required: at once)
            response = ps_pb2.PushResponse(applied=False, reason="duplicate")
        else:
            if len(request.shards) > 1:  # in the same tick as the update: a cut sees both
                self.store.ledger.note_sent(worker_id, seq, session, request.shards)
            response = ps_pb2.PushResponse(applied=True)
        if not request.return_values:
            return response, None
        reads = _Reads()  # async mode: a read waits for nothing (``before_pull``)
        if applied and not request.omit_values:  # the variables just updated, not looked up again
            # ``_after_push``'s dense branch, inline; the pairs come in the order of ``tensors`` (its names:
            # no ``Variable.name`` property call)
            for name, (var, grad) in zip(tensors, applied, strict=True):
                if isinstance(grad, tables.RowGrad):  # a table's rows: ``_after_push`` reads them all
                    reads.clear()
                    self._after_push(tensors, (), reads)
                    break
                value, version = var.state
                reads.append((name, value.copy() if value.flags.writeable else value, version))
        else:
            self._after_push(tensors, request.omit_values, reads)
        return response, reads  # no dynamic piece here (``Store.applies_now``): the snapshot

    async def _push(
        self, header: ps_pb2.PushRequest, grads: dict[str, tables.Grad], deadline: float | None
    ) -> ps_pb2.PushResponse:
        if not header.worker_id:
            _header_ok(header.worker_id)
        self.check_serving("Push")
        self._updating += 1  # ``_update``, without a context manager on every push's path
        try:
            return await self._push_updating(header, grads, deadline)
        finally:
            self._updating -= 1  # ``_updated``, inline
            if not self._updating and self._quiet is not None:
                self._quiet.set()
                self._quiet = None

    async def _push_updating(
        self, header: ps_pb2.PushRequest, grads: dict[str, tables.Grad], deadline: float | None
    ) -> ps_pb2.PushResponse:
        if self.step_cuts is not None:
            if header.parts > 1:  # a step in parts: periodic checkpoints at whole steps
                self.step_cuts.parts = header.parts
            if header.checkpoint_step:  # before the push can complete a step
                self.step_cuts.learn(header.checkpoint_step)
        outcome = await self.mode.push(
            header.worker_id, header.seq, header.step, grads, header.session, deadline
        )
        if outcome.applied and len(header.shards) > 1:  # in the same tick as the update: a cut sees both
            self.store.ledger.note_sent(header.worker_id, header.seq, header.session, header.shards)
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

    def _after_push(self, grads: dict[str, tables.Grad], omit: Iterable[str], reads: _Reads) -> None:
        """What push_pull returns, into ``reads``: dense variables' values; a row gradient's distinct ids
        and their rows; nothing for the names in ``omit``."""
        skip = set(omit)
        names = []
        for name in grads:
            if name not in skip:
                names.append(name)
        found = self.store.lookup(names) if names else []  # one look-up for them all (none: not every one)
        for name, var in zip(names, found, strict=True):
            grad = grads[name]
            if isinstance(grad, tables.RowGrad):
                ids = np.unique(grad.ids.astype(np.int64))
                reads.value(embedding.ids_name(name), ids, var.version)
                reads.rows(embedding.values_name(name), var, ids)
            else:  # reads.value(name, *var.stable_value()), inline
                value, version = var.state
                reads.append((name, value.copy() if value.flags.writeable else value, version))

    async def leave(self, request: ps_pb2.LeaveRequest) -> ps_pb2.LeaveResponse:
        """Worker ``request.worker_id`` leaves: sync barriers and ssp clocks stop waiting for it."""
        self.check_serving("Leave")
        if not request.worker_id:
            raise InvalidArgumentError("leave needs a worker_id")
        with self._update():
            await self.mode.leave(request.worker_id)
            if self.primary is not None and self.mode.name != "async":  # async mode keeps no workers
                await self.primary.forward_leave(request.worker_id)
        return ps_pb2.LeaveResponse()

    # -- status ------------------------------------------------------------------------------------

    def status(self) -> ps_pb2.GetStatusResponse:
        """The shard's counters, role, peer, step and lease (GetStatus; never refused)."""
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
            term=self.term,
            unprotected=self.primary is not None and self.role == "primary" and self.primary.unprotected,
        )

    @property
    def term(self) -> int:
        """The replication term of the history this process holds (``psserver.replication``)."""
        if self.backup is not None and self.backup.role != "primary":
            return self.backup.term
        return self.primary.term if self.primary is not None else 0

    @property
    def role(self) -> str:
        """``primary``, ``backup`` or ``orphaned`` (see ``psserver.replication``)."""
        return self.backup.role if self.backup is not None else "primary"

    def _peer(self) -> str:
        if self.backup is not None and self.backup.role != "primary":
            return self.backup.primary
        return self.primary.backup if self.primary is not None else ""

    # -- checkpoints and cuts ----------------------------------------------------------------------

    async def save_checkpoint(self) -> ps_pb2.SaveCheckpointResponse:
        """Writes a checkpoint now. Raises: FailedPreconditionError (no directory), InternalError."""
        self.check_serving("SaveCheckpoint")
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

    async def prepare_cut(
        self, request: ps_pb2.PrepareCutRequest, deadline: float | None
    ) -> ps_pb2.PrepareCutResponse:
        """Holds the shard's state for a consistent cut (``psserver.cut``). Raises: PSError."""
        self.check_serving("PrepareCut")
        if self.stopping:
            raise UnavailableError("the shard is shutting down")
        return await self.cuts.prepare(request.cut_id, request.hold_s, deadline)

    async def commit_cut(
        self, request: ps_pb2.CommitCutRequest, deadline: float | None
    ) -> ps_pb2.SaveCheckpointResponse:
        """Writes a held cut as a checkpoint. Raises: PSError, InternalError (the write failed)."""
        self.check_serving("CommitCut")
        try:
            return await self.cuts.commit(request, deadline)
        except CheckpointError as err:
            raise InternalError(f"checkpoint failed: {err}") from err

    def release_cut(self, request: ps_pb2.ReleaseCutRequest) -> ps_pb2.ReleaseCutResponse:
        """Lets a held cut go (or discards it)."""
        released, discarded = self.cuts.release(request.cut_id, discard=request.discard)
        return ps_pb2.ReleaseCutResponse(released=released, discarded=discarded)

    # -- replication -------------------------------------------------------------------------------

    def replicate(
        self, requests: AsyncIterator[bytes], peer: str, term: int = 0
    ) -> AsyncIterator[ps_pb2.ReplicateResponse | codec.WireMessage]:
        """The stream a backup at ``peer`` (which has seen replication term ``term``) receives
        (``Primary.serve``). Raises: FailedPreconditionError (this shard is no primary)."""
        if self.backup is not None and self.backup.role == "orphaned":
            self.backup.check_serving("Replicate")  # its old primary is back as its backup: promote
        if self.primary is None or self.role != "primary":
            raise FailedPreconditionError(
                f"this shard is a {self.role}, not a primary: it cannot take a backup"
            )
        return self.primary.serve(requests, peer, term)
