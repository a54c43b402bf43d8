"""Mirrored (all-reduce) training for ``model.fit`` and ``GradientTape`` loops on the ring collective.

The place of MirroredStrategy (N processes on one machine) and
MultiWorkerMirroredStrategy (one process per machine, the worker list in
``TF_CONFIG``), in the spirit of Horovod. A ``model.fit`` script changes in three
lines::

    import psclient.keras as psk

    worker = psk.AllReduceWorker(["10.0.0.1:7000", "10.0.0.2:7000"], rank=0)  # or from TF_CONFIG
    model.compile(optimizer=psk.AllReduceOptimizer(keras.optimizers.Adam(1e-3), worker),  # 1
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(ds, epochs=5, callbacks=[worker.callback()])                                # 2

and a ``GradientTape`` loop calls ``worker.broadcast_variables(model.variables)``
once, then ``optimizer.apply(worker.allreduce_gradients(grads), model.trainable_variables)``.

How it works:

- Every rank holds a whole replica of the model and trains on its own shard of
  the data. ``worker.callback()`` broadcasts rank 0's weights (and the optimizer's
  state, when already built) to every rank when ``fit`` begins, so the replicas
  start equal.
- ``AllReduceOptimizer`` is the wrapped Keras optimizer's own class (an ``Adam``
  stays an ``Adam``: same update, same saved state) with one change: ``apply``
  first averages the gradients over all ranks with one fused ring all-reduce
  (``op="mean"``), in a ``tf.numpy_function`` inside Keras's compiled train step
  (``fit`` keeps ``tf.function``; XLA ``jit_compile`` must be off). Every rank then
  applies the same averaged gradient to the same weights: the replicas stay equal,
  bit for bit (the ring gives every rank the same bits, and the update is
  deterministic). The callback checks that at the end of training.
- Every rank must run the same number of steps (equal data shards); a rank that
  stops early makes the others fail with a deadline error naming it, never hang.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import keras
import numpy as np
import tensorflow as tf

from psclient.collective import ALLREDUCE_DTYPES, Ring
from psclient.errors import InternalError
from psclient.keras._common import StepTimer, check_no_jit, model_variables, variable_name
from psclient.tf_config import read_tf_config

log = logging.getLogger(__name__)


def ring_from_tf_config(environ: Mapping[str, str] = os.environ) -> tuple[list[str], int]:
    """``(ring addresses, rank)`` of this task: the ``chief`` then ``worker`` tasks of ``TF_CONFIG``.

    As MultiWorkerMirroredStrategy reads it: the chief, when there is one, is rank 0.

    Raises:
        ValueError: TF_CONFIG is unset or malformed, has no workers, or this task is not a worker.
    """
    cfg = read_tf_config(environ, unset_hint="give the ring addresses and rank instead")
    return cfg.workers, cfg.worker_rank()


def _reducible(dtype: tf.DType) -> bool:
    try:
        return np.dtype(dtype.as_numpy_dtype) in ALLREDUCE_DTYPES
    except TypeError:
        return False


class AllReduceWorker:
    """One rank of a mirrored (all-reduce) training job: a ring and the Keras helpers that use it.

    Args:
        addresses: ``HOST:PORT`` of every rank, in rank order (each rank serves on its own);
            default: the ``chief`` + ``worker`` tasks of ``TF_CONFIG``.
        rank: this worker's rank (default: from ``TF_CONFIG``).
        ring: an existing ``psclient.collective.Ring`` to use instead (not closed by ``close``).
        timeout: deadline of each collective in seconds; covers the wait for peers that start late.
        **ring_options: other ``Ring`` settings (``compression="fp16"``, ``auth_token``, ...).

    Raises:
        ValueError: bad addresses or rank, or no addresses and no TF_CONFIG.
        UnavailableError: this rank's address cannot be bound.
    """

    def __init__(
        self,
        addresses: Sequence[str] | None = None,
        rank: int | None = None,
        *,
        ring: Ring | None = None,
        timeout: float = 120.0,
        **ring_options: Any,
    ) -> None:
        if ring is None:
            if addresses is None:
                addresses, tf_rank = ring_from_tf_config()
                rank = tf_rank if rank is None else rank
            if rank is None:
                raise ValueError("give the rank with the addresses")
            ring = Ring(list(addresses), rank, timeout=timeout, **ring_options)
            self._owns_ring = True
        else:
            self._owns_ring = False
        self.ring = ring
        self.steps_done = 0

    @property
    def rank(self) -> int:
        return self.ring.rank

    @property
    def world(self) -> int:
        return self.ring.world

    @property
    def is_chief(self) -> bool:
        return self.ring.rank == 0

    def close(self) -> None:
        """Closes the ring (if this worker made it). Idempotent."""
        if self._owns_ring:
            self.ring.close()

    def __enter__(self) -> AllReduceWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- weights ---------------------------------------------------------------

    def broadcast_variables(self, model_or_variables: Any, root: int = 0) -> None:
        """Gives every rank ``root``'s values of the variables (all of a model's, trainable or not).

        One broadcast carries every variable's bytes. Eager only (call it before the training loop).

        Raises:
            ValueError: the ranks hold different variables (names, shapes or dtypes).
            PSError: the ring failed or timed out (names the rank).
        """
        variables = model_variables(model_or_variables, trainable_only=False)
        self._check_same_layout(variables, "broadcast_variables")
        if self.world == 1 or not variables:
            return
        values = [np.ascontiguousarray(v.numpy()) for v in variables]
        blob = np.concatenate([a.reshape(-1).view(np.uint8) for a in values])
        blob = self.ring.broadcast(blob, root=root)
        offset = 0
        for var, a in zip(variables, values, strict=True):
            part = blob[offset : offset + a.nbytes]
            offset += a.nbytes
            var.assign(part.view(a.dtype).reshape(a.shape))

    def weights_checksums(self, model_or_variables: Any) -> np.ndarray:
        """Every rank's checksum (CRC-32 of the bytes) of its variables, in rank order.

        Raises:
            PSError: the ring failed or timed out.
        """
        variables = model_variables(model_or_variables, trainable_only=False)
        crc = 0
        for v in variables:
            crc = zlib.crc32(np.ascontiguousarray(v.numpy()).tobytes(), crc)
        return self.ring.allgather(np.array([crc], np.int64))

    def weights_in_sync(self, model_or_variables: Any) -> bool:
        """Whether every rank holds bit-identical values of the variables (a collective call).

        Raises:
            PSError: the ring failed or timed out.
        """
        sums = self.weights_checksums(model_or_variables)
        return bool(np.all(sums == sums[0]))

    def _check_same_layout(self, variables: list[Any], what: str) -> None:
        layout = json.dumps([(variable_name(v), list(v.shape), str(v.dtype)) for v in variables])
        sums = self.ring.allgather(np.array([zlib.crc32(layout.encode())], np.int64))
        if not np.all(sums == sums[0]):
            bad = [r for r, s in enumerate(sums) if s != sums[0]]
            raise ValueError(
                f"{what}: rank(s) {bad} hold different variables (names, shapes or dtypes) than rank 0; "
                f"build the same model on every rank (rank {self.rank}: {len(variables)} variables)"
            )

    # -- gradients --------------------------------------------------------------

    def allreduce_arrays(self, arrays: Sequence[np.ndarray], op: str = "mean") -> list[np.ndarray]:
        """All-reduces numpy arrays over the ranks in one fused ring operation (``op="mean"`` averages).

        Raises:
            InvalidArgumentError: an unsupported dtype, or ranks that disagree on shapes.
            PSError: the ring failed or timed out (names the rank).
        """
        if not arrays:
            return []
        self.steps_done += 1
        out = self.ring.allreduce_many([np.asarray(a) for a in arrays], op=op)
        return list(out)

    def allreduce_gradients(self, grads: Sequence[Any], op: str = "mean") -> list[Any]:
        """Averages (``op``) gradients over all ranks; eager or inside a ``tf.function``.

        ``None`` entries stay ``None`` (every rank must have the same ``None`` entries);
        sparse gradients are densified; dtypes the ring does not reduce (bfloat16) travel as float32.

        Raises:
            PSError: the ring failed or timed out (wrapped by TensorFlow inside a graph).
        """
        grads = list(grads)
        index = [i for i, g in enumerate(grads) if g is not None]
        if not index:
            return grads
        tensors = [tf.convert_to_tensor(grads[i]) for i in index]
        wire = [t if _reducible(t.dtype) else tf.cast(t, tf.float32) for t in tensors]
        if tf.executing_eagerly():
            reduced = [tf.constant(a) for a in self.allreduce_arrays([t.numpy() for t in wire], op=op)]
        else:

            def fn(*arrays: np.ndarray) -> list[np.ndarray]:
                return self.allreduce_arrays(arrays, op=op)

            reduced = tf.numpy_function(
                fn, wire, Tout=[t.dtype for t in wire], stateful=True, name="ring_allreduce"
            )
            for r, t in zip(reduced, wire, strict=True):
                r.set_shape(t.shape)
        out = list(grads)
        for i, r, t in zip(index, reduced, tensors, strict=True):
            out[i] = r if r.dtype == t.dtype else tf.cast(r, t.dtype)
        return out

    # -- Keras -----------------------------------------------------------------

    def callback(self, *, check_sync: bool = True) -> AllReduceCallback:
        """The ``fit`` callback: broadcast rank 0's weights at train begin, check the replicas at the end."""
        return AllReduceCallback(self, check_sync=check_sync)


class AllReduceOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer that averages the gradients over all ranks before it applies them.

    ``AllReduceOptimizer(keras.optimizers.Adam(1e-3), worker)`` is an ``Adam`` (a
    subclass made for it, with the same name and configuration) whose ``apply``
    (and so ``apply_gradients`` and Keras's ``fit``) all-reduces first. Every
    setting of the wrapped optimizer works (schedules, clipping of the averaged
    gradient, weight decay, EMA).

    Args:
        optimizer: the Keras optimizer to wrap (its configuration is copied; it is not used).
        worker: the ``AllReduceWorker`` whose ring averages the gradients.

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer, or ``worker`` not an ``AllReduceWorker``.
    """

    _classes: ClassVar[dict[type, type]] = {}

    def __new__(cls, optimizer: Any = None, worker: Any = None, **kwargs: Any) -> AllReduceOptimizer:
        if cls is not AllReduceOptimizer:
            return super().__new__(cls)
        if isinstance(optimizer, AllReduceOptimizer):
            raise TypeError("the optimizer is already an AllReduceOptimizer")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"AllReduceOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer)!r}")
        base = type(optimizer)
        sub = cls._classes.get(base)
        if sub is None:
            sub = type(base.__name__, (AllReduceOptimizer, base), {"__module__": base.__module__})
            cls._classes[base] = sub
        return super().__new__(sub)

    def __init__(self, optimizer: keras.optimizers.Optimizer, worker: AllReduceWorker) -> None:
        if not isinstance(worker, AllReduceWorker):
            raise TypeError(f"worker must be a psclient.keras.AllReduceWorker, got {type(worker)!r}")
        super().__init__(**optimizer.get_config())
        self.allreduce_worker = worker

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        return super().apply(self.allreduce_worker.allreduce_gradients(grads), trainable_variables)


class AllReduceCallback(StepTimer):
    """Broadcasts rank 0's weights when ``fit`` begins; checks that the replicas agree when it ends.

    Also records throughput: ``steps_per_second`` (steps after the first, which traces the graph).

    Args:
        worker: the ``AllReduceWorker``.
        check_sync: at train end, compare a checksum of every rank's weights (raise if they differ).
    """

    def __init__(self, worker: AllReduceWorker, *, check_sync: bool = True) -> None:
        super().__init__()
        self.worker = worker
        self.check_sync = check_sync

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        check_no_jit(model, "all-reduce training")
        if not isinstance(model.optimizer, AllReduceOptimizer):
            raise ValueError(
                "compile the model with psclient.keras.AllReduceOptimizer(keras_optimizer, worker)"
            )
        variables = list(model.variables)
        if model.optimizer.built:
            variables += list(model.optimizer.variables)
        self.worker.broadcast_variables(variables)
        log.info("rank %d/%d: %d variables from rank 0", self.worker.rank, self.worker.world, len(variables))

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_end(logs)
        if self.check_sync:
            sums = self.worker.weights_checksums(self.model.variables)
            if not np.all(sums == sums[0]):
                raise InternalError(
                    f"rank {self.worker.rank}: replicas diverged (weight checksums by rank {sums.tolist()})"
                )


__all__ = [
    "AllReduceCallback", "AllReduceOptimizer", "AllReduceWorker", "ring_from_tf_config",
]  # fmt: skip
