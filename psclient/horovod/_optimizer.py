"""Horovod's ``DistributedOptimizer`` and ``DistributedGradientTape`` on ``psclient.keras``'s all-reduce."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from psclient.horovod._compression import Compression, Compressor
from psclient.horovod._ops import Average, Sum, resolve_op, size_op
from psclient.horovod._state import check_process_set, unsupported, worker
from psclient.keras import AllReduceOptimizer, AllReduceWorker


class _HorovodReducer(AllReduceWorker):
    """The process's ring with Horovod's gradient options (op, compression, scale factors).

    ``AllReduceOptimizer.apply`` hands it the gradients followed by the model's non-trainable
    statistics (BatchNorm moving averages, when attached); the options apply to the gradients only,
    the statistics are always averaged as they are.
    """

    def __init__(
        self, *, op: int, compression: type[Compressor], scale: float, sparse_as_dense: bool
    ) -> None:
        super().__init__(ring=worker().ring)
        self.op = op
        self.compression = compression
        self.scale = scale  # gradients are multiplied by it (backward passes summed, not averaged)
        self.sparse_as_dense = sparse_as_dense
        self._optimizer: Any = None

    def bind(self, optimizer: AllReduceOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def _num_statistics(self) -> int:
        opt = self._optimizer() if self._optimizer is not None else None
        averaged = getattr(opt, "_averaged", None)
        return len(averaged.variables()) if averaged is not None else 0

    def allreduce_gradients(self, grads: Sequence[Any], op: str = "mean") -> list[Any]:
        items = list(grads)
        n = len(items) - self._num_statistics()
        head: list[Any] = []
        ctxs: list[Any] = []
        for g in items[:n]:
            if g is None:
                head.append(None)
                ctxs.append(None)
                continue
            # NOTE: sparse gradients are always densified (the ring reduces dense tensors).
            t = tf.convert_to_tensor(g)
            if self.scale != 1.0:
                t = t * tf.cast(self.scale, t.dtype)
            t, ctx = self.compression.compress(t)
            head.append(t)
            ctxs.append((ctx, tf.convert_to_tensor(g).dtype))
        reduced = super().allreduce_gradients(head + items[n:], op="mean")
        out = []
        for r, ctx in zip(reduced[:n], ctxs, strict=True):
            if r is None:
                out.append(None)
                continue
            r = self.compression.decompress(r, ctx[0])
            r = tf.cast(r, ctx[1]) if r.dtype != ctx[1] else r
            out.append(r * tf.cast(size_op(), r.dtype) if self.op == Sum else r)
        return out + list(reduced[n:])


def _check_common(
    op: int, gradient_predivide_factor: float, groups: Any, num_groups: int, process_set: Any
) -> int:
    check_process_set(process_set)
    op = resolve_op(op)
    if op not in (Average, Sum):
        raise ValueError("op currently only supports hvd.Average and hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a positive integer or a list of lists of variables")
    return op


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> AllReduceOptimizer:
    """A Keras optimizer that all-reduces the gradients before it applies them (Horovod's).

    It is a ``psclient.keras.AllReduceOptimizer``: the wrapped optimizer's own class (an ``Adam`` stays
    an ``Adam`` and saves as one) whose ``apply`` averages (``op=hvd.Average``) or sums
    (``op=hvd.Sum``) the gradients over all ranks in one fused ring all-reduce.

    Args:
        optimizer: a Keras 3 optimizer (or its name).
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16`` (float gradients travel as float16).
        sparse_as_dense: accepted; sparse gradients are always densified before the ring.
        gradient_predivide_factor: accepted (with ``Average`` it only moves where the division happens).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        backward_passes_per_step: apply every N batches (Keras's ``gradient_accumulation_steps``);
            the gradients of the N batches are summed, or averaged with ``average_aggregated_gradients``.
        name, device_dense, device_sparse, num_groups, groups, scale_local_gradients: accepted, ignored
            (there is one fused all-reduce per step, on the host).

    Raises:
        ValueError: an op other than Average/Sum, ``backward_passes_per_step < 1``, or ``init`` not run.
        UnsupportedError: ``Adasum`` or a process set.
        TypeError: not a Keras 3 optimizer.
    """
    op = _check_common(op, gradient_predivide_factor, groups, num_groups, process_set)
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    accumulates = isinstance(optimizer, keras.optimizers.Optimizer) and optimizer.gradient_accumulation_steps
    if accumulates and backward_passes_per_step > 1:
        raise ValueError(
            "give backward_passes_per_step or the optimizer's gradient_accumulation_steps, not both"
        )
    scale = 1.0
    if backward_passes_per_step > 1 and not average_aggregated_gradients:
        scale = float(backward_passes_per_step)  # Keras averages the accumulated batches; Horovod sums them
    reducer = _HorovodReducer(op=op, compression=compression, scale=scale, sparse_as_dense=sparse_as_dense)
    opt = AllReduceOptimizer(optimizer, reducer)
    reducer.bind(opt)
    if backward_passes_per_step > 1:
        target = getattr(opt, "inner_optimizer", opt)  # a LossScaleOptimizer accumulates in its inner one
        target.gradient_accumulation_steps = backward_passes_per_step
    return opt


class _DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient`` all-reduces (see ``DistributedGradientTape``)."""

    def __init__(self, tape: tf.GradientTape, reducer: _HorovodReducer, scale_local_gradients: bool) -> None:
        self._tape = tape
        self._reducer = reducer
        self._scale_local = scale_local_gradients
        self._local_sources: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> _DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def register_local_source(self, source: Any) -> None:
        """Leaves this source's gradient out of the all-reduce (divided by the size, as Horovod does)."""
        self._local_sources.add(id(source))

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """The tape's gradients, all-reduced over the ranks (same structure as ``sources``)."""
        grads = self._tape.gradient(
            target, sources, output_gradients=output_gradients, unconnected_gradients=unconnected_gradients
        )
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        shared = [i for i, s in enumerate(flat_sources) if id(s) not in self._local_sources]
        reduced = self._reducer.allreduce_gradients([flat[i] for i in shared])
        out = list(flat)
        for i, r in zip(shared, reduced, strict=True):
            out[i] = r
        if self._scale_local:
            for i, s in enumerate(flat_sources):
                if id(s) in self._local_sources and out[i] is not None:
                    out[i] = tf.convert_to_tensor(out[i]) / tf.cast(size_op(), out[i].dtype)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(
        self, target: Any, sources: Sequence[Any], output_gradients: Any = None
    ) -> tuple[list[Any], list[Any]]:
        """``(local, global)`` lists of ``(source, gradient)`` pairs."""
        grads = self.gradient(target, list(sources), output_gradients=output_gradients)
        local = [(s, g) for s, g in zip(sources, grads, strict=True) if id(s) in self._local_sources]
        shared = [(s, g) for s, g in zip(sources, grads, strict=True) if id(s) not in self._local_sources]
        return local, shared


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """Wraps a ``tf.GradientTape`` so that ``gradient`` all-reduces (averages) over every rank.

    Eager or inside a ``tf.function``. ``register_local_source(var)`` keeps a source's gradient local.

    Raises:
        ValueError: an op other than Average/Sum, or ``init`` not run.
        UnsupportedError: ``Adasum`` or a process set.
    """
    op = _check_common(op, gradient_predivide_factor, groups, num_groups, process_set)
    reducer = _HorovodReducer(op=op, compression=compression, scale=1.0, sparse_as_dense=sparse_as_dense)
    return _DistributedGradientTape(gradtape, reducer, scale_local_gradients)


def PartialDistributedGradientTape(*args: Any, **kwargs: Any) -> Any:
    """Not supported (raises UnsupportedError)."""
    unsupported(
        "hvd.PartialDistributedGradientTape",
        "use hvd.DistributedGradientTape and tape.register_local_source(var) for each local layer's "
        "variables",
    )


def broadcast_global_variables(root_rank: int = 0) -> Any:
    """Not available in TensorFlow 2 (no global variables): raises RuntimeError (as Horovod does eagerly)."""
    raise RuntimeError(
        "hvd.broadcast_global_variables: TensorFlow 2 has no global variables; use "
        "hvd.broadcast_variables(model.variables, root_rank) and "
        "hvd.broadcast_variables(optimizer.variables, root_rank) after the first step, or "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) with model.fit"
    )
