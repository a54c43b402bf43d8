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
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from psclient.keras._backend import EagerAdapter, HostFn, OutputSpec
from psclient.keras._common import check_no_jit
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
        packing = _Packing.of(outputs, name)
        if packing is not None:
            packed = tf.numpy_function(
                packing.wrap(fn), list(inputs), Tout=packing.tout, stateful=True, name=name
            )
            return packing.unpack(packed)
        out = tf.numpy_function(
            fn, list(inputs), Tout=[tf.as_dtype(dtype) for _, dtype in outputs], stateful=True, name=name
        )
        for tensor, (shape, _) in zip(out, outputs, strict=True):
            tensor.set_shape(shape)
        return list(out)

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


# A host call's outputs of at most this many bytes, of a fixed shape, leave it together: one flat array per
# dtype, split in the graph (issue 42). TensorFlow converts each output of a ``numpy_function`` in Python
# (``FuncRegistry._convert``: about 24 calls an output, a version string parsed by a regular expression
# each time), so a step's exchange of six small variables paid ~145 calls for them; the copy into the
# flat array costs less than that below this size, and a larger output goes alone (no copy).
PACK_MAX_BYTES = 64 * 1024


class _Packing:
    """How a host call's small outputs of one dtype leave it in one flat array (``wrap``) and become the
    outputs again in the graph (``unpack``: ``tf.split`` and reshapes, no Python per step)."""

    def __init__(
        self, outputs: Sequence[OutputSpec], groups: dict[np.dtype[Any], list[int]], name: str
    ) -> None:
        self.name = name
        self.outputs = [(tuple(shape), np.dtype(dtype)) for shape, dtype in outputs]
        self.groups = list(groups.items())  # (dtype, the outputs it packs)
        grouped = {i for _, members in self.groups for i in members}
        self.alone = [i for i in range(len(outputs)) if i not in grouped]
        self.sizes = {i: int(np.prod(self.outputs[i][0])) for i in grouped}  # elements of each packed one
        self.tout = [tf.as_dtype(d) for d, _ in self.groups] + [
            tf.as_dtype(self.outputs[i][1]) for i in self.alone
        ]

    @classmethod
    def of(cls, outputs: Sequence[OutputSpec], name: str) -> _Packing | None:
        """The packing of ``outputs``, or None where no two small outputs share a dtype."""
        groups: dict[np.dtype[Any], list[int]] = {}
        for i, (shape, dtype) in enumerate(outputs):
            dt = np.dtype(dtype)
            if dt.kind not in "biuf" or any(d is None for d in shape):
                continue
            if int(np.prod(shape)) * dt.itemsize <= PACK_MAX_BYTES:
                groups.setdefault(dt, []).append(i)
        groups = {dt: members for dt, members in groups.items() if len(members) > 1}
        return cls(outputs, groups, name) if groups else None

    def wrap(self, fn: HostFn) -> Callable[..., list[np.ndarray]]:
        """``fn``, its small outputs copied into one flat array per dtype (then the others, in order).

        Raises:
            TypeError, ValueError: an output of another dtype or size than declared (as TensorFlow's
                own check of a ``numpy_function``'s outputs would).
        """
        groups, alone, outputs, sizes, name = self.groups, self.alone, self.outputs, self.sizes, self.name

        def packed(*arrays: np.ndarray) -> list[np.ndarray]:
            results = fn(*arrays)
            if len(results) != len(outputs):
                raise ValueError(f"{name}: the host function gave {len(results)} outputs, not {len(outputs)}")
            out: list[np.ndarray] = []
            for dtype, members in groups:
                flat = np.empty(sum(sizes[i] for i in members), dtype)
                at = 0
                for i in members:
                    value = np.asarray(results[i])
                    if value.dtype != dtype:
                        raise TypeError(f"{name}: output {i} is {value.dtype}, not {dtype}")
                    if value.size != sizes[i]:
                        raise ValueError(f"{name}: output {i} has shape {value.shape}, not {outputs[i][0]}")
                    flat[at : at + sizes[i]] = value.reshape(-1)
                    at += sizes[i]
                out.append(flat)
            out += [results[i] for i in alone]
            return out

        return packed

    def unpack(self, packed: Sequence[Any]) -> list[Any]:
        """The host call's outputs, in their declared order and shapes, from ``wrap``'s."""
        result: list[Any] = [None] * len(self.outputs)
        for k, (_, members) in enumerate(self.groups):
            pieces = tf.split(packed[k], [self.sizes[i] for i in members])
            for i, piece in zip(members, pieces, strict=True):
                result[i] = tf.reshape(piece, self.outputs[i][0])
        for tensor, i in zip(packed[len(self.groups) :], self.alone, strict=True):
            tensor.set_shape(self.outputs[i][0])
            result[i] = tensor
        return result


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
