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

and a ``GradientTape`` loop calls ``worker.broadcast_variables(model)`` and
``optimizer.attach(model)`` once, then ``optimizer.apply(grads, model.trainable_variables)``
each step.

How it works:

- Every rank holds a whole replica of the model and trains on its own shard of
  the data. ``worker.callback()`` broadcasts rank 0's weights (and the optimizer's
  state, when already built) to every rank when ``fit`` begins, so the replicas
  start equal. A model that ``fit`` builds lazily (a ``Sequential`` without an
  ``Input``) has no weights yet at that point: its weights and the optimizer's
  state are broadcast at the end of the first step instead (as Horovod's
  ``BroadcastGlobalVariablesCallback`` does), so the first step's update is rank 0's.
- ``AllReduceOptimizer`` is the wrapped Keras optimizer's own class (an ``Adam``
  stays an ``Adam``: same update, same saved state, and it serializes as a plain
  ``Adam``, so a saved model loads without psclient) with one change: ``apply``
  (and so ``apply_gradients``, Keras's ``fit`` and a custom ``train_step``) first
  averages the gradients over all ranks with one fused ring all-reduce
  (``op="mean"``), host code inside Keras's compiled train step, staged by the
  backend's adapter (``psclient.keras._backend``: a ``tf.numpy_function`` on
  TensorFlow, where XLA ``jit_compile`` must be off; an ``io_callback`` in JAX's
  jitted step; a direct call in PyTorch's eager one). Every rank then
  applies the same averaged gradient to the same weights with the same settings
  (learning-rate schedule, clipping and weight decay of the averaged gradient,
  gradient accumulation, EMA): the replicas stay equal, bit for bit (the ring
  gives every rank the same bits, and the update is deterministic). The callback
  checks that at the end of training.
- Non-trainable state that the forward pass updates (BatchNormalization's moving
  mean and variance) is averaged too, in the same fused all-reduce of each step:
  the current values of the float non-trainable variables of the model's
  trainable layers (layers frozen with ``trainable=False`` hold constants and are
  left out) travel with the gradients and every rank assigns the means back.
  Such a variable that the step does not change (a ``Normalization`` layer's
  adapted mean) gets the mean of equal values: itself with 2 ranks, possibly an
  ulp away with more (the same bits on every rank either way).
  This is not SyncBatchNorm: each rank still normalizes its batch with its own
  batch statistics; only the moving statistics (used at inference) are averaged
  after every step, so all replicas hold identical statistics, which are the mean
  of the ranks' updates (with momentum ``m``, ``m * old + (1 - m) * mean of the
  ranks' batch means``; the moving variance averages the per-rank batch variances
  and so leaves out the spread between the ranks' batch means). The callback
  tells the compiled optimizer which model to average; a ``GradientTape`` loop
  calls ``optimizer.attach(model)``. On JAX the optimizer's stateless step sees
  the statistics as they were before the forward pass: ``fit``'s step is
  wrapped (``DeferredExchanges.defer_state``, the JAX adapter) and the new
  statistics are averaged in a second ring operation once the step returned them.
- Loss scaling (``mixed_float16``): the scaled gradients are averaged before the
  ``LossScaleOptimizer`` checks them for inf/NaN, so every rank takes the same
  decision. ``AllReduceOptimizer(LossScaleOptimizer(opt), worker)`` is a
  ``LossScaleOptimizer`` that does this; the other order, which ``compile`` makes
  under a ``mixed_float16`` policy, is converted by the callback when ``fit``
  begins.
- Every rank must run the same number of steps (equal data shards); a rank that
  stops early makes the others fail with a deadline error naming it, never hang.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import keras
import numpy as np

from psclient.collective import ALLREDUCE_DTYPES, Ring
from psclient.keras import _backend
from psclient.keras._common import Deferred, DeferredExchanges, StepTimer, model_variables, variable_name
from pscore.errors import InternalError
from pscore.tf_config import read_tf_config

log = logging.getLogger(__name__)


def ring_from_tf_config(environ: Mapping[str, str] = os.environ) -> tuple[list[str], int]:
    """``(ring addresses, rank)`` of this task: the ``chief`` then ``worker`` tasks of ``TF_CONFIG``.

    As MultiWorkerMirroredStrategy reads it: the chief, when there is one, is rank 0.

    Raises:
        ValueError: TF_CONFIG is unset or malformed, has no workers, or this task is not a worker.
    """
    cfg = read_tf_config(environ, unset_hint="give the ring addresses and rank instead")
    return cfg.workers, cfg.worker_rank()


def _reducible(dtype: Any) -> bool:
    try:
        return np.dtype(keras.backend.standardize_dtype(dtype)) in ALLREDUCE_DTYPES
    except TypeError:
        return False


class AllReduceWorker(DeferredExchanges):
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
        # NOTE: np.ascontiguousarray makes a 0-d array 1-d; the variable's own shape is restored below.
        values = [np.ascontiguousarray(keras.ops.convert_to_numpy(v)) for v in variables]
        blob = np.concatenate([a.reshape(-1).view(np.uint8) for a in values])
        blob = self.ring.broadcast(blob, root=root)
        offset = 0
        for var, a in zip(variables, values, strict=True):
            part = blob[offset : offset + a.nbytes]
            offset += a.nbytes
            var.assign(part.view(a.dtype).reshape(tuple(var.shape)))

    def weights_checksums(self, model_or_variables: Any) -> np.ndarray:
        """Every rank's checksum (CRC-32 of the bytes) of its variables, in rank order.

        Raises:
            PSError: the ring failed or timed out.
        """
        variables = model_variables(model_or_variables, trainable_only=False)
        crc = 0
        for v in variables:
            crc = zlib.crc32(np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes(), crc)
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
        tensors = [keras.ops.convert_to_tensor(grads[i]) for i in index]
        wire = [t if _reducible(t.dtype) else keras.ops.cast(t, "float32") for t in tensors]

        def fn(*arrays: np.ndarray) -> list[np.ndarray]:
            return self.allreduce_arrays(arrays, op=op)

        specs = [(tuple(t.shape), keras.backend.standardize_dtype(t.dtype)) for t in wire]
        reduced = _backend.adapter().host_call(fn, wire, specs, "ring_allreduce")
        out = list(grads)
        for i, r, t in zip(index, reduced, tensors, strict=True):
            same = keras.backend.standardize_dtype(r.dtype) == keras.backend.standardize_dtype(t.dtype)
            out[i] = r if same else keras.ops.cast(r, t.dtype)
        return out

    # -- Keras -----------------------------------------------------------------

    def callback(self, *, check_sync: bool = True) -> AllReduceCallback:
        """The ``fit`` callback: broadcast rank 0's weights at train begin, check the replicas at the end."""
        return AllReduceCallback(self, check_sync=check_sync)


def _keras_optimizer(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, str | dict):
        return keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"AllReduceOptimizer wraps a keras.optimizers.Optimizer or its name, got {type(optimizer)!r}"
        )
    return optimizer


def _constructor_kwargs(optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """The keyword arguments that make a fresh copy of a (non loss-scale) Keras optimizer."""
    config = optimizer.get_config()
    # get_config serializes a schedule (or callable) to a dict that the constructor refuses; pass the
    # object itself (a user-written schedule need not be registered for serialization).
    lr = getattr(optimizer, "_learning_rate", None)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(lr) and not isinstance(lr, keras.Variable)
    ):
        config["learning_rate"] = lr
    elif isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = keras.optimizers.schedules.deserialize(config["learning_rate"])
    return config


def _trainable_layers_stats(model: keras.layers.Layer) -> list[Any]:
    """The float non-trainable variables that the model's trainable layers create (BatchNorm statistics).

    A frozen layer's weights (trainable variables of a ``trainable=False`` layer) and the state of frozen
    layers (a frozen BatchNorm does not update its statistics) are left out: they do not change.
    """
    out, seen = [], set()
    # NOTE: Keras 3 has no public API for a layer's own variables created with trainable=False.
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not layer.trainable:
            continue
        for v in layer._non_trainable_variables:
            if id(v) not in seen and _is_float(v.dtype):
                seen.add(id(v))
                out.append(v)
    return out


def _is_float(dtype: Any) -> bool:
    return bool(keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype)))


class _AveragedState:
    """What an ``AllReduceOptimizer`` averages besides the gradients (kept out of Keras/TF tracking)."""

    def __init__(self, source: Any) -> None:
        if isinstance(source, keras.layers.Layer):
            self._model: Any = weakref.ref(source)
            self._variables: list[Any] = []
        else:
            self._model = None
            self._variables = [v for v in source if _is_float(v.dtype)]

    def variables(self) -> list[Any]:
        if self._model is None:
            return list(self._variables)
        model = self._model()
        return [] if model is None else _trainable_layers_stats(model)


class AllReduceOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer that averages the gradients over all ranks before it applies them.

    ``AllReduceOptimizer(keras.optimizers.Adam(1e-3), worker)`` is an ``Adam`` (a
    subclass made for it, with the same name and configuration, which serializes as
    a plain ``Adam``: a saved model loads without psclient) whose ``apply`` (and so
    ``apply_gradients``, Keras's ``fit`` and a custom ``train_step``) all-reduces
    first. Every setting of the wrapped optimizer works and acts on the averaged
    gradient: learning-rate schedules, ``clipnorm``/``clipvalue``/``global_clipnorm``,
    weight decay, ``gradient_accumulation_steps`` (each micro-step's gradient is
    averaged), EMA. ``AllReduceOptimizer(LossScaleOptimizer(opt), worker)`` is a
    ``LossScaleOptimizer`` that averages the scaled gradients before its inf/NaN
    check, so every rank skips or applies the same steps (``fit`` with the callback
    also converts ``LossScaleOptimizer(AllReduceOptimizer(opt))``, which ``compile``
    makes under ``mixed_float16``; a ``GradientTape`` loop uses this order).

    With ``attach(model)`` (the callback does it in ``fit``), each step also averages
    the model's non-trainable statistics (BatchNorm moving mean and variance) in the
    same fused all-reduce; see the module docstring.

    Args:
        optimizer: the Keras optimizer to wrap, or its name (``"adam"``); its configuration is copied,
            the object itself is not used.
        worker: the ``AllReduceWorker`` whose ring averages the gradients.

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer (or is already an ``AllReduceOptimizer``), or
            ``worker`` is not an ``AllReduceWorker``.
    """

    _classes: ClassVar[dict[type, type]] = {}

    @classmethod
    def _subclass_for(cls, base: type) -> type:
        sub = cls._classes.get(base)
        if sub is None:
            # NOTE: __class__ answers the wrapped class, so Keras serializes the optimizer as the plain class
            # (get_config, registered name); isinstance(opt, AllReduceOptimizer) still holds (type(opt)).
            sub = type(
                base.__name__,
                (AllReduceOptimizer, base),
                {
                    "__module__": base.__module__,
                    "__qualname__": base.__qualname__,
                    "__class__": property(lambda _: base),
                },
            )
            cls._classes[base] = sub
        return sub

    def __new__(cls, optimizer: Any = None, worker: Any = None, **kwargs: Any) -> AllReduceOptimizer:
        if cls is not AllReduceOptimizer:
            return super().__new__(cls)
        optimizer = _keras_optimizer(optimizer)
        if isinstance(optimizer, AllReduceOptimizer) or isinstance(
            getattr(optimizer, "inner_optimizer", None), AllReduceOptimizer
        ):
            raise TypeError("the optimizer is already an AllReduceOptimizer")
        return super().__new__(cls._subclass_for(type(optimizer)))

    def __init__(self, optimizer: Any, worker: AllReduceWorker) -> None:
        if not isinstance(worker, AllReduceWorker):
            raise TypeError(f"worker must be a psclient.keras.AllReduceWorker, got {type(worker)!r}")
        optimizer = _keras_optimizer(optimizer)
        if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
            config = optimizer.get_config()
            inner = optimizer.inner_optimizer
            super().__init__(
                type(inner)(**_constructor_kwargs(inner)),
                initial_scale=config["initial_scale"],
                dynamic_growth_steps=config["dynamic_growth_steps"],
                name=config["name"],
            )
        else:
            super().__init__(**_constructor_kwargs(optimizer))
        self._init_allreduce(worker)

    def _init_allreduce(self, worker: AllReduceWorker) -> None:
        self.allreduce_worker = worker
        self._averaged: _AveragedState | None = None
        self._reduces = True  # False: an enclosing AllReduceOptimizer (a LossScaleOptimizer) reduces

    def attach(self, model_or_variables: Any) -> None:
        """Also averages these non-trainable variables over the ranks in each step (``apply``).

        Given a model, the float non-trainable variables of its trainable layers, looked up when the step
        is traced (so a model built lazily, by its first call, works): BatchNorm's moving mean and
        variance, and the like. Given variables, those (float ones). ``fit`` with ``worker.callback()``
        attaches the model for you; a ``GradientTape`` loop calls this once before training. Every rank
        must attach the same model.

        Raises:
            TypeError: neither a Keras layer/model nor a sequence of variables.
        """
        source = model_or_variables
        if not isinstance(source, keras.layers.Layer):
            source = list(source)
            if not all(hasattr(v, "assign") and hasattr(v, "dtype") for v in source):
                raise TypeError("attach takes a Keras model or a sequence of variables")
        self._averaged = _AveragedState(source)

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        if not self._reduces or len(grads) == 0:
            return super().apply(grads, trainable_variables)
        grads = list(grads)
        state = self._averaged.variables() if self._averaged is not None else []
        if state and not _backend.adapter().shared_state_in_step:
            deferred = self.allreduce_worker._deferred
            if deferred is None:  # not in fit's wrapped step (a custom loop on JAX)
                raise _backend.unsupported(
                    "averaging non-trainable state over the ring in the optimizer's step outside fit "
                    f"(BatchNorm statistics: {', '.join(variable_name(v) for v in state[:3])})"
                )
            deferred.append(self._average_after_step(state))
            state = []
        values = [v.value if isinstance(v, keras.Variable) else keras.ops.convert_to_tensor(v) for v in state]
        reduced = self.allreduce_worker.allreduce_gradients(grads + values)
        for var, mean in zip(state, reduced[len(grads) :], strict=True):
            var.assign(mean)
        return super().apply(reduced[: len(grads)], trainable_variables)

    def _average_after_step(self, state: list[Any]) -> Deferred:
        """JAX: the statistics the step computed, averaged over the ring once the step returned them (its own
        ring operation after the gradients'; see ``DeferredExchanges``)."""
        worker = self.allreduce_worker

        def exchange(state_of: Callable[[Any], Any]) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
            reduced = worker.allreduce_gradients([state_of(v) for v in state])
            return [], list(zip(state, reduced, strict=True))

        return exchange


def _collective_optimizer(optimizer: Any) -> AllReduceOptimizer | None:
    """The model's optimizer as the ``AllReduceOptimizer`` that reduces, or None if there is none.

    ``LossScaleOptimizer(AllReduceOptimizer(opt))`` (what ``compile`` makes under ``mixed_float16``) is turned
    into an ``AllReduceOptimizer`` in place (its state kept): the loss-scale optimizer must see the averaged
    gradients, or ranks would skip different steps.
    """
    if isinstance(optimizer, AllReduceOptimizer):
        return optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer) and isinstance(
        inner, AllReduceOptimizer
    ):
        object.__setattr__(optimizer, "__class__", AllReduceOptimizer._subclass_for(type(optimizer)))
        optimizer._init_allreduce(inner.allreduce_worker)
        inner._reduces = False
        return optimizer
    return None


class AllReduceCallback(StepTimer):
    """Broadcasts rank 0's weights when ``fit`` begins; checks that the replicas agree when it ends.

    A model not built when ``fit`` begins (built by its first step) is broadcast, with the optimizer's
    state, at the end of the first step. The compiled optimizer is attached to the model (its
    non-trainable statistics are averaged each step). Also records throughput: ``steps_per_second``
    (steps after the first, which traces the graph).

    Args:
        worker: the ``AllReduceWorker``.
        check_sync: at train end, compare a checksum of every rank's weights (raise if they differ).

    Raises:
        ValueError: (in ``fit``) the model is not compiled with an ``AllReduceOptimizer``, or uses XLA.
        InternalError: (at the end of ``fit``) the replicas' weights differ.
    """

    def __init__(self, worker: AllReduceWorker, *, check_sync: bool = True) -> None:
        super().__init__()
        self.worker = worker
        self.check_sync = check_sync
        self._broadcast_pending = False
        self._averaging: keras.Model | None = None  # the model whose evaluate averages over the ranks

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        model = self.model
        _backend.adapter().prepare_fit(self.worker, model, "all-reduce training")
        optimizer = _collective_optimizer(model.optimizer)
        # A custom train_step may apply its own optimizers (a GAN's d_optimizer and g_optimizer).
        own = [o for o in (_collective_optimizer(v) for v in vars(model).values()) if o is not None]
        if optimizer is None and not own:
            raise ValueError(
                "compile the model with psclient.keras.AllReduceOptimizer(keras_optimizer, worker), got "
                f"{type(model.optimizer).__name__}"
            )
        for opt in {id(o): o for o in [optimizer, *own] if o is not None}.values():
            opt.attach(model)
        self._average_validation(model)
        if not model.built or not model.variables:
            # Built by the first step (a Sequential without Input): broadcast after it.
            self._broadcast_pending = True
            log.info(
                "rank %d/%d: model not built yet, broadcast after the first step",
                self.worker.rank,
                self.worker.world,
            )
            return
        self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_train_batch_end(batch, logs)
        if self._broadcast_pending:
            self._broadcast_pending = False
            self._broadcast()

    def _average_validation(self, model: keras.Model) -> None:
        """While ``fit`` runs, its validation (``model.evaluate``) returns the metrics averaged over the
        ranks, so that every callback on every rank reads the same ``val_*`` whatever its place in the
        list: an ``EarlyStopping`` on ``val_loss`` stops every rank at the same epoch and restores the same
        weights. (Keras hands each callback list a copy of the logs: averaging them in a callback reaches
        only the callbacks after it.)"""
        evaluate = model.evaluate

        def averaged(*args: Any, **kwargs: Any) -> Any:
            logs = evaluate(*args, **kwargs)
            if isinstance(logs, dict) and logs:
                names = sorted(logs)
                values = [np.asarray(logs[n], np.float64).reshape(-1) for n in names]
                means = self.worker.ring.allreduce_many(values, op="mean")
                logs = {n: float(m[0]) if m.size == 1 else m for n, m in zip(names, means, strict=True)}
            return logs

        object.__setattr__(model, "evaluate", averaged)  # an instance attribute: fit calls self.evaluate
        self._averaging = model

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """A rank that stops (a callback on a metric of its own) stops them all: a rank that went on
        alone would wait in collectives the others never make."""
        super().on_epoch_end(epoch, logs)
        stop = self.worker.ring.allreduce(np.array([float(bool(self.model.stop_training))]), op="max")
        self.model.stop_training = bool(stop[0] > 0)

    def _broadcast(self) -> None:
        model = self.model
        variables = list(model.variables)
        if model.optimizer.built:
            variables += list(model.optimizer.variables)
        self.worker.broadcast_variables(variables)
        log.info("rank %d/%d: %d variables from rank 0", self.worker.rank, self.worker.world, len(variables))

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_end(logs)
        if self._averaging is not None:  # the model's own evaluate again
            vars(self._averaging).pop("evaluate", None)
            self._averaging = None
        if self.check_sync:
            sums = self.worker.weights_checksums(self.model.variables)
            if not np.all(sums == sums[0]):
                raise InternalError(
                    f"rank {self.worker.rank}: replicas diverged (weight checksums by rank {sums.tolist()})"
                )


__all__ = [
    "AllReduceCallback", "AllReduceOptimizer", "AllReduceWorker", "ring_from_tf_config",
]  # fmt: skip
