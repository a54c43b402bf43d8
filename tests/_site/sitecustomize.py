"""Run at the start of every Python process the test suite starts (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH``): keeps three optional packages that TensorFlow and Keras import whenever they are
installed, and that the suite's TensorFlow and Keras processes do not use, out of those processes.

- JAX: ``import tensorflow`` (2.21) imports it (``tensorflow/lite/python/util.py``: ``try: from jax import
  jit``), and the suite installs it for the Keras JAX backend's tests: about 0.6-1.1 s of CPU in every
  TensorFlow process. Marked absent unless ``KERAS_BACKEND=jax`` (or ``PSTEST_KEEP_JAX=1``).
- matplotlib: ``import keras`` imports ``matplotlib.pyplot`` for its visualization helpers
  (``keras/src/visualization/``: ``try: import matplotlib.pyplot as plt except ImportError: plt = None``),
  about 0.4 s. Refused to Keras's own modules alone; ``psload --plot`` still draws.
- scikit-learn: ``import keras`` imports it for its scikit-learn wrappers (``keras/src/wrappers/``: ``try:
  import sklearn except ImportError``), about 0.7-1.2 s (scipy comes with it). Refused to Keras's own modules
  alone: the examples and ``trainer.data`` that load scikit-learn's digits import it themselves.

Each time the library takes the ``ImportError`` branch it has for machines without the package. Nothing of
this project's under test uses them there. Not part of the project: no user process runs this, and the
suite's own processes undo it (``restore``).
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from typing import Any

if os.environ.get("KERAS_BACKEND") != "jax" and os.environ.get("PSTEST_KEEP_JAX") != "1":
    sys.modules.setdefault("jax", None)  # type: ignore[assignment]


_KEPT_FROM_KERAS = frozenset({"matplotlib", "sklearn"})


class _KeptFromKeras(MetaPathFinder):
    """Fails ``import matplotlib`` or ``import sklearn`` (and their submodules) where a module of Keras
    itself imports them."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.partition(".")[0] in _KEPT_FROM_KERAS:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
                frame = frame.f_back  # the import machinery, up to the module that imports
            if frame is not None and str(frame.f_globals.get("__name__", "")).startswith("keras."):
                raise ModuleNotFoundError(f"{fullname} is kept out of Keras's import by the test suite")
        return None


sys.meta_path.insert(0, _KeptFromKeras())


def restore() -> None:
    """Undoes both in this process: the suite's own processes (pytest, xdist's workers, which start with
    this folder on their path too) keep what is installed, so ``pytest.importorskip("jax")`` still runs
    the JAX backend's tests. ``tests/conftest.py`` calls it."""
    if "jax" in sys.modules and sys.modules["jax"] is None:
        del sys.modules["jax"]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _KeptFromKeras)]
