"""Python function calls per Keras training step: ``psclient.keras.PSWorker``'s ``fit`` against the same
model's local ``fit``, in the worker process (issue 42's count of the Keras glue).

A count of calls does not move with a noisy machine the way a time does (see ``bench_calls.py``, which
counts the client's and the shard's calls per operation). Here the counter runs in the worker's process
only, on every Python thread: the caller's (Keras's ``fit`` loop, the glue's callback), the client's event
loop, and the threads TensorFlow runs a step's host functions in (``tf.numpy_function``: the glue's
exchange with the shards). Those threads are TensorFlow's own, started without Python's profiler, so this
script switches it on inside each host-function call (``script_ops.FuncRegistry.__call__``, TensorFlow's
entry into Python for ``numpy_function``; a private name of TensorFlow that a later release may move).

For each model of ``trainer.models`` named: ``fit`` of ``--warmup`` batches (tracing), then ``--steps``
batches counted, locally and then on an async cluster of ``--shards`` shards (``LocalCluster``) with the
same compiled step (``jit_compile=False``, as the glue needs). The glue's calls per step are the
difference. ``--top N`` lists the N functions whose calls per step grew most from local to the PS.

Usage::

    python bench/bench_keras_calls.py [--models mlp,cnn,resnet] [--steps 200] [--top 15]
                                      [--out bench/results/keras_calls]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

BATCH = 64
REPO = str(Path(__file__).resolve().parent.parent) + os.sep


def _where(filename: str) -> str:
    """A source file named by its package path (site-packages, the standard library, this repository)."""
    for mark in ("site-packages/", f"python{sys.version_info.major}.{sys.version_info.minor}/", REPO):
        _, found, tail = filename.rpartition(mark)
        if found:
            return tail
    return filename


class _Counter:
    """Calls (``call`` events: a Python function entered, a generator or coroutine resumed) while on."""

    def __init__(self) -> None:
        self.on = False
        self.calls = 0
        self.per_function: collections.Counter[tuple[str, str]] = collections.Counter()

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and self.on:
            self.calls += 1
            code = frame.f_code
            self.per_function[_where(code.co_filename), code.co_name] += 1

    def reset(self) -> None:
        self.calls = 0
        self.per_function.clear()


def _install(counter: _Counter) -> None:
    """The counter on every thread: this one, those started later, and TensorFlow's host-function calls."""
    from tensorflow.python.ops import script_ops

    sys.setprofile(counter.profile)
    threading.setprofile(counter.profile)
    call = script_ops.FuncRegistry.__call__

    def counted(self: Any, token: Any, device: Any, args: Any) -> Any:
        sys.setprofile(counter.profile)  # a TensorFlow thread: no profiler of its own
        try:
            return call(self, token, device, args)
        finally:
            sys.setprofile(None)

    script_ops.FuncRegistry.__call__ = counted


def _per_step(
    counter: _Counter, model: Any, x: Any, y: Any, args: argparse.Namespace, callbacks: list[Any]
) -> dict[str, Any]:
    warm = args.warmup * BATCH
    model.fit(x[:warm], y[:warm], batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    counter.reset()
    counter.on = True
    n = args.steps * BATCH
    model.fit(x[:n], y[:n], batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    counter.on = False
    return {
        "calls": counter.calls / args.steps,
        "per_function": {k: v / args.steps for k, v in counter.per_function.items()},
    }


def run_model(name: str, args: argparse.Namespace, counter: _Counter) -> dict[str, Any]:
    import keras

    import psclient.keras as psk
    from trainer import models
    from trainer.cluster import LocalCluster

    shape = (28, 28, 1)
    rng = np.random.default_rng(0)
    n = (args.steps + args.warmup) * BATCH
    x = rng.random((n, *shape), dtype=np.float32)
    y = rng.integers(0, 10, n)

    def compiled(optimizer: Any) -> Any:
        keras.utils.set_random_seed(0)
        model = models.build(name, shape, 10)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", jit_compile=False)
        return model

    local = _per_step(counter, compiled(keras.optimizers.Adam(1e-3)), x, y, args, [])
    with LocalCluster(args.shards) as cluster:
        worker = psk.PSWorker(cluster.addresses, worker_index=0, num_workers=1)
        try:
            model = compiled(psk.DistributedOptimizer(keras.optimizers.Adam(1e-3), worker))
            ps = _per_step(counter, model, x, y, args, [worker.callback()])
            variables = len(model.trainable_variables)
        finally:
            worker.close()
    grew = {k: ps["per_function"].get(k, 0.0) - local["per_function"].get(k, 0.0) for k in ps["per_function"]}
    top = sorted(grew.items(), key=lambda kv: -kv[1])[: args.top]
    return {
        "model": name,
        "trainable_variables": variables,
        "local_calls_per_step": round(local["calls"], 1),
        "ps_calls_per_step": round(ps["calls"], 1),
        "glue_calls_per_step": round(ps["calls"] - local["calls"], 1),
        "top": [{"function": f"{f}:{fn}", "calls_per_step": round(v, 1)} for (f, fn), v in top],
    }


def render(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Python calls per Keras step: PSWorker against local fit",
        "",
        f"Command: `{command}` ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"Python {platform.python_version()}, one worker process, async shards).",
        "",
        "| model | trainable variables | local fit | PSWorker fit | the glue |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['trainable_variables']} | {r['local_calls_per_step']:.0f} | "
            f"{r['ps_calls_per_step']:.0f} | {r['glue_calls_per_step']:.0f} |"
        )
    for r in results:
        lines += ["", f"The functions whose calls per step grew most ({r['model']}):", ""]
        lines += [f"- {t['calls_per_step']:.1f} `{t['function']}`" for t in r["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn", help="trainer.models names, comma-separated")
    parser.add_argument("--steps", type=int, default=200, help="batches counted per fit")
    parser.add_argument("--warmup", type=int, default=10, help="batches before counting (tracing)")
    parser.add_argument("--shards", type=int, default=2, help="async shards of the PS run")
    parser.add_argument("--top", type=int, default=15, help="functions listed per model")
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    counter = _Counter()
    _install(counter)
    results = []
    for name in args.models.split(","):
        result = run_model(name, args, counter)
        local, ps, glue = (
            result[k] for k in ("local_calls_per_step", "ps_calls_per_step", "glue_calls_per_step")
        )
        print(f"{name}: local {local:.0f}, PSWorker {ps:.0f}, the glue {glue:.0f} calls a step", flush=True)
        results.append(result)
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    command = "python bench/bench_keras_calls.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(results, command.strip())
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(results, indent=2) + "\n")
        Path(args.out + ".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
