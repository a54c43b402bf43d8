"""``psclient.keras`` on Keras's JAX and PyTorch backends: the same script (``_backend_train.py``, the
README's ``train.py`` with held-out test images) trains under ``pstrain launch`` in async and sync mode and
under ``psrun`` (all-reduce) to within a few points of the same script run locally on that backend, and the
glue imports no TensorFlow there. Custom training loops, a GAN's two optimizers and ``overlap=True`` run
against a cluster in one process per backend (``_backend_loops.py``).

Each backend's tests run where its package is installed (``pip install ".[jax]"`` / ``".[torch]"``) and are
skipped otherwise. Every run is a subprocess with ``KERAS_BACKEND`` set (a process has one Keras backend).
On JAX ``fit`` stays compiled (the exchange is an ``io_callback`` in the jitted step); PyTorch steps are
eager. What a backend cannot do yet is refused with a ``PSError`` naming the backend and the feature.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.e2e]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUN_TIMEOUT_S = 300  # a run takes 10-30 s on 2 loaded cores
# Test accuracy points (360 images: one is 0.28 points) below local that a distributed run may land. Local
# reaches 0.95-0.96 on JAX and PyTorch at 8 epochs; sync and all-reduce runs landed on local's accuracy, async
# within a point (2026-12-06); an untrained model scores ~0.1.
MARGIN = 0.03
# Async runs swing more: two workers' steps land on each other's stale values, more so on loaded cores. In a
# CI run on cores loaded ~6x (the suite took 30 min) PyTorch's async run landed 0.919 against local's 0.95,
# one image under MARGIN; alone they land within a point.
ASYNC_MARGIN = 0.05
BACKENDS = ("jax", "torch")
_MODES = {"psrun": "allreduce"}  # what from_env reads under a launcher that is not pstrain launch


def _env(backend: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PSTRAIN_MODE", "EPOCHS")}
    env["KERAS_BACKEND"] = backend
    # PyTorch's CPU kernels start a thread per core in every process: 3-4 processes on 2 cores then run the
    # MLP's steps 50x slower than one thread each.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _launch(backend: str, mode: str, script: Path, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(script)]
    if mode == "psrun":  # Horovod's launcher: an all-reduce job's ranks (TF_CONFIG, PSTRAIN_MODE=allreduce)
        cmd = [sys.executable, "-m", "trainer.psrun", "-np", "2", "--timeout", str(RUN_TIMEOUT_S), *cmd]
    elif mode != "local":
        cmd = [sys.executable, "-m", "trainer", "launch", "--mode", mode, "--timeout", str(RUN_TIMEOUT_S),
               "--", *cmd]  # fmt: skip
    env = {**_env(backend), **env}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30, env=env, cwd=ROOT)


def run(backend: str, mode: str, script: Path = HERE / "_backend_train.py", **env: str) -> dict[str, Any]:
    """Runs the script locally or under ``pstrain launch --mode``; returns worker 0's RESULT."""
    proc = _launch(backend, mode, script, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split("RESULT ", 1)[1] for ln in proc.stdout.splitlines() if "RESULT " in ln]
    assert len(lines) == 1, proc.stdout[-3000:]  # worker 0 only
    result = json.loads(lines[0])
    print(f"\n{backend} {mode} {script.name}: {json.dumps(result)}")
    assert result.get("backend", backend) == backend and result["mode"] == _MODES.get(mode, mode)
    return result


def run_against(backend: str, script: Path, *addresses: str) -> dict[str, Any]:
    """Runs a script that trains against clusters it is given (``ADDR,ADDR`` each); returns its RESULT."""
    proc = subprocess.run(
        [sys.executable, str(script), *addresses],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(backend), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [ln.split("RESULT ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    print(f"\n{backend} {script.name}: {line}")
    return dict(json.loads(line))


@pytest.fixture(scope="module")
def local() -> dict[str, float]:
    return {}


# Sync mode runs the same script in test_a_rate_set_by_a_callback_reaches_the_shards (and the subclassed
# model's own step below): one sync run of it per backend, not two (the suite's CPU time). Its all-reduce
# run is started by psrun (Horovod's launcher; the subclassed model's below by pstrain launch).
@pytest.mark.parametrize("mode", ["async", "psrun"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_readme_script_trains_on_the_backend_as_locally(
    backend: str, mode: str, local: dict[str, float]
) -> None:
    pytest.importorskip(backend)
    if backend not in local:
        base = run(backend, "local")
        assert not base["glue_imported_tensorflow"], base
        local[backend] = base["test_accuracy"]
    result = run(backend, mode, RING_LOOP="1" if mode == "psrun" else "0")
    assert not result["glue_imported_tensorflow"], result
    margin = ASYNC_MARGIN if mode == "async" else MARGIN
    assert result["test_accuracy"] >= local[backend] - margin, (result, local)
    if mode == "psrun":  # a custom loop on the ring (JAX: jitted stateless_apply): the ranks stay equal
        assert result["ring_loop_in_sync"], result
        assert result["ring_loop_losses"][1] < 0.7 * result["ring_loop_losses"][0], result
    if mode != "psrun":  # an evaluator's copy loaded from the shards
        assert result["loaded_accuracy"] >= local[backend] - margin, (result, local)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rate_set_by_a_callback_reaches_the_shards(backend: str) -> None:
    """A ``LearningRateScheduler`` halves the rate every epoch; each change goes to the shards before the
    next step (on JAX too, where ``fit`` keeps the optimizer's variables out of Python while it runs). Sync
    mode: both workers send each epoch's rate before its steps, so the shards end with the last one (in
    async mode a worker an epoch behind would send an older rate after worker 0 has finished)."""
    pytest.importorskip(backend)
    result = run(backend, "sync", LR_SCHEDULE="1", EPOCHS="3")
    assert result["learning_rate"] == pytest.approx(2e-3 * 2 * 0.25, rel=1e-6), result  # lr_scale 2
    assert result["shard_learning_rate"] == pytest.approx(result["learning_rate"], rel=1e-6), result
    assert result["test_accuracy"] >= 0.8, result  # an untrained model scores ~0.1
    assert not result["glue_imported_tensorflow"], result
    # the shards hold the final model: the evaluator's copy is the same model
    assert result["loaded_accuracy"] == pytest.approx(result["test_accuracy"], abs=1e-6), result


LOOPS = HERE / "_backend_loops.py"


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_loops_a_gan_and_overlap_train_as_locally(backend: str, make_cluster) -> None:
    """Training outside ``fit``'s built-in step (``_backend_loops.py``, one subprocess against an async
    cluster, one worker): the backend's own loop as keras-io writes it (JAX: jitted ``stateless_apply``;
    PyTorch: ``backward``, ``optimizer.apply``) and a GAN's two optimizers (PyTorch: keras-io's GAN under
    ``fit``; JAX: a jitted loop, each part attached with its optimizer first) train exactly as the same code
    locally (SGD, no overlap); on JAX a part not attached first is a ``PSError`` naming backend and feature.
    ``overlap=True`` trains a ``psclient.keras.Embedding`` table whose ids are host-hashed strings
    (``string_ids``); ``key_type="string"`` is a ``PSError`` that names ``string_ids``, and ``import
    psclient.horovod`` (Horovod's TensorFlow API) one that names ``psclient.keras.from_env``."""
    pytest.importorskip(backend)
    cluster = make_cluster(num_shards=2)
    result = run_against(backend, LOOPS, ",".join(cluster.addresses))
    assert not result["glue_imported_tensorflow"], result
    for part in ("loop", "gan"):
        np.testing.assert_allclose(result[f"{part}_remote_losses"], result[f"{part}_local_losses"], rtol=1e-5)
        assert result[f"{part}_weights_max_diff"] < 1e-5, result
    assert result["loop_remote_losses"][-1] < 0.5 * result["loop_remote_losses"][0], result
    if backend == "jax":
        error = result["gan_unattached_error"] or ""
        assert "a second optimizer" in error and "'jax' backend" in error and "worker.attach" in error, error
    refused = result["string_refused"] or ""
    assert "key_type='string'" in refused and repr(backend) in refused and "string_ids" in refused, refused
    refused = result["horovod_refused"] or ""  # Horovod's TensorFlow API: psclient.keras under psrun instead
    assert "psclient.horovod" in refused and repr(backend) in refused and "from_env" in refused, refused
    assert result["overlap"] and result["overlap_losses"][-1] < 0.7 * result["overlap_losses"][0], result
    # every distinct value got its own row (no collision among 300 values, 31 bits on JAX)
    assert result["string_ids_rows_on_shards"] == result["string_ids_distinct"] == result["distinct_values"]
    assert result["string_ids_dtype"] == ("int32" if backend == "jax" else "int64"), result


EMBEDDING = HERE / "_backend_embedding.py"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_table_on_the_shards_trains_as_a_local_embedding(backend: str, make_cluster) -> None:
    """``psclient.keras.Embedding`` (rows only on the shards) on JAX (``fit`` jitted: the rows come in through
    an ``io_callback``, their gradient goes out through a ``custom_vjp``) and PyTorch (a hook on the rows):
    one sync worker with SGD trains, epoch by epoch, as Keras's own Embedding trains locally from the same
    rows (with BatchNorm: on JAX the step's exchange runs after the step, ``PSWorker.defer_state``); only
    the touched rows change; a dynamic table of raw ids trains; a bad id is a clear error. One subprocess
    (``_backend_embedding.py``)."""
    pytest.importorskip(backend)
    cluster = make_cluster(
        num_shards=2, server_args=("--mode", "sync", "--replicas-to-aggregate", "1", "--total-replicas", "1")
    )
    asynchronous = make_cluster(num_shards=2) if importlib.util.find_spec("tensorflow") else None
    addresses = [",".join(c.addresses) for c in (cluster, asynchronous) if c is not None]
    result = run_against(backend, EMBEDDING, *addresses)
    np.testing.assert_allclose(result["remote_losses"], result["local_losses"], rtol=1e-4)
    assert result["remote_losses"][-1] < 0.7 * result["remote_losses"][0], result
    steps = 3 * 256 // 32
    assert result["steps_done"] == steps and result["stale_steps"] == 0, result  # one sync step a batch
    assert result["touched_rows_max_error"] < 1e-4 and result["untouched_rows_unchanged"], result
    assert result["predict_max_error"] < 1e-4, result
    assert result["largest_weight"] < 1000, result  # no 5,000 x 8 table on the worker
    # a step moves at most its batch's rows (ids and values out; none back) and the small dense variables
    assert result["bytes_per_step"] < 32 * 4 * (8 + 8 * 4) + 4096, result
    assert "out of range" in (result["bad_id_error"] or ""), result
    assert result["dynamic_losses"][-1] < 0.7 * result["dynamic_losses"][0], result
    assert result["dynamic_rows_on_shards"] == result["distinct_raw_ids"], result
    if asynchronous is not None:  # prefetch_rows (tf.data): each epoch's first batch is read in its step
        assert result["prefetch_losses"][-1] < 0.7 * result["prefetch_losses"][0], result
        stats = result["prefetch_stats"]
        assert stats["hits"] + stats["misses"] == steps and stats["hits"] >= steps // 2, stats


SUBCLASSED = HERE / "_backend_subclassed.py"


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_subclassed_model_with_batchnorm_and_its_own_train_step(
    backend: str, mode: str, local: dict[str, float]
) -> None:
    """A subclassed model (Conv, BatchNorm, Dense) whose ``train_step`` is the backend's own as keras-io
    writes it (JAX: stateless, ``stateless_apply``; PyTorch: ``backward``, ``optimizer.apply``) trains as
    locally. Sync mode: a fresh copy loaded from the shards, BatchNorm statistics included, evaluates
    exactly like the worker. All-reduce: the statistics are averaged over the ring (the callback checks
    that every rank ends with the same bits). On JAX the optimizer's stateless step sees the statistics
    as they were before the forward pass: the step's exchange, or the ring's averaging of the statistics,
    runs after the step (``DeferredExchanges.defer_state``). 2026-12-06, 3 epochs: JAX local 0.981, sync
    0.964; PyTorch local 0.972, sync 0.975 (examples/batchnorm_cnn.py, 2 epochs: JAX local 0.981, async
    0.967, sync 0.983, allreduce 0.983; PyTorch 3 epochs: local 0.981, async 0.969, sync 0.989, allreduce
    0.992)."""
    pytest.importorskip(backend)
    key = f"{backend} subclassed"
    if key not in local:
        local[key] = run(backend, "local", SUBCLASSED)["test_accuracy"]
    result = run(backend, mode, SUBCLASSED)
    assert result["test_accuracy"] >= local[key] - MARGIN, (result, local[key])
    if mode == "sync":
        assert result["loaded_accuracy"] == pytest.approx(result["test_accuracy"], abs=1e-6), result
        assert result["stale_steps"] == 0, result
