"""Horovod shim overhead: Horovod's Keras MNIST example through ``psclient.horovod`` vs ``psclient.keras``.

The model of Horovod's ``tensorflow2_keras_mnist`` example (``examples/horovod/tensorflow2_keras_mnist.py``:
Conv32-Conv64-MaxPool-Dropout-Dense128-Dropout-Dense10 on 28x28x1, Adam(0.001 x size), batch 128 per rank,
the example's ``digits_mnist`` data: scikit-learn's digits padded to 28x28, ``repeat().shuffle().batch()``),
trained with ``model.fit`` for ``--warmup`` + ``--steps`` steps in one epoch, by three systems run
interleaved in rounds (the order rotates each round):

* ``horovod``: ``psrun -np N``; ``psclient.horovod.keras``: ``hvd.init()``, ``hvd.DistributedOptimizer``,
  ``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``.
* ``keras-allreduce``: ``psrun -np N``; the same model with ``psclient.keras.AllReduceWorker()`` (from the
  ``TF_CONFIG`` psrun sets), ``AllReduceOptimizer`` and ``worker.callback()``.
* ``local``: one plain Python process, plain Keras ``fit`` (no ring), the same model and batch.

Throughput: each rank's steps/s over the steps after ``--warmup`` (a callback's clock from the end of step
``warmup`` to the end of the last step: the first steps trace the graph and broadcast the weights), then
the mean over the ranks. Per system the median over the rounds; the ratio horovod / keras-allreduce is taken
per round (the two ran back to back) and its median, min and max are reported.

Usage:
    python bench/bench_horovod.py --ranks 2 --repeat 3 --out bench/results/horovod
    python bench/bench_horovod.py --ranks 2,4 --repeat 1 --steps 20      # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm

SYSTEMS = ("horovod", "keras-allreduce", "local")
_BATCH = 128  # the example's
_RUN_TIMEOUT_S = 300
_PSRUN_LINE = re.compile(r"^\[(\d+)\]<stdout>:(.*)$")


def _env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


# -- one rank (child) -----------------------------------------------------------------


def _child_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(cm.REPO / "examples" / "horovod"))
    import digits_mnist
    import keras
    import tensorflow as tf

    system = args.child
    if system == "horovod":
        import psclient.horovod.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif system == "keras-allreduce":
        import psclient.keras as psk

        worker = psk.AllReduceWorker()
        rank, size = worker.rank, worker.world
    else:
        rank, size = 0, 1

    (images, labels), _ = digits_mnist.load_data(path=f"mnist-{rank}.npz")
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(_BATCH)
    model = keras.Sequential(
        [
            keras.layers.Conv2D(32, [3, 3], activation="relu"),
            keras.layers.Conv2D(64, [3, 3], activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Dropout(0.25),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    opt: Any = keras.optimizers.Adam(0.001 * size)
    callbacks: list[Any] = []
    if system == "horovod":
        opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)
        callbacks.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    elif system == "keras-allreduce":
        opt = psk.AllReduceOptimizer(opt, worker)
        callbacks.append(worker.callback())
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])

    warmup, steps = args.warmup, args.steps
    marks: dict[int, float] = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch + 1 in (warmup, warmup + steps):
                marks[batch + 1] = time.perf_counter()

    callbacks.append(Clock())
    model.fit(dataset, steps_per_epoch=warmup + steps, epochs=1, callbacks=callbacks, verbose=0)
    elapsed = marks[warmup + steps] - marks[warmup]
    result = {
        "rank": rank,
        "size": size,
        "steps": steps,
        "seconds": elapsed,
        "steps_per_second": steps / elapsed,
    }
    print(cm.RESULT_PREFIX + json.dumps(result), flush=True)


# -- the parent -----------------------------------------------------------------------


def _child_cmd(args: argparse.Namespace, system: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", system,
            "--warmup", str(args.warmup), "--steps", str(args.steps)]  # fmt: skip


def run_once(args: argparse.Namespace, system: str, ranks: int) -> dict[str, Any]:
    """One run of ``system`` on ``ranks`` ranks: per-rank steps/s and their mean."""
    if system == "local":
        cmd = _child_cmd(args, system)
    else:
        psrun = Path(sys.executable).parent / "psrun"
        cmd = [str(psrun), "-np", str(ranks), "--timeout", str(_RUN_TIMEOUT_S), *_child_cmd(args, system)]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S + 30, env=_env(), cwd=cm.REPO, check=False
    )
    wall = time.perf_counter() - t0
    per_rank: dict[int, float] = {}
    for line in proc.stdout.splitlines():
        m = _PSRUN_LINE.match(line)
        body = m.group(2) if m else line
        if body.startswith(cm.RESULT_PREFIX):
            r = json.loads(body[len(cm.RESULT_PREFIX) :])
            per_rank[r["rank"]] = r["steps_per_second"]
    expected = 1 if system == "local" else ranks
    if proc.returncode != 0 or len(per_rank) != expected:
        raise RuntimeError(
            f"{system} x{ranks} exited {proc.returncode} with {len(per_rank)}/{expected} results:\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    rates = [per_rank[r] for r in sorted(per_rank)]
    return {
        "steps_per_second_per_rank": round(statistics.fmean(rates), 3),
        "per_rank": [round(x, 3) for x in rates],
        "wall_s": round(wall, 1),
    }


def summarize(results: dict[str, Any]) -> None:
    for key, rows in results["runs"].items():
        summary: dict[str, Any] = {}
        for system, runs in rows.items():
            ok = [r["steps_per_second_per_rank"] for r in runs if "error" not in r]
            if ok:
                summary[system] = {
                    "median": round(statistics.median(ok), 3),
                    "min": round(min(ok), 3),
                    "max": round(max(ok), 3),
                    "rounds": len(ok),
                }
        hv, ka = rows.get("horovod", []), rows.get("keras-allreduce", [])
        ratios = [
            a["steps_per_second_per_rank"] / b["steps_per_second_per_rank"]
            for a, b in zip(hv, ka, strict=False)
            if "error" not in a and "error" not in b
        ]
        if ratios:
            summary["ratio_horovod_over_keras"] = {
                "median": round(statistics.median(ratios), 4),
                "min": round(min(ratios), 4),
                "max": round(max(ratios), 4),
                "per_round": [round(x, 4) for x in ratios],
            }
        results["summary"][key] = summary


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# Horovod shim overhead: `psclient.horovod` vs `psclient.keras.AllReduceOptimizer` vs one process",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), load average before the run {m['loadavg_1_5_15']}; "
        f"TensorFlow {results['tf_version']}, Keras {results['keras_version']}. All ranks are processes on "
        f"this one machine and share its {m['cpus']} cores (4 ranks on 2 cores are oversubscribed 2x). "
        f"Model: Horovod's tensorflow2_keras_mnist CNN ({results['params']:,} params), Adam, batch {_BATCH} "
        f"per rank, digits padded to 28x28; `fit` of {results['warmup']} warm-up + {results['steps']} "
        f"timed steps per rank; {results['repeat']} rounds, systems interleaved (order rotated per round).",
        "",
        "| ranks | system | steps/s per rank (median) | min - max | per round |",
        "| ---: | --- | ---: | ---: | --- |",
    ]
    for key, rows in results["runs"].items():
        summary = results["summary"].get(key, {})
        for system, runs in rows.items():
            per_round = ", ".join(
                f"{r['steps_per_second_per_rank']:.2f}" if "error" not in r else "failed" for r in runs
            )
            s = summary.get(system)
            if s is None:
                lines.append(f"| {key} | {system} | - | - | {per_round} |")
                continue
            lines.append(
                f"| {key} | {system} | {s['median']:.2f} | {s['min']:.2f} - {s['max']:.2f} | {per_round} |"
            )
    lines += ["", "| ranks | horovod / keras-allreduce (median) | min - max | per round | < 5 % cost? |",
              "| ---: | ---: | ---: | --- | --- |"]  # fmt: skip
    for key in results["runs"]:
        r = results["summary"].get(key, {}).get("ratio_horovod_over_keras")
        if r is None:
            continue
        met = "yes" if r["median"] >= 0.95 else "no"
        lines.append(
            f"| {key} | {r['median']:.3f} | {r['min']:.3f} - {r['max']:.3f} | "
            f"{', '.join(f'{x:.3f}' for x in r['per_round'])} | {met} |"
        )
    for key in results["runs"]:
        r = results["summary"].get(key, {}).get("ratio_horovod_over_keras")
        if r is None:
            continue
        verdict = "met" if r["median"] >= 0.95 else "NOT met"
        lines += [
            "",
            f"Result, {key} ranks: the < 5 % goal is {verdict}: `psclient.horovod` runs at "
            f"{r['median']:.3f}x the steps/s of `psclient.keras.AllReduceOptimizer` (median over "
            f"{len(r['per_round'])} rounds, a cost of {(1 - r['median']) * 100:.1f} %; rounds "
            f"{r['min']:.3f} - {r['max']:.3f}).",
        ]
    errors = [
        f"- {key} {system} round {i}: {r['error']}"
        for key, rows in results["runs"].items()
        for system, runs in rows.items()
        for i, r in enumerate(runs)
        if "error" in r
    ]
    if errors:
        lines += ["", "Failures:", *errors]
    lines += [
        "",
        "Systems: `horovod` = `psrun -np N python bench/bench_horovod.py --child horovod` (`psclient.horovod."
        "keras`: `hvd.init`, `hvd.DistributedOptimizer`, `BroadcastGlobalVariablesCallback(0)`); "
        "`keras-allreduce` = the same under psrun with `psclient.keras.AllReduceWorker()` + "
        "`AllReduceOptimizer` + `worker.callback()`; `local` = one process, plain Keras `fit`, alone on the "
        "machine (its steps/s is per process; it has all cores, the ranks share them). The ratio is per "
        "round (the two systems ran back to back) and the goal is that `psclient.horovod` costs < 5 % "
        "(ratio >= 0.95).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2", help="comma-separated rank counts, e.g. 2,4")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeat", type=int, default=3, help="rounds")
    p.add_argument("--warmup", type=int, default=5, help="steps not timed (tracing, broadcast)")
    p.add_argument("--steps", type=int, default=80, help="timed steps per rank")
    p.add_argument("--out", help="write OUT.md and OUT.json")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child_main(args)
        return 0
    os.environ.update({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    import keras
    import tensorflow as tf

    systems = args.systems.split(",")
    rank_counts = [int(x) for x in args.ranks.split(",")]
    results: dict[str, Any] = {
        "command": "python bench/bench_horovod.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": cm.machine_note(),
        "tf_version": tf.__version__,
        "keras_version": keras.__version__,
        "batch_size": _BATCH,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeat": args.repeat,
        "params": 1_199_882,  # 320 + 18,496 + 1,179,776 + 1,290
        "runs": {},
        "summary": {},
    }
    t_start = time.perf_counter()
    for ranks in rank_counts:
        key = str(ranks)
        rows: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for rnd in range(args.repeat):
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for system in order:
                try:
                    r = run_once(args, system, ranks)
                except Exception as err:  # a failed run is reported, the others still run
                    r = {"error": f"{type(err).__name__}: {str(err)[-300:]}"}
                r["round"] = rnd
                rows[system].append(r)
                print(f"ranks={ranks} round={rnd} {system}: {r}", flush=True)
        results["runs"][key] = {s: sorted(rows[s], key=lambda r: r["round"]) for s in systems}
    results["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    summarize(results)
    results["top_processes_after"] = cm.top_processes()
    text = render(results)
    print(text)
    cm.write_results(args.out, text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
