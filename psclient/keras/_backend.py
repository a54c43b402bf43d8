"""The Keras backend the glue runs on, and its adapter: the only backend-specific part of the glue.

The glue (``PSWorker``, ``DistributedOptimizer``, ``AllReduceWorker``, their callbacks) is written
against Keras and numpy; what differs between TensorFlow, JAX and PyTorch is how a step's host
code (a push, a ring operation: numpy in, numpy out) runs inside the step, and a few details of
variables. An ``Adapter`` holds those, one per backend, as Horovod keeps one thin module per
framework over a framework-free core:

- ``tensorflow`` (``psclient.keras._tf_adapter``): ``tf.numpy_function`` inside ``fit``'s
  ``tf.function`` (XLA off), ``IndexedSlices`` gradients of Embedding tables (only the batch's
  rows travel), and the build of models that only their step builds.
- ``jax`` (``psclient.keras._jax_adapter``): ``jax.experimental.io_callback`` (ordered) inside the
  jitted, stateless train step: ``fit`` stays compiled; the callback takes the gradients as
  arguments and returns the new values, which the optimizer's stateless apply hands back to Keras.
- ``torch`` (``psclient.keras._torch_adapter``): eager steps (this module's ``EagerAdapter``): numpy
  in and out of the optimizer's ``apply``.

TensorFlow is imported only by its adapter, so the glue does not import it on the other backends.
What a backend cannot do yet raises ``unsupported(feature)``: a ``PSError`` that names the backend
and the feature.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from pscore.errors import PSError

BACKENDS = ("tensorflow", "jax", "torch")
# (shape, numpy dtype) of a host function's output; None in a shape: known only when it runs (a shape of
# None: not even its rank)
OutputSpec = tuple[tuple[int | None, ...] | None, Any]
HostFn = Callable[..., list[np.ndarray]]  # numpy arrays in, numpy arrays out
RowLookup = Callable[[np.ndarray], np.ndarray]  # 1-D ids -> their rows, (len(ids), width)
RowKeeper = Callable[[np.ndarray, np.ndarray], None]  # (1-D ids, their rows' gradient): kept for the push


def backend_name() -> str:
    """The Keras backend of this process (``KERAS_BACKEND``): ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return str(keras.backend.backend())


def unsupported(feature: str, backend: str | None = None) -> PSError:
    """The error for something the glue cannot do on this backend yet (see the backend table in the Keras
    guide, docs/keras.md)."""
    backend = backend or backend_name()
    return PSError(
        f"{feature} is not supported on the Keras {backend!r} backend yet (KERAS_BACKEND={backend}); "
        "see the backend table in docs/keras.md"
    )


class EagerAdapter:
    """A backend whose training steps run eagerly (PyTorch): host code is called directly, numpy in and out.

    The base of the other adapters, which change what differs.
    """

    name = "torch"
    # what the shards and the ring can do only on some backends (the Keras guide's table)
    row_sparse_gradients = False  # Embedding tables: only the batch's rows travel
    # non-trainable state (BatchNorm statistics) read and assigned where the optimizer applies the gradients
    shared_state_in_step = True
    # psclient.keras.Embedding: the backward pass hands the looked-up rows' gradient to host code
    # (``lookup_rows``), which the step's exchange pushes; else (TensorFlow) the layer's gradient is
    # an IndexedSlices that the step's exchange takes as an input.
    host_row_gradients = False

    @property
    def id_bits(self) -> int:
        """How many bits an integer id of a model input keeps (64: int64; JAX without ``jax_enable_x64``: 31,
        a non-negative int32)."""
        return 64

    def eager(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which variables are read and assigned eagerly, also while a step is traced."""
        return contextlib.nullcontext()

    def tracing(self, *tensors: Any) -> bool:
        """Whether the step is being traced (symbolic tensors: host code must be staged, not called)."""
        return False

    def values_in_step(self, *tensors: Any) -> bool:
        """Whether the values of these variables or tensors can be read (``eager``) where the step is."""
        return True

    def host_call(
        self, fn: HostFn, inputs: Sequence[Any], outputs: Sequence[OutputSpec], name: str
    ) -> list[Any]:
        """Runs ``fn`` (numpy arrays in and out) as part of the step; returns its outputs as tensors."""
        arrays = [np.asarray(keras.ops.convert_to_numpy(t)) for t in inputs]
        return [keras.ops.convert_to_tensor(a) for a in fn(*arrays)]

    def lookup_rows(
        self, ids: Any, anchor: Any, lookup: RowLookup, keep: RowKeeper, width: int, dtype: str
    ) -> Any:
        """Rows of the 1-D integer ``ids`` as a tensor ``(len(ids), width)``, read in the step by the host
        function ``lookup(ids) -> rows`` (numpy), and differentiable: the backward pass hands
        ``keep(ids, the rows' gradient)`` (numpy) the rows' gradient and gives ``anchor`` (a
        trainable variable's value) a zero gradient, so that the optimizer's step applies the
        anchor and the exchange pushes the rows (``psclient.keras.Embedding``)."""
        raise unsupported("psclient.keras.Embedding's lookup", self.name)

    def row_gradient(self, grad: Any) -> tuple[Any, Any] | None:
        """``(ids, rows)`` of a gradient that holds only some rows of a table, else None (a dense one)."""
        return None

    def scatter_rows(self, variable: Any, ids: Any, rows: Any) -> None:
        """Writes ``rows`` into the rows ``ids`` of a 2-D variable."""
        index = keras.ops.expand_dims(keras.ops.cast(ids, "int32"), -1)
        variable.assign(keras.ops.scatter_update(variable.value, index, keras.ops.cast(rows, variable.dtype)))

    def to_numpy(self, value: Any) -> np.ndarray:
        """A variable's or tensor's value as a numpy array (eager)."""
        return np.asarray(keras.ops.convert_to_numpy(value))

    def read_rate(self, rate: Any) -> float | None:
        """An optimizer's learning rate (a variable), or None when the backend holds it elsewhere now."""
        return float(self.to_numpy(rate))

    def prepare_fit(self, worker: Any, model: keras.Model, what: str) -> None:
        """``fit`` begins with ``worker``'s callback (the parameter server, ``what`` names it in errors)."""

    def prepare_unbuilt(self, worker: Any, model: keras.Model) -> None:
        """``worker`` attaches ``model`` before it is built: it is attached when its first step applies
        gradients (eager steps build it before they do)."""

    def pending_step(self, model: keras.Model | None) -> None:
        """A step applies gradients of a model whose variables have no values yet."""
        raise ValueError(
            f"model {getattr(model, 'name', '?')!r} is still not built when its first step applies "
            "gradients: call it on a batch, or model.build(input_shape), before training"
        )


@functools.cache
def _adapter_for(name: str) -> EagerAdapter:
    if name in BACKENDS:
        module = importlib.import_module(f"psclient.keras._{'tf' if name == 'tensorflow' else name}_adapter")
        adapter: EagerAdapter = module.Adapter()
        return adapter
    raise unsupported("psclient.keras", name)


def adapter() -> EagerAdapter:
    """The adapter of this process's Keras backend.

    Raises:
        PSError: a backend the glue does not know (only TensorFlow, JAX and PyTorch).
    """
    return _adapter_for(backend_name())


class _LazyTensorFlow:
    """``tensorflow``, imported on first use (by modules that use it only on the TensorFlow backend)."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module("tensorflow"), attr)


tensorflow = _LazyTensorFlow()


__all__ = [
    "BACKENDS", "EagerAdapter", "HostFn", "OutputSpec", "RowKeeper", "RowLookup", "adapter", "backend_name",
    "tensorflow", "unsupported",
]  # fmt: skip
