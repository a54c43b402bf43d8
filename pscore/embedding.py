"""Embedding tables: row-sparse gradients (``Rows``), duplicate summing, and per-row initializers.

Pure numpy, shared by the client and the shards (psserver imports it for the
wire names of row gradients and for ``sum_duplicates``).

A row gradient travels as two tensors named after the table piece it updates
(``ids_name`` and ``values_name``: the piece's stored name plus a NUL-separated
suffix, which no variable name has), so the push chunking and framing of dense
gradients carry it unchanged.

>>> r = Rows([3, 1, 3], np.ones((3, 2), np.float32))
>>> ids, values = sum_duplicates(r.ids, r.values)
>>> ids, values
(array([1, 3]), array([[1., 1.],
       [2., 2.]], dtype=float32))
>>> init_rows("emb", np.array([7]), 2, np.float32, "zeros")
array([[0., 0.]], dtype=float32)

Dynamic tables keyed by strings hash each key to an int64 id with
``hash_keys``: BLAKE2b with an 8-byte digest of the key's UTF-8 bytes (``bytes``
keys as they are), read as a little-endian signed int64. It is the same on
every process, platform and restart (no ``PYTHONHASHSEED``):

>>> hash_keys(["user:42", b"user:42"])
array([-9028972112616151079, -9028972112616151079])
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

IDS_SUFFIX = "\x00ids"
VALUES_SUFFIX = "\x00values"
LOOKUP_SUFFIX = "\x00lookup"

# An initializer: "zeros", "ones", "uniform" (Keras's Embedding default, U(-0.05, 0.05)),
# ("uniform", minval, maxval), "normal" (N(0, 0.05)), ("normal", stddev) or ("normal", mean, stddev),
# or a callable ``f(row_ids, dim, dtype) -> array of shape [len(row_ids), dim]`` that must give a
# row the same values whoever calls it (e.g. seeded from the row id).
Initializer = str | tuple[Any, ...] | Callable[[np.ndarray, int, np.dtype], Any]

_DEFAULT_SCALE = 0.05  # Keras's RandomUniform(-0.05, 0.05) / RandomNormal(stddev=0.05)


@dataclass(frozen=True, slots=True)
class Rows:
    """A row-sparse gradient (or the rows ``push_pull`` returns) of an embedding table.

    ``values[k]`` belongs to row ``ids[k]``; ``values.shape == ids.shape + (dim,)``.
    Duplicate ids are summed before the push.

    Example:
        c.push({"emb": psclient.Rows(ids=np.array([3, 7, 3]), values=grads)})  # row 3 gets both
    """

    ids: Any
    values: Any


@dataclass(frozen=True, slots=True)
class Regularizer:
    """An L1/L2 regularizer of a table's rows, applied by the shards (Keras's ``embeddings_regularizer``).

    Its gradient ``l1 * sign(w) + 2 * l2 * w`` is added to a row's gradient before the
    optimizer's rule, on the shard that holds the row, so a regularized table still
    sends only the rows a step touches. Which rows get it on each update:

    - ``every_row=False`` (the default, the *lazy* rule of embedding systems): the rows the
      update touches. Costs nothing extra; a row no batch reads is not decayed.
    - ``every_row=True`` (*exact*): every row of the table, as a dense Keras update with
      the regularizer in the loss does; the shard then updates its whole piece on every
      push (fixed-size tables only).

    Example:
        c.create_embedding("users", 10**6, 32, regularizer=psclient.Regularizer(l2=1e-6))

    >>> Regularizer(l2=0.5).gradient(np.array([[1.0, -2.0]], np.float32))
    array([[ 1., -2.]], dtype=float32)
    """

    l1: float = 0.0
    l2: float = 0.0
    every_row: bool = False

    def __post_init__(self) -> None:
        for field in ("l1", "l2"):
            value = getattr(self, field)
            if not isinstance(value, int | float | np.floating) or not np.isfinite(value) or value < 0:
                raise ValueError(f"Regularizer: `{field}` must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, field, float(value))
        object.__setattr__(self, "every_row", bool(self.every_row))

    def gradient(self, rows: np.ndarray) -> np.ndarray:
        """The regularizer's gradient at ``rows`` (same shape and dtype)."""
        out = np.zeros_like(rows)
        if self.l1:
            out += rows.dtype.type(self.l1) * np.sign(rows)
        if self.l2:
            out += rows.dtype.type(2.0 * self.l2) * rows
        return out


def ids_name(stored: str) -> str:
    """The wire name of a row gradient's ids for table piece ``stored``."""
    return stored + IDS_SUFFIX


def values_name(stored: str) -> str:
    """The wire name of a row gradient's values for table piece ``stored``."""
    return stored + VALUES_SUFFIX


def lookup_name(stored: str) -> str:
    """The wire name of the rows a push read for table piece ``stored`` (``PushRequest.lookup_ids``)."""
    return stored + LOOKUP_SUFFIX


def split_wire_name(name: str) -> tuple[str, str]:
    """``(stored name, "ids" | "values" | "lookup" | "")`` of a wire tensor name ("": a dense tensor)."""
    stored, sep, part = name.partition("\x00")
    return (stored, part) if sep else (name, "")


def sum_duplicates(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sums the values of equal ids; returns the distinct ids (sorted) and their sums.

    Args:
        ids: integer ids, shape ``[n]``.
        values: shape ``[n, dim]``.

    Rows of one id are added in their order in ``ids`` (deterministic). Ids already strictly
    increasing (what a client sends a shard) are returned with ``values`` as they are: no sort, no copy.
    """
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0:
        return ids, np.asarray(values).reshape(0, *np.shape(values)[1:])
    if np.logical_and.reduce(np.greater(ids[1:], ids[:-1]), axis=None):  # .all(), without its wrapper
        return ids, values
    order = ids.argsort(kind="stable")  # ndarray methods, not numpy's Python wrappers (np.argsort...)
    sorted_ids = ids[order]
    first = np.empty(sorted_ids.shape, dtype=bool)  # where a run of equal ids starts (no np.concatenate)
    first[:1] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = first.nonzero()[0]
    unique = sorted_ids[starts]
    if unique.size == ids.size:
        return unique, values[order]
    return unique, np.add.reduceat(values[order], starts, axis=0)


def _seed(table: str) -> int:
    return zlib.crc32(table.encode("utf-8"))


def _uniform01(table: str, rows: np.ndarray, dim: int, stream: int = 0) -> np.ndarray:
    """Uniform [0, 1) doubles, shape ``[len(rows), dim]``, a function of (table, row, column, stream) only.

    A counter-based hash (splitmix64 of the element's global index and the
    table's seed), so any process, any shard count and any subset of rows get
    the same values for a row.
    """
    rows = np.asarray(rows, dtype=np.uint64).reshape(-1, 1)
    cols = np.arange(dim, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        x = rows * np.uint64(max(dim, 1)) + cols
        x = x * np.uint64(2) + np.uint64(stream)
        x ^= np.uint64(_seed(table)) << np.uint64(32)
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def hash_keys(keys: Any) -> np.ndarray:
    """The int64 ids of string keys (any shape; ``str`` or ``bytes``): see the module docs.

    Raises:
        TypeError: a key that is neither ``str`` nor ``bytes``.
    """
    arr = np.asarray(keys, dtype=object) if not isinstance(keys, np.ndarray) else keys
    if arr.dtype.kind not in "USO":
        raise TypeError(f"string keys expected, got an array of {arr.dtype.name}")
    digests = []
    for key in arr.reshape(-1).tolist():
        if isinstance(key, str):
            key = key.encode("utf-8")
        elif not isinstance(key, bytes):
            raise TypeError(f"key {key!r} ({type(key).__name__}) is not a str or bytes")
        digests.append(hashlib.blake2b(key, digest_size=8).digest())
    return np.frombuffer(b"".join(digests), dtype="<i8").astype(np.int64).reshape(arr.shape)


def initializer_args(initializer: Initializer) -> tuple[str, tuple[float, ...]]:
    """A named initializer as ``(name, args)`` (its wire form ``ps_pb2.RowInitializer``).

    >>> initializer_args(("uniform", -1, 1)), initializer_args("normal")
    (('uniform', (-1.0, 1.0)), ('normal', ()))

    Raises:
        ValueError: a callable (it cannot travel to the shards), or an unknown initializer.
    """
    if callable(initializer):
        raise ValueError(
            "a dynamic table's rows are created on the shards: its initializer must be a name "
            "('zeros', 'ones', 'uniform', 'normal') or a tuple such as ('uniform', -0.1, 0.1), not a callable"
        )
    check_initializer(initializer)
    kind, *args = (initializer,) if isinstance(initializer, str) else tuple(initializer)
    return str(kind).lower(), tuple(float(a) for a in args)


def check_initializer(initializer: Initializer, table: str = "check") -> None:
    """Raises ValueError (naming ``table``) for an initializer ``init_rows`` does not know."""
    if callable(initializer):  # called with the table's real ids and dim when it is created
        return
    init_rows(table, np.zeros(1, np.int64), 1, np.dtype(np.float32), initializer)


def init_rows(table: str, rows: np.ndarray, dim: int, dtype: Any, initializer: Initializer) -> np.ndarray:
    """The initial values of rows ``rows`` of table ``table``: deterministic per (table, row).

    Raises:
        ValueError: an unknown initializer, or a callable's result of the wrong shape.
    """
    dtype = np.dtype(dtype)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    n = rows.size
    if callable(initializer):
        out = np.asarray(initializer(rows, dim, dtype), dtype=dtype)
        if out.shape != (n, dim):
            raise ValueError(f"table {table!r}: the initializer returned shape {out.shape}, not {(n, dim)}")
        return np.ascontiguousarray(out)
    kind, *args = (initializer,) if isinstance(initializer, str) else tuple(initializer)
    kind = str(kind).lower()
    if kind == "zeros" and not args:
        return np.zeros((n, dim), dtype)
    if kind == "ones" and not args:
        return np.ones((n, dim), dtype)
    if kind in ("uniform", "random_uniform") and len(args) in (0, 2):
        lo, hi = (float(args[0]), float(args[1])) if args else (-_DEFAULT_SCALE, _DEFAULT_SCALE)
        return (lo + (hi - lo) * _uniform01(table, rows, dim)).astype(dtype)
    if kind in ("normal", "random_normal") and len(args) in (0, 1, 2):
        mean, stddev = (0.0, _DEFAULT_SCALE) if not args else (0.0, args[0]) if len(args) == 1 else args
        u1 = _uniform01(table, rows, dim, 0)
        u2 = _uniform01(table, rows, dim, 1)
        z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller; 1 - u1 is in (0, 1]
        return (float(mean) + float(stddev) * z).astype(dtype)
    raise ValueError(
        f"table {table!r}: unknown initializer {initializer!r}; use 'zeros', 'ones', 'uniform', "
        "('uniform', minval, maxval), 'normal', ('normal', stddev), ('normal', mean, stddev) or a "
        "callable f(row_ids, dim, dtype)"
    )
