"""One training script for every mode: ``psclient.keras.from_env()`` reads the mode and cluster that
``pstrain launch`` (or a deploy file) set, and wraps the optimizer and callbacks to match.

    import psclient.keras as psk

    dist = psk.from_env()                                   # PSTRAIN_MODE and TF_CONFIG
    model.compile(optimizer=dist.optimizer(keras.optimizers.Adam(1e-3)), loss=..., metrics=[...])
    model.fit(x[dist.index::dist.num_workers], y[dist.index::dist.num_workers],
              epochs=5, callbacks=dist.callbacks())
    dist.close()

``PSTRAIN_MODE``: ``local`` (default: plain Keras), ``async``, ``sync``, ``ssp`` (a
``PSWorker`` on the ``ps`` tasks of ``TF_CONFIG``) or ``allreduce`` (an
``AllReduceWorker`` on its ``worker`` tasks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import keras

from psclient.keras._allreduce import AllReduceOptimizer, AllReduceWorker
from psclient.keras._ps import MODES, DistributedOptimizer, PSWorker

ENV_MODE = "PSTRAIN_MODE"
ENV_MODES = ("local", *MODES, "allreduce")


@dataclass
class Distribution:
    """The mode of this training process and its worker (``None`` when local).

    Attributes:
        mode: ``"local"``, ``"async"``, ``"sync"``, ``"ssp"`` or ``"allreduce"``.
        worker: the ``PSWorker`` or ``AllReduceWorker``; ``None`` in local mode.
    """

    mode: str
    worker: PSWorker | AllReduceWorker | None = None
    _callbacks: list[Any] = field(default_factory=list)

    @property
    def index(self) -> int:
        """This worker's index (rank); 0 in local mode."""
        if isinstance(self.worker, PSWorker):
            return self.worker.worker_index
        return self.worker.rank if self.worker is not None else 0

    @property
    def num_workers(self) -> int:
        """The number of workers; 1 in local mode."""
        if isinstance(self.worker, PSWorker):
            return self.worker.num_workers
        return self.worker.world if self.worker is not None else 1

    @property
    def lr_scale(self) -> int:
        """How many workers' batches one update averages: ``num_workers`` in sync and all-reduce modes
        (each update sees a batch that many times larger), else 1. Multiply the learning rate by it
        (the linear scaling rule, as Horovod's examples do with ``hvd.size()``)."""
        return self.num_workers if self.mode in ("sync", "allreduce") else 1

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0 (the one that should write checkpoints and print summaries)."""
        return self.index == 0

    def optimizer(self, optimizer: Any) -> Any:
        """The optimizer for ``model.compile`` in this mode (the optimizer itself when local)."""
        if isinstance(self.worker, PSWorker):
            return DistributedOptimizer(optimizer, self.worker)
        if isinstance(self.worker, AllReduceWorker):
            return AllReduceOptimizer(keras.optimizers.get(optimizer), self.worker)
        return optimizer

    def callbacks(self, *chief_only: Any) -> list[Any]:
        """The callbacks ``fit`` needs in this mode (new ones per call; none when local).

        Args:
            *chief_only: callbacks to run on worker 0 only (``ModelCheckpoint``, ``TensorBoard``,
                ``CSVLogger``: one writer per file, not one per worker).
        """
        mine = list(chief_only) if self.is_chief else []
        if self.worker is None:
            return mine
        return [*mine, self.worker.callback()]

    def attach(self, model: keras.Model, optimizer: Any = None) -> None:
        """For a ``GradientTape`` loop, before the first step: the parameter server's variables are
        created or found and loaded (``PSWorker.attach``); on the ring, rank 0's weights are broadcast.

        Args:
            model: the built model.
            optimizer: the optimizer the loop applies (``dist.optimizer(...)``'s result).
        """
        if isinstance(self.worker, PSWorker):
            self.worker.attach(model, optimizer)
        elif isinstance(self.worker, AllReduceWorker):
            self.worker.broadcast_variables(model)
            if isinstance(optimizer, AllReduceOptimizer):
                optimizer.attach(model)  # its moving statistics are averaged with the gradients

    def finish(self) -> None:
        """For a ``GradientTape`` loop, after the last step: the parameter server's final values are
        loaded (and sync/ssp barriers stop waiting for this worker)."""
        if isinstance(self.worker, PSWorker):
            self.worker.finish()

    def close(self) -> None:
        """Closes the worker's client or ring. Idempotent."""
        if self.worker is not None:
            self.worker.close()


def from_env(environ: Mapping[str, str] = os.environ, **worker_options: Any) -> Distribution:
    """The ``Distribution`` that ``PSTRAIN_MODE`` and ``TF_CONFIG`` describe.

    Args:
        environ: where to read them (tests pass a dict).
        **worker_options: passed to ``PSWorker`` or ``AllReduceWorker`` (``timeout``, ``auth_token``, ...).

    Raises:
        ValueError: an unknown mode, or TF_CONFIG missing or malformed for a distributed mode.
    """
    mode = environ.get(ENV_MODE, "local") or "local"
    if mode not in ENV_MODES:
        raise ValueError(f"{ENV_MODE}={mode!r}; expected one of {', '.join(ENV_MODES)}")
    if mode == "local":
        return Distribution(mode)
    if mode == "allreduce":
        return Distribution(mode, AllReduceWorker(**worker_options))
    return Distribution(mode, PSWorker(mode=mode, **worker_options))
