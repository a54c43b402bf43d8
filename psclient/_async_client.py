"""AsyncPSClient: the parameter-server client on grpc.aio (one channel per shard, concurrent fan-out)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from psclient import _bulk, _link
from psclient import _requests as rq
from psclient._fanout import each, gather
from psclient._requests import PushedValues
from psclient._tables import RowRead, TableMethods, returned_rows, row_tensors
from psclient._wire import Op
from psclient.config import ClientConfig
from pscore import codec, embedding
from pscore.embedding import Rows
from pscore.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, PSError
from pscore.optimizers import SGD, Optimizer, optimizer_from_proto
from pscore.placement import plan
from psproto.v1 import ps_pb2

log = logging.getLogger(__name__)

Tensors = Mapping[str, Any]  # name -> array-like, or psclient.Rows for an embedding table


class AsyncPSClient(TableMethods):
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
            await self._await_pieces(missing)
        return self.registry.resolve(names)

    async def _await_pieces(self, names: Sequence[str]) -> None:
        """Waits, up to the client's timeout, until each of ``names`` found partly on the shards is whole.

        A variable cut over the shards (or a table) is created piece by piece, each on its shard at once:
        a listing can find some of the pieces of one that another client is creating (every worker of a
        job creates the model at start). Names with no piece at all are left to the caller.

        Raises:
            NotFoundError: a variable still partly there at the deadline (its creator failed mid-way).
        """
        pieces = self.registry.pieces
        partial = [n for n in names if n in pieces and not self.registry.complete(n)]
        deadline = time.monotonic() + self.config.timeout
        delay = 0.005
        while partial:
            if time.monotonic() + delay > deadline:
                group = pieces[partial[0]]
                shards = sorted({p.shard for p in group})
                raise NotFoundError(
                    f"variable {partial[0]!r} is only partly on the shards after {self.config.timeout:g} s: "
                    f"{len(group)} of its {group[0].count} pieces (on shards {shards}); "
                    "the client that created it failed before it created the rest"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
            await self.list_variables(partial)
            partial = [n for n in partial if not self.registry.complete(n)]

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
        await self._await_pieces(list(existing))  # another client's create of the same ones, in progress
        created = {n: False for n in arrays if n in existing}
        for n in created:
            self._check_existing(n, arrays[n], opts[n], existing[n])
        # The new ones go where a plan of the whole batch puts them, not a plan of the new ones alone: every
        # worker of a job creates the model at start, and one whose listing found part of the batch there
        # (another worker's creates in flight) placed the rest by its own plan, on other shards than the
        # other worker was creating them on: those variables then stood twice, the workers pushing into
        # different copies, and some shards held twice the others' bytes (n = k = 16 async, 30 Mbit/s:
        # 6 of 16 workers sent 2.3x as much to 4 shards, 0.76 of the link bound; bench/results/
        # scaling_2026-12-07e/). One plan of the batch is the same in every worker.
        whole = {n for n in arrays if opts[n].needs_whole_variable}  # clipnorm, Adafactor, Lamb: never cut
        batch = plan({n: (a.shape, a.dtype) for n, a in arrays.items()}, self.num_shards,
                     self.config.partition_bytes, whole)  # fmt: skip
        placement = {n: pieces for n, pieces in batch.items() if n not in existing}
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

        Each stored tensor is read at one version, never half of a push. A variable
        cut over the shards (``partition_bytes``) is read piece by piece, each at its
        shard's version, so beside pushes its pieces can differ by the pushes in
        flight (as TensorFlow's partitioned variables); ``save_checkpoint(consistent=True)``
        gives one version of the whole model.

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
        into = rq.Gather(pieces, self._pool.take, self._pool.min_bytes)

        async def pull_from(shard: int, wanted: list[rq.Piece]) -> None:
            request = ps_pb2.PullRequest(
                names=[p.stored_name for p in wanted], worker_id=self.worker_id, step=step,
                max_chunk_bytes=self.config.chunk_bytes, ema=ema,
            )  # fmt: skip
            sink = (  # one shard's answer holds all of it: the Gather is the sink itself
                into
                if len(per_shard) == 1
                else _link.Sink(into.add, into.place, functools.partial(into.restart, wanted))
            )
            answer = await self._shards[shard].request(
                Op.PULL, request, (), sink, nbytes=sum(p.nbytes for p in wanted)
            )
            into.add_versions(answer.versions)

        await each(pull_from, per_shard)
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
        parts: int = 1,
    ) -> PushedValues:
        """Pushes gradients and returns the updated values of those variables, in one round trip per shard.

        Args:
            grads, step, every_shard: as ``push``.
            return_rows: which tables' updated rows to return: True (all), False
                (none: a caller that reads them by ``lookup`` anyway saves the bytes),
                or the names of the tables whose rows it needs. The push itself, and
                in ssp mode the wait for the staleness bound, are the same either way.
            parts: sync mode: each shard's gradients go as ``parts`` pushes (about equal
                bytes, cut by stored name: ``_requests.split_parts``) for the shard's steps
                ``step * parts`` to ``step * parts + parts - 1``, every shard's at once and each
                shard's one after the other, so that a shard applies and answers the first part
                once every worker's first part is in, while the later parts still arrive (one push
                of the whole applies and answers nothing before all of it is in). Each part is a sync step of
                its own on the shard: applied once, as the mean of the same workers' gradients
                (all workers, with ``replicas_to_aggregate == total_replicas``); so every worker
                must push with the same ``parts`` and variables, and the shards count ``parts``
                steps per step (``GetStatus.step``; a periodic checkpoint may fall between two
                parts). Async and ssp modes: each part is a push of its own, applied as it comes (a
                shard holding fewer tensors than ``parts`` gets empty parts, answered as applied).
                Arrays only (no ``Rows``). Default 1: one push per shard.

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
            grads,
            step=step,
            return_values=True,
            every_shard=every_shard,
            return_rows=return_rows,
            parts=parts,
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
        parts: int = 1,
    ) -> tuple[bool, dict[str, Any], dict[str, np.ndarray]]:
        """``push``, ``push_pull`` and ``push_pull_lookup``: one push to every shard concerned, each part
        over its own wire (``parts``: see ``push_pull``); returns whether every shard applied it, push_pull's
        values and the rows read."""
        if parts != 1 or type(parts) is not int:  # True == 1
            _check_parts(parts, grads, lookup)
        reads: dict[str, RowRead] = {}
        if lookup:
            groups = await self._known(list(lookup))
            what = "lookup with a push"
            reads = {
                n: RowRead(n, groups[n], ids, self.num_shards, what, distinct) for n, ids in lookup.items()
            }
        plan = await self._push_plan(grads, return_rows, every_shard)
        per_shard = plan.per_shard
        # Rows to read: with the push to their shard, or by a Lookup where nothing is pushed.
        reading: dict[str, tuple[RowRead, np.ndarray]] = {}  # wire name -> its read and positions
        lookup_ids: dict[int, list[ps_pb2.TensorChunk]] = {}
        for read in reads.values():
            for shard, (piece, where) in read.per_shard.items():
                lookup_ids.setdefault(shard, []).append(read.wire_ids(piece, where))
                reading[embedding.lookup_name(piece.stored_name)] = (read, where)
        seq = next(self._seq)
        # Every shard's piece of the push names them all: a consistent cut holds it on all or none.
        shards = sorted(per_shard) if len(per_shard) > 1 else []
        answers = None  # a plain push keeps nothing of its answers
        # push_pull's arrays from one shard, no table's rows among them: their Gather is the sink itself
        whole = None
        if (
            return_values
            and not reading
            and parts == 1
            and len(per_shard) == 1
            and len(plan.pieces) == len(plan.known)
        ):
            whole = rq.Gather(plan.pieces, self._pool.take, self._pool.min_bytes)
        elif return_values or reading:
            answers = _PushAnswers(plan.pieces, reading, self._pool if return_values else None)

        def push_to(
            shard: int, tensors: list[tuple[str, np.ndarray]], part: tuple[int, int] | None = None
        ) -> Awaitable[_link.Answer]:
            """One shard's part of the push: its answer, to await. push_pull's values come straight into
            the arrays of ``answers.into`` (over the data port; embedding rows, and values over gRPC,
            through ``answers.add``). ``part``: ``(its step, its seq)`` for one of ``parts`` pushes."""
            # The fields that are set, only: an empty list given to the constructor costs about as much as
            # the message itself (upb), and most pushes leave five of the nine fields at their defaults.
            part_step, part_seq = part if part is not None else (step, seq)
            header = ps_pb2.PushRequest(worker_id=self.config.worker_id, seq=part_seq, session=self.session)
            if part_step:
                header.step = part_step
            if part is not None:
                header.parts = parts
            if shards:
                header.shards.extend(shards)
            if self._checkpoint_step:
                header.checkpoint_step = self._checkpoint_step
            if return_values:
                header.return_values = True
                if shard in plan.omit:
                    header.omit_values.extend(plan.omit[shard])
            if shard in lookup_ids:
                header.lookup_ids.extend(lookup_ids[shard])
            sink: _link.Sink | rq.Gather | None = whole  # None: a plain push (the link's discarding sink)
            if answers is not None:
                place = answers.into.place if answers.into is not None else None
                names = None if part is None else {name for name, _ in tensors}  # a retry restarts its own
                sink = _link.Sink(
                    functools.partial(answers.add, shard),
                    place,
                    functools.partial(answers.restart, shard, names),
                )
            return self._shards[shard].request(Op.PUSH, header, tensors, sink)  # no frame of its own

        async def read_only(shard: int, chunks: list[ps_pb2.TensorChunk]) -> None:
            request = ps_pb2.LookupRequest(ids=chunks, worker_id=self.worker_id, step=step + 1)
            assert answers is not None  # rows to read: made
            answers.read(shard, chunks, await self._lookup_call(shard, request))

        if parts > 1:  # every shard's parts at once, each shard's in turn (``_bulk.PART_NOTSENT_LOWAT``)
            order = sorted(per_shard)
            first = self._first_turn % len(order)
            order = order[first:] + order[:first]
            cut = {shard: rq.split_parts(per_shard[shard], parts) for shard in order}
            calls_in_order = []
            for g in range(parts):
                part = (step * parts + g, seq if g == 0 else next(self._seq))
                calls_in_order += [push_to(shard, cut[shard][g], part) for shard in order]
            token = _bulk.IN_PARTS.set(True)  # the parts' tasks take the part's turn rule (_bulk)
            try:
                results = await gather(calls_in_order)
            finally:
                _bulk.IN_PARTS.reset(token)
        elif len(per_shard) == 1 and not lookup_ids:  # one shard, nothing else to read: no tasks, no tables
            ((shard, tensors),) = per_shard.items()
            results = [await push_to(shard, tensors)]
        else:
            order = sorted(per_shard)
            if len(order) > 1:  # the parts go up in turn (``_bulk.Uplink``), from this worker's own shard on
                first = self._first_turn % len(order)
                order = order[first:] + order[:first]
            work: dict[int, Any] = {shard: per_shard[shard] for shard in order}
            calls: dict[int, Callable[[int, Any], Awaitable[Any]]] = dict.fromkeys(per_shard, push_to)
            for shard, chunks in lookup_ids.items():
                if shard not in per_shard:
                    work[shard], calls[shard] = chunks, read_only
            results = await each(lambda shard, w: calls[shard](shard, w), work) if work else []
            results = [r for shard, r in zip(work, results, strict=True) if shard in per_shard]
        applied = True
        for answer in results:  # the shards' answers: whether each applied it, the checkpoint step announced
            applied = applied and answer.applied
            if answer.checkpoint_step > self._checkpoint_step:
                self._checkpoint_step = answer.checkpoint_step
        if answers is not None and reading:
            answers.check_read()
        looked_up = {name: read.result() for name, read in reads.items()} if reads else {}
        if whole is not None:
            return applied, whole.result(), looked_up
        if answers is None or not return_values:
            return applied, {}, looked_up
        return applied, answers.values(grads, plan), looked_up

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
                for shard, tensors in row_tensors(name, group, grads[name]).items():
                    per_shard.setdefault(shard, []).extend(tensors)
        if every_shard:
            for shard in range(self.num_shards):
                per_shard.setdefault(shard, [])
        returned = []  # a loop, not a comprehension: no call per push
        for n in row_tables:
            if n not in omitted:
                returned.append(n)
        return _PushPlan(known=known, pieces=pieces, returned_tables=returned, omit=omit, per_shard=per_shard)

    async def _create_piece(self, shard: int, spec: ps_pb2.VariableSpec, value: np.ndarray | None) -> bool:
        """Creates one stored tensor (``value`` None: a piece whose rows the shard makes); True if created."""

        def messages() -> Iterable[ps_pb2.CreateVariablesRequest | codec.WireMessage]:
            yield ps_pb2.CreateVariablesRequest(variables=[spec])
            if value is not None:
                for batch in codec.wire_batches([(spec.name, value)], self.config.chunk_bytes):
                    yield codec.WireMessage(_EMPTY_CREATE, "values", batch)

        resp = await self._shards[shard].unary_stream("CreateVariables", messages)
        return bool(resp.created[0])

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

        changed = [n for names_ in await each(update_on, per_shard) for n in names_]
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

        await each(replace_on, per_shard)
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
        await each(assign_on, {s: t for s, t in per_shard.items() if s not in risky})

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


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__ (one a push).
@dataclass(slots=True, kw_only=True)
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
        pool: the ``ArrayPool`` of push_pull's arrays; None: a plain push (its values are dropped).
    """

    def __init__(
        self,
        pieces: dict[str, list[rq.Piece]],
        reading: dict[str, tuple[RowRead, np.ndarray]],
        pool: rq.ArrayPool | None,
    ) -> None:
        self.into = rq.Gather(pieces, pool.take, pool.min_bytes) if pool is not None else None
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

    def restart(self, shard: int, names: set[str] | None = None) -> None:
        """Forgets what ``shard`` answered so far (``names``: of these stored tensors only, a push in parts
        whose other parts were answered): a retried attempt starts over."""
        if self.into is not None and (self.into.arrived or self._row_parts):  # a first attempt: nothing
            self.into.restart(
                p
                for group in self._pieces.values()
                for p in group
                if p.shard == shard and (names is None or p.stored_name in names)
            )
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
        values: dict[str, Any] = self.into.result()  # a dict of its own
        if not plan.returned_tables:  # arrays only: no rows, none under keys
            return values
        values.update(returned_rows(plan.returned_tables, plan.known, self._row_parts))
        for name, rows in values.items():  # a string-keyed table's rows come back under their keys
            if isinstance(rows, Rows) and plan.known[name][0].keys == "string":
                keys = np.asarray(grads[name].ids).reshape(-1)
                hashed, first = np.unique(embedding.hash_keys(keys), return_index=True)
                values[name] = Rows(keys[first[np.searchsorted(hashed, rows.ids)]], rows.values)
        return values


_EMPTY_ASSIGN = ps_pb2.AssignRequest()
_EMPTY_CREATE = ps_pb2.CreateVariablesRequest()


def _check_parts(parts: int, grads: Tensors, lookup: Mapping[str, Any] | None) -> None:
    """Raises InvalidArgumentError unless a push may go in ``parts`` parts (``push_pull``)."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise InvalidArgumentError(f"parts must be an int >= 1, got {parts!r}")
    if lookup:
        raise InvalidArgumentError("a push in parts reads no rows (lookup): push_pull_lookup takes no parts")
    for name, grad in grads.items():
        if isinstance(grad, Rows):
            raise InvalidArgumentError(f"a push in parts takes arrays only; {name!r} is psclient.Rows")


def _finite(arr: np.ndarray) -> bool:
    """Whether every element is finite (always, for a dtype that is not floating point)."""
    return arr.dtype.kind != "f" or bool(np.isfinite(arr).all())


__all__ = ["AsyncPSClient", "PSError", "gather"]
