"""Embedding table pieces on a shard: row gradients, their validation, and row reads.

A table piece is a stored variable of shape ``[rows, dim]`` whose spec has a
``TableRows`` (see ``pscore.placement`` for the row rule), or one shard's
piece of a dynamic table (spec ``DynamicTable``: rows in a hash table,
``psserver.rows``). A row gradient
(``RowGrad``) arrives as two wire tensors (``pscore.embedding.ids_name`` /
``values_name``) and is paired here; the store validates it (``validate``)
before anything is claimed or applied, and applies it in place, row by row
(``Store.apply``).

A fixed table piece whose spec names an initializer (``TableRows.initializer``)
is created without values: the shard computes its rows (``initial_rows``), the
same values the client would have computed and sent, since each row is a
function of (table, row id) only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pscore import embedding
from pscore.errors import InvalidArgumentError
from pscore.placement import dynamic_row_shard, global_row
from psproto.v1 import ps_pb2


@dataclass(frozen=True, slots=True)
class RowGrad:
    """A row-sparse gradient of one table piece: distinct global ids (int64, sorted) and their values."""

    ids: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.values.nbytes


Grad = np.ndarray | RowGrad

_INIT_BLOCK_ELEMENTS = 1 << 20  # elements initialized at once: the float64/uint64 temporaries stay ~8 MiB


def made_here(spec: ps_pb2.VariableSpec) -> bool:
    """Whether the shard makes a fixed table piece's initial rows (its spec names an initializer)."""
    return spec.HasField("table") and spec.table.HasField("initializer")


def regularizer(spec: ps_pb2.VariableSpec) -> embedding.Regularizer | None:
    """A table piece's regularizer (``TableRows.regularizer`` / ``DynamicTable.regularizer``), or None.

    Raises:
        InvalidArgumentError: a negative or non-finite weight, or ``every_row`` on a dynamic table.
    """
    if spec.HasField("table"):
        msg = spec.table.regularizer if spec.table.HasField("regularizer") else None
    elif spec.HasField("dynamic"):
        msg = spec.dynamic.regularizer if spec.dynamic.HasField("regularizer") else None
    else:
        return None
    if msg is None:
        return None
    try:
        reg = embedding.Regularizer(l1=msg.l1, l2=msg.l2, every_row=msg.every_row)
    except ValueError as err:
        raise InvalidArgumentError(f"table {table_name(spec)!r}: {err}") from None
    if reg.every_row and spec.HasField("dynamic"):
        raise InvalidArgumentError(
            f"table {table_name(spec)!r}: a dynamic table's regularizer applies to the rows each push "
            "touches (every_row is for tables of fixed size)"
        )
    return reg if reg.l1 or reg.l2 else None


def rows_to_update(
    spec: ps_pb2.VariableSpec, rows: np.ndarray, values: np.ndarray, reg: embedding.Regularizer | None
) -> tuple[np.ndarray, np.ndarray]:
    """The local rows an update of ``rows`` changes, and their gradients: those rows, or with an
    ``every_row`` regularizer every row of the piece (zero gradient where nothing was pushed)."""
    if reg is None or not reg.every_row:
        return rows, values
    full = np.zeros((int(spec.table.rows), values.shape[1]), values.dtype)
    full[rows] = values
    return np.arange(full.shape[0], dtype=np.int64), full


def row_initializer(init: ps_pb2.RowInitializer) -> str | tuple[Any, ...]:
    """The ``pscore.embedding.init_rows`` initializer of a wire ``RowInitializer`` ("" is "uniform")."""
    name = init.name or "uniform"
    return (name, *init.args) if init.args else name


def initial_rows(spec: ps_pb2.VariableSpec, dtype: np.dtype) -> np.ndarray:
    """The initial rows of fixed table piece ``spec`` (checked) from its ``TableRows.initializer``.

    Exactly the rows ``init_rows`` gives for the piece's global row ids,
    computed a block of rows at a time into the result, so the temporaries stay
    small whatever the piece's size.

    Raises:
        ValueError: an unknown initializer.
    """
    t = spec.table
    init = row_initializer(t.initializer)
    embedding.check_initializer(init, t.table)
    out = np.empty((t.rows, t.dim), dtype)
    block = max(1, _INIT_BLOCK_ELEMENTS // max(1, t.dim))
    for start in range(0, t.rows, block):
        local = np.arange(start, min(start + block, t.rows), dtype=np.int64)
        out[start : start + local.size] = embedding.init_rows(
            t.table, global_row(local, t.index, t.count), t.dim, dtype, init
        )
    return out


def is_table(spec: ps_pb2.VariableSpec) -> bool:
    """Whether ``spec`` is a piece of an embedding table (fixed or dynamic)."""
    return spec.HasField("table") or spec.HasField("dynamic")


def table_name(spec: ps_pb2.VariableSpec) -> str:
    """The user-visible table of a table piece ("" for another variable)."""
    if spec.HasField("dynamic"):
        return spec.dynamic.table
    return spec.table.table if spec.HasField("table") else ""


def pair(tensors: Mapping[str, np.ndarray]) -> dict[str, Grad]:
    """Pairs the wire tensors of row gradients into ``RowGrad`` s (raw: validated later by ``validate``).

    Raises:
        InvalidArgumentError: ids without values or values without ids.
    """
    out: dict[str, Grad] = {}
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        if "\x00" not in name:  # a dense gradient (``embedding.split_wire_name``'s "" part), the common case
            out[name] = t
            continue
        stored, _, part = name.partition("\x00")  # embedding.split_wire_name, inline
        if not part:
            out[name] = t
        elif part in ("ids", "values"):
            parts.setdefault(stored, {})[part] = t
        else:
            raise InvalidArgumentError(f"tensor {name!r}: unknown row gradient part {part!r}")
    for stored, p in parts.items():
        if set(p) != {"ids", "values"}:
            raise InvalidArgumentError(
                f"row gradient for {stored!r} has {sorted(p)} but needs both ids and values"
            )
        if stored in out:
            raise InvalidArgumentError(f"push carries both a dense and a row gradient for {stored!r}")
        out[stored] = RowGrad(p["ids"], p["values"])
    return out


def wire_tensors(grads: Mapping[str, Grad]) -> list[tuple[str, np.ndarray]]:
    """The wire tensors of gradients (a ``RowGrad`` as its two tensors); inverse of ``pair``."""
    out: list[tuple[str, np.ndarray]] = []
    for name, g in grads.items():
        if isinstance(g, RowGrad):
            out += [(embedding.ids_name(name), g.ids), (embedding.values_name(name), g.values)]
        else:
            out.append((name, g))
    return out


def check_ids(spec: ps_pb2.VariableSpec, ids: np.ndarray, what: str) -> np.ndarray:
    """Validates global row ids for table piece ``spec``; returns them as int64.

    Raises:
        InvalidArgumentError: not a table, ids not integers or not 1-D, or an id out of
            range or held by another shard (the message names the table and the first bad id).
    """
    dynamic = spec.HasField("dynamic")
    if not (dynamic or spec.HasField("table")):  # is_table(spec), inline
        raise InvalidArgumentError(f"{what}: variable {spec.name!r} is not an embedding table")
    if ids.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what} for table {table_name(spec)!r}: ids have dtype {ids.dtype.name}, not an integer"
        )
    if ids.ndim != 1:
        raise InvalidArgumentError(
            f"{what} for table {table_name(spec)!r}: ids have shape {ids.shape}, not [n]"
        )
    ids = ids.astype(np.int64, copy=False)
    if dynamic:  # any 64-bit id; only the shard rule is checked
        d = spec.dynamic
        shard = dynamic_row_shard(ids, d.count)
        bad_shard = shard != d.index
        if np.logical_or.reduce(bad_shard, axis=None):  # bad_shard.any(), without its Python wrapper
            i = int(np.argmax(bad_shard))
            raise InvalidArgumentError(
                f"{what} for table {d.table!r}: id {int(ids[i])} is held by shard {int(shard[i])}, "
                f"not by this one (shard {d.index} of {d.count})"
            )
        return ids
    t = spec.table
    bad = (ids < 0) | (ids >= t.num_rows) | (ids % t.count != t.index)
    if np.logical_or.reduce(bad, axis=None):  # bad.any(), without its Python wrapper
        first = int(ids[int(np.argmax(bad))])
        if 0 <= first < t.num_rows:
            why = f"is held by shard {first % t.count}, not by this one (shard {t.index} of {t.count})"
        else:
            why = f"is out of range [0, {t.num_rows})"
        raise InvalidArgumentError(f"{what} for table {t.table!r}: id {first} {why}")
    return ids


def validate(spec: ps_pb2.VariableSpec, dtype: np.dtype, grad: RowGrad, *, allow_non_finite: bool) -> RowGrad:
    """Checks a row gradient for table piece ``spec``; returns it with duplicate ids summed.

    Raises:
        InvalidArgumentError: see ``check_ids``; values of another dtype, row count or dim;
            non-finite values (unless allowed).
    """
    ids = check_ids(spec, grad.ids, "row gradient")
    table = spec.dynamic if spec.HasField("dynamic") else spec.table  # table_name and _dim, inline
    name, dim = table.table, int(table.dim)
    values = grad.values
    if values.dtype != dtype:
        raise InvalidArgumentError(
            f"row gradient for table {name!r} has dtype {values.dtype.name}; the table has {dtype.name}"
        )
    if values.shape != (ids.size, dim):
        raise InvalidArgumentError(
            f"row gradient for table {name!r} has values of shape {values.shape} for {ids.size} ids; "
            f"expected {(ids.size, dim)} (one row of dim {dim} per id)"
        )
    if not allow_non_finite and not np.logical_and.reduce(np.isfinite(values), axis=None):  # no .all()
        bad = int(np.argmax(~np.isfinite(values).all(axis=1)))
        raise InvalidArgumentError(
            f"row gradient for table {name!r} has non-finite (NaN or Inf) values for id {int(ids[bad])}; "
            "rejected (start the shard with --allow-non-finite to apply them)"
        )
    ids, values = embedding.sum_duplicates(ids, values)
    return RowGrad(ids, values)


def scan_fixed(
    spec: ps_pb2.VariableSpec, value: np.ndarray, after: int | None, n: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """A fixed table piece's first ``n`` global ids ``> after`` (ascending), copies of their rows, and
    whether they are the last (``DynamicRows.scan`` for a fixed piece)."""
    t = spec.table
    start = 0 if after is None else max(0, (after - t.index) // t.count + 1)  # first local row past it
    stop = min(int(t.rows), start + n)
    start = min(start, stop)
    ids = global_row(np.arange(start, stop, dtype=np.int64), t.index, t.count)
    return ids, value[start:stop].copy(), stop >= t.rows


def local_rows(spec: ps_pb2.VariableSpec, ids: np.ndarray) -> np.ndarray:
    """The local row indices of validated global ids."""
    return ids // spec.table.count


def mean(grads: list[RowGrad], count: int) -> RowGrad:
    """The mean over ``count`` workers of row gradients (a row a worker did not push counts as zero)."""
    ids = np.concatenate([g.ids for g in grads])
    values = np.concatenate([g.values for g in grads])
    ids, values = embedding.sum_duplicates(ids, values)
    if count > 1:
        values = values / values.dtype.type(count)
    return RowGrad(ids, values)
