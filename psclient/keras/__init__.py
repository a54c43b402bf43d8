"""Keras 3 glue: parameter-server and all-reduce training for ``model.fit`` and ``GradientTape`` loops.

This subpackage is the only part of psclient that imports Keras (and TensorFlow, on Keras's TensorFlow
backend only). It runs on Keras's TensorFlow, JAX and PyTorch backends (``KERAS_BACKEND``): a backend-free
core plus one thin adapter per backend (``_backend``: how a step runs host code); what a backend cannot
do yet raises a ``PSError`` that names the backend and the feature (the table in docs/keras.md).

- Parameter server (``_ps``, a package: setup, step, optimizer, callbacks): ``PSWorker``,
  ``DistributedOptimizer``, ``PSCallback``, ``load_from_ps``; variables and optimizer live on the shards.
  ``Embedding`` (``_embedding``): a layer whose table lives only on the shards, and
  ``prefetch_rows``, which reads the next batch's rows while a step computes; ``string_ids`` hashes string
  feature values to its ids on the host (JAX and PyTorch have no string tensors).
- All-reduce (``_allreduce``): ``AllReduceWorker``, ``AllReduceOptimizer``,
  ``AllReduceCallback``; every rank holds a replica and gradients are averaged
  over the ring (``psclient.collective``), as with MirroredStrategy or Horovod.
"""

from psclient.keras._allreduce import (
    AllReduceCallback,
    AllReduceOptimizer,
    AllReduceWorker,
    ring_from_tf_config,
)
from psclient.keras._common import variable_name
from psclient.keras._embedding import Embedding, prefetch_rows, string_ids
from psclient.keras._env import Distribution, from_env
from psclient.keras._naming import model_variable_names
from psclient.keras._ps import (
    MODES,
    STATE_OPTIMIZER,
    DistributedOptimizer,
    PSCallback,
    PSWorker,
    load_from_ps,
    server_optimizer,
)
from pscore.errors import PSError

__all__ = [
    "MODES",
    "STATE_OPTIMIZER",
    "AllReduceCallback",
    "AllReduceOptimizer",
    "AllReduceWorker",
    "DistributedOptimizer",
    "Distribution",
    "Embedding",
    "PSCallback",
    "PSError",
    "PSWorker",
    "from_env",
    "load_from_ps",
    "model_variable_names",
    "prefetch_rows",
    "ring_from_tf_config",
    "server_optimizer",
    "string_ids",
    "variable_name",
]  # fmt: skip
