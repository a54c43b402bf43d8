"""AsyncPSClient: the parameter-server client on grpc.aio (one channel per shard, concurrent fan-out)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from psclient import _bulk, _link
from psclient import _requests as rq
from psclient._requests import PushedValues
from psclient._wire import Op
from psclient.config import ClientConfig
from pscore import codec, embedding
from pscore.embedding import Rows
from pscore.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, PSError
from pscore.optimizers import SGD, Optimizer, optimizer_from_proto
from pscore.placement import dynamic_pieces, dynamic_row_shard, global_row, plan, table_pieces
from psproto.v1 import ps_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
Tensors = Mapping[str, Any]  # name -> array-like, or psclient.Rows for an embedding table


async def gather(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Runs awaitables concurrently; on failure cancels the rest and raises the first error itself."""
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_as_coro(c)) for c in coros]
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw


class AsyncPSClient:
    """Async client of a sharded parameter server.

    Example:
        ```python
        async with psclient.AsyncPSClient(["127.0.0.1:50051"], worker_id="w0") as c:
            await c.create("w", np.zeros((4, 4), np.float32), optimizer=psclient.SGD(0.1))
            await c.push({"w": np.ones((4, 4), np.float32)})
            values = await c.pull()
        ```

    Concurrency: methods may be called concurrently from tasks of the event loop
    the client was first used on; use one AsyncPSClient per event loop.

    Args:
        addresses: ``HOST:PORT`` of every shard, in shard order; ``PRIMARY|BACKUP`` for a replicated
            shard (``psserver --backup-of``): calls fail over to the other address on UNAVAILABLE.
        worker_id: identifies this worker; unique per worker. Each client also picks a random
            session id (``session``) once: a push is applied once per ``(worker_id, session, seq)``,
            a newer client with the same worker_id takes over on the shards (a restarted worker),
            and the older one's pushes then fail with ``WorkerIdConflictError``.
        auth_token: sent as ``authorization: Bearer <token>`` on every call.
        timeout: deadline of each call, seconds.
        tls_ca, tls_cert, tls_key: PEM file paths (TLS; cert/key for mutual TLS).
        **options: other ``ClientConfig`` fields (chunk_bytes, unary_max_bytes, ...); ``data_port=False``
            keeps every transfer on gRPC (by default pulls, pushes and lookups go over the shard's
            raw-TCP data port, see ``psclient._bulk``; ``data_port_min_bytes=N``: those of N bytes or
            more per shard, smaller ones over gRPC).
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
        worker_id: str | None = None,
        auth_token: str | None = None,
        timeout: float = 30.0,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        **options: Any,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        kwargs = dict(options)
        if worker_id is not None:
            kwargs["worker_id"] = worker_id
        self.config = ClientConfig(
            addresses=tuple(addresses),
            auth_token=auth_token,
            timeout=timeout,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            **kwargs,
        )
        self.registry = rq.Registry()
        self._pool = rq.ArrayPool()  # pulled arrays, recycled once the caller drops them
        self._seq = itertools.count(1)
        # A push's large parts go up one shard at a time (``_bulk.Uplink``), starting at this worker's own
        # shard (``_bulk.first_turn``): workers pushing at once upload to different shards at each turn.
        # The clients of one process (on one event loop) take turns together: they share the host's link.
        uplink = _bulk.process_uplink() if self.config.stagger_uploads else None
        self._first_turn = _bulk.first_turn(self.config.worker_id)
        credentials = _link.Credentials(self.config)
        # Per shard: its replicas' channels and data connections, retries, failover and the wires.
        self._shards = [
            _link.ShardLink(shard, self.config, credentials, uplink)
            for shard in range(self.config.num_shards)
        ]
        # Never 0 (0 is "no session": a client from before sessions).
        self.session = secrets.randbits(64) or 1
        # Sync mode: the step of the cluster's next periodic checkpoint, learnt from push answers and
        # passed on in every push, so that every shard learns it in time (see psserver.cut.StepCuts).
        self._checkpoint_step = 0

    # -- plumbing -----------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def num_shards(self) -> int:
        return self.config.num_shards

    async def close(self) -> None:
        """Closes the channels and data connections. Idempotent."""
        await gather(link.close() for link in self._shards)

    async def __aenter__(self) -> AsyncPSClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- discovery ----------------------------------------------------------

    async def list_variables(self, names: Iterable[str] = ()) -> dict[str, list[ps_pb2.VariableInfo]]:
        """Lists the stored tensors on every shard (all, or those of ``names``), per variable name.

        Raises:
            PSError: a shard failed.
        """
        request = ps_pb2.ListVariablesRequest(names=list(names))

        async def list_on(shard: int) -> tuple[int, ps_pb2.ListVariablesResponse]:
            resp = await self._shards[shard].unary("ListVariables", request)
            return shard, resp

        found: dict[str, list[ps_pb2.VariableInfo]] = {}
        for shard, resp in await gather(list_on(s) for s in range(self.num_shards)):
            if resp.num_shards and resp.num_shards != self.num_shards:
                raise InvalidArgumentError(
                    f"shard {shard} at {self.config.addresses[shard]} says the cluster has {resp.num_shards} "
                    f"shards; this client was given {self.num_shards} addresses"
                )
            pieces = []
            for info in resp.variables:
                piece = rq.piece_from_spec(info.spec, shard)
                pieces.append(piece)
                found.setdefault(piece.variable, []).append(info)
            self.registry.add(pieces)
        return found

    async def _known(self, names: Iterable[str] | None) -> dict[str, list[rq.Piece]]:
        if names is None:  # every variable on the shards, including those other workers created since
            listed = await self.list_variables()
            return {n: self.registry.pieces[n] for n in listed if self.registry.complete(n)}
        names = list(names)
        try:
            return self.registry.resolve(names)  # the common case: every name known
        except NotFoundError:
            pass
        missing = [n for n in names if not self.registry.complete(n)]
        if missing:
            await self.list_variables(missing)
        return self.registry.resolve(names)

    # -- create -------------------------------------------------------------

    async def create(self, name: str, value: Any, optimizer: Optimizer | None = None) -> bool:
        """Creates one variable (see ``create_many``); returns True if this call created it."""
        return (await self.create_many({name: value}, optimizer=optimizer))[name]

    async def create_many(
        self,
        values: Tensors,
        optimizer: Optimizer | None = None,
        optimizers: Mapping[str, Optimizer] | None = None,
    ) -> dict[str, bool]:
        """Creates variables with initial values; placement is balanced over the batch.

        Idempotent: a variable that already exists with an equal spec (dtype,
        shape, optimizer) is left as it is (its current value wins) and
        reported False.

        Args:
            values: name -> initial value.
            optimizer: the server-side optimizer (default ``SGD()``).
            optimizers: per-variable optimizers, overriding ``optimizer``.

        Raises:
            AlreadyExistsError: a name exists with a different spec.
            InvalidArgumentError: an unsupported dtype, or a malformed value.
        """
        optimizer = optimizer or SGD()
        arrays: dict[str, np.ndarray] = {}
        for name, raw in values.items():
            if not name or "\x00" in name:
                raise InvalidArgumentError(f"invalid variable name {name!r}")
            try:
                arrays[name] = codec.as_wire_array(raw)
                codec.wire_dtype(arrays[name].dtype)
            except (codec.CodecError, TypeError, ValueError) as err:
                raise InvalidArgumentError(f"initial value of {name!r}: {err}") from None
        opts = {n: (optimizers or {}).get(n, optimizer) for n in arrays}
        existing = await self.list_variables(list(arrays))
        created = {n: False for n in arrays if n in existing}
        for n in created:
            self._check_existing(n, arrays[n], opts[n], existing[n])
        new = {n: (a.shape, a.dtype) for n, a in arrays.items() if n not in existing}
        placement = plan(new, self.num_shards, self.config.partition_bytes)
        per_shard: dict[int, list[tuple[ps_pb2.VariableSpec, np.ndarray]]] = {}
        for name, pieces in placement.items():
            for piece in pieces:
                per_shard.setdefault(piece.shard, []).append(
                    (rq.spec_of(piece, opts[name]), rq.piece_view(piece, arrays[name]))
                )

        async def create_on(shard: int, items: list[tuple[ps_pb2.VariableSpec, np.ndarray]]) -> list[bool]:
            def messages() -> Iterable[ps_pb2.CreateVariablesRequest | codec.WireMessage]:
                yield ps_pb2.CreateVariablesRequest(variables=[spec for spec, _ in items])
                tensors = [(spec.name, value) for spec, value in items]
                for batch in codec.wire_batches(tensors, self.config.chunk_bytes):
                    yield codec.WireMessage(_EMPTY_CREATE, "values", batch)

            resp = await self._shards[shard].unary_stream("CreateVariables", messages)
            return list(resp.created)

        shards = sorted(per_shard)
        results = await gather(create_on(s, per_shard[s]) for s in shards)
        for shard, flags in zip(shards, results, strict=True):
            for (spec, _), flag in zip(per_shard[shard], flags, strict=True):
                name = spec.partition.variable if spec.HasField("partition") else spec.name
                created[name] = created.get(name, True) and flag
        for pieces in placement.values():
            self.registry.add(pieces)
        return {n: created[n] for n in arrays}

    def _check_existing(
        self, name: str, value: np.ndarray, optimizer: Optimizer, infos: list[ps_pb2.VariableInfo]
    ) -> None:
        group = self.registry.pieces.get(name, [])
        mismatch = []
        if group and group[0].full_shape != value.shape:
            mismatch.append(f"it has shape {group[0].full_shape}, asked for {value.shape}")
        if group and group[0].dtype != value.dtype:
            mismatch.append(f"it has dtype {group[0].dtype.name}, asked for {value.dtype.name}")
        wanted = optimizer.to_proto()
        if infos and infos[0].spec.optimizer != wanted:
            have = infos[0].spec.optimizer
            mismatch.append(
                f"it has optimizer {have.name}{dict(have.params)}, "
                f"asked for {wanted.name}{dict(wanted.params)}"
            )
        if mismatch:
            raise AlreadyExistsError(
                f"variable {name!r} already exists with a different spec: {'; '.join(mismatch)}"
            )

    # -- pull ---------------------------------------------------------------

    async def pull(
        self, names: Iterable[str] | None = None, *, step: int = 0, ema: bool = False
    ) -> dict[str, np.ndarray]:
        """Reads current values: all variables, or ``names``. Returned arrays are read-only.

        >>> averages = await client.pull(["dense/kernel"], ema=True)  # doctest: +SKIP

        Args:
            names: the variables (default: every variable on the shards).
            step: the reader's step (ssp mode waits for the staleness bound).
            ema: read the exponential moving averages the shards keep for
                variables whose optimizer has ``use_ema=True`` instead of their
                values (without ``names``: every such variable).

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: with ``ema``, a variable that keeps no average.
            PSError: a shard failed (UnavailableError, DeadlineExceededError, ...).
        """
        values, _ = await self.pull_with_versions(names, step=step, ema=ema)
        return values

    async def pull_with_versions(
        self, names: Iterable[str] | None = None, *, step: int = 0, ema: bool = False
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Like ``pull``, also returning each stored tensor's version (update count).

        Dynamic tables are hash tables, not arrays: a pull of every variable
        leaves them out, and naming one is an ``InvalidArgumentError`` (read
        their rows with ``lookup``).
        """
        if ema and names is None:  # every variable that keeps an average
            listed = await self.list_variables()
            names = [
                n
                for n, infos in listed.items()
                if infos
                and not infos[0].spec.HasField("dynamic")
                and infos[0].spec.optimizer.params.get("use_ema", 0.0)
            ]
        pieces = await self._known(names)
        for name, group in list(pieces.items()):
            if group[0].keys and names is None:
                del pieces[name]
            elif group[0].keys:
                raise InvalidArgumentError(
                    f"pull: {name!r} is a dynamic embedding table (a hash table, not an array); "
                    "read its rows with lookup(name, ids)"
                )
        per_shard: dict[int, list[rq.Piece]] = {}
        for group in pieces.values():
            for piece in group:
                per_shard.setdefault(piece.shard, []).append(piece)
        into = rq.Gather(pieces, self._pool.take)

        async def pull_from(shard: int, wanted: list[rq.Piece]) -> None:
            request = ps_pb2.PullRequest(
                names=[p.stored_name for p in wanted], worker_id=self.worker_id, step=step,
                max_chunk_bytes=self.config.chunk_bytes, ema=ema,
            )  # fmt: skip
            sink = _link.Sink(into.add, into.place, functools.partial(into.restart, wanted))
            answer = await self._shards[shard].request(
                Op.PULL, request, (), sink, nbytes=sum(p.nbytes for p in wanted)
            )
            into.add_versions(answer.versions)

        await _each(pull_from, per_shard)
        return into.result(), into.versions

    # -- push ---------------------------------------------------------------

    async def push(self, grads: Tensors, *, step: int = 0, every_shard: bool = False) -> bool:
        """Applies gradients with each variable's server-side optimizer.

        Each shard applies its part all-or-nothing. The push carries this
        worker's id, this client's session and a fresh sequence number, so a
        retry is applied once.

        Args:
            grads: name -> gradient (same shape and dtype as the variable); for an
                embedding table, ``psclient.Rows(ids, values)``: only those rows are
                updated (duplicate ids summed, ``values`` cast to the table's dtype);
                a dynamic table creates, admits and evicts rows as it applies the
                push (see ``create_embedding``).
                In sync mode a table's update is the mean over the step's workers
                of their summed rows, a row absent from a worker's push counting as
                zero.
            step: the worker's step (sync and ssp modes).
            every_shard: also send an empty push (this step, no gradients) to the shards that
                hold none of these variables. In sync mode every shard then completes every
                step, so workers whose steps update different sets of variables (a GAN's two
                optimizers, frozen layers) keep one step count for all shards.

        Returns:
            True if every shard applied it (False: a duplicate or a dropped stale step).

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: shape or dtype mismatch, or non-finite values; for
                ``Rows``: non-integer ids, an id out of range (the message names the
                table and the first bad id), values whose shape is not
                ``ids.shape + (dim,)``, or Rows for a variable that is not a table
                (or an array for one that is). Nothing is applied anywhere.
            WorkerIdConflictError: another live client uses this worker_id (and took over).
            PSError: a shard failed.
        """
        applied, _, _ = await self._push(grads, step=step, return_values=False, every_shard=every_shard)
        return applied

    async def push_pull(
        self,
        grads: Tensors,
        *,
        step: int = 0,
        every_shard: bool = False,
        return_rows: bool | Iterable[str] = True,
    ) -> PushedValues:
        """Pushes gradients and returns the updated values of those variables, in one round trip per shard.

        Args:
            grads, step, every_shard: as ``push``.
            return_rows: which tables' updated rows to return: True (all), False
                (none: a caller that reads them by ``lookup`` anyway saves the bytes),
                or the names of the tables whose rows it needs. The push itself, and
                in ssp mode the wait for the staleness bound, are the same either way.

        Returns:
            A ``PushedValues`` (a ``dict``; ``.applied``: whether every shard applied the push, as
            ``push`` returns): name -> the variable's new value (read-only array); for a ``Rows``
            gradient whose rows are returned, ``psclient.Rows(ids, values)``: the
            distinct ids pushed (int64, sorted) and their rows after the update,
            shape ``[n, dim]`` (a string-keyed dynamic table: the distinct keys, in
            the order of their hashed ids; a row a dynamic table did not admit: its
            initializer's row). A table whose rows are not returned is absent.

        Raises:
            PSError: as ``push``.
        """
        applied, values, _ = await self._push(
            grads, step=step, return_values=True, every_shard=every_shard, return_rows=return_rows
        )
        return PushedValues(values, applied=applied)

    async def push_pull_lookup(
        self,
        grads: Tensors,
        lookup: Mapping[str, Any],
        *,
        step: int = 0,
        return_rows: bool | Iterable[str] = True,
        distinct: bool = False,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``push_pull``, and the rows of other ids read once the push is applied, in the same round trip.

        A worker that knows its next batch's ids reads their rows with this step's push
        (``psclient.keras.prefetch_rows``): one request per shard a step instead of two,
        and the rows include this push's update, as a ``lookup`` after the push would.
        A shard that holds rows to read but none of the gradients gets a ``Lookup``.

        >>> values, rows = await client.push_pull_lookup(  # doctest: +SKIP
        ...     {"emb": Rows(ids, grad_rows), "dense": g}, {"emb": next_ids}, step=k, return_rows=False)

        Args:
            grads, step, return_rows: as ``push_pull``.
            lookup: table -> ids, as ``lookup``'s (any shape). In ssp mode the rows are read
                at ``step + 1`` (the step the push's caller reads for).
            distinct: as ``lookup``'s, for every table of ``lookup``.

        Returns:
            ``(values, rows)``: ``values`` as ``push_pull``'s; ``rows[table]`` as
            ``lookup(table, ids)``'s, shape ``ids.shape + (dim,)``.

        Raises:
            PSError: as ``push`` and ``lookup``: a bad id in ``lookup`` refuses the whole push
                (nothing is applied).
        """
        _, values, rows = await self._push(
            grads, step=step, return_values=True, return_rows=return_rows, lookup=lookup, distinct=distinct
        )
        return values, rows

    async def _push(
        self,
        grads: Tensors,
        *,
        step: int,
        return_values: bool,
        every_shard: bool = False,
        return_rows: bool | Iterable[str] = True,
        lookup: Mapping[str, Any] | None = None,
        distinct: bool = False,
    ) -> tuple[bool, dict[str, Any], dict[str, np.ndarray]]:
        """``push``, ``push_pull`` and ``push_pull_lookup``: one push to every shard concerned, each part
        over its own wire; returns whether every shard applied it, push_pull's values and the rows read."""
        reads: dict[str, _RowRead] = {}
        if lookup:
            groups = await self._known(list(lookup))
            what = "lookup with a push"
            reads = {
                n: _RowRead(n, groups[n], ids, self.num_shards, what, distinct) for n, ids in lookup.items()
            }
        plan = await self._push_plan(grads, return_rows, every_shard)
        per_shard = plan.per_shard
        # Rows to read: with the push to their shard, or by a Lookup where nothing is pushed.
        reading: dict[str, tuple[_RowRead, np.ndarray]] = {}  # wire name -> its read and positions
        lookup_ids: dict[int, list[ps_pb2.TensorChunk]] = {}
        for read in reads.values():
            for shard, (piece, where) in read.per_shard.items():
                lookup_ids.setdefault(shard, []).append(read.wire_ids(piece, where))
                reading[embedding.lookup_name(piece.stored_name)] = (read, where)
        seq = next(self._seq)
        # Every shard's piece of the push names them all: a consistent cut holds it on all or none.
        shards = sorted(per_shard) if len(per_shard) > 1 else []
        answers = (  # a plain push keeps nothing of its answers
            _PushAnswers(plan.pieces, reading, self._pool.take if return_values else None)
            if return_values or reading
            else None
        )

        async def push_to(shard: int, tensors: list[tuple[str, np.ndarray]]) -> bool:
            """One shard's part of the push; returns whether it was applied. push_pull's values come
            straight into the arrays of ``answers.into`` (over the data port; embedding rows, and values
            over gRPC, through ``answers.add``)."""
            header = ps_pb2.PushRequest(
                worker_id=self.config.worker_id,
                seq=seq,
                session=self.session,
                step=step,
                return_values=return_values,
                shards=shards,
                checkpoint_step=self._checkpoint_step,
                omit_values=plan.omit.get(shard, []) if return_values else [],
                lookup_ids=lookup_ids.get(shard, []),
            )
            sink = None  # a plain push: nothing in its answer to keep (the link's own discarding sink)
            if answers is not None:
                place = answers.into.place if answers.into is not None else None
                sink = _link.Sink(
                    functools.partial(answers.add, shard), place, functools.partial(answers.restart, shard)
                )
            answer = await self._shards[shard].request(Op.PUSH, header, tensors, sink)
            if answer.checkpoint_step > self._checkpoint_step:
                self._checkpoint_step = answer.checkpoint_step
            return answer.applied

        async def read_only(shard: int, chunks: list[ps_pb2.TensorChunk]) -> bool:
            request = ps_pb2.LookupRequest(ids=chunks, worker_id=self.worker_id, step=step + 1)
            assert answers is not None  # rows to read: made
            answers.read(shard, chunks, await self._lookup_call(shard, request))
            return True

        if len(per_shard) == 1 and not lookup_ids:  # one shard, nothing else to read: no tasks, no tables
            ((shard, tensors),) = per_shard.items()
            results = [await push_to(shard, tensors)]
        else:
            order = sorted(per_shard)
            if len(order) > 1:  # the parts go up in turn (``_bulk.Uplink``), from this worker's own shard on
                first = self._first_turn % len(order)
                order = order[first:] + order[:first]
            work: dict[int, Any] = {shard: per_shard[shard] for shard in order}
            calls: dict[int, Callable[[int, Any], Awaitable[bool]]] = dict.fromkeys(per_shard, push_to)
            for shard, chunks in lookup_ids.items():
                if shard not in per_shard:
                    work[shard], calls[shard] = chunks, read_only
            results = await _each(lambda shard, w: calls[shard](shard, w), work) if work else []
            results = [r for shard, r in zip(work, results, strict=True) if shard in per_shard]
        if answers is not None and reading:
            answers.check_read()
        looked_up = {name: read.result() for name, read in reads.items()} if reads else {}
        return (
            all(results),
            answers.values(grads, plan) if answers is not None and return_values else {},
            looked_up,
        )

    async def _push_plan(
        self, grads: Tensors, return_rows: bool | Iterable[str], every_shard: bool
    ) -> _PushPlan:
        """Where each gradient goes (the wire tensors per shard), and which tables' rows come back.

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: Rows for a variable that is not a table, an array for one that
                is, or a bad gradient (see ``rq.split_by_shard`` and ``_row_tensors``).
        """
        try:  # every variable known: ``_known``'s common case, without its frame
            known = self.registry.resolve(grads)
        except NotFoundError:
            known = await self._known(list(grads))
        pieces: dict[str, list[rq.Piece]] = {}  # a loop, not comprehensions: no call per push
        row_tables = []
        for n, g in known.items():
            if isinstance(grads[n], Rows):
                row_tables.append(n)
            else:
                pieces[n] = g
        if isinstance(return_rows, bool):
            omitted = set() if return_rows else set(row_tables)
        else:
            omitted = set(row_tables) - set(return_rows)
        omit: dict[int, list[str]] = {}  # per shard: the stored names whose rows are not returned
        for name in omitted:
            for piece in known[name]:
                omit.setdefault(piece.shard, []).append(piece.stored_name)
        for name, group in known.items():
            if group[0].table != isinstance(grads[name], Rows):
                raise InvalidArgumentError(
                    f"gradient for {name!r}: push psclient.Rows(ids, values) for an embedding table, "
                    "and arrays for other variables"
                    if group[0].table
                    else f"gradient for {name!r} is psclient.Rows, but {name!r} is not an embedding table"
                )
        per_shard = rq.split_by_shard(pieces, grads, "gradient")
        for name, group in known.items():
            if name not in pieces:
                for shard, tensors in _row_tensors(name, group, grads[name]).items():
                    per_shard.setdefault(shard, []).extend(tensors)
        if every_shard:
            for shard in range(self.num_shards):
                per_shard.setdefault(shard, [])
        returned = [n for n in row_tables if n not in omitted] if row_tables else row_tables
        return _PushPlan(known=known, pieces=pieces, returned_tables=returned, omit=omit, per_shard=per_shard)

    # -- embedding tables -----------------------------------------------------

    async def create_embedding(
        self,
        name: str,
        num_rows: int | None,
        dim: int,
        *,
        dtype: Any = np.float32,
        optimizer: Optimizer | None = None,
        initializer: embedding.Initializer = "uniform",
        key_type: str = "int64",
        capacity: int | None = None,
        min_count: int = 1,
        eviction: str = "lru",
        ttl_steps: int | None = None,
        ttl_seconds: float | None = None,
        regularizer: embedding.Regularizer | None = None,
    ) -> bool:
        """Creates an embedding table of ``num_rows`` rows of ``dim``, spread by row over every shard.

        Row ``i`` lives on shard ``i % num_shards`` (``pscore.placement``). The
        initial values are a function of (``name``, row id) only, so every
        process creates the same table. A named initializer travels in the
        spec and each shard computes its own rows: the create sends no values,
        so the caller's memory and the upload do not grow with the table. A
        callable initializer runs here (one shard's piece at a time) and its
        values are sent in chunks.
        Idempotent like ``create``: an existing table with an equal spec (rows,
        dim, dtype, optimizer) is left as it is (its current rows win) and False
        returned.

        With ``num_rows=None`` the table is *dynamic*: a hash table on the
        shards keyed by any 64-bit id (``key_type="int64"``) or by strings
        (``key_type="string"``: raw feature values, hashed by
        ``pscore.embedding.hash_keys``), spread by a hash of the id
        (``pscore.placement.dynamic_row_shard``). A row is created on its id's
        first applied push (after ``min_count`` pushes), starting from the
        initializer's row for that id; before that a lookup returns the
        initializer's row. With a ``capacity`` the shards evict rows (LRU or
        LFU) to stay within it, and rows not updated for ``ttl_steps`` pushes or
        ``ttl_seconds`` are removed (see ``psserver.dynamic``). Admission,
        eviction and expiry follow the pushes applied (lookups change nothing),
        so a retried push, a backup and a restored checkpoint agree.

        >>> await client.create_embedding("users", 10**6, 32, optimizer=psclient.Adagrad())  # doctest: +SKIP
        >>> await client.create_embedding(  # doctest: +SKIP
        ...     "items", None, 32, capacity=1_000_000, min_count=2, eviction="lfu", ttl_steps=100_000)

        Args:
            name: the table's name.
            num_rows: rows, >= 1 (ids are ``0 .. num_rows - 1``); None: a dynamic table.
            dim: row width, >= 1.
            dtype: a floating-point dtype.
            optimizer: the server-side optimizer (default ``SGD()``), applied row by
                row (the lazy rule: see ``psserver.optimizers.apply_rows``); not
                Adafactor, Lamb, clipnorm or gradient accumulation.
            initializer: ``"uniform"`` (Keras's Embedding default, U(-0.05, 0.05)),
                ``("uniform", minval, maxval)``, ``"normal"`` / ``("normal", stddev)``
                / ``("normal", mean, stddev)``, ``"zeros"``, ``"ones"``, or (fixed
                tables only) a callable ``f(row_ids, dim, dtype) -> [len(row_ids), dim]``
                that is deterministic per row.
            key_type: dynamic tables: ``"int64"`` (integer ids) or ``"string"`` (str/bytes keys).
            capacity: dynamic tables: rows of the whole table at most, >= 1 (each shard
                holds ``ceil(capacity / num_shards)``); None: unbounded.
            min_count: dynamic tables: pushes of an id before it gets a row, >= 1
                (at most 65535); until then its updates are dropped.
            eviction: dynamic tables with a capacity: ``"lru"`` (least recently
                updated first) or ``"lfu"`` (fewest updates first).
            ttl_steps, ttl_seconds: dynamic tables: remove rows not updated for this
                many pushes to the table, or seconds (None: never).
            regularizer: an L1/L2 regularizer the shards apply to the rows
                (``psclient.Regularizer``: the rows each push touches, or with
                ``every_row=True`` every row, fixed-size tables only); None: none.

        Returns:
            True if this call created the table.

        Raises:
            AlreadyExistsError: ``name`` exists with a different spec (or is not a table).
            InvalidArgumentError: a bad name, size, dtype, initializer, optimizer, or
                dynamic-table option (capacity < 1, min_count < 1, an unknown key type
                or eviction policy, a TTL <= 0, dynamic options for a fixed table).
        """
        optimizer = optimizer or SGD()
        if not name or "\x00" in name:
            raise InvalidArgumentError(f"invalid table name {name!r}")
        dynamic = num_rows is None
        if not (dynamic or isinstance(num_rows, int | np.integer)) or not isinstance(dim, int | np.integer):
            raise InvalidArgumentError(
                f"table {name!r}: num_rows (or None) and dim must be ints, got {num_rows!r}, {dim!r}"
            )
        dim = int(dim)
        if (not dynamic and int(num_rows) < 1) or dim < 1:  # type: ignore[arg-type]
            raise InvalidArgumentError(f"table {name!r}: num_rows ({num_rows}) and dim ({dim}) must be >= 1")
        try:
            dt = np.dtype(dtype)
            codec.wire_dtype(dt)
        except (codec.CodecError, TypeError) as err:
            raise InvalidArgumentError(f"table {name!r}: {err}") from None
        if dt.kind != "f":
            raise InvalidArgumentError(f"table {name!r}: dtype {dt.name} is not floating point")
        if not isinstance(optimizer, Optimizer):
            raise InvalidArgumentError(
                f"table {name!r}: optimizer must be a psclient optimizer, got {optimizer!r}"
            )
        if optimizer.needs_whole_variable:
            raise InvalidArgumentError(
                f"table {name!r}: {optimizer!r} needs the whole variable; a table is updated row by row "
                "(use clipvalue, or another optimizer)"
            )
        if optimizer.gradient_accumulation_steps:
            raise InvalidArgumentError(
                f"table {name!r}: gradient_accumulation_steps is not supported for tables"
            )
        try:
            embedding.check_initializer(initializer)
        except ValueError as err:
            raise InvalidArgumentError(str(err)) from None
        wanted = optimizer.to_proto()
        reg = _regularizer_proto(name, regularizer, dynamic)
        if dynamic:
            options = _dynamic_options(
                name, dim, initializer, key_type, capacity, min_count, eviction, ttl_steps, ttl_seconds
            )
            if reg is not None:
                options.regularizer.CopyFrom(reg)
            return await self._create_dynamic(name, dim, dt, wanted, options)
        if (key_type, capacity, min_count, eviction, ttl_steps, ttl_seconds) != (
            "int64",
            None,
            1,
            "lru",
            None,
            None,
        ):
            raise InvalidArgumentError(
                f"table {name!r}: key_type, capacity, min_count, eviction and the TTLs are options of "
                "dynamic tables (num_rows=None); a table of fixed size has none"
            )
        num_rows = int(num_rows)  # type: ignore[arg-type]
        existing = await self.list_variables([name])
        if name in existing:
            for info in existing[name]:
                t = info.spec.table
                if (
                    not info.spec.HasField("table")
                    or (t.num_rows, t.dim) != (num_rows, dim)
                    or (codec.numpy_dtype(info.spec.dtype) != dt or info.spec.optimizer != wanted)
                    or (t.regularizer if t.HasField("regularizer") else None) != reg
                ):
                    raise AlreadyExistsError(
                        f"{name!r} already exists with a different spec: "
                        + (
                            f"a table of {t.num_rows} x {t.dim} {codec.numpy_dtype(info.spec.dtype).name} "
                            f"with {info.spec.optimizer.name}{dict(info.spec.optimizer.params)}"
                            if info.spec.HasField("table")
                            else "it is not a table of fixed size"
                        )
                        + f"; asked for {num_rows} x {dim} {dt.name} with {wanted.name}{dict(wanted.params)}"
                    )
            if self.registry.complete(name):
                return False
        pieces = table_pieces(name, num_rows, dim, dt, self.num_shards)

        async def create_table_piece(piece: rq.Piece) -> bool:
            rows, _ = piece.stored_shape
            spec = ps_pb2.VariableSpec(
                name=piece.stored_name,
                dtype=codec.wire_dtype(dt),
                shape=piece.stored_shape,
                optimizer=wanted,
                table=ps_pb2.TableRows(
                    table=name, num_rows=num_rows, dim=dim, index=piece.index, count=piece.count, rows=rows
                ),
            )
            if reg is not None:
                spec.table.regularizer.CopyFrom(reg)
            if not callable(initializer):  # the shard makes the rows: nothing to compute or send here
                kind, args = embedding.initializer_args(initializer)
                spec.table.initializer.CopyFrom(ps_pb2.RowInitializer(name=kind, args=args))
                return await self._create_piece(piece.shard, spec, None)
            ids = global_row(np.arange(rows, dtype=np.int64), piece.index, piece.count)
            if piece.nbytes > _INLINE_INIT_BYTES:
                value = await asyncio.to_thread(embedding.init_rows, name, ids, dim, dt, initializer)
            else:
                value = embedding.init_rows(name, ids, dim, dt, initializer)
            return await self._create_piece(piece.shard, spec, value)

        created = await gather(create_table_piece(p) for p in pieces)
        self.registry.add(pieces)
        return all(created)

    async def _create_piece(self, shard: int, spec: ps_pb2.VariableSpec, value: np.ndarray | None) -> bool:
        """Creates one stored tensor (``value`` None: a piece whose rows the shard makes); True if created."""

        def messages() -> Iterable[ps_pb2.CreateVariablesRequest | codec.WireMessage]:
            yield ps_pb2.CreateVariablesRequest(variables=[spec])
            if value is not None:
                for batch in codec.wire_batches([(spec.name, value)], self.config.chunk_bytes):
                    yield codec.WireMessage(_EMPTY_CREATE, "values", batch)

        resp = await self._shards[shard].unary_stream("CreateVariables", messages)
        return bool(resp.created[0])

    async def _create_dynamic(
        self, name: str, dim: int, dt: np.dtype, optimizer: ps_pb2.OptimizerSpec, options: ps_pb2.DynamicTable
    ) -> bool:
        """``create_embedding`` of a dynamic table: one empty piece per shard."""
        pieces = dynamic_pieces(name, dim, dt, self.num_shards, _KEY_NAMES[options.key_type])
        specs = []
        for piece in pieces:
            spec = ps_pb2.VariableSpec(
                name=piece.stored_name, dtype=codec.wire_dtype(dt), shape=[0, dim], optimizer=optimizer
            )
            spec.dynamic.CopyFrom(options)
            spec.dynamic.index, spec.dynamic.count = piece.index, piece.count
            specs.append(spec)
        existing = await self.list_variables([name])
        if name in existing:
            want = {s.name: s for s in specs}
            for info in existing[name]:
                if info.spec != want.get(info.spec.name):
                    raise AlreadyExistsError(
                        f"{name!r} already exists with a different spec: {_describe_table(info.spec)}; "
                        f"asked for {_describe_table(specs[0])}"
                    )
            if self.registry.complete(name):
                return False
        created = await gather(
            self._create_piece(p.shard, spec, None) for p, spec in zip(pieces, specs, strict=True)
        )
        self.registry.add(pieces)
        return all(created)

    async def lookup(self, name: str, ids: Any, *, step: int = 0, distinct: bool = False) -> np.ndarray:
        """Reads rows of an embedding table: the result has shape ``ids.shape + (dim,)``.

        One request per shard that holds any of the ids, carrying only its
        distinct ids (split further when the rows would exceed
        ``config.unary_max_bytes``). A dynamic table answers an id without a
        row with its initializer's row (and creates nothing).

        >>> v = await client.lookup("users", np.array([[3, 7], [7, 0]]))  # (2, 2, dim)  # doctest: +SKIP
        >>> v = await client.lookup("tags", ["sports", "news"])  # string keys  # doctest: +SKIP

        Args:
            name: the table.
            ids: ids of any shape: integers (int32 or int64), each in ``[0, num_rows)``
                for a fixed table, any 64-bit value for a dynamic one; str or bytes
                keys for a string-keyed dynamic table.
            step: the worker's step (ssp mode waits as for ``pull``).
            distinct: the ids are distinct already (as ``tf.unique`` leaves them), so the
                client does not deduplicate them again; a repeated id is then read twice
                (the result is the same).

        Returns:
            A new array of the table's dtype.

        Raises:
            NotFoundError: no such table.
            InvalidArgumentError: ``name`` is not a table, ids that are not
                integers (or, for a string-keyed table, not strings), or an id out
                of range (the message names the table and the first bad id).
            PSError: a shard failed.
        """
        group = self.registry.pieces.get(name)
        if not group or len(group) != group[0].count:  # not known yet (``Registry.complete``): ask the shards
            group = (await self._known([name]))[name]
        read = _RowRead(name, group, ids, len(self._shards), "lookup", distinct)
        batch_rows = max(1, self.config.unary_max_bytes // max(1, read.row_bytes))

        async def lookup_on(shard: int, work: tuple[rq.Piece, np.ndarray]) -> None:
            piece, where = work
            for start in range(0, where.size, batch_rows):
                part = where[start : start + batch_rows]
                request = ps_pb2.LookupRequest(
                    ids=[read.wire_ids(piece, part)], worker_id=self.config.worker_id, step=step
                )
                values = await self._lookup_call(shard, request)
                read.fill(shard, part, values[0] if len(values) == 1 else None)

        await _each(lookup_on, read.per_shard) if read.per_shard else None
        return read.result()

    async def _lookup_call(self, shard: int, request: ps_pb2.LookupRequest) -> list[Any]:
        """One Lookup on a shard; returns the answer's tensors, in the order asked.

        Raises:
            PSError: as the Lookup call.
        """
        rows: list[Any] = []
        await self._shards[shard].request(Op.LOOKUP, request, (), _link.Sink(rows.append, restart=rows.clear))
        return rows

    async def export(
        self, name: str, *, batch_rows: int | None = None
    ) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        """Iterates over every row of an embedding table, in batches: ``(ids, rows)`` (for serving).

        One shard after the other, each in ascending id order (``ScanRows``):
        a fixed table's ids ``0 .. num_rows - 1``, a dynamic table's ids that
        have a row (a string-keyed table's hashed ids: ``pscore.embedding.hash_keys``
        maps keys to them). Memory is O(batch). Each batch is the shards' rows at
        one instant; run it after training (or on a cluster restored from a
        checkpoint) for one consistent table: while training runs, a dynamic table
        may create rows in batches already read, or evict rows of batches to come.

        >>> async for ids, rows in client.export("users"):  # doctest: +SKIP
        ...     index.add(ids, rows)

        Args:
            name: the table.
            batch_rows: rows per batch at most (default: about ``config.unary_max_bytes``
                of rows; a shard caps a batch at about 32 MiB).

        Yields:
            ``(ids, rows)``: int64 ids ``[n]`` and their rows ``[n, dim]`` (new arrays), n >= 1.

        Raises:
            NotFoundError: no such table.
            InvalidArgumentError: ``name`` is not a table, or ``batch_rows`` < 1.
            PSError: a shard failed.
        """
        group = (await self._known([name]))[name]
        if not group[0].table:
            raise InvalidArgumentError(f"export: {name!r} is not an embedding table")
        if batch_rows is not None and batch_rows < 1:
            raise InvalidArgumentError(f"export of {name!r}: batch_rows must be >= 1, got {batch_rows}")
        dim, itemsize = group[0].full_shape[1], group[0].dtype.itemsize
        max_rows = batch_rows or max(1, self.config.unary_max_bytes // max(1, dim * itemsize))
        for piece in group:
            after: int | None = None
            while True:
                request = ps_pb2.ScanRowsRequest(name=piece.stored_name, max_rows=max_rows, after=after)
                shard = piece.shard
                resp = await self._shards[shard].unary("ScanRows", request)
                got = {c.name: codec.decode(c) for c in resp.values}
                ids = got.get(embedding.ids_name(piece.stored_name))
                rows = got.get(embedding.values_name(piece.stored_name))
                if ids is None or rows is None or rows.shape != (ids.size, dim) or ids.ndim != 1:
                    raise codec.CodecError(f"table {name!r}: shard {shard} returned a malformed page")
                if ids.size:
                    yield np.array(ids, np.int64), np.array(rows)
                    after = int(ids[-1])
                if resp.done:
                    break
                if not ids.size:
                    raise codec.CodecError(f"table {name!r}: shard {shard} returned an empty page (not done)")

    async def leave(self) -> None:
        """Tells every shard this worker is done (end of training), so that none waits for it.

        In sync mode a step then needs ``min(N, M - workers left)`` gradients; in
        ssp mode this worker no longer holds others back. A later push counts it
        in again. A no-op in async mode.

        Raises:
            PSError: a shard failed.
        """
        request = ps_pb2.LeaveRequest(worker_id=self.worker_id)

        async def leave_shard(shard: int) -> None:
            await self._shards[shard].unary("Leave", request)

        await gather(leave_shard(s) for s in range(self.num_shards))

    async def status(self) -> list[ps_pb2.GetStatusResponse]:
        """Every shard's status (mode, step, counters, role), in shard order.

        Raises:
            PSError: a shard failed.
        """
        request = ps_pb2.GetStatusRequest()

        async def status_of(shard: int) -> ps_pb2.GetStatusResponse:
            return await self._shards[shard].unary("GetStatus", request)

        return await gather(status_of(s) for s in range(self.num_shards))

    # -- optimizer hyper-parameters -------------------------------------------

    async def set_learning_rate(self, learning_rate: float, names: Iterable[str] | None = None) -> list[str]:
        """Sets the learning rate of existing variables on the shards, keeping their optimizer slots.

        For Keras callbacks that change the rate during training
        (``LearningRateScheduler``, ``ReduceLROnPlateau``): the next push to each
        variable uses ``learning_rate`` exactly. The change is saved in
        checkpoints and made on a shard's backup too. Afterwards
        ``create`` is idempotent only with the new rate in the spec.

        >>> await client.set_learning_rate(1e-4, ["dense/kernel", "dense/bias"])  # doctest: +SKIP

        Args:
            learning_rate: the new constant rate, >= 0.
            names: the variables (user-visible names); None: every variable on
                the shards whose learning rate is a constant (those with a
                schedule are left alone).

        Returns:
            The names of the variables changed, sorted.

        Raises:
            NotFoundError: a named variable does not exist.
            InvalidArgumentError: the rate is negative, or a named variable's
                learning rate is a schedule (a schedule's rate cannot be set, as in Keras).
            PSError: a shard failed.
        """
        return await self.update_optimizer({"learning_rate": learning_rate}, names)

    async def update_optimizer(
        self, params: Mapping[str, float], names: Iterable[str] | None = None
    ) -> list[str]:
        """Sets optimizer hyper-parameters (by Keras name) of existing variables, keeping their slots.

        All or nothing per shard: a shard checks every one of its variables
        before it changes any. The optimizer class and its slots cannot change
        (SGD's momentum from 0, Adam's amsgrad and gradient_accumulation_steps
        would change the slots).

        Args:
            params: e.g. ``{"learning_rate": 1e-4, "beta_1": 0.8}``.
            names: the variables (user-visible names); None: every variable.

        Returns:
            The names of the variables changed, sorted.

        Raises:
            NotFoundError: a named variable does not exist.
            InvalidArgumentError: an unknown parameter, a value out of range, a
                change of the slots, or a learning rate set on a schedule.
            PSError: a shard failed.
        """
        params = {str(k): float(v) for k, v in params.items()}
        if not params:
            raise InvalidArgumentError("update_optimizer needs at least one hyper-parameter")
        if names is None:
            per_shard: dict[int, list[str]] = {s: [] for s in range(self.num_shards)}
        else:
            names = list(names)
            per_shard = {}
            for pieces in (await self._known(names)).values():
                for piece in pieces:
                    per_shard.setdefault(piece.shard, []).append(piece.stored_name)
            # Checked here too, so that a change refused on one shard is not made on another.
            for name, infos in (await self.list_variables(names)).items():
                _check_optimizer_update(name, infos[0].spec.optimizer, params)
        variable_of = {p.stored_name: p.variable for ps in self.registry.pieces.values() for p in ps}

        async def update_on(shard: int, stored: list[str]) -> list[str]:
            request = ps_pb2.UpdateOptimizerRequest(names=stored, params=params)
            resp = await self._shards[shard].unary("UpdateOptimizer", request)
            return list(resp.names)

        changed = [n for names_ in await _each(update_on, per_shard) for n in names_]
        return sorted({variable_of.get(n, n) for n in changed})

    async def replace_optimizer(self, optimizer: Optimizer, names: Iterable[str]) -> list[str]:
        """Replaces the optimizer of existing variables by ``optimizer``, of any class, with fresh slots.

        What compiling a Keras model with a new optimizer does: e.g. a frozen
        layer's variables, created with ``SGD(learning_rate=1.0)``, train with
        ``Adam(1e-4)`` once the layer is unfrozen. Each variable's slots start
        as at creation and the optimizer's step count (bias correction,
        schedules; ``VariableInfo.iterations``) restarts at 0; values and
        versions are kept. All or nothing per shard; every piece of a
        partitioned variable is changed. Saved in checkpoints and made on a
        shard's backup too. Afterwards ``create`` is idempotent only with
        ``optimizer``. A retry replaces (and resets) again.

        >>> await client.replace_optimizer(psclient.Adam(1e-4), ["dense/kernel"])  # doctest: +SKIP

        Args:
            optimizer: the new server-side optimizer.
            names: the variables (user-visible names).

        Returns:
            The names of the variables changed, sorted.

        Raises:
            NotFoundError: a named variable does not exist.
            InvalidArgumentError: ``optimizer`` is not a psclient optimizer, or
                needs the whole variable (clipnorm, Adafactor, Lamb) for one cut
                into partitions.
            PSError: a shard failed.
        """
        if not isinstance(optimizer, Optimizer):
            raise InvalidArgumentError(
                f"replace_optimizer needs a psclient optimizer (psclient.Adam(...)), got {optimizer!r}"
            )
        names = list(dict.fromkeys(names))
        if not names:
            return []
        spec = optimizer.to_proto()
        pieces = await self._known(names)
        # Checked here too, so that a replacement refused on one shard is not made on another.
        for name, group in pieces.items():
            if optimizer.needs_whole_variable and len(group) > 1:
                raise InvalidArgumentError(
                    f"variable {name!r} is cut into {len(group)} partitions, but {optimizer!r} needs the "
                    "whole variable on one shard (clipnorm, Adafactor and Lamb use norms or means over it)"
                )
        per_shard: dict[int, list[str]] = {}
        for group in pieces.values():
            for piece in group:
                per_shard.setdefault(piece.shard, []).append(piece.stored_name)

        async def replace_on(shard: int, stored: list[str]) -> None:
            request = ps_pb2.UpdateOptimizerRequest(names=stored, optimizer=spec, reset=True)
            await self._shards[shard].unary("UpdateOptimizer", request)

        await _each(replace_on, per_shard)
        return sorted(pieces)

    # -- assign -------------------------------------------------------------

    async def assign(self, values: Mapping[str, np.ndarray]) -> None:
        """Sets variables to the given values, keeping their optimizer slots and step counts.

        For a worker whose values must win on the shards (Keras's
        ``EarlyStopping(restore_best_weights=True)``, loading weights into a
        running job). Each variable's version goes up by one. Applied at once in
        every mode (not part of a sync step or an ssp clock), all or nothing per
        shard, and made on a shard's backup before the call returns. Values of
        any size travel in chunks; a partitioned variable is split like a push.
        A retry sets the same values again, which is harmless.

        Shards that get non-finite values are sent theirs first, one at a
        time, so that a shard that refuses them leaves every other shard
        unchanged.

        >>> await client.assign({"dense/kernel": best_kernel})  # doctest: +SKIP

        Args:
            values: name -> value (same shape and dtype as the variable).

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: a shape or dtype mismatch, or non-finite values
                of a floating-point variable (unless the shards allow them).
            PSError: a shard failed.
        """
        if not values:
            return
        pieces = await self._known(list(values))
        per_shard = rq.split_by_shard(pieces, values, "value")

        async def assign_on(shard: int, tensors: list[tuple[str, np.ndarray]]) -> None:
            def messages() -> Iterable[codec.WireMessage]:
                for batch in codec.wire_batches(tensors, self.config.chunk_bytes):
                    yield codec.WireMessage(_EMPTY_ASSIGN, "values", batch)

            await self._shards[shard].unary_stream("Assign", messages)

        risky = {s: t for s, t in per_shard.items() if not all(_finite(a) for _, a in t)}
        for shard, tensors in risky.items():
            await assign_on(shard, tensors)
        await _each(assign_on, {s: t for s, t in per_shard.items() if s not in risky})

    # -- checkpoints --------------------------------------------------------

    async def save_checkpoint(
        self, *, consistent: bool = False, timeout: float | None = None
    ) -> list[ps_pb2.SaveCheckpointResponse]:
        """Makes every shard write a checkpoint now; returns when all are durable (one reply per shard).

        Each shard saves on its own, at its own instant, unless ``consistent``:
        then every shard holds new updates back at one cut of the whole cluster
        (a two-phase save, ``psclient._cut``): a push is in the checkpoint on all
        the shards it went to or on none, sync shards are all at one step
        boundary, and every file has the same id, so restoring them gives one
        version of the whole model. Training pauses for the hold (about the
        time of one push plus the snapshot; the files are written after it).

        Args:
            consistent: take one consistent cut of every shard.
            timeout: seconds the consistent save may take in all (default: the
                client's timeout); every hold ends by then, and on each shard by
                itself a second later should this client die.

        Raises:
            ConsistentCutError: (``consistent``) a shard was down, refused, or the
                deadline passed: the save was aborted, every hold released and
                any file already written deleted (its ``__cause__`` says why).
            FailedPreconditionError: a shard runs without ``--checkpoint-dir``.
            PSError: a shard failed.
        """
        if consistent:
            from psclient._cut import consistent_save

            return await consistent_save(self, self.config.timeout if timeout is None else timeout)
        request = ps_pb2.SaveCheckpointRequest()

        async def save_on(shard: int) -> ps_pb2.SaveCheckpointResponse:
            return await self._shards[shard].unary("SaveCheckpoint", request)

        return await gather(save_on(s) for s in range(self.num_shards))


def _check_optimizer_update(name: str, spec: ps_pb2.OptimizerSpec, params: Mapping[str, float]) -> None:
    """Raises InvalidArgumentError where a shard would refuse ``params`` for a variable with ``spec``."""
    if "learning_rate" in params and spec.HasField("learning_rate_schedule"):
        raise InvalidArgumentError(
            f"variable {name!r}: its learning rate is a schedule ({spec.learning_rate_schedule.name}), "
            "which cannot be set (as in Keras)"
        )
    new = ps_pb2.OptimizerSpec()
    new.CopyFrom(spec)
    new.params.update(params)
    try:
        optimizer_from_proto(new)
    except ValueError as err:
        raise InvalidArgumentError(f"variable {name!r}: {err}") from None


_KEY_TYPES = {"int64": ps_pb2.KEY_TYPE_INT64, "string": ps_pb2.KEY_TYPE_STRING}
_KEY_NAMES = {
    ps_pb2.KEY_TYPE_UNSPECIFIED: "int64",
    ps_pb2.KEY_TYPE_INT64: "int64",
    ps_pb2.KEY_TYPE_STRING: "string",
}
_EVICTIONS = {"lru": ps_pb2.EVICTION_LRU, "lfu": ps_pb2.EVICTION_LFU}
_MAX_MIN_COUNT = (1 << 16) - 1  # the shards' admission counters are 16-bit


def _regularizer_proto(
    name: str, regularizer: embedding.Regularizer | None, dynamic: bool
) -> ps_pb2.RowRegularizer | None:
    """The wire form of a table's regularizer (None for none, or one with zero weights).

    Raises:
        InvalidArgumentError: not a ``psclient.Regularizer``, or ``every_row`` on a dynamic table.
    """
    if regularizer is None:
        return None
    if not isinstance(regularizer, embedding.Regularizer):
        raise InvalidArgumentError(
            f"table {name!r}: regularizer must be a psclient.Regularizer, got {regularizer!r}"
        )
    if regularizer.every_row and dynamic:
        raise InvalidArgumentError(
            f"dynamic table {name!r}: the regularizer applies to the rows each push touches "
            "(every_row is for tables of fixed size)"
        )
    if not (regularizer.l1 or regularizer.l2):
        return None
    return ps_pb2.RowRegularizer(l1=regularizer.l1, l2=regularizer.l2, every_row=regularizer.every_row)


def _dynamic_options(
    name: str,
    dim: int,
    initializer: embedding.Initializer,
    key_type: str,
    capacity: int | None,
    min_count: int,
    eviction: str,
    ttl_steps: int | None,
    ttl_seconds: float | None,
) -> ps_pb2.DynamicTable:
    """The checked options of a dynamic table (without the shard index and count).

    Raises:
        InvalidArgumentError: an option out of range or of the wrong type (the message names it).
    """

    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"dynamic table {name!r}: {why}")

    if key_type not in _KEY_TYPES:
        raise bad(f"key_type {key_type!r} is not 'int64' or 'string'")
    if eviction not in _EVICTIONS:
        raise bad(f"eviction {eviction!r} is not 'lru' or 'lfu'")
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1
    ):
        raise bad(f"capacity must be an int >= 1 (or None: unbounded), got {capacity!r}")
    if (
        isinstance(min_count, bool)
        or not isinstance(min_count, int | np.integer)
        or not 1 <= min_count <= _MAX_MIN_COUNT
    ):
        raise bad(f"min_count must be an int in [1, {_MAX_MIN_COUNT}], got {min_count!r}")
    if ttl_steps is not None and (
        isinstance(ttl_steps, bool) or not isinstance(ttl_steps, int | np.integer) or ttl_steps < 1
    ):
        raise bad(f"ttl_steps must be an int >= 1 (or None: never), got {ttl_steps!r}")
    if ttl_seconds is not None and not (
        isinstance(ttl_seconds, int | float) and math.isfinite(ttl_seconds) and ttl_seconds > 0
    ):
        raise bad(f"ttl_seconds must be a number > 0 (or None: never), got {ttl_seconds!r}")
    try:
        kind, args = embedding.initializer_args(initializer)
    except ValueError as err:
        raise bad(str(err)) from None
    return ps_pb2.DynamicTable(
        table=name,
        dim=dim,
        key_type=_KEY_TYPES[key_type],
        capacity=int(capacity or 0),
        min_count=int(min_count),
        eviction=_EVICTIONS[eviction],
        ttl_steps=int(ttl_steps or 0),
        ttl_seconds=float(ttl_seconds or 0.0),
        initializer=ps_pb2.RowInitializer(name=kind, args=args),
    )


def _describe_table(spec: ps_pb2.VariableSpec) -> str:
    """A table piece's spec in words (for AlreadyExistsError)."""
    dtype = codec.numpy_dtype(spec.dtype).name
    opt = f"{spec.optimizer.name}{dict(spec.optimizer.params)}"
    if spec.HasField("table"):
        return f"a table of {spec.table.num_rows} x {spec.table.dim} {dtype} with {opt}"
    if not spec.HasField("dynamic"):
        return "it is not an embedding table"
    d = spec.dynamic
    init = (d.initializer.name, *d.initializer.args)
    return (
        f"a dynamic table of dim {d.dim} {dtype} with {opt}, {_KEY_NAMES[d.key_type]} keys, "
        f"capacity {d.capacity or None}, min_count {d.min_count}, "
        f"{ps_pb2.Eviction.Name(d.eviction).removeprefix('EVICTION_').lower()}, "
        f"ttl_steps {d.ttl_steps or None}, ttl_seconds {d.ttl_seconds or None}, initializer {init}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _PushPlan:
    """Where a push's gradients go (``AsyncPSClient._push_plan``)."""

    known: dict[str, list[rq.Piece]]  # every variable pushed -> its pieces
    pieces: dict[str, list[rq.Piece]]  # those pushed as arrays (not Rows) -> their pieces
    returned_tables: list[str]  # the tables pushed as Rows whose updated rows push_pull returns
    omit: dict[int, list[str]]  # per shard: the stored names of the tables whose rows are not returned
    per_shard: dict[int, list[tuple[str, np.ndarray]]]  # the wire tensors for each shard


class _PushAnswers:
    """What a push's shards answer: push_pull's values (arrays straight into a ``Gather``, a table's
    rows per shard) and the rows read with the push (``push_pull_lookup``).

    Args:
        pieces: the variables pushed as arrays, whose values push_pull returns.
        reading: the wire name of each set of rows read with the push -> its read and positions.
        take: ``ArrayPool.take`` for push_pull's arrays; None: a plain push (its values are dropped).
    """

    def __init__(
        self,
        pieces: dict[str, list[rq.Piece]],
        reading: dict[str, tuple[_RowRead, np.ndarray]],
        take: Callable[[int, np.dtype], np.ndarray] | None,
    ) -> None:
        self.into = rq.Gather(pieces, take) if take is not None else None
        self._pieces = pieces
        self._reading = reading
        self._row_parts: dict[int, codec.Assembler] = {}  # per shard: the rows it returned (push_pull)
        self._read_parts: set[str] = set()  # the wire names of the rows read so far

    def add(self, shard: int, chunk: Any) -> None:
        """One tensor of ``shard``'s answer: rows read, a table's updated rows, or a variable's value."""
        if chunk.name in self._reading:
            read, where = self._reading[chunk.name]
            read.fill(shard, where, chunk)
            self._read_parts.add(chunk.name)
            return
        if self.into is None:
            return
        if "\x00" in chunk.name:
            self._row_parts.setdefault(shard, codec.Assembler()).add(chunk)
        else:
            self.into.add(chunk)

    def restart(self, shard: int) -> None:
        """Forgets what ``shard`` answered so far: a retried attempt starts over."""
        if self.into is not None:
            self.into.restart(p for group in self._pieces.values() for p in group if p.shard == shard)
            self._row_parts.pop(shard, None)

    def read(self, shard: int, asked: list[ps_pb2.TensorChunk], values: list[Any]) -> None:
        """The answer of a Lookup for the rows of ``asked`` (a shard that got none of the push)."""
        for ids, chunk in zip(asked, values, strict=False):  # in the order asked
            name = embedding.lookup_name(ids.name)
            read, where = self._reading[name]
            read.fill(shard, where, chunk)
            self._read_parts.add(name)

    def check_read(self) -> None:
        """Raises CodecError if rows to read were not returned."""
        missing = set(self._reading) - self._read_parts
        if missing:
            raise codec.CodecError(f"rows of {sorted(missing)[0]!r} were not returned")

    def values(self, grads: Tensors, plan: _PushPlan) -> dict[str, Any]:
        """push_pull's values: name -> array, or ``Rows`` for a table (a string-keyed one's under its keys);
        a plain push's: none.

        Raises:
            CodecError: a shard did not return a table's rows.
        """
        if self.into is None:  # a plain push
            return {}
        values: dict[str, Any] = dict(self.into.result())
        values.update(_returned_rows(plan.returned_tables, plan.known, self._row_parts))
        for name, rows in values.items():  # a string-keyed table's rows come back under their keys
            if isinstance(rows, Rows) and plan.known[name][0].keys == "string":
                keys = np.asarray(grads[name].ids).reshape(-1)
                hashed, first = np.unique(embedding.hash_keys(keys), return_index=True)
                values[name] = Rows(keys[first[np.searchsorted(hashed, rows.ids)]], rows.values)
        return values


class _RowRead:
    """The rows of one table's ``ids`` being read (``lookup``, or a push's ``lookup``): the distinct ids,
    which shard holds which, and the result being filled in. ``distinct``: the caller's ids are distinct
    already (``tf.unique``'s), so they are not deduplicated again (a repeated id is then read twice).

    Raises (constructor): InvalidArgumentError: not a table, or bad ids (see ``_table_ids`` and
    ``_dynamic_ids``).
    """

    def __init__(
        self, name: str, group: list[rq.Piece], ids: Any, num_shards: int, what: str, distinct: bool = False
    ) -> None:
        if not group[0].table:
            raise InvalidArgumentError(f"{what}: {name!r} is not an embedding table")
        self.name = name
        num_rows, self.dim = group[0].full_shape
        if group[0].keys:
            arr = _dynamic_ids(name, ids, group[0].keys, what)
        else:
            arr = _table_ids(name, ids, num_rows, what)
        self.shape = arr.shape
        self.unique = arr.reshape(-1)
        self.inverse: np.ndarray | None = None
        if not distinct:
            self.unique, self.inverse = _unique_inverse(self.unique)
        self.out = np.empty((self.unique.size, self.dim), dtype=group[0].dtype)
        self.row_bytes = self.dim * self.out.itemsize
        u = self.unique
        shard_of = dynamic_row_shard(u, num_shards) if group[0].keys else u % num_shards
        self.per_shard: dict[int, tuple[rq.Piece, np.ndarray]] = {}
        for piece in group:
            where = np.flatnonzero(shard_of == piece.shard) if num_shards > 1 else np.arange(u.size)
            if where.size:
                self.per_shard[piece.shard] = (piece, where)

    def wire_ids(self, piece: rq.Piece, part: np.ndarray) -> ps_pb2.TensorChunk:
        """The request tensor of the distinct ids at positions ``part`` (all held by ``piece``)."""
        return codec.encode(piece.stored_name, _wire_ids(self.unique[part], piece))

    def fill(self, shard: int, part: np.ndarray, chunk: Any) -> None:
        """Stores the rows a shard returned for positions ``part``. Raises: CodecError (none, wrong shape)."""
        rows = codec.decode(chunk) if chunk is not None else None
        if rows is None or rows.shape != (part.size, self.dim):
            raise codec.CodecError(f"table {self.name!r}: shard {shard} returned rows of the wrong shape")
        self.out[part] = rows

    def result(self) -> np.ndarray:
        """The rows of the ids as asked: shape ``ids.shape + (dim,)`` (a new array)."""
        rows = self.out if self.inverse is None else self.out[self.inverse]
        return rows.reshape((*self.shape, self.dim))


def _unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` of 1-D ``ids`` (the same arrays), by ndarray methods: no
    Python wrapper of numpy's per call (np.unique walks eight).

    >>> u, inv = _unique_inverse(np.array([5, 3, 5, 9, 3]))
    >>> u.tolist(), inv.tolist()
    ([3, 5, 9], [1, 0, 1, 2, 0])
    """
    perm = ids.argsort()
    ordered = ids[perm]
    first = np.empty(ordered.shape, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(ordered.shape, dtype=np.intp)
    inverse[perm] = first.cumsum() - 1
    return ordered[first], inverse


def _dynamic_ids(name: str, ids: Any, keys: str, what: str) -> np.ndarray:
    """The int64 ids (shape kept) of a dynamic table's keys: integers, or hashed strings.

    Raises:
        InvalidArgumentError: strings for an int64-keyed table, anything else for a string-keyed one.
    """
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=object if _has_bytes(ids) else None)
    if keys == "string":
        if arr.dtype.kind not in "USO":
            raise InvalidArgumentError(
                f"{what} in table {name!r}: the table is keyed by strings; ids have dtype {arr.dtype.name} "
                "(pass the raw str or bytes keys)"
            )
        try:
            return embedding.hash_keys(arr)
        except TypeError as err:
            raise InvalidArgumentError(f"{what} in table {name!r}: {err}") from None
    if arr.dtype.kind in "USO":
        raise InvalidArgumentError(
            f"{what} in table {name!r}: the table is keyed by int64 ids; got strings "
            "(create it with key_type='string' for string keys)"
        )
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what} in table {name!r}: ids have dtype {arr.dtype.name}, not an integer"
        )
    return arr.astype(np.int64, copy=False)  # uint64 ids wrap to int64: 64-bit keys either way


def _has_bytes(ids: Any) -> bool:
    return isinstance(ids, list | tuple) and any(isinstance(i, bytes) for i in ids)


def _table_ids(name: str, ids: Any, num_rows: int, what: str) -> np.ndarray:
    """Checked ids of table ``name`` as an int64 array (their shape kept).

    Raises:
        InvalidArgumentError: not integers, or an id out of ``[0, num_rows)`` (the first one is named).
    """
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what} in table {name!r}: ids have dtype {arr.dtype.name}, not an integer"
        )
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr >= num_rows)
    if np.logical_or.reduce(bad, axis=None):  # bad.any(), without its Python wrapper
        first = int(arr.reshape(-1)[int(np.argmax(bad.reshape(-1)))])
        raise InvalidArgumentError(f"{what} in table {name!r}: id {first} is out of range [0, {num_rows})")
    return arr


def _wire_ids(ids: np.ndarray, piece: rq.Piece) -> np.ndarray:
    """Checked ids as they travel: int32 for a fixed table of up to 2**31 rows (half the bytes), or int64."""
    if not piece.keys and piece.full_shape[0] <= _INT32_IDS_MAX_ROWS:
        return ids.astype(np.int32)
    return np.ascontiguousarray(ids)


def _row_tensors(name: str, group: list[rq.Piece], grad: Rows) -> dict[int, list[tuple[str, np.ndarray]]]:
    """A ``Rows`` gradient as wire tensors per shard: every shard of the table gets its ids (maybe none).

    Duplicates are summed here; values are cast to the table's dtype.

    Raises:
        InvalidArgumentError: see ``_table_ids``; values not floating point, or not of
            shape ``ids.shape + (dim,)``.
    """
    num_rows, dim = group[0].full_shape
    if group[0].keys:
        ids = _dynamic_ids(name, grad.ids, group[0].keys, "row gradient")
    else:
        ids = _table_ids(name, grad.ids, num_rows, "row gradient")
    values = np.asarray(grad.values)
    if values.dtype.kind != "f":
        raise InvalidArgumentError(f"row gradient for table {name!r}: values have dtype {values.dtype.name}")
    if values.shape != (*ids.shape, dim):
        raise InvalidArgumentError(
            f"row gradient for table {name!r}: values have shape {values.shape}; ids have shape {ids.shape}, "
            f"so values must have shape {(*ids.shape, dim)} (one row of dim {dim} per id)"
        )
    unique, summed = embedding.sum_duplicates(ids.reshape(-1), values.reshape(-1, dim))
    summed = codec.as_wire_array(summed.astype(group[0].dtype, copy=False))
    out = {}
    shard_of = dynamic_row_shard(unique, group[0].count) if group[0].keys else unique % group[0].count
    for piece in group:
        if len(group) == 1:
            mine_ids, mine = unique, summed
        else:
            mask = shard_of == piece.index
            mine_ids, mine = unique[mask], summed[mask]
        out[piece.shard] = [
            (embedding.ids_name(piece.stored_name), _wire_ids(mine_ids, piece)),
            (embedding.values_name(piece.stored_name), np.ascontiguousarray(mine)),
        ]
    return out


def _returned_rows(
    names: list[str], known: Mapping[str, list[rq.Piece]], parts: Mapping[int, codec.Assembler]
) -> dict[str, Rows]:
    """The rows push_pull returned for each table, ids sorted. Raises: CodecError for a missing piece."""
    got = {shard: a.result() for shard, a in parts.items()}
    out = {}
    for name in names:
        ids, values = [], []
        for piece in known[name]:
            tensors = got.get(piece.shard, {})
            i = tensors.get(embedding.ids_name(piece.stored_name))
            v = tensors.get(embedding.values_name(piece.stored_name))
            if i is None or v is None:
                raise codec.CodecError(f"table {name!r}: shard {piece.shard} did not return its rows")
            ids.append(i)
            values.append(v)
        all_ids = np.concatenate(ids)
        order = np.argsort(all_ids, kind="stable")
        out[name] = Rows(all_ids[order], np.concatenate(values)[order])
    return out


_INLINE_INIT_BYTES = 4 << 20  # a table piece's initial values above this are computed in a thread
_INT32_IDS_MAX_ROWS = 2**31  # a fixed table's ids travel as int32 up to this many rows
_EMPTY_ASSIGN = ps_pb2.AssignRequest()
_EMPTY_CREATE = ps_pb2.CreateVariablesRequest()


def _finite(arr: np.ndarray) -> bool:
    """Whether every element is finite (always, for a dtype that is not floating point)."""
    return arr.dtype.kind != "f" or bool(np.isfinite(arr).all())


async def _each(fn: Callable[[int, Any], Awaitable[T]], per_shard: Mapping[int, Any]) -> list[T]:
    """``fn(shard, work)`` for every shard concurrently; a single shard is awaited directly (no tasks)."""
    if len(per_shard) == 1:
        ((shard, work),) = per_shard.items()
        return [await fn(shard, work)]
    return await gather(fn(s, w) for s, w in per_shard.items())


__all__ = ["AsyncPSClient", "PSError", "gather"]
