"""Embedding tables on the client: ``create_embedding``, ``lookup`` and ``export`` (``TableMethods``, a
base of ``AsyncPSClient``), the one options object of a dynamic table (``DynamicOptions``), and the
helpers that turn ids and row gradients into wire tensors per shard.

``DynamicOptions`` is what the async client, the sync client and ``psclient.keras.Embedding`` share:
its defaults are the keyword defaults of their signatures, and its ``check`` is the one place the
options are checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from psclient import _link
from psclient import _requests as rq
from psclient._fanout import each, gather
from psclient._wire import Op
from pscore import codec, embedding
from pscore.embedding import Rows
from pscore.errors import AlreadyExistsError, InvalidArgumentError
from pscore.optimizers import SGD, Optimizer
from pscore.placement import dynamic_pieces, dynamic_row_shard, global_row, table_pieces
from psproto.v1 import ps_pb2

if TYPE_CHECKING:
    from psclient.config import ClientConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamicOptions:
    """The options of a dynamic table (``create_embedding(name, None, dim, ...)``), as given.

    The defaults are a fixed table's: ``DynamicOptions()`` means "no dynamic option". Construction
    checks nothing (``psclient.keras.Embedding`` keeps what it was given until the worker attaches);
    ``check`` does, once for every caller.

    Attributes:
        key_type: ``"int64"`` (integer ids) or ``"string"`` (str/bytes keys, hashed).
        capacity: rows of the whole table at most, >= 1; None: unbounded.
        min_count: pushes of an id before it gets a row, in ``[1, 65535]``.
        eviction: ``"lru"`` or ``"lfu"`` (with a capacity).
        ttl_steps, ttl_seconds: remove rows not updated for this many pushes / seconds; None: never.
    """

    key_type: str = "int64"
    capacity: int | None = None
    min_count: int = 1
    eviction: str = "lru"
    ttl_steps: int | None = None
    ttl_seconds: float | None = None

    def is_default(self) -> bool:
        """Whether no option differs from its default (the only options a fixed table may have)."""
        return self == _NO_OPTIONS

    def kwargs(self) -> dict[str, Any]:
        """The options as ``create_embedding``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check(self, name: str) -> None:
        """Raises InvalidArgumentError (naming ``name`` and the option) for an option out of range or of
        the wrong type."""

        def bad(why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"dynamic table {name!r}: {why}")

        if self.key_type not in _KEY_TYPES:
            raise bad(f"key_type {self.key_type!r} is not 'int64' or 'string'")
        if self.eviction not in _EVICTIONS:
            raise bad(f"eviction {self.eviction!r} is not 'lru' or 'lfu'")
        if self.capacity is not None and not _is_int(self.capacity, 1):
            raise bad(f"capacity must be an int >= 1 (or None: unbounded), got {self.capacity!r}")
        if not (_is_int(self.min_count, 1) and self.min_count <= _MAX_MIN_COUNT):
            raise bad(f"min_count must be an int in [1, {_MAX_MIN_COUNT}], got {self.min_count!r}")
        if self.ttl_steps is not None and not _is_int(self.ttl_steps, 1):
            raise bad(f"ttl_steps must be an int >= 1 (or None: never), got {self.ttl_steps!r}")
        ttl_seconds = self.ttl_seconds
        if ttl_seconds is not None and not (
            isinstance(ttl_seconds, int | float) and math.isfinite(ttl_seconds) and ttl_seconds > 0
        ):
            raise bad(f"ttl_seconds must be a number > 0 (or None: never), got {ttl_seconds!r}")

    def proto(self, name: str, dim: int, initializer: embedding.Initializer) -> ps_pb2.DynamicTable:
        """The checked wire options of table ``name`` (without the shard index and count).

        Raises:
            InvalidArgumentError: see ``check``; a bad initializer.
        """
        self.check(name)
        try:
            kind, args = embedding.initializer_args(initializer)
        except ValueError as err:
            raise InvalidArgumentError(f"dynamic table {name!r}: {err}") from None
        return ps_pb2.DynamicTable(
            table=name,
            dim=dim,
            key_type=_KEY_TYPES[self.key_type],
            capacity=int(self.capacity or 0),
            min_count=int(self.min_count),
            eviction=_EVICTIONS[self.eviction],
            ttl_steps=int(self.ttl_steps or 0),
            ttl_seconds=float(self.ttl_seconds or 0.0),
            initializer=ps_pb2.RowInitializer(name=kind, args=args),
        )


_NO_OPTIONS = DynamicOptions()


def _is_int(value: Any, low: int) -> bool:
    """An int (not a bool) >= ``low``."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and value >= low


class TableMethods:
    """``AsyncPSClient``'s embedding-table methods (its base class; see the client for the attributes)."""

    config: ClientConfig
    registry: rq.Registry
    _shards: list[_link.ShardLink]

    if TYPE_CHECKING:  # the client's own methods these use

        @property
        def num_shards(self) -> int: ...

        async def list_variables(self, names: Iterable[str] = ()) -> dict[str, list[ps_pb2.VariableInfo]]: ...

        async def _known(self, names: Iterable[str] | None) -> dict[str, list[rq.Piece]]: ...

        async def _create_piece(
            self, shard: int, spec: ps_pb2.VariableSpec, value: np.ndarray | None
        ) -> bool: ...

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
        ``ttl_seconds`` are removed (see ``psserver.rows``). Admission,
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
        options = DynamicOptions(
            key_type=key_type, capacity=capacity, min_count=min_count, eviction=eviction,
            ttl_steps=ttl_steps, ttl_seconds=ttl_seconds,
        )  # fmt: skip
        return await self._create_embedding(
            name, num_rows, dim, dtype=dtype, optimizer=optimizer, initializer=initializer, options=options,
            regularizer=regularizer,
        )  # fmt: skip

    async def _create_embedding(
        self,
        name: str,
        num_rows: int | None,
        dim: int,
        *,
        dtype: Any,
        optimizer: Optimizer | None,
        initializer: embedding.Initializer,
        options: DynamicOptions,
        regularizer: embedding.Regularizer | None,
    ) -> bool:
        """``create_embedding`` with its dynamic-table options in one object (the sync client's way in)."""
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
            wire = options.proto(name, dim, initializer)
            if reg is not None:
                wire.regularizer.CopyFrom(reg)
            return await self._create_dynamic(name, dim, dt, wanted, wire)
        if not options.is_default():
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
        read = RowRead(name, group, ids, len(self._shards), "lookup", distinct)
        batch_rows = max(1, self.config.unary_max_bytes // max(1, read.row_bytes))
        per_shard = read.per_shard
        if len(per_shard) == 1:  # one shard, one request (the common case): no task, no closure
            ((shard, (piece, where)),) = per_shard.items()
            if where.size <= batch_rows:
                await self._read_rows(read, shard, piece, where, step)
                return read.result()

        async def lookup_on(shard: int, work: tuple[rq.Piece, np.ndarray]) -> None:
            piece, where = work
            for start in range(0, where.size, batch_rows):
                await self._read_rows(read, shard, piece, where[start : start + batch_rows], step)

        await each(lookup_on, per_shard) if per_shard else None
        return read.result()

    async def _read_rows(
        self, read: RowRead, shard: int, piece: rq.Piece, part: np.ndarray, step: int
    ) -> None:
        """One Lookup of the rows of ``read`` at positions ``part`` (all held by ``piece`` on ``shard``),
        filled in. Raises: PSError, as the Lookup call."""
        request = ps_pb2.LookupRequest(
            ids=[read.wire_ids(piece, part)], worker_id=self.config.worker_id, step=step
        )
        rows: list[Any] = []
        # With the rows' bytes: a small lookup shares a frame with this process's other small requests to
        # the shard (``ShardLink.request``).
        await self._shards[shard].request(
            Op.LOOKUP,
            request,
            (),
            _link.Sink(rows.append, restart=rows.clear),
            nbytes=part.size * read.row_bytes,
        )
        read.fill(shard, part, rows[0] if len(rows) == 1 else None)

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


class RowRead:
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


def row_tensors(name: str, group: list[rq.Piece], grad: Rows) -> dict[int, list[tuple[str, np.ndarray]]]:
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
    summed = summed.astype(group[0].dtype, copy=False)
    if summed.dtype.byteorder == ">" or not summed.flags.c_contiguous:  # a wire array already, mostly
        summed = codec.as_wire_array(summed)
    out = {}
    shard_of = dynamic_row_shard(unique, group[0].count) if group[0].keys else unique % group[0].count
    for piece in group:
        if len(group) == 1:
            mine_ids, mine = unique, summed
        else:
            mask = shard_of == piece.index
            mine_ids, mine = unique[mask], summed[mask]
        out[piece.shard] = [  # embedding.ids_name and values_name, inline
            (piece.stored_name + embedding.IDS_SUFFIX, _wire_ids(mine_ids, piece)),
            (piece.stored_name + embedding.VALUES_SUFFIX, np.ascontiguousarray(mine)),
        ]
    return out


def returned_rows(
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


__all__ = ["DynamicOptions", "RowRead", "TableMethods", "returned_rows", "row_tensors"]
