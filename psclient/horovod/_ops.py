"""Horovod's tensor collectives on the ring: allreduce, allgather, broadcast, reducescatter, objects, join.

Each takes a ``tf.Tensor`` (or anything ``tf.convert_to_tensor`` takes) and works eagerly and
inside a ``tf.function`` (the ring call runs in a ``tf.numpy_function``; XLA is not supported).
Every rank must call the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from psclient import elastic
from psclient.collective import ALLREDUCE_DTYPES
from psclient.horovod._compression import Compression, Compressor
from psclient.horovod._state import check_process_set, local_rank, local_size, unsupported, worker
from psclient.keras._tf_host import numpy_call

# Horovod's reduction ops (the same values as horovod.tensorflow.mpi_ops).
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_RING_OPS = {Average: "mean", Sum: "sum", Min: "min", Max: "max"}


def resolve_op(op: int | None, average: bool | None = None) -> int:
    """Horovod's ``op``/deprecated ``average`` pair as one op (default ``Average``).

    Raises:
        ValueError: both given, or an unknown op.
        UnsupportedError: ``Adasum`` or ``Product``.
    """
    if op is not None and average is not None:
        raise ValueError("give op or average (deprecated), not both")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        unsupported("op=hvd.Adasum", "use hvd.Average (the default)")
    if op == Product:
        unsupported("op=hvd.Product", "use hvd.Sum of logarithms, or hvd.Min/hvd.Max")
    if op not in _RING_OPS:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, hvd.Sum, hvd.Min or hvd.Max")
    return op


def _wire_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype a tensor travels as: itself when the ring reduces it, else float32 / int64."""
    try:
        if np.dtype(dtype.as_numpy_dtype) in ALLREDUCE_DTYPES:
            return dtype
    except TypeError:
        pass
    return tf.float32 if dtype.is_floating else tf.int64


def _host_call(
    fn: Callable[..., list[np.ndarray]],
    tensors: Sequence[tf.Tensor],
    tout: Sequence[tf.DType],
    name: str,
    like_inputs: bool = False,
) -> list[tf.Tensor]:
    """Runs ``fn`` on the tensors' numpy values: now when eager, in a ``tf.numpy_function`` in a graph. With
    ``like_inputs``, each output has its input's shape (an all-reduce's, a broadcast's), so the small ones
    leave the host function packed (``numpy_call``); else their shapes are set by the caller."""
    if tf.executing_eagerly():
        return [
            tf.convert_to_tensor(a, dtype=d)
            for a, d in zip(fn(*[t.numpy() for t in tensors]), tout, strict=True)
        ]
    shapes: list[tuple[int | None, ...] | None] = [None] * len(tout)  # not even the rank known
    if like_inputs:
        shapes = [tuple(t.shape.as_list()) if t.shape.rank is not None else None for t in tensors]
    specs = [(shape, d.as_numpy_dtype) for shape, d in zip(shapes, tout, strict=True)]
    return numpy_call(fn, tensors, specs, name)


def _allreduce_dense(
    tensors: Sequence[tf.Tensor],
    op: int,
    compression: type[Compressor],
    prescale_factor: float,
    postscale_factor: float,
) -> list[tf.Tensor]:
    """One fused ring all-reduce of dense tensors (compressed, pre/post-scaled around it)."""
    if not tensors:
        return []
    ring_op = _RING_OPS[op]
    originals = [tf.convert_to_tensor(t) for t in tensors]
    scaled = [t * tf.cast(prescale_factor, t.dtype) if prescale_factor != 1.0 else t for t in originals]
    compressed = [compression.compress(t) for t in scaled]
    wire = [t if _wire_dtype(t.dtype) == t.dtype else tf.cast(t, _wire_dtype(t.dtype)) for t, _ in compressed]
    w = worker()

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return list(w.ring.allreduce_many([np.asarray(a) for a in arrays], op=ring_op))

    reduced = _host_call(fn, wire, [t.dtype for t in wire], "hvd_allreduce", like_inputs=True)
    out = []
    for r, t, (c, ctx) in zip(reduced, originals, compressed, strict=True):
        r.set_shape(t.shape)
        r = compression.decompress(tf.cast(r, c.dtype) if r.dtype != c.dtype else r, ctx)
        r = tf.cast(r, t.dtype) if r.dtype != t.dtype else r
        out.append(r * tf.cast(postscale_factor, r.dtype) if postscale_factor != 1.0 else r)
    return out


def _runtime_int(value: Callable[[], int], name: str) -> tf.Tensor:
    """An int32 scalar read when the step runs (a ``tf.numpy_function`` in a graph), not when it is traced.

    In a psrun elastic job the size and rank change when the ring is re-formed, while a traced step
    (Keras's ``train_function``) is kept.
    """
    if tf.executing_eagerly():
        return tf.constant(value(), tf.int32)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True, name=name)
    return tf.reshape(out, [])


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """Horovod's ``size_op``: the number of ranks, as an int32 tensor evaluated when the op runs.

    Raises:
        UnsupportedError: a process set other than the global one (id 0).
    """
    if process_set_id != 0:
        unsupported("process sets", "use the global process set")
    return _runtime_int(lambda: worker().world, "hvd_size")


def rank_op(name: str | None = None) -> tf.Tensor:
    """Horovod's ``rank_op``: this process's rank, as an int32 tensor evaluated when the op runs."""
    return _runtime_int(lambda: worker().rank, "hvd_rank")


def local_size_op(name: str | None = None) -> tf.Tensor:
    """Horovod's ``local_size_op``: the ranks on this host, evaluated when the op runs."""
    return _runtime_int(local_size, "hvd_local_size")


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """Horovod's ``local_rank_op``: this rank's index on its host, evaluated when the op runs."""
    return _runtime_int(local_rank, "hvd_local_rank")


def _allreduce_sparse(t: tf.IndexedSlices, op: int) -> tf.IndexedSlices:
    """As Horovod: an all-gather of the values and indices (Average divides the values by the size)."""
    if op not in (Average, Sum):
        raise ValueError("only hvd.Average and hvd.Sum reduce tf.IndexedSlices")
    values = allgather(t.values)
    indices = allgather(t.indices)
    if op == Average:
        values = values / tf.cast(size_op(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=t.dense_shape)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """All-reduces a list of tensors in one fused ring operation (``op`` default ``hvd.Average``).

    ``tf.IndexedSlices`` are all-gathered (values and indices) as in Horovod. ``device_*``,
    ``name`` and ``ignore_name_scope`` are accepted and ignored.

    Raises:
        UnsupportedError: ``Adasum``/``Product``, or a process set other than the global one.
        PSError: the ring failed or timed out (wrapped by TensorFlow inside a graph).
    """
    check_process_set(process_set)
    op = resolve_op(op, average)
    items = list(tensors)
    out: list[Any] = [None] * len(items)
    dense = []
    for i, t in enumerate(items):
        if isinstance(t, tf.IndexedSlices):
            if prescale_factor != 1.0 or postscale_factor != 1.0:
                raise ValueError("prescale_factor/postscale_factor are not supported with tf.IndexedSlices")
            out[i] = _allreduce_sparse(t, op)
        else:
            dense.append(i)
    reduced = _allreduce_dense([items[i] for i in dense], op, compression, prescale_factor, postscale_factor)
    for i, r in zip(dense, reduced, strict=True):
        out[i] = r
    return out


def _differentiable_allreduce(x: tf.Tensor, reduce: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    # The gradient of an all-reduce (sum or mean) is the same all-reduce of the upstream gradient.
    @tf.custom_gradient
    def f(t: tf.Tensor) -> Any:
        return reduce(t), reduce

    return f(x)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = None,
    ignore_name_scope: bool = False,
) -> Any:
    """All-reduces a tensor over every rank (``op`` default ``hvd.Average``); Horovod's ``hvd.allreduce``.

    A ``tf.IndexedSlices`` is all-gathered (values and indices). Differentiable for ``Average``/``Sum``.

    Raises:
        UnsupportedError: ``Adasum``/``Product``, or a process set other than the global one.
        PSError: the ring failed or timed out.
    """
    check_process_set(process_set)
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return grouped_allreduce(
            [tensor], op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor
        )[0]

    def reduce(t: tf.Tensor) -> tf.Tensor:
        return _allreduce_dense([t], op, compression, prescale_factor, postscale_factor)[0]

    t = tf.convert_to_tensor(tensor)
    if op in (Average, Sum) and t.dtype.is_floating:
        return _differentiable_allreduce(t, reduce)
    return reduce(t)


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: Any = None
) -> tf.Tensor:
    """Concatenates every rank's tensor along the first axis, in rank order (lengths may differ).

    Raises:
        UnsupportedError: a process set other than the global one.
        PSError: the ring failed, timed out, or the ranks' trailing shapes or dtypes differ.
    """
    check_process_set(process_set)
    t = tf.convert_to_tensor(tensor)
    if t.shape.rank == 0:
        t = tf.reshape(t, [1])
    w = worker()
    dtype = t.dtype

    def fn(a: np.ndarray) -> list[np.ndarray]:
        a = np.ascontiguousarray(a)
        # Any dtype travels as bytes: gather the rows' bytes, then view them back.
        row = a.reshape(a.shape[0], -1).view(np.uint8) if a.size else np.zeros((a.shape[0], 0), np.uint8)
        gathered = w.ring.allgather(row if row.shape[1] else np.zeros((a.shape[0], 1), np.uint8))
        if not row.shape[1]:
            return [np.zeros((gathered.shape[0], *a.shape[1:]), a.dtype)]
        return [gathered.view(a.dtype).reshape(-1, *a.shape[1:])]

    out = _host_call(fn, [t], [dtype], "hvd_allgather")[0]
    out.set_shape([None, *t.shape[1:]])
    return out


def grouped_allgather(tensors: Sequence[Any], process_set: Any = None, **kwargs: Any) -> list[tf.Tensor]:
    """``allgather`` of each tensor (a list)."""
    return [allgather(t, process_set=process_set) for t in tensors]


def _broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int) -> list[np.ndarray]:
    """Root's arrays on every rank, in one ring broadcast of their bytes (any dtype)."""
    w = worker()
    values = [np.asarray(a) for a in arrays]
    if w.world == 1 or not values:
        return [np.array(a) for a in values]
    # NOTE: np.ascontiguousarray makes a 0-d array 1-d; each array's own shape is restored below.
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in values]
    blob = np.concatenate([*parts, np.zeros(0, np.uint8)])
    blob = w.ring.broadcast(blob, root=root_rank)
    out, offset = [], 0
    for a in values:
        out.append(blob[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape))
        offset += a.nbytes
    return out


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = None,
) -> tf.Tensor:
    """``root_rank``'s value of the tensor, on every rank (same shape and dtype everywhere).

    Raises:
        UnsupportedError: a process set other than the global one.
        PSError: the ring failed or timed out, or the ranks' shapes differ.
    """
    check_process_set(process_set)
    t = tf.convert_to_tensor(tensor)
    out = _host_call(lambda a: _broadcast_arrays([a], root_rank), [t], [t.dtype], "hvd_broadcast")[0]
    out.set_shape(t.shape)
    return out


def broadcast_variables(
    variables: Any, root_rank: int, process_set: Any = None, inplace: bool = False
) -> Any:
    """Assigns ``root_rank``'s values to the variables on every rank, in one ring broadcast.

    Works eagerly and inside a ``tf.function`` (e.g. after the first training step, when the
    optimizer's variables exist). Pass a list of variables (``model.variables``,
    ``optimizer.variables``).

    Returns:
        None eagerly; in a graph, the grouped assign op (TF2 runs it without being asked).

    Raises:
        UnsupportedError: a process set other than the global one.
        PSError: the ring failed or timed out, or the ranks hold different variables.
    """
    check_process_set(process_set)
    if callable(variables) and not hasattr(variables, "assign"):
        variables = variables()  # Keras 2's optimizer.variables() was a method
    variables = list(variables)
    if not variables:
        return None
    values = [
        tf.convert_to_tensor(v.value if hasattr(v, "value") and not callable(v.value) else v)
        for v in variables
    ]
    out = _host_call(
        lambda *a: _broadcast_arrays(a, root_rank),
        values,
        [v.dtype for v in values],
        "hvd_broadcast_variables",
        like_inputs=True,
    )
    assigns = []
    for var, value, new in zip(variables, values, out, strict=True):
        new.set_shape(value.shape)
        assigns.append(var.assign(new))
    if tf.executing_eagerly():
        return None
    return tf.group([a for a in assigns if a is not None and not isinstance(a, tf.Variable)])


def _rows_of(rank_: int, world: int, n: int) -> tuple[int, int]:
    """Horovod's reducescatter split of ``n`` rows: ``n // world`` each, the first ``n % world`` one more."""
    base, extra = divmod(n, world)
    start = rank_ * base + min(rank_, extra)
    return start, start + base + (1 if rank_ < extra else 0)


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    name: str | None = None,
    process_set: Any = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduces the tensor over every rank, then gives rank ``r`` its block of the first axis.

    Blocks as in Horovod: ``n // size`` rows each, the first ``n % size`` ranks one more. (Implemented
    as an all-reduce then a slice: the same result, twice the traffic of a true reduce-scatter.)

    Raises:
        UnsupportedError: ``Adasum``/``Product`` or another process set.
        PSError: the ring failed or timed out.
    """
    check_process_set(process_set)
    op = resolve_op(op)
    t = tf.convert_to_tensor(tensor)
    if t.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with a first axis")
    reduced = _allreduce_dense([t], op, compression, prescale_factor, postscale_factor)[0]
    n = tf.shape(reduced)[0]
    world, me = tf.cast(size_op(), n.dtype), tf.cast(rank_op(), n.dtype)
    base, extra = n // world, n % world
    start = me * base + tf.minimum(me, extra)
    stop = start + base + tf.cast(me < extra, n.dtype)
    return reduced[start:stop]


def grouped_reducescatter(
    tensors: Sequence[Any],
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: Any = None,
    **kwargs: Any,
) -> list[tf.Tensor]:
    """``reducescatter`` of each tensor (a list)."""
    return [reducescatter(t, compression=compression, op=op, process_set=process_set) for t in tensors]


def broadcast_object(
    obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = None
) -> Any:
    """``root_rank``'s Python object (pickled) on every rank. Eager only (call it outside a tf.function).

    Raises:
        UnsupportedError: another process set.
        PSError: the ring failed or timed out.
    """
    check_process_set(process_set)
    return elastic.broadcast_object(worker().ring, obj, root_rank)


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = None
) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (Horovod's ``broadcast_object_fn``)."""
    return lambda obj: broadcast_object(obj, root_rank, process_set=process_set)


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: Any = None
) -> list[Any]:
    """Every rank's Python object (pickled), as a list in rank order. Eager only.

    Raises:
        UnsupportedError: another process set.
        PSError: the ring failed or timed out.
    """
    check_process_set(process_set)
    return elastic.allgather_object(worker().ring, obj)


def join(device: str = "") -> int:
    """Horovod's ``join``: this rank has run out of data; returns the rank that joined last.

    Until every rank has joined, this rank takes part in the all-reduces of the ranks still
    training, contributing zeros, as Horovod's joined ranks do (so ``hvd.Average`` still divides by
    ``hvd.size()``; ``hvd.Min``/``hvd.Max`` ignore joined ranks here, where Horovod reduces their
    zeros too). Broadcasts and all-gathers raise while ranks are joined, as in Horovod. Call it
    eagerly (outside a ``tf.function``), after the rank's last step. Each wait for the others' next
    collective is bounded by the ring's deadline (120 s).

    Raises:
        FailedPreconditionError: the ranks still training called a broadcast or all-gather.
        PSError: the ring failed or timed out.
    """
    return worker().ring.join()
