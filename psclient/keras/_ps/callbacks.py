"""The Keras side of parameter-server training: ``PSCallback`` (``fit``'s callback) and ``load_from_ps`` (an
evaluator's copy of a model)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import keras

from psclient._sync_client import PSClient
from psclient.keras._common import StepTimer, variable_name
from psclient.keras._naming import model_variable_names
from psclient.keras._ps.optimizer import DistributedOptimizer, _unwrap_loss_scale
from psclient.keras._ps.setup import _remote_tables

if TYPE_CHECKING:
    from psclient.keras._ps.worker import PSWorker

log = logging.getLogger(__name__)


def load_from_ps(model_or_variables: Any, client: PSClient) -> None:
    """Assigns the shards' current values to a model's variables (for an evaluator or a final export).

    A model gets all of its shared state (trainable variables, BatchNorm statistics, frozen
    layers), found by the stable names of ``model_variable_names``: any copy of the model,
    built in any process, loads.

    Raises:
        NotFoundError: a variable is not on the shards (a different model, or another model name).
        PSError: a shard failed.
    """
    if isinstance(model_or_variables, keras.Model):
        remote = _remote_tables(model_or_variables)  # psclient.keras.Embedding: its rows stay on the shards
        named = [(v, n) for v, n in model_variable_names(model_or_variables) if id(v) not in remote]
    else:
        named = [(v, variable_name(v)) for v in model_or_variables]
    values = client.pull([n for _, n in named])
    for var, name in named:
        var.assign(values[name])


class PSCallback(StepTimer):
    """Attaches the model to the parameter server when ``fit`` begins; loads the final values when it ends.

    Before each step it sends a learning rate changed by another callback to the shards (with
    ``compile(steps_per_execution=n)``: before each ``n`` steps, when Keras calls the callbacks).
    Also records throughput: ``steps`` and ``steps_per_second`` (steps after the first, which
    traces the graph).
    """

    def __init__(self, worker: PSWorker) -> None:
        super().__init__()
        self.worker = worker

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        model = self.model
        self.worker._backend.prepare_fit(self.worker, model, "parameter-server training")
        optimizer = _unwrap_loss_scale(model.optimizer)
        if not isinstance(optimizer, DistributedOptimizer):
            optimizer = None  # a custom train_step may apply its own DistributedOptimizers (a GAN)
        self.worker.begin_fit(model, optimizer)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_train_batch_begin(batch, logs)
        self.worker.sync_learning_rates()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        first = self.steps == 0
        super().on_train_batch_end(batch, logs)
        if first and not self.worker.optimizers:
            raise ValueError(
                "no psclient.keras.DistributedOptimizer applied gradients in the first step: compile the "
                "model with DistributedOptimizer(keras_optimizer, worker) (or use it in your train_step)"
            )

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_end(logs)
        self.worker.end_fit(self.model)
