# ruff: noqa: E501 - the migration table is pasted into README.md as it is
"""Horovod's TensorFlow API on the ring: ``import psclient.horovod as hvd`` in place of ``horovod.tensorflow``.

Horovod users move over by changing one import (``psclient.horovod.keras`` for
``horovod.tensorflow.keras``) and starting with ``psrun`` in place of ``horovodrun``::

    psrun -np 2 python train.py

Everything is built on ``psclient.keras.AllReduceWorker`` (``hvd.init`` makes one from the
``TF_CONFIG`` that ``psrun`` sets), ``psclient.keras.AllReduceOptimizer`` (``hvd.DistributedOptimizer``
is one) and ``psclient.collective.Ring``. ``hvd.worker()`` returns the process's
``AllReduceWorker`` for mixing with the ``psclient.keras`` API.

Migration table
---------------

| Horovod | psclient | Differences |
| --- | --- | --- |
| `horovodrun -np 4 python train.py` | `psrun -np 4 python train.py` | Output prefixed `[rank]<stdout>:`/`[rank]<stderr>:` as horovodrun's; a failing rank's exit status is psrun's and the other ranks are stopped (SIGTERM, then SIGKILL after 5 s); `--timeout` (default 1800 s) ends a hung job with status 124. |
| `horovodrun -np 4 -H h1:2,h2:2 python train.py` | on each host: `psrun -np 4 -H h1:2,h2:2 --host-index I --base-port P python train.py` | No ssh: start one psrun per host (`I` = the host's index in `-H`, the same `P` on every host); ranks listen on `host:P+local_rank`. Without `--host-index`, psrun prints these commands and exits. |
| `horovodrun -np 3 --min-np 2 --max-np 4 [--host-discovery-script S] python train.py` (elastic) | `psrun -np 3 --min-np 2 --max-np 4 [--host-discovery-script S] python train.py` | One host only (`-H localhost:N` gives the slots; a discovery script's other hosts are ignored). A lost rank does not end the job while `--min-np` are left; `--blacklist-cooldown-range`, `--reset-limit`, `--elastic-timeout`, `--slots-per-host` as horovodrun's. Output prefixed with the worker's start index (`[3]<stdout>:`), not its current rank. Status 0 when the job finishes, even with ranks lost on the way. No `TF_CONFIG`: `hvd.init()` asks psrun's rendezvous. |
| `horovod.run(fn, np=2)` | `psrun -np 2 python script.py` | `hvd.run` raises, naming psrun. |
| `import horovod.tensorflow as hvd` | `import psclient.horovod as hvd` | |
| `import horovod.tensorflow.keras as hvd` | `import psclient.horovod.keras as hvd` | |
| `hvd.init()` | `hvd.init()` | The layout comes from `TF_CONFIG` (set by psrun, `pstrain launch --mode allreduce`, Kubeflow); a world of size 1 without it. `comm=` and `process_sets=` raise `UnsupportedError`. |
| `size()`, `rank()`, `local_size()`, `local_rank()`, `cross_size()`, `cross_rank()`, `is_homogeneous()` | same | Hosts are told apart by the host names of the ring addresses. |
| `shutdown()`, `is_initialized()` | same | `shutdown` also runs at exit. |
| `Average`, `Sum`, `Min`, `Max` | same | `Adasum` and `Product` raise `UnsupportedError`. |
| `Compression.none`, `Compression.fp16` | same | fp16: float tensors travel and are summed as float16. |
| `DistributedOptimizer(opt, compression=, op=, backward_passes_per_step=, average_aggregated_gradients=, sparse_as_dense=)` | same (Keras 3 optimizers) | A `psclient.keras.AllReduceOptimizer`: the optimizer's own class (saves as a plain `Adam`). `backward_passes_per_step` uses Keras's `gradient_accumulation_steps` (the ring runs every pass, not every N-th; same result). Sparse gradients are always densified. `groups`, `num_groups`, `device_*` are accepted and ignored (one fused all-reduce per step). With the broadcast callback, BatchNorm moving statistics are averaged every step too, so replicas stay identical. Legacy `tf.compat.v1` optimizers are not supported. |
| `DistributedGradientTape(tape, ...)` | same | Eager and in `tf.function`; `register_local_source` works; sparse gradients are densified. |
| `broadcast_variables(variables, root_rank)` | same | Also inside a `tf.function` (e.g. on the first step); one broadcast for all the variables. |
| `broadcast_global_variables(root_rank)` | `broadcast_variables(model.variables, 0)` or the callback | TF2 has no global variables: raises `RuntimeError` naming the alternatives. |
| `allreduce`, `grouped_allreduce` | same | `tf.IndexedSlices` are all-gathered, as in Horovod; differentiable for `Average`/`Sum`. |
| `allgather`, `grouped_allgather`, `broadcast` | same | Not differentiable. |
| `reducescatter`, `grouped_reducescatter` | same | Horovod's blocks (the first `n % size` ranks get one row more); an all-reduce then a slice (twice the traffic). |
| `broadcast_object`, `allgather_object` | same | pickle, not cloudpickle; eager only. |
| `join()` | same | A rank out of data calls it; until all have joined it takes part in the others' all-reduces with zeros (`Average` still divides by `size()`, as Horovod's); returns the last rank to join. `Min`/`Max` ignore joined ranks (Horovod reduces their zeros too). Broadcasts and all-gathers raise while ranks are joined, as in Horovod. Each wait for the others' next collective is bounded by the ring's deadline (120 s). Every collective costs one extra small all-reduce (the control round that makes this possible); `PS_HOROVOD_JOIN=0` drops it, and `join` is then only a barrier. |
| `size_op()`, `rank_op()`, `local_size_op()`, `local_rank_op()` | same | Read when the op runs (a `tf.numpy_function`), so a traced step follows an elastic resize. |
| `callbacks.BroadcastGlobalVariablesCallback(0)` | same | After the first batch (lazily built models work), once; at the end of `fit` it checks that every rank holds the same weights. |
| `callbacks.MetricAverageCallback()` | same | One fused all-reduce of every metric per epoch. |
| `callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs)` | same | `momentum_correction` has no effect (a Keras 3 optimizer's momentum is a constant of the compiled step); needs a float learning rate. |
| `callbacks.LearningRateScheduleCallback(initial_lr, multiplier)` | same | As above. |
| `callbacks.BestModelCheckpoint(monitor=)` | same, plus `filepath=` | Horovod's Spark estimator set the path; here give it. |
| `hvd.load_model(path)` | `keras.models.load_model(path)`, compile with `DistributedOptimizer` | Raises, naming the alternative. |
| `global_process_set` | same | The only process set; `ProcessSet`, `add_process_set`, `remove_process_set` raise: start one psrun job per group. |
| `hvd.elastic.run`, `State`, `ObjectState`, `TensorFlowKerasState`, `TensorFlowState`; Keras: `KerasState`, `CommitStateCallback`, `UpdateBatchStateCallback`, `UpdateEpochStateCallback` | same | Under `psrun --min-np M --max-np N` (one host; no `--network-interface`/ssh): a lost rank breaks the ring at once (psrun tells every rank: no deadline to wait for); the others restore the last commit, re-form a smaller ring (re-ranked, lowest surviving rank is the new rank 0), sync from it and go on; new ranks (a freed slot after `--blacklist-cooldown-range`, or a slot `--host-discovery-script` adds) join at the next `commit()`. `UpdateBatchStateCallback` does not shorten the resumed epoch (Keras 3 callbacks cannot). Outside an elastic psrun job, `run` syncs once and a failure ends the job. |
| `HorovodInternalError`, `HostsUpdatedInterrupt` | same (`hvd.elastic.HorovodInternalError`, ...) | Told apart from other errors by the ring's state, never by message text. |
| `start_timeline`, `stop_timeline` | `keras.callbacks.TensorBoard(profile_batch=...)` | Raise. |
| `alltoall`, `SyncBatchNormalization`, `PartialDistributedGradientTape` | `allgather`; `BatchNormalization`; `register_local_source` | Raise, naming the alternative. |
| `mpi_built()`, `gloo_built()`, `nccl_built()`, ... | same | All `False` (the ring is gRPC or TCP). |

Every rank must call the same collectives in the same order (a rank that runs out of data calls
``hvd.join()``); a rank that stops early makes the others fail with a deadline error naming it
(never a hang). XLA (``jit_compile=True``) is not supported: the ring runs as host code in the step.
"""

from typing import Any, NoReturn

import keras

from pscore.errors import PSError

if keras.backend.backend() != "tensorflow":  # before anything imports TensorFlow
    raise PSError(
        f"psclient.horovod (Horovod's TensorFlow API) is not supported on the Keras {keras.backend.backend()!r} "
        f"backend (KERAS_BACKEND={keras.backend.backend()}): under psrun, use psclient.keras.from_env() (an "
        "AllReduceWorker from psrun's TF_CONFIG) or psclient.keras.AllReduceWorker; see the backend table in "
        "docs/keras.md"
    )

from psclient.horovod import elastic
from psclient.horovod._compression import Compression, Compressor
from psclient.horovod._ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    broadcast,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    rank_op,
    reducescatter,
    size_op,
)
from psclient.horovod._optimizer import (
    DistributedGradientTape,
    DistributedOptimizer,
    PartialDistributedGradientTape,
    broadcast_global_variables,
)
from psclient.horovod._state import (
    ProcessSet,
    UnsupportedError,
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
    is_homogeneous,
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
    worker,
)

_ELSEWHERE = {
    "alltoall": "not supported; use allgather and slice",
    "SyncBatchNormalization": "not supported; use keras.layers.BatchNormalization (with the broadcast callback "
    "its moving statistics are averaged every step)",
}


def __getattr__(name: str) -> NoReturn:
    if name in _ELSEWHERE:
        raise AttributeError(f"psclient.horovod.{name}: {_ELSEWHERE[name]}")
    raise AttributeError(f"module 'psclient.horovod' has no attribute {name!r}")


def run(*args: Any, **kwargs: Any) -> NoReturn:
    """Not supported (raises UnsupportedError): start scripts with ``psrun -np N python script.py``."""
    raise UnsupportedError(
        "horovod.run is not supported by psclient.horovod; use psrun -np N python script.py"
    )
