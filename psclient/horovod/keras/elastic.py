"""Horovod's Keras elastic API (``horovod.tensorflow.keras.elastic``): ``hvd.elastic`` of the Keras API.

``KerasState`` and ``run`` as in ``psclient.horovod.elastic``, and the callbacks that keep the
state current during ``model.fit``: ``CommitStateCallback`` (commit every N batches and at each
epoch's end), ``UpdateBatchStateCallback`` (``state.batch``) and ``UpdateEpochStateCallback``
(``state.epoch``). Horovod's Keras example::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=500 // hvd.size(), epochs=24 - state.epoch,
                        callbacks=callbacks)

    train(state)
"""

from __future__ import annotations

from typing import Any

import keras

from psclient.elastic import State
from psclient.horovod.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    TensorFlowKerasState,
    TensorFlowState,
    run,
)


class KerasState(TensorFlowKerasState):
    """The state of a Keras model and its optimizer (Horovod's ``KerasState``); see ``TensorFlowKerasState``.

    Args:
        model: a built Keras model (compiled with its optimizer, or give ``optimizer``).
        optimizer: its optimizer (default: ``model.optimizer``).
        **kwargs: attributes to keep with the weights (``epoch=0``, ``batch=0``).
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of each epoch.

    A failure loses the batches since the last commit; a commit copies the weights to host memory
    and runs one small collective (are ranks waiting to join?), so commit less often for large models.

    Args:
        state: the ``State`` to commit.
        batches_per_commit: batches between commits (default 1).
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError("batches_per_commit must be >= 1")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same on every rank after a reset

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the current batch of the epoch (0 again at each epoch's end).

    Unlike Horovod's, it does not shorten the epoch that resumes after a reset (Keras 3 gives
    callbacks no way to end an epoch early): that epoch runs its full ``steps_per_epoch`` again
    from the restored weights; use ``dataset.skip(state.batch)`` or fewer epochs to compensate.

    Args:
        state: a ``State`` with a ``batch`` attribute.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of epochs done, across resets (``fit`` counts from 0 each time).

    Pass ``epochs=total - state.epoch`` to ``fit`` (as Horovod's example does).

    Args:
        state: a ``State`` with an ``epoch`` attribute.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch  # type: ignore[attr-defined]

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_epoch = self.state.epoch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        # +1: a reset after this epoch's end must not run it again.
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]


__all__ = [
    "CommitStateCallback",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
