"""``DistributedOptimizer``: a Keras optimizer whose updates the shards make, and the server-side spec of a
Keras optimizer (``server_optimizer``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import keras

from pscore.optimizers import Optimizer, optimizer_from_config

if TYPE_CHECKING:
    from psclient.keras._ps.worker import PSWorker

log = logging.getLogger(__name__)


# Keras optimizer settings the worker applies itself (they are not per-variable rules).
_WORKER_SIDE_KEYS = ("global_clipnorm", "gradient_accumulation_steps")


def _keras_optimizer(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, str | dict):
        return keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer or its name, got {type(optimizer)!r}")
    return optimizer


def _unwrap_loss_scale(optimizer: Any) -> Any:
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def server_optimizer(optimizer: Any) -> Optimizer:
    """The server-side optimizer spec matching a Keras 3 optimizer (or its name, e.g. ``"adam"``).

    Settings the worker applies itself (``global_clipnorm``, ``gradient_accumulation_steps``,
    loss scaling) are not part of the spec.

    Raises:
        ValueError: an optimizer or setting the shards do not implement.
        TypeError: not an optimizer.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.server_optimizer
    inner = _keras_optimizer(_unwrap_loss_scale(optimizer))
    config = {k: v for k, v in inner.get_config().items() if k not in _WORKER_SIDE_KEYS}
    return optimizer_from_config(type(inner).__name__, config)


def _row_optimizer(optimizer: Any) -> Optimizer | None:
    """The server-side spec of ``optimizer`` when the shards can apply it to a table row by row, else None."""
    if optimizer is None:
        return None
    try:
        spec = server_optimizer(optimizer)
    except (TypeError, ValueError):
        return None
    return None if spec.needs_whole_variable or spec.gradient_accumulation_steps else spec


class DistributedOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer whose updates happen on the parameter server.

    ``DistributedOptimizer(keras.optimizers.Adam(1e-3), worker)`` is an ``Adam`` (a
    subclass made for it, with the same name and configuration, so a saved model
    loads as a plain ``Adam`` without psclient) whose updates are done by the shards
    with the same rule; it keeps no slots on the worker. A ``LossScaleOptimizer``
    stays outside: ``DistributedOptimizer(LossScaleOptimizer(Adam()), w)`` returns
    ``LossScaleOptimizer(DistributedOptimizer(Adam(), w))``. Use with
    ``model.compile(optimizer=...)`` and ``worker.callback()``.

    With ``use_ema=True`` the shards keep the moving average of each variable (an
    optimizer slot, updated after each update as Keras does, and written into the
    variable every ``ema_overwrite_frequency`` updates); the worker keeps none. At
    the end of ``fit`` (Keras's ``finalize_variable_values``) each worker reads the
    averages, writes them into the shards' variables (Keras overwrites the
    variables with their averages: a later ``fit``, an evaluator or a checkpoint
    sees them) and into its model, so the model ends as local Keras's does. The
    shards count updates per variable (Keras counts the optimizer's steps: the
    same while every step updates every variable). With ``gradient_accumulation_steps``
    (done by the worker) the shards move the average once per push, Keras on
    every step. ``keras.callbacks.SwapEMAWeights`` is not supported (it reads
    averages kept on the worker).

    Args:
        optimizer: a Keras optimizer, or its name (``"adam"``).
        worker: the ``PSWorker`` to train on.

    Raises:
        ValueError: an optimizer or setting the shards do not implement.
        TypeError: not a Keras optimizer, or ``worker`` is not a ``PSWorker``.
    """

    _classes: ClassVar[dict[type, type]] = {}

    def __new__(cls, optimizer: Any = None, worker: Any = None, **kwargs: Any) -> Any:
        if cls is not DistributedOptimizer:
            return super().__new__(cls)
        if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
            config = optimizer.get_config()
            return keras.mixed_precision.LossScaleOptimizer(
                DistributedOptimizer(optimizer.inner_optimizer, worker, **kwargs),
                initial_scale=config["initial_scale"],
                dynamic_growth_steps=config["dynamic_growth_steps"],
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a DistributedOptimizer")
        base = type(_keras_optimizer(optimizer))
        sub = cls._classes.get(base)
        if sub is None:
            sub = type(base.__name__, (DistributedOptimizer, base), {"__module__": base.__module__})
            cls._classes[base] = sub
        return super().__new__(sub)

    def __init__(self, optimizer: Any, worker: PSWorker, name: str | None = None) -> None:
        from psclient.keras._ps.worker import PSWorker  # which imports this module

        if not isinstance(worker, PSWorker):
            raise TypeError(f"worker must be a psclient.keras.PSWorker, got {type(worker)!r}")
        inner = _keras_optimizer(optimizer)
        spec = server_optimizer(inner)  # refuses what the shards cannot do, first
        config = inner.get_config()
        if isinstance(config.get("learning_rate"), dict):  # a schedule: the object, as from_config does
            config["learning_rate"] = keras.optimizers.schedules.deserialize(config["learning_rate"])
        if name is not None:
            config["name"] = name
        super().__init__(**config)
        self.server_optimizer = spec
        self.worker = worker

    @property
    def has_schedule(self) -> bool:
        """Whether the learning rate is a schedule (evaluated on the shards)."""
        return isinstance(self._learning_rate, keras.optimizers.schedules.LearningRateSchedule)

    def build(self, variables: Sequence[Any]) -> None:
        # No slots on the worker: the shards hold them (the wrapped class's build would add them), and
        # the moving averages too (the base class's build would add a copy of the weights).
        use_ema, self.use_ema = self.use_ema, False
        try:
            keras.optimizers.Optimizer.build(self, variables)
        finally:
            self.use_ema = use_ema

    def _update_model_variables_moving_average(self, trainable_variables: Any) -> None:
        return None  # on the shards (the ``average`` slot)

    def _overwrite_model_variables_with_average_value(self, trainable_variables: Any) -> None:
        return None  # ema_overwrite_frequency: the shards overwrite; the exchange brings the values

    def finalize_variable_values(self, var_list: Any) -> None:
        """The end of ``fit`` with ``use_ema``: the shards' moving averages become the variables' values,
        on the shards and in ``var_list`` (the model's trainable variables), as Keras does it locally.

        Raises:
            PSError: a shard failed.
        """
        worker = self.worker
        if not self.use_ema or not worker.attached:
            return
        worker._drain()  # the last step's push is applied first
        named = [(worker.name_of(v), v) for v in var_list]
        named = [
            (n, v)
            for n, v in named
            if n not in worker._remote and getattr(worker._specs.get(n), "use_ema", False)
        ]
        if not named:
            return
        averages = worker.client.pull([n for n, _ in named], ema=True)
        worker.client.assign(averages)
        with worker._backend.eager():
            for name, var in named:
                var.assign(averages[name])
        log.info(
            "worker %d: %d variables now hold their moving averages (use_ema)",
            worker.worker_index,
            len(named),
        )

    def _apply_weight_decay(self, variables: Any) -> None:
        return None  # on the shards

    def _backend_update_step(self, grads: Any, trainable_variables: Any, learning_rate: Any) -> None:
        self.worker.apply_gradients(grads, trainable_variables, optimizer=self)
