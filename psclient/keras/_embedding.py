"""``psclient.keras.Embedding``: an embedding layer whose rows live only on the shards.

A drop-in for ``keras.layers.Embedding`` for tables too big for a worker::

    emb = psk.Embedding(10_000_000, 64, worker=worker)   # created by the chief, found by the others
    model = keras.Sequential([keras.Input((20,), dtype="int32"), emb, ...])
    model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adagrad(0.1), worker), loss=...)
    model.fit(ds, callbacks=[worker.callback()])

Design (why it trains correctly in every mode):

- The table is a ``create_embedding`` table on the shards; the worker keeps no copy
  (its memory is O(batch)). The layer's only weight is a one-element trainable
  *anchor* (zeros, never used as a value): its stable name is the table's name on
  the shards, so ``PSWorker.attach`` creates (chief) or finds (others) the table
  with the same optimizer logic as every other variable.
- Forward (inside ``fit``'s compiled step): the batch's distinct ids
  (``tf.unique``) are looked up through the client in a ``tf.numpy_function``, which
  also spreads those rows to the batch's ids: ``ids.shape + (output_dim,)``.
- Backward: a ``tf.custom_gradient`` on the looked-up rows hands the rows' gradient
  (summed per distinct id) to the layer, and gives the anchor a zero gradient so that
  the tape reaches the layer at all (a tape only differentiates paths from its
  variables). When the ``DistributedOptimizer`` applies the step, the worker
  replaces the anchor's gradient by those rows and pushes them as
  ``psclient.Rows`` *in the same exchange* as the dense gradients. So sync mode
  keeps one push (one global step) per batch, and async/ssp keep their overlap;
  nothing is pulled back for the table (the next lookup reads the rows).
- On JAX and PyTorch (the backend's adapter, ``lookup_rows``): the batch's ids come as they are
  (static shapes: JAX's jitted ``fit`` stays compiled), the host reads each distinct id's row once
  (in the step: an ``io_callback`` on JAX, a direct call on PyTorch), and the backward pass hands
  the rows' gradient to the layer (JAX: a ``custom_vjp`` whose backward runs a host callback;
  PyTorch: a hook on the rows, a leaf tensor that requires grad). The step's exchange takes them
  (``take_rows``: summed per distinct id) and pushes them as ``psclient.Rows``, as above. Ids are
  int32 on JAX unless ``jax_enable_x64`` is set (a dynamic table's raw ids then must be below 2**31);
  string keys are TensorFlow's only; ``prefetch_rows`` needs ``ids=`` there (tf ops: the model's own
  graph runs on its backend, not inside tf.data).
- The server-side optimizer is the model's ``DistributedOptimizer``'s, or
  ``optimizer=`` (a Keras optimizer or a psclient spec), applied row by row; an
  optimizer the shards cannot apply by row (Adafactor, Lamb, clipnorm) is refused.
- ``load_from_ps`` and ``PSWorker.refresh`` skip the table (no local variable):
  an evaluator's copy of the model reads the rows through its own worker.

Dynamic tables (``input_dim=None``): the table is a hash table on the shards
(``create_embedding(name, None, dim, ...)``): any int64 id, or with
``key_type="string"`` raw string feature values (a ``tf.string`` input; the
client hashes the batch's distinct values), with the table's ``capacity``,
``min_count``, ``eviction`` and TTL. A row starts from the initializer's row for
its id on its first push; until then (and after an eviction) the layer reads
that initializer row.

    users = psk.Embedding(None, 32, worker=worker, capacity=1_000_000, min_count=2)
    tags = psk.Embedding(None, 8, worker=worker, key_type="string")  # keras.Input((k,), dtype="string")

Prefetch (``prefetch_rows``): the layer sees only the batch of the step it runs
in, so it cannot know the next batch's ids; the *dataset* can. ::

    ds = psk.prefetch_rows(ds, model)   # before model.fit(ds, ...)

maps every element through the model's ids (a sub-model from the inputs to each
``psclient.keras.Embedding``'s input, or ``ids=``) and hands the element on
through ``Dataset.prefetch(depth)``: while step ``k`` computes, tf.data prepares
element ``k + 1`` and asks for its distinct ids' rows. Step ``k``'s exchange
(its push) reads them on the shards once the push is applied
(``PSClient.push_pull_lookup``): one round trip per shard a step instead of a
push and a lookup. In the step, the layer's lookup (the same
``tf.numpy_function`` in ``fit``'s compiled step) takes those rows when their
ids are exactly the batch's distinct ids, and reads them itself otherwise (the
first step of an epoch, an element tf.data prepared only after the step before
pushed, validation data, ``predict``, a failed read), so results never depend
on whether a prefetch happened. Staleness: the rows include this worker's
updates up to the step before (as a lookup in the step would), and other
workers' pushes up to that push's arrival; in async mode with overlap the
step waits for the previous push's answer instead of its own lookup. Sync mode
never prefetches (a step reads the rows after the previous step's global
update), and neither does a layer before its worker attached.

Limits: ids are checked against ``input_dim`` (a clear error, before any request);
no ``mask_zero``; no loss scaling of the layer's rows (``mixed_float16``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np

from psclient._tables import DynamicOptions
from psclient.keras._backend import adapter, backend_name, unsupported
from psclient.keras._backend import tensorflow as tf  # imported when first used: on TensorFlow only
from psclient.keras._ps import PSWorker, server_optimizer
from pscore.embedding import Initializer, Rows, hash_keys
from pscore.errors import PSError
from pscore.optimizers import Optimizer

log = logging.getLogger(__name__)

_PREFETCH_KEEP = 8  # lookups started ahead and not used yet, per layer, at most (the oldest are dropped)


def _row_initializer(init: Any) -> Initializer:
    """A ``create_embedding`` initializer for a Keras initializer (name, config or object)."""
    if isinstance(init, str) and init.lower() in ("uniform", "random_uniform", "normal", "random_normal"):
        return init.lower()
    if isinstance(init, str) and init.lower() in ("zeros", "ones"):
        return init.lower()
    if isinstance(init, tuple) or (callable(init) and not isinstance(init, keras.initializers.Initializer)):
        return init
    obj = keras.initializers.get(init)
    if isinstance(obj, keras.initializers.Zeros):
        return "zeros"
    if isinstance(obj, keras.initializers.Ones):
        return "ones"
    if isinstance(obj, keras.initializers.RandomUniform):
        return ("uniform", float(obj.minval), float(obj.maxval))
    if isinstance(obj, keras.initializers.RandomNormal):
        return ("normal", float(obj.mean), float(obj.stddev))
    raise ValueError(
        f"embeddings_initializer {init!r}: the shards initialize rows themselves; use 'uniform', 'normal', "
        "'zeros', 'ones', RandomUniform, RandomNormal, or a callable f(row_ids, dim, dtype)"
    )


class Embedding(keras.layers.Layer):
    """An embedding layer whose table lives only on the parameter server (see the module docs).

    Example:
        emb = psk.Embedding(10_000_000, 64, worker=worker, optimizer=keras.optimizers.Adagrad(0.1))

    Not thread-safe: one training loop per layer, as for its ``PSWorker``. Not serializable with
    the model (``get_config`` has no worker): rebuild it in code where the model is loaded.

    Args:
        input_dim: rows of the table (ids are ``0 .. input_dim - 1``); None: a dynamic table
            (any id; see ``psclient.PSClient.create_embedding``).
        output_dim: row width.
        worker: the ``PSWorker`` that trains the model.
        optimizer: the table's server-side optimizer (a Keras optimizer, its name or a psclient
            spec); default: the model's ``DistributedOptimizer``'s.
        embeddings_initializer: ``"uniform"`` (Keras's default, U(-0.05, 0.05)), ``"normal"``,
            ``"zeros"``, ``"ones"``, ``RandomUniform`` / ``RandomNormal``, or a callable
            ``f(row_ids, dim, dtype)`` deterministic per row (fixed tables only).
        embeddings_regularizer: an L1, L2 or L1L2 regularizer (``keras.regularizers.l2(1e-6)``),
            applied by the shards to the rows (``PSWorker(table_regularization=...)``: the rows
            each step touches, or every row of a fixed table).
        key_type: dynamic tables: ``"int64"`` (integer inputs) or ``"string"`` (``tf.string``
            inputs: raw feature values).
        capacity, min_count, eviction, ttl_steps, ttl_seconds: dynamic tables: as
            ``create_embedding``'s (rows at most, pushes before admission, ``"lru"``/``"lfu"``,
            expiry).
        **kwargs: ``keras.layers.Layer`` arguments (``name``, ``trainable``, ...).

    Raises:
        TypeError: ``worker`` is not a ``PSWorker``.
        ValueError: bad sizes, a dynamic-table option out of range or given for a fixed table, or
            an initializer or optimizer the shards cannot use by row (the optimizer: when the worker
            attaches the model).

    In a step (wrapped by TensorFlow in a graph): ``ValueError`` for an id outside
    ``[0, input_dim)``, ``RuntimeError`` before the model is attached, ``PSError`` from a shard
    (``InvalidArgumentError`` for strings fed to an int64-keyed table or the reverse).
    """

    _ps_remote_table = True  # PSWorker, load_from_ps: the anchor names a table with no local copy

    def __init__(
        self,
        input_dim: int | None,
        output_dim: int,
        *,
        worker: PSWorker,
        optimizer: Any = None,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        key_type: str = "int64",
        capacity: int | None = None,
        min_count: int = 1,
        eviction: str = "lru",
        ttl_steps: int | None = None,
        ttl_seconds: float | None = None,
        **kwargs: Any,
    ) -> None:
        if key_type == "string" and backend_name() != "tensorflow":
            raise unsupported(
                "psclient.keras.Embedding with key_type='string' (string tensors; hash the values in the "
                "input pipeline with psclient.keras.string_ids(values) and give the ids to a dynamic table: "
                "input_dim=None, key_type='int64')"
            )
        super().__init__(**kwargs)
        if not isinstance(worker, PSWorker):
            raise TypeError(f"worker must be a psclient.keras.PSWorker, got {type(worker)!r}")
        if (input_dim is not None and int(input_dim) < 1) or int(output_dim) < 1:
            raise ValueError(f"input_dim ({input_dim}) and output_dim ({output_dim}) must be >= 1")
        self.input_dim = None if input_dim is None else int(input_dim)
        self.output_dim = int(output_dim)
        self.dynamic_options = DynamicOptions(
            key_type=key_type, capacity=capacity, min_count=min_count, eviction=eviction,
            ttl_steps=ttl_steps, ttl_seconds=ttl_seconds,
        )  # fmt: skip
        if input_dim is not None and not self.dynamic_options.is_default():
            raise ValueError(
                f"psclient.keras.Embedding {self.name!r}: key_type, capacity, min_count, eviction and the "
                "TTLs are options of dynamic tables (input_dim=None)"
            )
        try:
            self.dynamic_options.check(self.name)
        except PSError as err:  # the client's InvalidArgumentError, as the layer's ValueError
            raise ValueError(f"psclient.keras.Embedding: {err}") from None
        self.key_type = key_type
        self.worker = worker
        self.server_optimizer: Optimizer | None = None if optimizer is None else server_optimizer(optimizer)
        self.initializer = _row_initializer(embeddings_initializer)
        # L1 / L2 / L1L2, applied by the shards to the rows (PSWorker's table_regularization)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self._pending: list[tuple[Any, Any, Any]] = []  # (graph, ids, row gradients) of backward passes
        # JAX, PyTorch: (ids, row gradients) that backward passes handed to the host, for the next push
        self._host_rows: list[tuple[np.ndarray, np.ndarray]] = []
        self._host_lock = threading.Lock()  # JAX's callbacks may run on another thread than the exchange's
        self._prefetched = _Prefetched()

    def build(self, input_shape: Any = None) -> None:
        # Not a table: a one-element handle whose name is the table's on the shards.
        self.anchor = self.add_weight(shape=(1,), initializer="zeros", name="embeddings", trainable=True)
        self.built = True

    @property
    def table_name(self) -> str:
        """The table's name on the shards (the anchor's stable name once the model is attached)."""
        return self.worker.name_of(self.anchor)

    def table_options(self) -> dict[str, Any]:
        """The ``create_embedding`` arguments of the layer's table (but its name and optimizer)."""
        options = {
            "num_rows": self.input_dim,
            "dim": self.output_dim,
            "dtype": np.dtype(self.variable_dtype),
            "initializer": self.initializer,
        }
        if self.input_dim is None:
            options.update(self.dynamic_options.kwargs())
        return options

    def compute_output_spec(self, inputs: Any) -> Any:
        return keras.KerasTensor((*tuple(inputs.shape), self.output_dim), dtype=self.compute_dtype)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return (*tuple(input_shape), self.output_dim)

    @property
    def prefetch_stats(self) -> dict[str, int]:
        """``{"hits": lookups answered by a prefetch, "misses": lookups read in the step}``."""
        return {"hits": self._prefetched.hits, "misses": self._prefetched.misses}

    def _ids(self, ids: Any) -> np.ndarray:
        return np.asarray(ids) if self.key_type == "string" else np.asarray(ids, np.int64)

    def _bad_id(self, ids: np.ndarray) -> int | None:
        if self.input_dim is not None and ids.size and (ids.min() < 0 or ids.max() >= self.input_dim):
            return int(ids[(ids < 0) | (ids >= self.input_dim)][0])
        return None

    def start_prefetch(self, ids: Any) -> bool:
        """Asks for the rows of distinct ``ids`` for a step to come (see ``prefetch_rows``): the worker's
        next exchange (this step's push) reads them.

        Returns False, asking nothing, in sync mode, before the worker attached, or for
        ids the step's own lookup will refuse (it raises the error then).
        """
        ids = self._ids(ids)
        if not self.worker.attached or self.worker.mode == "sync" or not ids.size:
            return False
        if self._bad_id(ids) is not None:
            return False
        self._prefetched.want(_key(ids), ids)
        return True

    def wanted_rows(self) -> tuple[Any, np.ndarray] | None:
        """The ``(key, distinct ids)`` of the oldest batch ``start_prefetch`` asked for that no exchange
        reads yet (the next step's, when tf.data prepared it in time), or None."""
        return self._prefetched.next_wanted()

    def rows_coming(self, key: Any, fut: concurrent.futures.Future[Any], table: str | None = None) -> None:
        """The exchange reading the rows of ``key`` (from ``wanted_rows``) gives their future: of the
        rows, or with ``table``, of the exchange's ``(values, rows by table)`` (one future a step for
        the exchange and every layer)."""
        self._prefetched.assign(key, fut, table)

    def rows_read(self, key: Any, rows: np.ndarray) -> None:
        """The exchange read the rows of ``key`` (from ``wanted_rows``): here they are."""
        self._prefetched.assign(key, _Ready(rows))

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = self._ids(ids)
        if ids.size and self.worker.attached:  # a prefetch's ids: checked when it was asked for
            rows = self._prefetched.take(_key(ids), self.worker.client.wait_timeout)
            if rows is not None:
                return rows.astype(self.variable_dtype, copy=False)
        bad = self._bad_id(ids)
        if bad is not None:
            raise ValueError(
                f"psclient.keras.Embedding {self.name!r}: id {bad} is out of range [0, {self.input_dim})"
            )
        if not self.worker.attached:
            raise RuntimeError(
                f"psclient.keras.Embedding {self.name!r}: its table is on the shards; attach the model "
                "first (worker.callback() in fit, or worker.attach(model, optimizer))"
            )
        dtype = np.dtype(self.variable_dtype)
        if not ids.size:
            return np.zeros((0, self.output_dim), dtype)
        # ``ids`` are tf.unique's: the client need not deduplicate them again
        rows = self.worker.client.lookup(self.table_name, ids, step=self.worker.step, distinct=True)
        return np.asarray(rows, dtype)

    def _lookup_each(self, ids: np.ndarray, where: np.ndarray) -> np.ndarray:
        """The rows of distinct ``ids`` (``_lookup``), one for each entry of ``where`` (indices into them)."""
        return self._lookup(ids)[where]

    def call(self, inputs: Any) -> Any:
        if backend_name() != "tensorflow":
            return self._call_host(inputs)
        ids = tf.convert_to_tensor(inputs)
        if self.key_type == "string" and ids.dtype != tf.string:
            raise ValueError(
                f"psclient.keras.Embedding {self.name!r}: its table is keyed by strings; the input has dtype "
                f"{ids.dtype.name} (use keras.Input(..., dtype='string'))"
            )
        if self.key_type != "string":
            if ids.dtype == tf.string:
                raise ValueError(
                    f"psclient.keras.Embedding {self.name!r}: the input is strings; its table is keyed by "
                    "int64 ids (create the layer with input_dim=None, key_type='string')"
                )
            ids = tf.cast(ids, tf.int64)
        unique, where = tf.unique(tf.reshape(ids, [-1]))
        # The host call reads the distinct rows and spreads them to the batch's ids itself (numpy): a
        # tf.gather of them costs more, in TensorFlow's thread pool, than the copy (issue 42).
        out = tf.numpy_function(
            self._lookup_each,
            [unique, where],
            Tout=tf.as_dtype(self.variable_dtype),
            stateful=True,
            name="ps_lookup",
        )
        out.set_shape([None, self.output_dim])
        layer = self

        @tf.custom_gradient
        def hook(out: Any, anchor: Any) -> Any:
            def grad(dy: Any) -> Any:
                layer._pending.append((_graph_key(), unique, _summed_rows(dy, where, tf.shape(unique)[0])))
                return None, tf.zeros_like(anchor)

            return tf.identity(out), grad

        out = hook(out, tf.convert_to_tensor(self.anchor.value))
        out = tf.reshape(out, tf.concat([tf.shape(ids), [self.output_dim]], 0))
        return tf.cast(out, self.compute_dtype)

    def _call_host(self, inputs: Any) -> Any:
        """JAX, PyTorch: the batch's rows through the adapter's ``lookup_rows`` (static shapes: the ids as
        they come; the host reads each distinct id once), gradients caught for the push (``take_rows``)."""
        ids = keras.ops.convert_to_tensor(inputs)
        if "int" not in keras.backend.standardize_dtype(ids.dtype):
            ids = keras.ops.cast(ids, "int32")
        flat = keras.ops.reshape(ids, (-1,))
        rows = self.worker._backend.lookup_rows(
            flat, self.anchor.value, self._lookup_all, self._keep_rows, self.output_dim, self.variable_dtype
        )
        out = keras.ops.reshape(rows, (*tuple(ids.shape), self.output_dim))
        return keras.ops.cast(out, self.compute_dtype)

    def _lookup_all(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ids with repeats: each distinct id read once (``_lookup``; in first-seen order, as
        ``tf.unique`` gives them, so that a prefetch of the batch matches)."""
        unique, inverse = _first_seen_unique(self._ids(ids).reshape(-1))
        return self._lookup(unique)[inverse]

    def _keep_rows(self, ids: np.ndarray, grads: np.ndarray) -> None:
        with self._host_lock:
            self._host_rows.append(
                (self._ids(ids).reshape(-1), np.asarray(grads).reshape(-1, self.output_dim))
            )

    def take_rows(self) -> Rows | None:
        """JAX, PyTorch: the row gradients the step's backward passes handed over, summed per distinct id
        (what the step pushes), or None when none did."""
        with self._host_lock:
            kept, self._host_rows = self._host_rows, []
        if not kept:
            return None
        ids = np.concatenate([i for i, _ in kept])
        grads = np.concatenate([g for _, g in kept]).astype(np.dtype(self.variable_dtype), copy=False)
        unique, inverse = np.unique(ids, return_inverse=True)
        summed = np.zeros((len(unique), self.output_dim), grads.dtype)
        np.add.at(summed, inverse.reshape(-1), grads)
        return Rows(unique, summed)

    def take_gradient(self) -> tf.IndexedSlices:
        """The row gradients of this graph's (or the eager step's) backward passes, as IndexedSlices."""
        keys, graph = [], _graph_key()
        while graph is not None:  # this graph, or one it is nested in (a cond branch of the train step)
            keys.append(graph)
            graph = getattr(graph, "outer_graph", None)
        keys = keys or [None]
        mine = [(i, g) for k, i, g in self._pending if any(k is key for key in keys)]
        self._pending = []  # what other graphs left is from traces that are done with
        if not mine:
            raise RuntimeError(
                f"psclient.keras.Embedding {self.name!r}: its gradient is applied where its backward pass "
                "did not run (apply the gradients in the train step that computed them)"
            )
        ids = tf.concat([i for i, _ in mine], 0)
        rows = tf.concat([tf.cast(g, self.variable_dtype) for _, g in mine], 0)
        return tf.IndexedSlices(rows, ids)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(input_dim=self.input_dim, output_dim=self.output_dim)
        if self.input_dim is None:
            config.update(self.dynamic_options.kwargs())
        return config


class _Ready:
    """Rows an exchange already read (``rows_read``), taken as a future's result."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def result(self, timeout: float | None = None) -> np.ndarray:
        return self.rows


# rows being read (alone, or with an exchange's values), or read
_Rows = concurrent.futures.Future[Any] | _Ready
# distinct ids; once an exchange reads them, their rows' future and the table's name in its result (or None)
_Entry = tuple[np.ndarray, _Rows | None, str | None]


class _Prefetched:
    """Rows asked for ahead of the steps that use them, by the exact distinct ids they read.

    An entry is *wanted* (``want``: the ids of an element tf.data prepared) until an
    exchange reads it (``assign``: the future of its rows); the step's lookup ``take`` s
    it. A step whose rows no exchange read yet reads them itself (a miss).

    Thread-safe: tf.data's thread wants, the step's exchange assigns and its ``numpy_function`` takes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # key -> (distinct ids, the future of their rows once an exchange reads them)
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def want(self, key: Any, ids: np.ndarray) -> None:
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = (ids, None, None)
            while len(self._entries) > _PREFETCH_KEEP:  # the oldest were never used (validation data ...)
                self._entries.popitem(last=False)

    def next_wanted(self) -> tuple[Any, np.ndarray] | None:
        """The oldest entry no exchange reads yet. Only that one: an exchange reads the rows of the
        step after it, not of steps further ahead (their rows would miss the pushes in between)."""
        with self._lock:
            return next(((key, ids) for key, (ids, fut, _) in self._entries.items() if fut is None), None)

    def assign(self, key: Any, fut: _Rows, table: str | None = None) -> None:
        """``fut`` reads the rows of ``key``: its result is the rows, or with ``table`` an exchange's
        ``(values, rows by table)``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[1] is None:
                self._entries[key] = (entry[0], fut, table)

    def take(self, key: Any, timeout: float) -> np.ndarray | None:
        """The rows read ahead for ``key``, or None (none read, or the read failed: read them anew)."""
        with self._lock:
            entry = self._entries.pop(key, None)
        fut = entry[1] if entry is not None else None
        if fut is not None:
            try:
                rows = fut.result(timeout)
            except (PSError, concurrent.futures.CancelledError, TimeoutError) as err:
                log.debug("prefetched rows failed (%s); reading them in the step", err)
            else:
                self.hits += 1
                table = entry[2]  # type: ignore[index]  # an entry with a future
                return np.asarray(rows if table is None else rows[1][table])
        self.misses += 1
        return None


def string_ids(values: Any, bits: int | None = None) -> np.ndarray:
    """Integer ids of string feature values, for a dynamic ``Embedding`` (``input_dim=None``) on any backend.

    JAX and PyTorch have no string tensors, so a ``key_type="string"`` table cannot take its keys in
    their steps: hash the values on the host (in the input pipeline, before the model) and feed the
    ids to an int64-keyed dynamic table. The id of a value is ``pscore.embedding.hash_keys``'s 64-bit
    BLAKE2b hash of its UTF-8 bytes (the hash a string-keyed table uses; the same on every process,
    platform and restart), kept whole or cut to its low ``bits`` (then non-negative, below
    ``2**bits``). Two distinct values share a row when their ids collide: for ``n`` distinct values
    about ``n**2 / 2**(bits + 1)`` pairs do (with 31 bits, one pair at ~65,000 values, ~230 at a
    million, each sharing its row as a hashing trick does; with 64 bits none in practice). The ids are
    int32 for ``bits <= 31``, else int64.

    >>> string_ids(["user:42", b"user:42", "user:7"], bits=64).tolist()
    [-9028972112616151079, -9028972112616151079, -4979482534328686182]
    >>> string_ids(["user:42"], bits=31).tolist()
    [2090543065]

    Args:
        values: ``str`` or ``bytes`` values, any shape (the shape is kept).
        bits: 1-64; default: what the backend's integer inputs keep (64: int64 on TensorFlow and PyTorch,
            and on JAX with ``jax_enable_x64``; 31 on JAX without it, whose inputs are int32).

    Raises:
        TypeError: a value that is neither ``str`` nor ``bytes``.
        ValueError: ``bits`` out of range.
    """
    bits = adapter().id_bits if bits is None else int(bits)
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    ids = hash_keys(values)
    if bits == 64:
        return ids
    return (ids & np.int64((1 << bits) - 1)).astype(np.int64 if bits > 31 else np.int32)


def _summed_rows(dy: Any, where: Any, n: Any) -> Any:
    """The distinct rows' gradient, dense ``[n, dim]``: ``dy``, the gradient of the rows of each looked-up
    id (``where``: which distinct row each is), summed per distinct row.

    Sorted, then summed by ``tf.sparse.segment_sum`` (which reads the rows in that order, no copy): an
    ``UnsortedSegmentSum`` (what converting a gather's ``IndexedSlices`` runs) costs about twice the CPU on
    TensorFlow 2.21, ~325 against ~145 us a step for bench_embedding's 2,048 x 64 float32 on the 2-core VM
    (issue 42). The stable sort keeps each row's terms in their order; the sum's rounding may differ from
    the unsorted one's in the last bits."""
    if isinstance(dy, tf.IndexedSlices):  # some of the looked-up rows (the output read by a gather)
        values, segments = dy.values, tf.gather(where, dy.indices)
    else:
        values, segments = dy, where
    order = tf.argsort(segments, stable=True)
    return tf.sparse.segment_sum(values, order, tf.gather(segments, order), num_segments=n)


def _first_seen_unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct ids in first-seen order, index of each id in them)``, as ``tf.unique``.

    >>> _first_seen_unique(np.array([5, 3, 5, 1]))
    (array([5, 3, 1]), array([0, 1, 0, 2]))
    """
    sorted_ids, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return sorted_ids[order], rank[inverse.reshape(-1)]


def _key(ids: np.ndarray) -> Any:
    """An exact, hashable key of distinct ids: their bytes (int64), or the tuple of string keys."""
    return ids.tobytes() if ids.dtype.kind in "iu" else tuple(ids.reshape(-1).tolist())


def _remote_layers(model: keras.Model) -> list[Embedding]:
    layers = model._flatten_layers() if hasattr(model, "_flatten_layers") else model.layers
    return [layer for layer in layers if isinstance(layer, Embedding)]


def prefetch_rows(
    dataset: tf.data.Dataset,
    model: keras.Model,
    *,
    depth: int = 1,
    ids: Callable[[Any], Any] | None = None,
) -> tf.data.Dataset:
    """The dataset, with the rows of each element's ids read with the step before's push.

    See the module docs (Prefetch) for what it does, and the staleness it adds.

    >>> ds = psk.prefetch_rows(ds, model)  # doctest: +SKIP
    >>> model.fit(ds, epochs=3, callbacks=[worker.callback()])  # doctest: +SKIP

    Args:
        dataset: what ``fit`` trains on: elements ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, w)``.
        model: the model whose ``psclient.keras.Embedding`` layers read the rows.
        depth: elements (steps) prepared ahead, >= 1 (``Dataset.prefetch``).
        ids: ``ids(x)`` -> the ids tensor of the model's one such layer, or a dict from layer
            name to ids tensor; default: the model's own inputs-to-layer graph (a functional or
            ``Sequential`` model whose layers are each called once).

    Returns:
        A dataset with the same elements.

    Raises:
        ValueError: no ``psclient.keras.Embedding`` in the model, ``depth`` < 1, or the ids of a
            layer cannot be derived from the model's inputs (pass ``ids=``).
        PSError: on JAX or PyTorch without ``ids=`` (there the model's graph cannot run inside
            tf.data; ``ids`` maps an element to its ids with tf ops, and TensorFlow must be installed).
    """
    if (
        ids is None and backend_name() != "tensorflow"
    ):  # the model's own graph runs on its backend, not in tf.data
        raise unsupported("psclient.keras.prefetch_rows without ids= (pass ids=lambda x: the ids, in tf ops)")
    layers = _remote_layers(model)
    if not layers:
        raise ValueError(f"model {model.name!r} has no psclient.keras.Embedding layer to prefetch rows for")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    ids_of = _ids_function(model, layers, ids)
    tupled = isinstance(dataset.element_spec, tuple)

    def start(*uniques: np.ndarray) -> np.bool_:
        for layer, unique in zip(layers, uniques, strict=True):
            try:
                layer.start_prefetch(unique)
            except (PSError, RuntimeError) as err:  # a closed client: the step reads (and reports) itself
                log.debug("prefetch for %s not asked: %s", layer.name, err)
        return np.bool_(True)

    def tap(*element: Any) -> Any:
        tensors = ids_of(element[0])
        uniques = []
        for layer, t in zip(layers, tensors, strict=True):
            t = tf.convert_to_tensor(t)
            if layer.key_type != "string":
                t = tf.cast(t, tf.int64)
            uniques.append(tf.unique(tf.reshape(t, [-1]))[0])  # as the layer's call computes them
        started = tf.numpy_function(start, uniques, Tout=tf.bool, stateful=True, name="ps_prefetch")
        with tf.control_dependencies([started]):
            out = tf.nest.map_structure(tf.identity, element)
        return out if tupled else out[0]

    return dataset.map(tap).prefetch(depth)


def _ids_function(
    model: keras.Model, layers: list[Embedding], ids: Callable[[Any], Any] | None
) -> Callable[[Any], list[Any]]:
    """``x`` -> each layer's ids tensor, in ``layers`` order."""
    if ids is not None:

        def given(x: Any) -> list[Any]:
            out = ids(x)
            if isinstance(out, Mapping):
                missing = [layer.name for layer in layers if layer.name not in out]
                if missing:
                    raise ValueError(f"prefetch_rows: ids(x) gave no ids for the layers {missing}")
                return [out[layer.name] for layer in layers]
            if len(layers) != 1:
                raise ValueError(
                    f"prefetch_rows: the model has {len(layers)} psclient.keras.Embedding layers; "
                    "ids(x) must return a dict from layer name to ids"
                )
            return [out]

        return given
    try:
        sub = keras.Model(model.inputs, [layer.input for layer in layers])
    except (AttributeError, ValueError, TypeError) as err:
        raise ValueError(
            f"prefetch_rows: the ids of {[layer.name for layer in layers]} cannot be derived from the "
            f"inputs of model {model.name!r} ({err}); pass ids=lambda x: {{layer name: ids tensor}}"
        ) from None

    def derived(x: Any) -> list[Any]:
        out = sub(x, training=False)
        return list(out) if isinstance(out, list | tuple) else [out]

    return derived


def _graph_key() -> Any:
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


__all__ = ["Embedding", "prefetch_rows", "string_ids"]
