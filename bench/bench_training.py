"""Training throughput: Keras 3 ``fit`` on psserver (async, sync) vs local vs TensorFlow's PS strategy.

All systems train the same Keras 3 model (``trainer.models``: the MNIST CNN, and
the 784-256-256-10 MLP for scale) with Adam on synthetic 28x28 images, batch 64
per worker, in the same run:

* ``local``: ``pstrain local`` (one process, ``fit``; OneDeviceStrategy's place).
* ``ps-async`` / ``ps-async-nooverlap`` / ``ps-sync``: ``pstrain worker`` x 2 processes
  (``fit`` with ``psclient.keras``) on a 2-shard psserver cluster; ``ps-sync`` is
  N = M = 2. Throughput is the sum of the workers' steps/s (steps after the first).
* ``allreduce``: ``pstrain worker --mode allreduce`` x 2 processes (``fit`` with
  ``psclient.keras.AllReduceOptimizer``: gradients averaged over a 2-rank ring each
  step, no shards; MirroredStrategy's place). Throughput: the sum of the workers' steps/s.
* ``tf-ps``: TensorFlow's ParameterServerStrategy with a custom training loop
  (``ClusterCoordinator.schedule`` of a ``tf.function`` step, per-worker
  datasets): 2 ps + 2 worker ``tf.distribute.Server`` processes and this
  coordinator. Keras 3 ``fit`` itself cannot run on that strategy (it fails with
  a ValueError about ``create_per_worker_dataset``), and tf_keras is not
  installed, so the custom loop is the path measured. Throughput: steps
  completed by both workers per second, after a warm-up.

Backends (``--backends tensorflow,jax,torch``; default tensorflow): every system but ``tf-ps`` runs on
each Keras backend (``KERAS_BACKEND``), so a backend's PS and all-reduce throughput sits next to its own
``local`` in the same run (``vs local``). On JAX ``fit`` is jitted (the exchange is an ``io_callback`` in
the step); ``ps-async-eager`` is the same run with ``PSTRAIN_JIT_COMPILE=0`` (the step un-jitted, the
exchange called directly) for comparison. PyTorch runs with ``OMP_NUM_THREADS=1`` (its CPU kernels
otherwise start a thread per core in every process: 4 processes on 2 cores ran 50x slower).

Beside steps/s, each row has the worker processes' own CPU time per timed step (``pstrain``'s
``cpu_seconds_per_step``: all the process's threads, from the end of its first step to the end of its
last) and, for the PS systems, both shards' CPU per worker step (``/proc/<pid>/stat`` over the whole
run): on a machine others load, steps/s swings with their load, the CPU per step much less. The notes
also say how often each process ran the model's Python ``train_step`` (a compiled ``fit``: its traces).

Usage:
    python bench/bench_training.py --out bench/results/training       # writes training.md / training.json
    python bench/bench_training.py --models mlp --systems local,ps-async --steps 100   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm
import _tfps

SYSTEMS = ("local", "ps-async", "ps-async-nooverlap", "ps-sync", "allreduce", "tf-ps")
EXTRA_SYSTEMS = ("ps-async-eager",)  # JAX: the step un-jitted
BACKENDS = ("tensorflow", "jax", "torch")
_BACKEND = "tensorflow"  # the backend of the runs being made (main sets it)
_RUN_TIMEOUT_S = 600


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    env["KERAS_BACKEND"] = _BACKEND
    if _BACKEND == "torch":
        env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def _data_flags(args: argparse.Namespace, workers: int) -> list[str]:
    # epochs=2 over steps/2 batches per worker per epoch: a few seconds of data, constant step count
    per_epoch = max(1, args.steps // 2)
    size = per_epoch * args.batch_size * workers
    return ["--data", "synthetic", "--image-size", "28", "--synthetic-size", str(size),
            "--batch-size", str(args.batch_size), "--epochs", "2"]  # fmt: skip


def run_local(args: argparse.Namespace, model: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "local.json"
        cmd = [sys.executable, "-m", "trainer", "local", "--model", model, *_data_flags(args, 1),
               "--result-json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=_RUN_TIMEOUT_S, env=_env(), cwd=cm.REPO)
        r = json.loads(out.read_text())
    return {"steps_per_second": r["steps_per_second"], "steps": r["steps"], **_cpu([r])}


def _cpu(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' own CPU per timed step (ms; the mean over workers, and each one's), where reported."""
    per = [r.get("cpu_seconds_per_step") for r in results]
    if any(c is None or c != c for c in per):
        return {}
    out: dict[str, Any] = {"worker_cpu_ms_per_step": 1e3 * sum(per) / len(per)}
    if len(per) > 1:
        out["per_worker_cpu_ms"] = [round(1e3 * c, 2) for c in per]
    calls = [r.get("step_python_calls") for r in results]
    if None not in calls:  # the train_step's Python runs: a compiled fit's traces, or one a step
        out["step_python_calls"] = calls
    return out


def run_ps(
    args: argparse.Namespace, model: str, mode: str, overlap: bool, env: dict[str, str] | None = None
) -> dict[str, Any]:
    from trainer.cluster import LocalCluster, cpu_seconds

    server_args = (
        ["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2"] if mode == "sync" else []
    )
    with LocalCluster(2, server_args=server_args) as cluster:
        shard_pids = [p.pid for p in cluster.procs if p is not None]
        shard_cpu0 = sum(cpu_seconds(pid) for pid in shard_pids)
        procs, outs = [], []
        for i in range(2):
            out = Path(cluster.workdir) / f"w{i}.json"
            outs.append(out)
            cmd = [sys.executable, "-m", "trainer", "worker", "--ps", ",".join(cluster.addresses),
                   "--worker-index", str(i), "--num-workers", "2", "--mode", mode, "--model", model,
                   *_data_flags(args, 2), "--result-json", str(out)]  # fmt: skip
            if not overlap:
                cmd.append("--no-overlap")
            if getattr(args, "partition_bytes", None) is not None:
                cmd += ["--partition-bytes", str(args.partition_bytes)]
            run_env = _env(**(env or {}))
            pipe, both = subprocess.PIPE, subprocess.STDOUT
            procs.append(subprocess.Popen(cmd, stdout=pipe, stderr=both, env=run_env, cwd=cm.REPO))
        for p in procs:
            stdout, _ = p.communicate(timeout=_RUN_TIMEOUT_S)
            if p.returncode != 0:
                raise RuntimeError(f"worker failed:\n{stdout.decode(errors='replace')[-3000:]}")
        shard_cpu = sum(cpu_seconds(pid) for pid in shard_pids) - shard_cpu0
        results = [json.loads(o.read_text()) for o in outs]
    steps = sum(r["steps"] for r in results)
    return {
        "steps_per_second": sum(r["steps_per_second"] for r in results),
        "steps": steps,
        "per_worker": [round(r["steps_per_second"], 1) for r in results],
        **_cpu(results),
        # both shards' CPU over the whole run (setup and the final pulls too) per worker step
        "shards_cpu_ms_per_step": 1e3 * shard_cpu / steps if steps else float("nan"),
    }


def run_allreduce(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from trainer.cluster import reserve_ports

    ring = ",".join(reserve_ports(2))
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for i in range(2):
            out = Path(tmp) / f"w{i}.json"
            outs.append(out)
            cmd = [sys.executable, "-m", "trainer", "worker", "--mode", "allreduce", "--ring", ring,
                   "--worker-index", str(i), "--model", model, *_data_flags(args, 2),
                   "--result-json", str(out)]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), cwd=cm.REPO
                )
            )
        try:
            for p in procs:
                stdout, _ = p.communicate(timeout=_RUN_TIMEOUT_S)
                if p.returncode != 0:
                    raise RuntimeError(f"worker failed:\n{stdout.decode(errors='replace')[-3000:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = [json.loads(o.read_text()) for o in outs]
    return {
        "steps_per_second": sum(r["steps_per_second"] for r in results),
        "steps": sum(r["steps"] for r in results),
        "per_worker": [round(r["steps_per_second"], 1) for r in results],
        **_cpu(results),
    }


# -- TensorFlow's ParameterServerStrategy --------------------------------------------


def _tf_coordinator_main(args: argparse.Namespace) -> None:
    import keras
    import tensorflow as tf

    from trainer import models

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(args.cluster)), rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = models.build(args.model, (28, 28, 1))
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    batch = args.batch_size

    def dataset_fn() -> tf.data.Dataset:
        x = tf.random.uniform([batch * 16, 28, 28, 1])
        y = tf.random.uniform([batch * 16], maxval=10, dtype=tf.int64)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it: Any) -> Any:
        def replica_fn(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        x, y = next(it)
        return strategy.run(replica_fn, args=(x, y))

    for _ in range(20):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    steps = args.steps * 2  # same total steps as two workers of ours
    t0 = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - t0
    print(cm.RESULT_PREFIX + json.dumps([{"steps_per_second": steps / elapsed, "steps": steps}]), flush=True)


def run_tf_ps(args: argparse.Namespace, model: str) -> dict[str, Any]:
    with _tfps.cluster(2, 2, env=_env()) as tf_cluster:
        result = cm.run_child(
            [__file__, "--tf-coordinator", "--cluster", tf_cluster.spec, "--model", model,
             "--steps", str(args.steps), "--batch-size", str(args.batch_size)],
            timeout=_RUN_TIMEOUT_S, env=_env(),
        )  # fmt: skip
    return result[0]


def _param_count(model: str) -> int:
    from trainer import models

    return int(models.build(model, (28, 28, 1)).count_params())


def render(results: dict[str, Any]) -> str:
    lines = [
        "# Training throughput: Keras 3 on psserver vs local vs TensorFlow's ParameterServerStrategy",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {results['machine']['cpus']} CPUs ({results['machine']['cpu_model']}), "
        f"load average before the run {results['machine']['loadavg_1_5_15']}; TensorFlow "
        f"{results['tf_version']}, Keras {results['keras_version']}. Synthetic 28x28x1 images, Adam, "
        f"batch {results['batch_size']} per worker, {results['steps']} steps per worker; 2 ps shards and "
        "2 workers as processes on this one machine (they share its CPUs).",
        "",
        "| model | params | backend | system | steps/s | vs local | vs tf-ps | worker CPU ms/step "
        "| shards CPU ms/step | notes |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for model, rows in results["models"].items():
        tf_rate = rows.get("tf-ps", {}).get("steps_per_second")
        for key, r in rows.items():
            system, _, backend = key.partition("@")
            backend = backend or "tensorflow"
            head = f"| {model} | {results['params'][model]:,} | {backend} | {system}"
            if "error" in r:
                lines.append(f"{head} | - | - | - | - | - | failed: {r['error']} |")
                continue
            rate = r["steps_per_second"]
            local_rate = rows.get("local" if backend == "tensorflow" else f"local@{backend}", {})
            local_rate = local_rate.get("steps_per_second")
            ratio = f"{rate / tf_rate:.2f}x" if tf_rate else "-"
            vs_local = f"{rate / local_rate:.2f}x" if local_rate and system != "local" else "-"
            note = f"per worker {r['per_worker']}" if "per_worker" in r else ""
            if "per_worker_cpu_ms" in r:
                note += f", CPU ms {r['per_worker_cpu_ms']}"
            if "step_python_calls" in r:
                note += f"{', ' if note else ''}train_step runs {r['step_python_calls']}"
            cpu = f"{r['worker_cpu_ms_per_step']:.2f}" if "worker_cpu_ms_per_step" in r else "-"
            shards = f"{r['shards_cpu_ms_per_step']:.2f}" if "shards_cpu_ms_per_step" in r else "-"
            lines.append(f"{head} | {rate:.1f} | {vs_local} | {ratio} | {cpu} | {shards} | {note} |")
    lines += [
        "",
        "Systems: `local` = one process, Keras `fit` (no PS); `ps-async` = 2 `pstrain worker` processes, "
        "Keras `fit` with `psclient.keras` (fused push_pull of step k overlapped with step k+1's compute); "
        "`ps-async-nooverlap` = the same without the overlap; `ps-async-eager` (JAX) = `ps-async` with the "
        "step un-jitted (`PSTRAIN_JIT_COMPILE=0`; `ps-async` on JAX is jitted, the exchange an `io_callback` "
        "in the step); `ps-sync` = N = M = 2 barrier; `allreduce` = "
        "2 `pstrain worker --mode allreduce` processes, Keras `fit` with `psclient.keras.AllReduceOptimizer` "
        "(gradients averaged over a 2-rank `psclient.collective` ring each step, no shards); `tf-ps` = "
        "TensorFlow ParameterServerStrategy + ClusterCoordinator custom loop (Keras 3 model and optimizer "
        "under the strategy's scope; Keras 3 `fit` does not run on this strategy; no tf_keras installed). "
        "`vs local`: against the same backend's `local` in this run (the PS and all-reduce rates are the sum "
        "of two workers'). PyTorch runs with `OMP_NUM_THREADS=1`. `worker CPU ms/step`: each worker's "
        "(or the local process's) own CPU time, all its threads, from the end of its first step to the end "
        "of its last, per step (the mean of the workers'): unlike steps/s, the machine's other load barely "
        "moves it. `shards CPU ms/step`: both shards' CPU over the whole run (setup and final pulls "
        "included) per worker step. `train_step runs`: how often each process ran the model's Python "
        "`train_step` (per process): a compiled `fit` runs it only to trace it (a few), an eager one "
        "every step (as many as its steps).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    p.add_argument("--backends", default="tensorflow", help=f"Keras backends, of {', '.join(BACKENDS)}")
    p.add_argument("--steps", type=int, default=200, help="training steps per worker")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--partition-bytes",
        type=int,
        help="ps systems: the workers' partition_bytes (pstrain --partition-bytes; default: the client's)",
    )
    p.add_argument("--out", help="write OUT.md and OUT.json")
    p.add_argument("--tf-coordinator", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cluster", help=argparse.SUPPRESS)
    p.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tf_coordinator:
        _tf_coordinator_main(args)
        return 0
    os.environ.update({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    import keras
    import tensorflow as tf

    results: dict[str, Any] = {
        "command": "python bench/bench_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": cm.machine_note(),
        "tf_version": tf.__version__,
        "keras_version": keras.__version__,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "models": {},
        "params": {},
    }
    global _BACKEND
    results["backends"] = args.backends.split(",")
    for model in args.models.split(","):
        results["params"][model] = _param_count(model)
        rows: dict[str, Any] = {}
        for backend in results["backends"]:
            _BACKEND = backend
            for system in args.systems.split(","):
                if system == "tf-ps" and backend != "tensorflow":
                    continue
                if system == "ps-async-eager" and backend != "jax":
                    continue
                runner = {
                    "local": lambda m=model: run_local(args, m),
                    "ps-async": lambda m=model: run_ps(args, m, "async", True),
                    "ps-async-nooverlap": lambda m=model: run_ps(args, m, "async", False),
                    "ps-async-eager": lambda m=model: run_ps(
                        args, m, "async", True, {"PSTRAIN_JIT_COMPILE": "0"}
                    ),
                    "ps-sync": lambda m=model: run_ps(args, m, "sync", False),
                    "allreduce": lambda m=model: run_allreduce(args, m),
                    "tf-ps": lambda m=model: run_tf_ps(args, m),
                }[system]
                key = system if backend == "tensorflow" else f"{system}@{backend}"
                try:
                    rows[key] = runner()
                except Exception as err:  # a failed system is reported, the others still run
                    rows[key] = {"error": f"{type(err).__name__}: {str(err)[-300:]}"}
                print(model, key, rows[key], flush=True)
        results["models"][model] = rows
    results["top_processes_after"] = cm.top_processes()
    text = render(results)
    print(text)
    cm.write_results(args.out, text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
