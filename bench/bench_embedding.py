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
  looks up the batch's distinct ids and pushes their gradients.

Reported per variant: steps/s (the workers' sum; steps after the first), payload
bytes per worker-step (tensor bytes through the client: gradients pushed, values
pulled, rows looked up; framing not counted), the worker's peak RSS, and the run's
wall time (worker start to exit: TensorFlow import, table creation, training).

Usage:
    python bench/bench_embedding.py --out bench/results/embedding          # embedding.md / .json
    python bench/bench_embedding.py --rows 100000 --steps 20 --variants psk   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm

VARIANTS = ("dense", "keras-table", "psk")
_RESULT = "RESULT "


def _env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def _rss_mib(field: str = "VmHWM") -> float:
    """This process's peak (VmHWM) or current (VmRSS) resident memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _count_bytes(client: Any) -> dict[str, int]:
    """Wraps the client's data calls to count tensor payload bytes (sent and received)."""
    import numpy as np

    from pscore.embedding import Rows

    box = {"sent": 0, "received": 0}

    def size(x: Any) -> int:
        if isinstance(x, Rows):
            return int(np.asarray(x.ids).nbytes + np.asarray(x.values).nbytes)
        return int(np.asarray(x).nbytes)

    def sent(grads: Any) -> None:
        box["sent"] += sum(size(g) for g in grads.values())

    def received(values: Any) -> Any:
        box["received"] += sum(size(v) for v in values.values())
        return values

    push, push_pull_future, pull, lookup = client.push, client.push_pull_future, client.pull, client.lookup

    def w_push(grads: Any, **kw: Any) -> Any:
        sent(grads)
        return push(grads, **kw)

    def w_push_pull_future(grads: Any, **kw: Any) -> Any:
        sent(grads)
        fut = push_pull_future(grads, **kw)
        fut.add_done_callback(lambda f: f.exception() is None and received(f.result()))
        return fut

    def w_pull(names: Any = None, **kw: Any) -> Any:
        return received(pull(names, **kw))

    def w_lookup(name: str, ids: Any, **kw: Any) -> Any:
        box["sent"] += int(np.asarray(ids).nbytes)
        out = lookup(name, ids, **kw)
        box["received"] += int(out.nbytes)
        return out

    client.push, client.push_pull_future, client.pull, client.lookup = (
        w_push, w_push_pull_future, w_pull, w_lookup,
    )  # fmt: skip
    return box


def worker_main(args: argparse.Namespace) -> None:
    import keras
    import numpy as np

    import psclient.keras as psk

    t0 = time.perf_counter()
    dense = {"partition_bytes": 0} if args.variant == "dense" else {}  # clipnorm: whole, on one shard
    worker = psk.PSWorker(
        args.addresses.split(","), worker_index=args.index, num_workers=args.workers, **dense
    )
    box = _count_bytes(worker.client)
    if args.variant == "psk":
        emb: Any = psk.Embedding(args.rows, args.dim, worker=worker, name="emb")
    else:
        emb = keras.layers.Embedding(args.rows, args.dim, name="emb")
    model = keras.Sequential(
        [keras.Input((args.ids,), dtype="int32"), emb, keras.layers.GlobalAveragePooling1D(),
         keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)], name="bench_embedding",
    )  # fmt: skip
    opt = keras.optimizers.Adagrad(0.1, clipnorm=1e9 if args.variant == "dense" else None)
    model.compile(optimizer=psk.DistributedOptimizer(opt, worker), loss="mse")
    rng = np.random.default_rng(args.index)
    n = max(1, args.steps // 2) * args.batch_size  # two epochs
    x = ((rng.zipf(1.2, size=(n, args.ids)) - 1) % args.rows).astype(np.int32)  # power-law ids
    y = (x % 7 == 0).mean(axis=1, keepdims=True).astype(np.float32)
    cb = worker.callback()
    attach_bytes: dict[str, int] = {}
    end_bytes: dict[str, int] = {}

    rss_before_fit = _rss_mib("VmRSS")
    steps_seen = [0]

    class Mark(keras.callbacks.Callback):
        """Bytes of steps 2..n: not the attach, the first step's pull of every variable or the final pull."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            steps_seen[0] += 1
            if steps_seen[0] == 1:
                attach_bytes.update(box)
            end_bytes.update(box)

    hist = model.fit(
        x, y, batch_size=args.batch_size, epochs=2, verbose=0, shuffle=False, callbacks=[cb, Mark()]
    )
    worker.close()
    steps = cb.steps
    result = {
        "variant": args.variant,
        "index": args.index,
        "steps": steps,
        "steps_per_s": cb.steps_per_second,
        "bytes_per_step": (sum(end_bytes.values()) - sum(attach_bytes.values())) / max(1, steps - 1),
        "sent_per_step": (end_bytes["sent"] - attach_bytes["sent"]) / max(1, steps - 1),
        "setup_bytes": sum(attach_bytes.values()),
        "peak_rss_mib": _rss_mib(),
        "rss_before_fit_mib": rss_before_fit,
        "rss_end_mib": _rss_mib("VmRSS"),
        "weights_mib": sum(int(np.prod(w.shape)) * 4 for w in model.weights) / 2**20,
        "loss": [float(hist.history["loss"][0]), float(hist.history["loss"][-1])],
        "wall_s": time.perf_counter() - t0,
    }
    print(_RESULT + json.dumps(result), flush=True)


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    from trainer.cluster import LocalCluster

    cluster = LocalCluster(num_shards=2, server_args=["--mode", "async"]).start()
    try:
        cmd = [
            [sys.executable, __file__, "--worker", "--variant", variant, "--index", str(i),
             "--addresses", ",".join(cluster.addresses), "--workers", str(args.workers),
             "--rows", str(args.rows), "--dim", str(args.dim), "--ids", str(args.ids),
             "--batch-size", str(args.batch_size),
             "--steps", str(args.dense_steps if variant == "dense" else args.steps)]
            for i in range(args.workers)
        ]  # fmt: skip
        procs = [
            subprocess.Popen(
                c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=cm.REPO
            )
            for c in cmd
        ]
        rows = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            lines = [ln for ln in out.splitlines() if ln.startswith(_RESULT)]
            if p.returncode or not lines:
                raise RuntimeError(f"{variant} worker exited {p.returncode}:\n{out[-2000:]}\n{err[-3000:]}")
            rows.append(json.loads(lines[-1][len(_RESULT) :]))
    finally:
        cluster.stop()
    return {
        "variant": variant,
        "workers": len(rows),
        "steps_per_worker": rows[0]["steps"],
        "steps_per_s": sum(r["steps_per_s"] for r in rows),
        "bytes_per_worker_step": sum(r["bytes_per_step"] for r in rows) / len(rows),
        "sent_per_worker_step": sum(r["sent_per_step"] for r in rows) / len(rows),
        "setup_bytes": sum(r["setup_bytes"] for r in rows),
        "peak_rss_mib_per_worker": [round(r["peak_rss_mib"]) for r in rows],
        "end_rss_mib_per_worker": [round(r["rss_end_mib"]) for r in rows],
        "worker_weights_mib": rows[0]["weights_mib"],
        "loss_first_last": rows[0]["loss"],
        "wall_s": max(r["wall_s"] for r in rows),
    }


def _markdown(args: argparse.Namespace, results: list[dict[str, Any]], command: str) -> str:
    mib = 2**20
    lines = [
        "# Embedding training: whole variable vs Keras Embedding table vs psclient.keras.Embedding",
        "",
        f"Command: `{command}`",
        "",
        f"Model: Embedding {args.rows:,} x {args.dim} (float32, {args.rows * args.dim * 4 / mib:.0f} MiB), "
        f"{args.ids} power-law ids (zipf 1.2) per example mean-pooled, Dense 64 relu, Dense 1; Adagrad(0.1) "
        f"on the shards; batch {args.batch_size}; 2 async shards (overlap on), {args.workers} worker(s); "
        f"`model.fit` with psclient.keras. Machine: {json.dumps(cm.machine_note())}",
        "",
        "| variant | steps/worker | steps/s (sum) | payload MiB / worker-step | of which sent | setup MiB "
        "(attach, first step; all workers) | worker weights MiB | peak RSS MiB per worker | "
        "RSS at end MiB per worker | wall s | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['steps_per_worker']} | {r['steps_per_s']:.2f} | "
            f"{r['bytes_per_worker_step'] / mib:.3f} | {r['sent_per_worker_step'] / mib:.3f} | "
            f"{r['setup_bytes'] / mib:.1f} | {r['worker_weights_mib']:.2f} | "
            f"{', '.join(map(str, r['peak_rss_mib_per_worker']))} | "
            f"{', '.join(map(str, r['end_rss_mib_per_worker']))} | "
            f"{r['wall_s']:.1f} | {r['loss_first_last'][0]:.4f} -> {r['loss_first_last'][1]:.4f} |"
        )
    lines += [
        "",
        "Payload bytes are tensor bytes through the client (gradients and ids sent; values, returned rows "
        "and looked-up rows received), counted in the worker by wrapping `push`, `push_pull_future`, `pull` "
        "and `lookup`; gRPC framing is not counted. Bytes up to the end of the first step (attach, the "
        "first pull, the first step's pull of every variable) are the setup column (the chief's table "
        "creation is not counted: `create_embedding` is not "
        "wrapped); the final pull after training is not counted. Loss: the mean of epoch 1 -> epoch 2. "
        "`dense` pushes and pulls the whole table each step; "
        "`keras-table` pushes the batch's rows and gets them back (the worker keeps a whole copy); `psk` "
        "looks up the batch's distinct rows, pushes their gradients, and (async push_pull) gets the pushed "
        "rows back too (not used: the next lookup reads the shards).",
        "",
        "Peak RSS: the chief's (worker 0) includes creating the table: with `keras-table` it holds "
        "Keras's initial table and sends it; with `psk`, `create_embedding` computes the initial rows of "
        "each shard's piece in the client before streaming them (transient: see its RSS at the end). "
        "The other workers' RSS is the O(batch) steady state.",
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
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", help="write OUT.md and OUT.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--addresses", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    results = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        r = run_variant(args, variant)
        print(json.dumps(r), flush=True)
        results.append(r)
    command = "python bench/bench_embedding.py " + " ".join(sys.argv[1:])
    md = _markdown(args, results, command)
    print(md)
    if args.out:
        Path(args.out + ".md").write_text(md)
        Path(args.out + ".json").write_text(json.dumps({"command": command, "results": results}, indent=2))


if __name__ == "__main__":
    main()
