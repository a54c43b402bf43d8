"""The glue's TensorFlow adapter (see ``psclient.keras._backend``), the only glue module importing TensorFlow.

- Host code in a step: a ``tf.numpy_function`` inside ``fit``'s ``tf.function`` (so ``fit`` keeps
  its graph; XLA ``jit_compile`` must be off), called directly when eager.
- Embedding tables: their gradients are ``IndexedSlices``, so only the batch's rows travel.
- Models built by their first batch: Keras on TensorFlow builds them while it traces the train step,
  where new variables have no values until the step runs. ``prepare_unbuilt`` makes the train step
  build such a model first, eagerly, from the batch's shapes (as Keras's other backends do); a model
  that only its own step can build (no ``call``) is attached in the step's second trace, which
  TensorFlow makes once it initialized the variables of the first.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from psclient.keras._backend import EagerAdapter, HostFn, OutputSpec
from psclient.keras._common import check_no_jit
from psclient.keras._tf_host import numpy_call
from pscore.errors import PSError

log = logging.getLogger(__name__)


class Adapter(EagerAdapter):
    """TensorFlow: graph steps (``tf.function``) with host code in ``tf.numpy_function``."""

    name = "tensorflow"
    row_sparse_gradients = True

    def eager(self) -> contextlib.AbstractContextManager[Any]:
        return tf.init_scope()

    def tracing(self, *tensors: Any) -> bool:
        return not tf.executing_eagerly()

    def host_call(
        self, fn: HostFn, inputs: Sequence[Any], outputs: Sequence[OutputSpec], name: str
    ) -> list[Any]:
        if tf.executing_eagerly():
            return [tf.constant(a) for a in fn(*[np.asarray(t) for t in inputs])]
        return numpy_call(fn, inputs, outputs, name)

    def row_gradient(self, grad: Any) -> tuple[Any, Any] | None:
        if not isinstance(grad, tf.IndexedSlices):
            return None
        keys = grad.indices if grad.indices.dtype == tf.string else tf.cast(grad.indices, tf.int64)
        return keys, tf.convert_to_tensor(grad.values)

    def scatter_rows(self, variable: Any, ids: Any, rows: Any) -> None:
        variable.value.scatter_update(tf.IndexedSlices(rows, ids))

    def to_numpy(self, value: Any) -> np.ndarray:
        if tf.executing_eagerly() and hasattr(value, "numpy"):  # half the time of convert_to_numpy
            return np.asarray(value.numpy())
        return super().to_numpy(value)

    def read_rate(self, rate: Any) -> float | None:
        """One ``ReadVariableOp`` when eager (``PSCallback`` reads the rate every batch): ``numpy()``'s
        path (a name scope, the read, an identity, the tape's bookkeeping) costs several times that."""
        var = getattr(rate, "value", None)
        if isinstance(var, tf.Variable) and tf.executing_eagerly():
            try:
                return float(tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=var.dtype))
            except (AttributeError, ValueError, TypeError):  # a distributed variable: its replicas hold it
                pass
        return super().read_rate(rate)

    def prepare_fit(self, worker: Any, model: keras.Model, what: str) -> None:
        check_no_jit(model, what)

    def prepare_unbuilt(self, worker: Any, model: keras.Model) -> None:
        """Makes ``fit``'s train step build an unbuilt model first, eagerly, from the batch's shapes, then
        attach it (``worker._attach_pending``); a model it cannot build is attached when the step applies
        gradients.

        Variables made inside a ``tf.function`` have no values until the step first runs: neither
        the chief's initial values nor the shards' could be read or set before that step computed
        on them. Built eagerly (``tf.init_scope``) and attached before the step is traced, the
        first step already computes on the shards' values.
        """
        if getattr(model, "_psclient_builds_first", False):
            return
        original = model.train_step

        @functools.wraps(original)
        def train_step(data: Any) -> Any:
            pending = worker._pending
            if pending is not None and pending[0] is model:
                _build_ahead(worker, model, data)
            worker._attach_pending()  # or, built by the step itself, when it first applies gradients
            return original(data)

        model.train_step = train_step
        model._psclient_builds_first = True
        if getattr(model, "train_function", None) is not None:  # fit made it before on_train_begin
            model.make_train_function(force=True)

    def pending_step(self, model: keras.Model | None) -> None:
        if tf.executing_eagerly():
            super().pending_step(model)
        # The first trace of a step that builds the model: TensorFlow traces it again once it
        # initialized the variables, and that trace attaches the model and exchanges.
        tf.numpy_function(_unattached_step, [], Tout=tf.bool, stateful=True, name="ps_unattached")


def _build_ahead(worker: Any, model: keras.Model, data: Any) -> None:
    """Builds ``model`` eagerly from the batch's shapes, as Keras's other backends do, when its ``call``
    can; else leaves the build to the step (a model without ``call``, whose own ``train_step`` calls
    its parts; a tape-style error)."""
    if type(model).call is keras.Model.call or (model.built and model.variables):
        return
    was_built = model.built
    with tf.init_scope():
        try:
            model._symbolic_build(data_batch=data)
        except (AttributeError, RuntimeError) as err:
            model.built = was_built  # Keras marked it built before its call failed
            log.info(
                "worker %d: could not build %r ahead of its step: %s", worker.worker_index, model.name, err
            )


def _unattached_step() -> np.bool_:
    """The host function of a step traced before its model's variables had values (never run when
    TensorFlow initializes them after that trace and traces the step again, as ``fit`` does)."""
    raise PSError(
        "this step was traced before its model's variables were initialized and TensorFlow ran that "
        "trace: build the model before training (call it on a batch, or model.build(input_shape))"
    )


__all__ = ["Adapter"]
