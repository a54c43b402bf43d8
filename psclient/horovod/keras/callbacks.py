"""Horovod's Keras callbacks (``hvd.callbacks``): broadcast, metric averages, learning-rate schedules."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from psclient.horovod._state import rank, size, worker
from psclient.keras import AllReduceCallback
from psclient.keras._allreduce import _collective_optimizer
from psclient.keras._common import check_no_jit

log = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(AllReduceCallback):
    """Broadcasts ``root_rank``'s model and optimizer variables after the first batch of ``fit``.

    As Horovod's: after the first batch, so a model that ``fit`` builds lazily (a ``Sequential``
    without an ``Input``) and the optimizer's state exist; once per callback object. With a
    ``hvd.DistributedOptimizer`` it also attaches the optimizer to the model (BatchNorm moving
    statistics are averaged every step, so replicas stay identical) and, at the end of ``fit``,
    checks that every rank holds the same weights (raises ``psclient.InternalError`` if not).

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted, ignored.
        local_variables: variables not to broadcast (also ``register_local_var``).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None) -> None:
        super().__init__(worker(), check_sync=True)
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local: set[int] = set()
        if local_variables is not None:
            items = [local_variables] if hasattr(local_variables, "assign") else list(local_variables)
            for v in items:
                self.register_local_var(v)

    def register_local_var(self, var: Any) -> None:
        """Leaves ``var`` out of the broadcast (a rank-local variable)."""
        if not hasattr(var, "assign"):
            raise ValueError("local variables must be variables")
        self._local.add(id(var))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        optimizer = _collective_optimizer(model.optimizer)
        # A custom train_step may apply its own optimizers (a GAN's): attach those too.
        own = [o for o in (_collective_optimizer(v) for v in vars(model).values()) if o is not None]
        collective = {id(o): o for o in [optimizer, *own] if o is not None}
        if collective:
            check_no_jit(model, "hvd.DistributedOptimizer")
            for opt in collective.values():
                opt.attach(model)
        # Replicas are only expected to agree when an optimizer all-reduces.
        self.check_sync = bool(collective) and not self._local
        self._broadcast_pending = not self.broadcast_done

    def _broadcast(self) -> None:
        model = self.model
        variables = [v for v in model.variables if id(v) not in self._local]
        if model.optimizer is not None and model.optimizer.built:
            variables += [v for v in model.optimizer.variables if id(v) not in self._local]
        self.worker.broadcast_variables(variables, root=self.root_rank)
        self.broadcast_done = True
        log.info("rank %d: %d variables from rank %d", self.worker.rank, len(variables), self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics (``logs``) over every rank at the end of each epoch, in place.

    Put it before the callbacks that read metrics (``ReduceLROnPlateau``, ``TensorBoard``,
    ``ModelCheckpoint``); Keras's progress bar prints the rank's own values. One fused ring
    all-reduce of every metric, in sorted name order (every rank must log the same names).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        names = sorted(logs)
        values = [np.asarray(logs[n], np.float64).reshape(-1) for n in names]
        means = worker().ring.allreduce_many(values, op="mean")
        for n, m in zip(names, means, strict=True):
            logs[n] = float(m[0]) if m.size == 1 else m


def _get_lr(optimizer: Any) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _set_lr(optimizer: Any, value: float) -> None:
    if isinstance(
        getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule
    ):
        raise ValueError(
            "the optimizer's learning rate is a LearningRateSchedule; Horovod's learning-rate callbacks "
            "need a float learning rate"
        )
    optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    As Horovod's: ``multiplier`` is a function of the epoch or a constant (``multiplier ** (epoch -
    start_epoch)``); ``staircase=True`` adjusts at each epoch's first batch with the integer
    epoch, ``staircase=False`` at every batch with ``epoch + batch / steps_per_epoch``. Logs the
    rate as ``lr`` at each epoch's end.

    ``momentum_correction`` is accepted but has no effect: a Keras 3 optimizer's momentum is a
    constant of the compiled step, not a variable that a callback can change.

    Raises:
        ValueError: no ``initial_lr`` and none on the optimizer; a scheduled learning rate; no
            ``steps_per_epoch`` for ``staircase=False`` when ``fit`` does not know it.
    """

    def __init__(
        self,
        initial_lr: float | None,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError(
            f"could not autodetect the number of steps per epoch; pass steps_per_epoch to "
            f"{type(self).__name__}() (or steps_per_epoch to fit)"
        )

    def _adjust_learning_rate(self, epoch: float) -> None:
        assert self.initial_lr is not None
        _set_lr(self.model.optimizer, self.initial_lr * self.multiplier(epoch))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = _get_lr(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            assert self.steps_per_epoch
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup, as Horovod's: ``lr`` from ``initial_lr / size`` to ``initial_lr`` in ``warmup_epochs``.

    ``lr'(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)``, adjusted at every
    batch (``epoch`` counts fractions); see "Accurate, Large Minibatch SGD" (Goyal et al. 2017).

    Args:
        initial_lr: the learning rate to reach (the scaled one: ``base_lr * hvd.size()``).
        warmup_epochs: epochs of warmup (default 5).
        momentum_correction: accepted, no effect in Keras 3 (see ``LearningRateScheduleCallback``).
        steps_per_epoch: batches per epoch (default: from ``fit``).
        verbose: 1 prints a line on rank 0 when the warmup ends.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that each epoch ends on a round value (as Horovod's).
            assert self.steps_per_epoch
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == (self.end_epoch or 0) - 1 and self.verbose > 0 and rank() == 0:
            lr = _get_lr(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``), as Horovod's.

    Horovod's Spark estimator sets ``filepath`` for it; here pass ``filepath=`` (a ``.keras`` file,
    or ``.weights.h5`` with ``save_weights_only``) or set ``callback.filepath`` before ``fit``.
    Add it on rank 0 only.

    Raises:
        ValueError: (in ``fit``) no ``filepath`` was set.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        filepath: str | None = None,
    ) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=filepath or placeholder,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        self.filepath = filepath  # type: ignore[assignment]

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.filepath:
            raise ValueError(
                "BestModelCheckpoint needs a filepath: BestModelCheckpoint(filepath='best.keras')"
            )
        super().on_train_begin(logs)


__all__: Sequence[str] = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
