"""``horovod.tensorflow.keras``'s names on the ring: ``import psclient.horovod.keras as hvd``.

The collectives here take and return values (numpy arrays), as Horovod's Keras module does.
"""

from typing import Any

import numpy as np

from psclient.horovod import _ops
from psclient.horovod._compression import Compression
from psclient.horovod._ops import Average, Sum
from psclient.horovod._optimizer import DistributedOptimizer, broadcast_global_variables
from psclient.horovod._state import (
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from psclient.horovod.keras import callbacks, elastic
from psclient.horovod.keras._unsupported import load_model


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: Any = Compression.none,
) -> np.ndarray:
    """All-reduces a value over every rank (``op`` default ``hvd.Average``); returns a numpy array."""
    return _ops.allreduce(
        value,
        average=average,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        compression=compression,
    ).numpy()


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    """Every rank's value concatenated along the first axis, in rank order (numpy)."""
    return _ops.allgather(value).numpy()


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """``root_rank``'s value on every rank (numpy)."""
    return _ops.broadcast(value, root_rank).numpy()


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> np.ndarray:
    """Reduces over every rank, then this rank's block of the first axis (numpy)."""
    return _ops.reducescatter(value, op=op).numpy()


__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
