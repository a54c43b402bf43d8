"""Runs a Horovod example unchanged, then prints this rank's weight checksum and test accuracy.

    python _horovod_probe.py EXAMPLE.py

Hooks ``keras.Model.fit`` and ``tf.train.Checkpoint`` to find the example's model (the
examples keep it local to ``main``), runs the script as ``__main__``, and prints
``PROBE rank=R crc=C accuracy=A`` (accuracy on the digits test split, which no rank trains on).

With ``KILL_WORKER=W`` and ``KILL_AT_BATCH=N`` (elastic tests), the process that psrun started as
worker ``W`` kills itself (SIGKILL) during its ``N``-th training batch. With ``PROBE_SEED=S``, each
process seeds Python, NumPy and TensorFlow with ``S`` + its psrun worker id, so that two runs of a job
differ only by what the test changes (the initial weights, data order and dropout are the same).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

_models: list[Any] = []


def _kill_callback() -> keras.callbacks.Callback | None:
    """A callback that SIGKILLs this process in its KILL_AT_BATCH-th batch, if it is worker KILL_WORKER."""
    victim = os.environ.get("KILL_WORKER")
    if victim is None or victim != os.environ.get("PSRUN_WORKER"):
        return None
    at = int(os.environ["KILL_AT_BATCH"])
    count = 0

    class Kill(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            nonlocal count
            count += 1
            if count == at:  # in the middle of this batch's step (its all-reduce, most likely)
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()

    return Kill()


def _hook() -> None:
    kill = _kill_callback()
    fit = keras.Model.fit

    def fit_and_record(self: Any, *args: Any, **kwargs: Any) -> Any:
        _models.append(self)
        if kill is not None:
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), kill]
        return fit(self, *args, **kwargs)

    keras.Model.fit = fit_and_record
    checkpoint_init = tf.train.Checkpoint.__init__

    def init_and_record(self: Any, root: Any = None, **kwargs: Any) -> None:
        if isinstance(kwargs.get("model"), keras.Model):
            _models.append(kwargs["model"])
        checkpoint_init(self, root, **kwargs)

    tf.train.Checkpoint.__init__ = init_and_record


def main() -> None:
    example = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(example.parent))  # the example's own imports (digits_mnist)
    if "PROBE_SEED" in os.environ:
        keras.utils.set_random_seed(int(os.environ["PROBE_SEED"]) + int(os.environ.get("PSRUN_WORKER", "0")))
    _hook()
    sys.argv = [str(example)]
    runpy.run_path(str(example), run_name="__main__")

    import digits_mnist

    import psclient.horovod as hvd

    model = _models[-1]
    crc = 0
    for w in model.get_weights():
        crc = zlib.crc32(np.ascontiguousarray(w).tobytes(), crc)
    _, (x_test, y_test) = digits_mnist.load_data()
    probs = model.predict(x_test[..., None].astype(np.float32) / 255.0, verbose=0)
    accuracy = float(np.mean(np.argmax(probs, axis=1) == y_test))
    print(f"PROBE rank={hvd.rank()} crc={crc} accuracy={accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
