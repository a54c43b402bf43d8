"""Embedding training on psserver: a whole variable vs Keras Embedding tables vs psclient.keras.Embedding.

The same model in every variant (an embedding of ``--rows`` x ``--dim``, mean-pooled
over ``--ids`` power-law ids per example, then a 64-unit dense tower), Adagrad on the
shards, trained by ``model.fit`` with ``psclient.keras`` on a 2-shard async cluster
(a fresh cluster per variant) by ``--workers`` worker processes, in the same run:

* ``dense``: ``keras.layers.Embedding`` kept a whole variable on the shards (the
  optimizer gets ``clipnorm=1e9``, which the shards cannot apply row by row, so the
  table path is off and the whole table, on one shard (``partition_bytes=0``: clipnorm needs
  it whole), is pushed and pulled every step).
* ``keras-table``: ``keras.layers.Embedding``: a row-spread table on the shards; the
  worker still holds the whole table (initial values sent by the chief, pushed rows
  scattered back into its copy).
* ``psk``: ``psclient.keras.Embedding``: the rows live only on the shards; each step
  looks up the batch's distinct ids and pushes their gradients (the pushed rows do not
  come back: ``push_pull(return_rows=...)``).
* ``psk-prefetch``: ``psk`` with ``psclient.keras.prefetch_rows``: the next batch's
  rows are read with the current step's push (``push_pull_lookup``: one request per
  shard a step).
* ``tf-ps``: TensorFlow's ParameterServerStrategy: 2 ps + ``--workers`` worker
  ``tf.distribute.Server`` processes and a coordinator running a custom loop
  (``ClusterCoordinator.schedule`` of a ``tf.function`` step) on the same model,
  the table a row-sharded ``ShardedVariable`` (``MinSizePartitioner``, 2 shards) read
  by ``tf.nn.embedding_lookup`` and updated by a sparse Adagrad (scatter ops on the
  ps tasks). Keras 3 ``fit`` cannot run on that strategy and tf_keras is not
  installed, so the custom loop is the path measured. Throughput: steps completed by
  all workers per second after 20 warm-up steps; payload bytes are not measured.
  ``--steps-per-execution n`` runs n steps per scheduled function (as Keras's
  ``compile(steps_per_execution=n)`` does for the psclient variants).
* ``keras-local``: the same model and data under Keras's own ``model.fit`` in one
  process, no parameter server, the table frozen (``trainable=False``: Keras's
  Adagrad would update the whole table every step): what ``fit`` and the model's
  compute cost a step around any exchange, the floor of the psclient variants'
  worker CPU.

Dynamic tables (issue 12), run by name (``--variants psk-capacity,psk-dynamic``): an
id stream drawn by a power law (``P(rank r) ~ (r + 1) ** -zipf``) from ``--id-space``
ids (10M), against ``--capacity`` rows (1M):

* ``psk-capacity``: a fixed ``psclient.keras.Embedding(capacity, dim)``, ids taken
  modulo the capacity (what a fixed-size table of the same memory does with them);
* ``psk-dynamic``: ``psclient.keras.Embedding(None, dim, capacity=capacity)``, a
  dynamic table keyed by the raw (hashed, 63-bit) ids with LRU eviction.

For these the driver also samples each shard's RSS twice a second while the
workers train (flat after warm-up: the rows are preallocated for the capacity),
and reads the table's admitted and evicted rows at the end (eviction rows/s over
the training time).

Disk tier (issue 21): ``--table-memory BYTES`` runs ``psk-dynamic`` (an unbounded
dynamic table, all in memory) and ``psk-tiered`` (the same table on shards started with
``--table-memory BYTES --table-dir``: hot rows in memory, the others on disk) on ids
drawn by the power law from ``--rows`` ids (``--id-space`` and ``--capacity`` are set
to ``--rows`` and 0), the same seeds; ``--prefill`` first pushes zero gradients for
every id (Adagrad leaves a row unchanged by a zero gradient), so the table holds all
``--rows`` rows before training. Reported: steps/s and its ratio to the in-memory run,
each shard's peak RSS (``VmHWM``) against the budget, the rows and bytes in each
tier, the memory hit rate, rows spilled and filled, and the loss curves (Keras's
running loss every few steps) side by side.

Reported per variant: steps/s (the workers' sum; steps after the first), payload
bytes per worker-step (tensor bytes through the client: gradients pushed, values
pulled, rows looked up; framing not counted) against the goal of issue 11,
``2 x (rows touched x dim x 4 B) + the dense variables`` (rows touched: the mean
distinct ids of a batch; the dense variables counted pushed and pulled, 2 x their
bytes; counted over the 100 steps after the first, then the counter is taken off), the
worker's peak RSS, CPU ms per step (workers and shards, over the steps after that
window: the counter is the bench's cost, not psclient's; what bounds steps/s when
every core is busy, as on this 2-core machine), and the run's wall time
(worker start to exit: TensorFlow import, table creation, training).

Usage:
    python bench/bench_embedding.py --out bench/results/embedding          # embedding.md / .json
    python bench/bench_embedding.py --steps-per-execution 8 --variants psk,psk-prefetch,tf-ps \
        --steps 1200 --workers 2 --out bench/results/embedding_spe8          # 8 steps per call
    python bench/bench_embedding.py --rows 100000 --steps 20 --variants psk   # a quick look
    python bench/bench_embedding.py --variants psk-capacity,psk-dynamic --steps 4000 \
        --out bench/results/embedding_dynamic                               # 10M-id stream, 1M rows
    python bench/bench_embedding.py --rows 10000000 --dim 32 --variants psk,psk-prefetch \
        --workers 2 --out bench/results/embedding_10m                       # worker RSS, 10M x 32
    python bench/bench_embedding.py --rows 2000000 --dim 32 --table-memory 64MiB --prefill \
        --steps 1500 --out bench/results/embedding_tiered                   # the disk tier vs in memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm
import _tfps

VARIANTS = ("dense", "keras-table", "psk", "psk-prefetch", "tf-ps", "keras-local")
DYNAMIC_VARIANTS = ("psk-capacity", "psk-dynamic", "psk-tiered")  # run by name: the id stream vs a capacity
_PREFILL_CHUNK = 8192  # ids per zero-gradient push of --prefill (a push must fit the in-memory tier)
_LOSS_POINTS = 30  # points of the loss curve recorded per run
_RESULT = "RESULT "
_RSS_SAMPLE_S = 0.5
_PAYLOAD_STEPS = 100  # psclient variants: payload counted over steps 2..101, CPU measured after them


def _env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def _stream(rng: Any, n: int, id_space: int, zipf: float) -> Any:
    """``n`` power-law ranks in ``[0, id_space)`` (inverse CDF of ``(r + 1) ** -zipf``, zipf < 1)."""
    import numpy as np

    u = rng.random(n)
    top = (id_space + 1.0) ** (1.0 - zipf)
    return np.minimum((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - zipf)) - 1.0, id_space - 1).astype(np.int64)


def _examples(args: argparse.Namespace, n: int) -> tuple[Any, Any]:
    """The variant's ``[n, ids]`` ids and labels (learnable through the rows)."""
    import numpy as np

    from pscore.placement import mix64

    rng = np.random.default_rng(args.index)
    if args.variant in DYNAMIC_VARIANTS:
        ranks = _stream(rng, n * args.ids, args.id_space, args.zipf).reshape(n, args.ids)
        y = (ranks % 7 == 0).mean(axis=1, keepdims=True).astype(np.float32)
        if args.variant == "psk-capacity":
            return ranks % args.capacity, y
        return (mix64(ranks) >> np.uint64(1)).astype(np.int64), y  # raw 63-bit ids
    x = ((rng.zipf(1.2, size=(n, args.ids)) - 1) % args.rows).astype(np.int32)  # power-law ids
    return x, (x % 7 == 0).mean(axis=1, keepdims=True).astype(np.float32)


def worker_main(args: argparse.Namespace) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import psclient.keras as psk
    from trainer.cluster import cpu_seconds, rss_mib
    from trainer.recsys import count_payload_bytes

    t0 = time.perf_counter()
    keras.utils.set_random_seed(1000 + args.index)  # the same dense tower in every run (loss curves compare)
    dense = {"partition_bytes": 0} if args.variant == "dense" else {}  # clipnorm: whole, on one shard
    worker = psk.PSWorker(
        args.addresses.split(","), worker_index=args.index, num_workers=args.workers, **dense
    )
    before = set(vars(worker.client))
    box = count_payload_bytes(worker.client)
    wrapped = set(vars(worker.client)) - before  # the client's methods the counter wrapped

    def uncount() -> None:
        """The client's own methods again: the payload window is over, the CPU window starts."""
        for name in wrapped:
            delattr(worker.client, name)

    if args.variant in ("psk", "psk-prefetch"):
        emb: Any = psk.Embedding(args.rows, args.dim, worker=worker, name="emb")
    elif args.variant == "psk-capacity":
        emb = psk.Embedding(args.capacity, args.dim, worker=worker, name="emb")
    elif args.variant in ("psk-dynamic", "psk-tiered"):
        emb = psk.Embedding(None, args.dim, worker=worker, name="emb", capacity=args.capacity or None)
    else:
        emb = keras.layers.Embedding(args.rows, args.dim, name="emb")
    id_dtype = "int64" if args.variant in DYNAMIC_VARIANTS else "int32"
    model = keras.Sequential(
        [keras.Input((args.ids,), dtype=id_dtype), emb, keras.layers.GlobalAveragePooling1D(),
         keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)], name="bench_embedding",
    )  # fmt: skip
    opt = keras.optimizers.Adagrad(0.1, clipnorm=1e9 if args.variant == "dense" else None)
    spe = args.steps_per_execution
    model.compile(optimizer=psk.DistributedOptimizer(opt, worker), loss="mse", steps_per_execution=spe)
    n = max(1, args.steps // 2) * args.batch_size  # two epochs
    x, y = _examples(args, n)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size)
    if args.variant == "psk-prefetch":
        ds = psk.prefetch_rows(ds, model)
    touched = float(
        np.mean([np.unique(x[i : i + args.batch_size]).size for i in range(0, n, args.batch_size)])
    )
    table = {id(w) for w in emb.weights}
    dense_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.weights if id(w) not in table)
    cb = worker.callback()
    attach_bytes: dict[str, int] = {}
    end_bytes: dict[str, int] = {}

    rss_before_fit = rss_mib(field="VmRSS")
    # calls of the step function; steps done by the end of the first call, and at the payload window's end
    steps_seen = [0, 0, 0]
    # steps after the first whose payload is counted (then the counter is taken off, and the CPU measured)
    payload_steps = min(_PAYLOAD_STEPS, max(1, max(1, args.steps // 2) // 2))
    shard_pids = [int(p) for p in args.shard_pids.split(",") if p]
    cpu_at: dict[str, list[float]] = {}  # after step 1 and at the end: this worker's CPU s, the shards'

    def cpu_now() -> list[float]:
        return [time.process_time(), *(cpu_seconds(p) for p in shard_pids)]

    prefill_s = [0.0]
    loss_curve: list[tuple[int, float]] = []
    every = max(1, args.steps // _LOSS_POINTS)

    class Prefill(keras.callbacks.Callback):
        """``--prefill``: after the attach (the table exists), zero gradients for every id of the id space."""

        def on_train_begin(self, logs: Any = None) -> None:
            if not (args.prefill and args.index == 0 and args.variant in DYNAMIC_VARIANTS):
                return
            import psclient
            from pscore.placement import mix64

            t = time.perf_counter()
            for start in range(0, args.id_space, _PREFILL_CHUNK):
                ranks = np.arange(start, min(start + _PREFILL_CHUNK, args.id_space), dtype=np.int64)
                ids = (mix64(ranks) >> np.uint64(1)).astype(np.int64)  # as _examples hashes them
                zeros = np.zeros((ids.size, args.dim), np.float32)
                worker.client.push({emb.table_name: psclient.Rows(ids, zeros)})
            prefill_s[0] = time.perf_counter() - t

    class Mark(keras.callbacks.Callback):
        """Payload bytes of steps 2 .. 1 + ``payload_steps`` (not the attach, the first step's pull of every
        variable or the final pull), then CPU from there to the end, without the counter: it wraps the
        client's calls and sizes every array they take and give, a cost of this bench, not of psclient (TF's
        PS has none)."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            steps_seen[0] += 1
            if steps_seen[0] % every == 0 and logs and "loss" in logs:
                loss_curve.append((steps_seen[0], float(logs["loss"])))
            if steps_seen[0] == 1:  # cb (before this callback) counted the steps of the first call
                attach_bytes.update(box)
                cpu_at["first"] = cpu_now()
                steps_seen[1] = cb.steps
            elif not steps_seen[2] and cb.steps - steps_seen[1] >= payload_steps:
                end_bytes.update(box)
                steps_seen[2] = cb.steps
                uncount()
                cpu_at["first"] = cpu_now()
            if not steps_seen[2]:  # a run too short to close the window: payload and CPU over steps 2..n
                end_bytes.update(box)

        def on_train_end(self, logs: Any = None) -> None:
            cpu_at["end"] = cpu_now()

    fit_started = time.perf_counter()
    hist = model.fit(ds, epochs=2, verbose=0, shuffle=False, callbacks=[cb, Prefill(), Mark()])
    fit_seconds = time.perf_counter() - fit_started
    worker.close()
    steps = cb.steps
    counted = max(1, (steps_seen[2] or steps) - steps_seen[1])  # the payload window's steps
    measured = max(1, steps - (steps_seen[2] or steps_seen[1]))  # the CPU window's
    result = {
        "variant": args.variant,
        "index": args.index,
        "steps": steps,
        "steps_per_s": cb.steps_per_second,
        "bytes_per_step": (sum(end_bytes.values()) - sum(attach_bytes.values())) / counted,
        "sent_per_step": (end_bytes["sent"] - attach_bytes["sent"]) / counted,
        "payload_steps": counted,
        "setup_bytes": sum(attach_bytes.values()),
        "peak_rss_mib": rss_mib(field="VmHWM"),
        "rss_before_fit_mib": rss_before_fit,
        "rss_end_mib": rss_mib(field="VmRSS"),
        "fit_s": fit_seconds,
        "distinct_ids": int(np.unique(x).size),
        "rows_touched_per_step": touched,
        "goal_bytes_per_step": 2 * touched * args.dim * 4 + 2 * dense_bytes,
        "prefetch": emb.prefetch_stats if args.variant == "psk-prefetch" else None,
        "weights_mib": sum(int(np.prod(w.shape)) * 4 for w in model.weights) / 2**20,
        "loss": [float(hist.history["loss"][0]), float(hist.history["loss"][-1])],
        "loss_curve": loss_curve,
        "prefill_s": prefill_s[0],
        "wall_s": time.perf_counter() - t0,
        # CPU seconds after the payload window (over steps 2..n when the run is too short for it): this
        # worker's, and the shards' (all workers' load)
        "cpu_s": [b - a for a, b in zip(cpu_at["first"], cpu_at["end"], strict=True)],
        "measured_steps": measured,
    }
    print(_RESULT + json.dumps(result), flush=True)


def local_main(args: argparse.Namespace) -> None:
    """The ``keras-local`` variant: the same model and data under Keras's own ``fit`` in this one process, no
    parameter server, the table frozen (what ``fit`` and the model's compute cost around any exchange)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(1000 + args.index)
    model = keras.Sequential(
        [keras.Input((args.ids,), dtype="int32"),
         keras.layers.Embedding(args.rows, args.dim, trainable=False), keras.layers.GlobalAveragePooling1D(),
         keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)],
        name="bench_embedding",
    )  # fmt: skip
    model.compile(
        optimizer=keras.optimizers.Adagrad(0.1), loss="mse", steps_per_execution=args.steps_per_execution
    )
    x, y = _examples(args, max(1, args.steps // 2) * args.batch_size)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size)
    marks: dict[str, tuple[int, float, float]] = {}  # after the first call of the step function, at the end
    calls = [0]

    class Mark(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            calls[0] += 1
            if calls[0] == 1:
                marks["first"] = (batch + 1, time.process_time(), time.perf_counter())

        def on_train_end(self, logs: Any = None) -> None:
            marks["end"] = (0, time.process_time(), time.perf_counter())

    t0 = time.perf_counter()
    hist = model.fit(ds, epochs=2, verbose=0, shuffle=False, callbacks=[Mark()])
    steps = int(model.optimizer.iterations.numpy())
    measured = max(1, steps - marks["first"][0])
    cpu_s, fit_s = (marks["end"][i] - marks["first"][i] for i in (1, 2))
    result = {
        "steps": steps, "steps_per_s": measured / fit_s, "fit_s": fit_s, "wall_s": time.perf_counter() - t0,
        "loss": [float(hist.history["loss"][0]), float(hist.history["loss"][-1])],
        "worker_cpu_ms_per_step": cpu_s / measured * 1e3,
    }  # fmt: skip
    print(_RESULT + json.dumps(result), flush=True)


def _run_for_result(cmd: list[str], what: str) -> dict[str, Any]:
    """Runs one of this bench's processes to its end; its last ``RESULT`` line."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=cm.REPO, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_RESULT) :])


def run_keras_local(args: argparse.Namespace) -> dict[str, Any]:
    """The ``keras-local`` variant: one process, no cluster."""
    cmd = [sys.executable, __file__, "--worker", "--variant", "keras-local", "--rows", str(args.rows),
           "--dim", str(args.dim), "--ids", str(args.ids), "--batch-size", str(args.batch_size),
           "--steps", str(args.steps), "--steps-per-execution", str(args.steps_per_execution)]  # fmt: skip
    r = _run_for_result(cmd, "keras-local")
    none = dict.fromkeys(("bytes_per_worker_step", "sent_per_worker_step", "goal_bytes_per_worker_step",
                          "rows_touched_per_step", "setup_bytes", "shard_cpu_ms_per_step"))  # fmt: skip
    return {
        **none, "variant": "keras-local", "workers": 1, "steps_per_worker": r["steps"],
        "steps_per_s": r["steps_per_s"], "peak_rss_mib_per_worker": [], "end_rss_mib_per_worker": [],
        "worker_weights_mib": args.rows * args.dim * 4 / 2**20, "loss_first_last": r["loss"],
        "wall_s": r["wall_s"], "fit_s": r["fit_s"], "worker_cpu_ms_per_step": r["worker_cpu_ms_per_step"],
    }  # fmt: skip


def tf_coordinator_main(args: argparse.Namespace) -> None:
    """The ``tf-ps`` variant's coordinator: the same model and data, on TensorFlow's PS strategy."""
    import numpy as np
    import tensorflow as tf

    from trainer.cluster import cpu_seconds

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(args.addresses)), rpc_layer="grpc"
    )
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=1 << 20, max_shards=2
    )  # the table row-sharded over both ps tasks, the small tower variables whole
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    rows, dim, lr, eps = args.rows, args.dim, 0.1, 1e-7  # Keras's Adagrad: accumulators start at 0.1

    def glorot(shape: list[int]) -> Any:  # Keras's Dense kernel initializer
        limit = (6.0 / sum(shape)) ** 0.5
        return tf.random.uniform(shape, -limit, limit, seed=0)

    with strategy.scope():
        emb = tf.Variable(lambda: tf.random.uniform([rows, dim], -0.05, 0.05, seed=0), name="emb")
        emb_acc = tf.Variable(lambda: tf.fill([rows, dim], 0.1), name="emb_acc")
        shapes = {"w1": [dim, 64], "b1": [64], "w2": [64, 1], "b2": [1]}
        dense = {k: tf.Variable(glorot(s) if len(s) == 2 else tf.zeros(s), name=k) for k, s in shapes.items()}
        dense_acc = {k: tf.Variable(tf.fill(s, 0.1), name=k + "_acc") for k, s in shapes.items()}
    x, y = _examples(args, max(1, args.steps // 2) * args.batch_size)
    x = x.astype(np.int64)

    def dataset_fn() -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch_size).prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def sparse_adagrad(var: Any, acc: Any, g: tf.IndexedSlices) -> None:
        ids, pos = tf.unique(g.indices)
        values = tf.math.unsorted_segment_sum(g.values, pos, tf.size(ids))
        acc.scatter_add(tf.IndexedSlices(values * values, ids))
        var.scatter_sub(tf.IndexedSlices(lr * values / (tf.sqrt(tf.gather(acc, ids)) + eps), ids))

    @tf.function
    def steps(it: Any) -> Any:  # steps_per_execution steps per scheduled function, as Keras's fit runs them
        loss = tf.constant(0.0)
        for _ in tf.range(args.steps_per_execution):
            loss = one_step(it)
        return loss

    def one_step(it: Any) -> Any:
        def replica_fn(xb: Any, yb: Any) -> Any:
            shards = emb.variables if hasattr(emb, "variables") else [emb]
            with tf.GradientTape() as tape:
                e = tf.nn.embedding_lookup(emb, xb)  # only the batch's rows, from the ps tasks
                h = tf.nn.relu(tf.reduce_mean(e, axis=1) @ dense["w1"] + dense["b1"])
                loss = tf.reduce_mean((h @ dense["w2"] + dense["b2"] - yb) ** 2)
            grads = tape.gradient(loss, [*shards, *dense.values()])
            acc_shards = emb_acc.variables if hasattr(emb_acc, "variables") else [emb_acc]
            for var, acc, g in zip(shards, acc_shards, grads[: len(shards)], strict=True):
                sparse_adagrad(var, acc, g)
            for (k, var), g in zip(dense.items(), grads[len(shards) :], strict=True):
                dense_acc[k].assign_add(g * g)
                var.assign_sub(lr * g / (tf.sqrt(dense_acc[k]) + eps))
            return loss

        xb, yb = next(it)
        return strategy.run(replica_fn, args=(xb, yb))

    step = steps if args.steps_per_execution > 1 else tf.function(one_step)  # 1: no loop around it
    for _ in range(max(1, 20 // args.steps_per_execution)):  # warm-up: tracing, first reads
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    calls = max(1, args.steps * args.workers // args.steps_per_execution)
    steps = calls * args.steps_per_execution  # as many steps as our workers take together
    pids = [int(p) for p in args.shard_pids.split(",") if p]  # the TF workers' and ps tasks'
    cpu0 = [time.process_time(), *(cpu_seconds(p) for p in pids)]
    t0 = time.perf_counter()
    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(calls)]
    coordinator.join()
    elapsed = time.perf_counter() - t0
    cpu = [b - a for a, b in zip(cpu0, [time.process_time(), *(cpu_seconds(p) for p in pids)], strict=True)]
    first, last = (float(np.mean(r.fetch())) for r in (losses[0], losses[-1]))
    result = {
        "steps_per_s": steps / elapsed, "steps": steps, "fit_s": elapsed, "loss": [first, last],
        # CPU ms per step: the coordinator and the TF workers (what runs the steps), the ps tasks
        "worker_cpu_ms_per_step": (cpu[0] + sum(cpu[1 : 1 + args.workers])) / steps * 1e3,
        "shard_cpu_ms_per_step": sum(cpu[1 + args.workers :]) / steps * 1e3,
    }  # fmt: skip
    print(_RESULT + json.dumps(result), flush=True)


def run_tf_ps(args: argparse.Namespace) -> dict[str, Any]:
    """The ``tf-ps`` variant: a TF cluster (2 ps, ``--workers`` workers) and its coordinator."""
    with _tfps.cluster(2, args.workers, env=_env()) as tf_cluster:
        cmd = [sys.executable, __file__, "--tf-coordinator", "--addresses", tf_cluster.spec,
               "--workers", str(args.workers), "--rows", str(args.rows), "--dim", str(args.dim),
               "--ids", str(args.ids), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--variant", "tf-ps", "--steps-per-execution", str(args.steps_per_execution), "--shard-pids",
               ",".join(str(tf_cluster.procs[f"{job}:{i}"].pid)
                        for job, n in (("worker", args.workers), ("ps", 2)) for i in range(n))]  # fmt: skip
        t0 = time.perf_counter()
        r = _run_for_result(cmd, "tf-ps coordinator")
        wall = time.perf_counter() - t0
    rss = tf_cluster.peak_rss_mib
    return {
        "variant": "tf-ps",
        "workers": args.workers,
        "steps_per_worker": r["steps"] // args.workers,
        "steps_per_s": r["steps_per_s"],
        "bytes_per_worker_step": None,
        "sent_per_worker_step": None,
        "goal_bytes_per_worker_step": None,
        "rows_touched_per_step": None,
        "setup_bytes": None,
        "peak_rss_mib_per_worker": [round(rss[f"worker:{i}"]) for i in range(args.workers)],
        "end_rss_mib_per_worker": [],
        "ps_peak_rss_mib": [round(rss[f"ps:{i}"]) for i in range(2)],
        "worker_weights_mib": 0.0,
        "loss_first_last": r["loss"],
        "wall_s": wall,
        "fit_s": r["fit_s"],
        "worker_cpu_ms_per_step": r["worker_cpu_ms_per_step"],
        "shard_cpu_ms_per_step": r["shard_cpu_ms_per_step"],
    }


def _sample_rss(
    cluster: Any, stop: threading.Event, samples: list[tuple[float, list[float]]], anon: list[list[float]]
) -> None:
    t0 = time.perf_counter()
    while not stop.wait(_RSS_SAMPLE_S):
        samples.append((time.perf_counter() - t0, cluster.shard_rss_mib()))
        anon.append(cluster.shard_rss_mib("RssAnon"))  # the process's own memory, not mapped file pages


def _table_counts(addresses: list[str]) -> dict[str, int]:
    """The bench table's rows and counters summed over the shards (a dynamic table's; else just rows)."""
    import psclient

    with psclient.PSClient(addresses, worker_id="bench-reader", timeout=60) as c:
        listed = c.list_variables()
    infos = [i for group in listed.values() for i in group if i.spec.HasField("dynamic")]
    fields = ("rows", "admitted", "evicted", "expired", "dropped_updates", "rows_in_memory", "rows_on_disk",
              "memory_bytes", "disk_bytes", "memory_rows_max", "spilled", "filled", "memory_hits",
              "disk_hits")  # fmt: skip
    return {f: sum(int(getattr(i.dynamic, f)) for i in infos) for f in fields}


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    from trainer.cluster import LocalCluster

    if variant == "tf-ps":
        return run_tf_ps(args)
    if variant == "keras-local":
        return run_keras_local(args)
    import tempfile

    tier_dir = None
    server_args = ["--mode", "async"]
    if variant == "psk-tiered":  # on the machine's disk (not the workdir's tmpfs, if /tmp were one)
        tier_dir = tempfile.TemporaryDirectory(prefix="bench-tier-", dir=cm.REPO)
        server_args += ["--table-memory", args.table_memory, "--table-dir", tier_dir.name]
        server_args += ["--table-tier-store", args.table_tier_store]
    cluster = LocalCluster(num_shards=2, server_args=server_args).start()
    samples: list[tuple[float, list[float]]] = []
    anon: list[list[float]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(cluster, stop, samples, anon), daemon=True)
    try:
        cmd = [
            [sys.executable, __file__, "--worker", "--variant", variant, "--index", str(i),
             "--addresses", ",".join(cluster.addresses), "--workers", str(args.workers),
             "--rows", str(args.rows), "--dim", str(args.dim), "--ids", str(args.ids),
             "--batch-size", str(args.batch_size),
             "--steps", str(args.dense_steps if variant == "dense" else args.steps),
             "--id-space", str(args.id_space), "--capacity", str(args.capacity), "--zipf", str(args.zipf),
             "--shard-pids", ",".join(str(p.pid) for p in cluster.procs if p is not None),
             "--steps-per-execution", str(args.steps_per_execution)]
            + (["--prefill"] if args.prefill else [])
            for i in range(args.workers)
        ]  # fmt: skip
        procs = [
            subprocess.Popen(
                c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=cm.REPO
            )
            for c in cmd
        ]
        sampler.start()
        rows = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            lines = [ln for ln in out.splitlines() if ln.startswith(_RESULT)]
            if p.returncode or not lines:
                raise RuntimeError(f"{variant} worker exited {p.returncode}:\n{out[-2000:]}\n{err[-3000:]}")
            rows.append(json.loads(lines[-1][len(_RESULT) :]))
        stop.set()
        sampler.join()
        counts = _table_counts(cluster.addresses) if variant in ("psk-dynamic", "psk-tiered") else {}
        shard_rss_end = cluster.shard_rss_mib()
        shard_peak = cluster.shard_rss_mib("VmHWM")
        shard_file = cluster.shard_rss_mib("RssFile")
    finally:
        stop.set()
        cluster.stop()
        if tier_dir is not None:
            tier_dir.cleanup()
    fit_s = max(r["fit_s"] for r in rows)
    dynamic = {}
    if variant in DYNAMIC_VARIANTS:
        total = [sum(s) for _, s in samples] or [float("nan")]
        quarter = lambda q: total[min(len(total) - 1, int(q * len(total)))]  # noqa: E731
        dynamic = {
            "id_space": args.id_space,
            "capacity": args.capacity,
            "zipf": args.zipf,
            "distinct_ids_per_worker": [r["distinct_ids"] for r in rows],
            "table": counts,
            "evicted_rows_per_s": counts["evicted"] / fit_s if counts and fit_s else None,
            "admitted_rows_per_s": counts["admitted"] / fit_s if counts and fit_s else None,
            "shard_rss_mib_sum_at": {q: round(quarter(q / 4)) for q in (1, 2, 3)} | {4: round(total[-1])},
            "shard_rss_mib_max": round(max(total)),
            "shard_rss_mib_end": [round(r) for r in shard_rss_end],
            "shard_rss_samples": [(round(t, 1), [round(r) for r in s]) for t, s in samples],
            "shard_peak_rss_mib": [round(r) for r in shard_peak],
            "shard_anon_rss_mib_max": [round(max(a[i] for a in anon)) if anon else None for i in range(2)],
            "shard_file_rss_mib_end": [round(r) for r in shard_file],
            "loss_curve": rows[0]["loss_curve"],
            "prefill_s": rows[0]["prefill_s"],
        }
    return {
        **dynamic,
        "variant": variant,
        "workers": len(rows),
        "steps_per_worker": rows[0]["steps"],
        "steps_per_s": sum(r["steps_per_s"] for r in rows),
        "bytes_per_worker_step": sum(r["bytes_per_step"] for r in rows) / len(rows),
        "goal_bytes_per_worker_step": sum(r["goal_bytes_per_step"] for r in rows) / len(rows),
        "rows_touched_per_step": sum(r["rows_touched_per_step"] for r in rows) / len(rows),
        "prefetch": [r["prefetch"] for r in rows] if variant == "psk-prefetch" else None,
        "sent_per_worker_step": sum(r["sent_per_step"] for r in rows) / len(rows),
        "setup_bytes": sum(r["setup_bytes"] for r in rows),
        "peak_rss_mib_per_worker": [round(r["peak_rss_mib"]) for r in rows],
        "end_rss_mib_per_worker": [round(r["rss_end_mib"]) for r in rows],
        "worker_weights_mib": rows[0]["weights_mib"],
        "loss_first_last": rows[0]["loss"],
        "wall_s": max(r["wall_s"] for r in rows),
        "fit_s": fit_s,
        # CPU ms per step (a worker's own; the shards' over worker 0's steps 2..n, for all the workers'
        # steps in that time): what a busy machine's throughput is bound by
        "worker_cpu_ms_per_step": sum(r["cpu_s"][0] / r["measured_steps"] for r in rows) / len(rows) * 1e3,
        "shard_cpu_ms_per_step": sum(rows[0]["cpu_s"][1:]) / (rows[0]["measured_steps"] * len(rows)) * 1e3,
    }


def _markdown_dynamic(args: argparse.Namespace, results: list[dict[str, Any]], command: str) -> str:
    mib = 2**20
    lines = [
        "# Dynamic embedding table vs a fixed table of the same capacity: an id stream larger than memory",
        "",
        f"Command: `{command}`",
        "",
        f"Id stream: {args.ids} ids per example drawn by a power law (zipf {args.zipf}) from "
        f"{args.id_space:,} ids; table capacity {args.capacity:,} rows x {args.dim} (float32, Adagrad: "
        f"{args.capacity * args.dim * 8 / mib:.0f} MiB of rows and slots over 2 async shards); batch "
        f"{args.batch_size}, {args.steps} steps per worker, {args.workers} worker(s). `psk-capacity`: a "
        "fixed table of that many rows, ids modulo the capacity; `psk-dynamic`: a dynamic table keyed by the "
        f"raw ids, LRU eviction. Machine: {json.dumps(cm.machine_note())}",
        "",
        "| variant | steps/s (sum) | distinct ids seen (per worker) | rows held | admitted | evicted | "
        "evicted rows/s | shard RSS MiB (sum) at 1/4, 1/2, 3/4, end of training | max | "
        "payload KiB / worker-step | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r.get("table", {})
        at = r.get("shard_rss_mib_sum_at", {})
        lines.append(
            f"| {r['variant']} | {r['steps_per_s']:.2f} | "
            f"{', '.join(map(str, r['distinct_ids_per_worker']))} | "
            f"{t.get('rows', '-')} | {t.get('admitted', '-')} | {t.get('evicted', '-')} | "
            f"{'-' if r['evicted_rows_per_s'] is None else round(r['evicted_rows_per_s'])} | "
            f"{', '.join(str(at[q]) for q in sorted(at))} | "
            f"{r['shard_rss_mib_max']} | {r['bytes_per_worker_step'] / 1024:.1f} | "
            f"{r['loss_first_last'][0]:.4f} -> {r['loss_first_last'][1]:.4f} |"
        )
    lines += [
        "",
        "Shard RSS is sampled every 0.5 s from /proc while the workers run (both shards summed); the "
        "fixed table's rows are all written at creation, the dynamic table's as ids arrive, up to the "
        "capacity, after which eviction reuses them: flat after warm-up. Evicted rows/s: the table's "
        "evictions over the longest worker's `fit` time.",
        "",
    ]
    return "\n".join(lines)


def _markdown_tiered(args: argparse.Namespace, results: list[dict[str, Any]], command: str) -> str:
    mib = 2**20
    budget = _parse_size(args.table_memory)
    base = next((r for r in results if r["variant"] == "psk-dynamic"), None)  # None: tiered alone
    prefilled = "prefilled (every id pushed a zero gradient first), " if args.prefill else ""
    store = {"log": "log segment", "lmdb": "LMDB"}.get(args.table_tier_store, args.table_tier_store)
    lines = [
        "# Disk tier: a dynamic table in memory vs on shards with --table-memory",
        "",
        f"Command: `{command}`",
        "",
        f"Table: {args.rows:,} ids x {args.dim} (float32, Adagrad: "
        f"{args.rows * args.dim * 8 / mib:.0f} MiB of rows and slots when all exist), {prefilled}"
        f"{args.ids} ids per example by a power law (zipf {args.zipf}); batch {args.batch_size}, "
        f"{args.steps} steps, {args.workers} worker(s), 2 async shards. `psk-tiered`: shards with "
        f"`--table-memory {args.table_memory} --table-tier-store {args.table_tier_store}` "
        f"({budget / mib:.0f} MiB per shard). "
        f"Machine: {json.dumps(cm.machine_note())}",
        "",
        "| variant | steps/s | vs in memory | shard RSS MiB: peak (VmHWM) / own max (RssAnon) / tier pages "
        "mapped at end (RssFile) | rows | in memory | on disk | memory MiB | disk MiB | memory hit rate | "
        "spilled | filled | prefill s | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r.get("table", {})
        looked = t.get("memory_hits", 0) + t.get("disk_hits", 0)
        tiered = r["variant"] == "psk-tiered"
        hit = f"{100 * t.get('memory_hits', 0) / looked:.1f}%" if tiered and looked else "-"
        kinds = ("shard_peak_rss_mib", "shard_anon_rss_mib_max", "shard_file_rss_mib_end")
        rss = " / ".join(", ".join(map(str, r[k])) for k in kinds)
        ratio = f"{r['steps_per_s'] / base['steps_per_s']:.2f}" if base else "-"
        lines.append(
            f"| {r['variant']} | {r['steps_per_s']:.2f} | {ratio} | "
            f"{rss}"
            f" | {t.get('rows', '-')} | "
            f"{t.get('rows_in_memory') if tiered else t.get('rows', '-')} | {t.get('rows_on_disk', 0)} | "
            f"{t.get('memory_bytes', 0) / mib:.0f} | {t.get('disk_bytes', 0) / mib:.0f} | "
            f"{hit} | "
            f"{t.get('spilled', 0)} | {t.get('filled', 0)} | {r.get('prefill_s', 0):.1f} | "
            f"{r['loss_first_last'][0]:.5f} -> {r['loss_first_last'][1]:.5f} |"
        )
    curves = {r["variant"]: dict(r.get("loss_curve", [])) for r in results}
    steps = sorted(set().union(*(c.keys() for c in curves.values())))
    lines += ["", "Loss curve (Keras's running loss of the epoch, worker 0):", "",
              "| step | " + " | ".join(curves) + " |", "|---" * (len(curves) + 1) + "|"]  # fmt: skip
    for st in steps:
        points = " | ".join(f"{c.get(st, float('nan')):.6f}" for c in curves.values())
        lines.append(f"| {st} | {points} |")
    lines += [
        "",
        f"Shard RSS: `VmHWM` at the end (prefill and training, everything resident: the disk tier's "
        f"{store} file pages the shard has read are mapped into it and count, though the kernel can drop "
        f"them); the largest `RssAnon` sampled every {_RSS_SAMPLE_S} s (the shard's own memory: what "
        f"`--table-memory` bounds; budget + 300 MiB = {budget / mib + 300:.0f} MiB); `RssFile` at the end "
        f"(mapped file pages: {store}'s, and the shard's code). Memory MiB: the tiered "
        "table's rows, slots and bookkeeping in memory (psctl status's MEM SIZE, both shards); disk MiB: "
        f"the blocks of its {store} files. Hit rate: ids of pushes and lookups found in memory.",
        "",
    ]
    return "\n".join(lines)


def _parse_size(text: str) -> int:
    from psserver.tier import parse_bytes

    return parse_bytes(text)


def _markdown(args: argparse.Namespace, results: list[dict[str, Any]], command: str) -> str:
    mib = 2**20

    def num(v: float | None, fmt: str, scale: float = 1.0) -> str:
        return "-" if v is None else format(v / scale, fmt)

    lines = [
        "# Embedding training: whole variable vs Keras Embedding table vs psclient.keras.Embedding vs TF PS",
        "",
        f"Command: `{command}`",
        "",
        f"Model: Embedding {args.rows:,} x {args.dim} (float32, {args.rows * args.dim * 4 / mib:.0f} MiB), "
        f"{args.ids} power-law ids (zipf 1.2) per example mean-pooled, Dense 64 relu, Dense 1; Adagrad(0.1) "
        f"on the shards; batch {args.batch_size}; 2 async shards, no overlap (PSWorker's default: a step "
        f"waits for its exchange), {args.workers} worker(s); "
        f"{args.steps_per_execution} step(s) per call of the step function; "
        f"`model.fit` with psclient.keras (`tf-ps`: TensorFlow's ParameterServerStrategy, 2 ps tasks, a "
        f"custom loop). Machine: {json.dumps(cm.machine_note())}",
        "",
        "| variant | steps/worker | steps/s (sum) | rows touched / step | payload KiB / worker-step | "
        "of which sent | goal KiB (2 x rows x dim x 4 B + dense pushed and pulled) | payload / goal | "
        "setup MiB (attach, first step; all workers) | worker weights MiB | peak RSS MiB per worker | "
        "RSS at end MiB per worker | CPU ms / step: worker, shards | wall s | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        payload, goal = r["bytes_per_worker_step"], r["goal_bytes_per_worker_step"]
        ratio = None if payload is None or not goal else payload / goal
        lines.append(
            f"| {r['variant']} | {r['steps_per_worker']} | {r['steps_per_s']:.2f} | "
            f"{num(r['rows_touched_per_step'], '.0f')} | {num(payload, '.1f', 1024)} | "
            f"{num(r['sent_per_worker_step'], '.1f', 1024)} | {num(goal, '.1f', 1024)} | "
            f"{num(ratio, '.2f')} | {num(r['setup_bytes'], '.1f', mib)} | {r['worker_weights_mib']:.2f} | "
            f"{', '.join(map(str, r['peak_rss_mib_per_worker'])) or '-'} | "
            f"{', '.join(map(str, r['end_rss_mib_per_worker'])) or '-'} | "
            f"{num(r.get('worker_cpu_ms_per_step'), '.2f')}, {num(r.get('shard_cpu_ms_per_step'), '.2f')} | "
            f"{r['wall_s']:.1f} | {r['loss_first_last'][0]:.4f} -> {r['loss_first_last'][1]:.4f} |"
        )
    notes = []
    for r in results:
        if r.get("prefetch"):
            notes.append(f"`{r['variant']}` lookups answered by a prefetch (per worker): {r['prefetch']}.")
        if r.get("ps_peak_rss_mib"):
            notes.append(f"`tf-ps` ps tasks' peak RSS MiB: {r['ps_peak_rss_mib']}.")
    lines += [
        "",
        "Payload bytes are tensor bytes through the client (gradients and ids sent; values, returned rows "
        "and looked-up rows received), counted in the worker by wrapping `push`, `push_pull` and "
        "`push_pull_lookup` (and their `_future`s), `pull` and `lookup`, over the first "
        f"{_PAYLOAD_STEPS} steps after the first (then the wrappers are taken off, so that the CPU column, "
        "measured after them, does not pay for them); framing is not counted. Bytes up to the end of "
        "the first step (attach, the first pull, the first step's pull of every variable) are the setup "
        "column (the chief's table creation is not counted: `create_embedding` is not wrapped, and "
        "sends no rows for a named initializer); the final pull after training is not counted. Loss: "
        "the mean of epoch 1 -> epoch 2 (`tf-ps`: the first and last measured step). "
        "`dense` pushes and pulls the whole table each step; "
        "`keras-table` pushes the batch's rows and gets them back (the worker keeps a whole copy); `psk` "
        "looks up the batch's distinct rows and pushes their gradients (nothing comes back for the table: "
        "`push_pull(return_rows=...)`); `psk-prefetch` (`prefetch_rows`) reads the next batch's rows with "
        "the step's push (`push_pull_lookup`: one request per shard a step). Goal (issue 11): "
        "rows touched = the mean distinct ids of a batch; the ids themselves, sent with the lookup and "
        "with the push, are what `psk` sends beyond it: counted here as given (8 B each), they travel "
        "as int32 (4 B) for a fixed table. CPU ms / step: CPU time over the measured steps divided by "
        f"the steps (psclient variants: the steps after the payload window, {_PAYLOAD_STEPS} steps after "
        "the first; a worker's own, and the shards' over worker 0's measured steps "
        "for all the workers' steps in that time; `tf-ps`: the coordinator and the TF workers, and the "
        "ps tasks): on a machine whose cores are all busy, steps/s follows their sum. `keras-local`: the "
        "same model and data under Keras's own `fit` in one process, no parameter server, the table frozen "
        "(`trainable=False`; Keras's Adagrad would update all of it every step): what `fit` and the model's "
        "compute cost around any exchange, the floor of the psclient variants' worker column.",
        "",
        "Peak RSS: the chief (worker 0) with `keras-table` holds Keras's initial table and sends it; with "
        "`psk` the shards make the initial rows (the chief sends none). Every `psk` worker's RSS is the "
        "O(batch) steady state plus TensorFlow.",
        *(["", *notes] if notes else []),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=8, help="ids per example")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dense-steps", type=int, default=12, help="steps of the (slow) dense variant")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--steps-per-execution",
        type=int,
        default=1,
        help="steps per call of the step function: Keras's compile(steps_per_execution=...) for the "
        "psclient variants, steps per scheduled function for tf-ps",
    )
    ap.add_argument("--id-space", type=int, default=10_000_000, help="dynamic variants: ids in the stream")
    ap.add_argument("--capacity", type=int, default=1_000_000, help="dynamic variants: rows of the table")
    ap.add_argument("--zipf", type=float, default=0.9, help="dynamic variants: power-law exponent (< 1)")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS + DYNAMIC_VARIANTS)} (default: %(default)s)",
    )
    ap.add_argument(
        "--table-memory",
        metavar="BYTES",
        help="disk tier: run psk-dynamic (in memory) and psk-tiered (shards with --table-memory BYTES) "
        "on --rows power-law ids (--variants psk-tiered: that one only, for a table past the machine's "
        "memory)",
    )
    ap.add_argument(
        "--table-tier-store",
        choices=("log", "lmdb"),
        default="log",
        help="disk tier: the shards' --table-tier-store for psk-tiered (default log)",
    )
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="dynamic variants: push zero gradients for every id first (the table holds all of them)",
    )
    ap.add_argument("--out", help="write OUT.md and OUT.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tf-coordinator", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--addresses", help=argparse.SUPPRESS)
    ap.add_argument("--shard-pids", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        local_main(args) if args.variant == "keras-local" else worker_main(args)
        return
    if args.tf_coordinator:
        tf_coordinator_main(args)
        return
    results = []
    if args.table_memory:  # both, unless one of them is asked for (a table too big to hold in memory)
        tiered_pair = ("psk-dynamic", "psk-tiered")
        given = [v for v in args.variants.split(",") if v]
        if args.variants != ap.get_default("variants") and any(v not in tiered_pair for v in given):
            raise SystemExit(f"--table-memory runs {' and '.join(tiered_pair)} only, not {args.variants}")
        asked = args.variants if args.variants in tiered_pair else ",".join(tiered_pair)
        args.variants, args.id_space, args.capacity = asked, args.rows, 0
    variants = args.variants.split(",")
    dynamic = [v in DYNAMIC_VARIANTS for v in variants]
    if any(dynamic) != all(dynamic):
        raise SystemExit(f"run {', '.join(DYNAMIC_VARIANTS)} apart from {', '.join(VARIANTS)}")
    if any(dynamic) and not 0 < args.zipf < 1:
        raise SystemExit("--zipf must be in (0, 1)")
    for variant in variants:
        if variant not in VARIANTS + DYNAMIC_VARIANTS:
            raise SystemExit(
                f"unknown variant {variant!r}; choose from {', '.join(VARIANTS + DYNAMIC_VARIANTS)}"
            )
        r = run_variant(args, variant)
        print(json.dumps({k: v for k, v in r.items() if k != "shard_rss_samples"}), flush=True)
        results.append(r)
    command = "python bench/bench_embedding.py " + " ".join(sys.argv[1:])
    render = _markdown_tiered if args.table_memory else _markdown_dynamic if any(dynamic) else _markdown
    md = render(args, results, command)
    print(md)
    if args.out:
        Path(args.out + ".md").write_text(md)
        Path(args.out + ".json").write_text(json.dumps({"command": command, "results": results}, indent=2))


if __name__ == "__main__":
    main()
