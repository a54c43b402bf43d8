"""Run at the start of every Python process the test suite starts (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH``): keeps JAX out of the processes that do not train on Keras's JAX backend.

``import tensorflow`` (2.21) imports JAX whenever it is installed (``tensorflow/lite/python/util.py``:
``try: from jax import jit``), and the suite installs it for the JAX backend's tests: about 1.1 s of CPU in
every TensorFlow process (a quarter of TensorFlow's own import), over a hundred such processes a run. Marked
absent here, TensorFlow's ``try`` takes the ``ImportError`` branch it has for machines without JAX; nothing
of this project's under test uses JAX outside ``KERAS_BACKEND=jax``, whose processes get it as installed.
``PSTEST_KEEP_JAX=1`` keeps it everywhere.

Not part of the project: no user process runs this.
"""

import os
import sys

if os.environ.get("KERAS_BACKEND") != "jax" and os.environ.get("PSTEST_KEEP_JAX") != "1":
    sys.modules.setdefault("jax", None)  # type: ignore[assignment]
