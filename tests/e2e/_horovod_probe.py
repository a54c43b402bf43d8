"""Runs a Horovod example unchanged, then prints this rank's weight checksum and test accuracy.

    python _horovod_probe.py EXAMPLE.py

Hooks ``keras.Model.fit`` and ``tf.train.Checkpoint`` to find the example's model (the
examples keep it local to ``main``), runs the script as ``__main__``, and prints
``PROBE rank=R crc=C accuracy=A`` (accuracy on the digits test split, which no rank trains on).
"""

from __future__ import annotations

import runpy
import sys
import zlib
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

_models: list[Any] = []


def _hook() -> None:
    fit = keras.Model.fit

    def fit_and_record(self: Any, *args: Any, **kwargs: Any) -> Any:
        _models.append(self)
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
