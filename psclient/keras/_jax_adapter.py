"""The glue's JAX adapter (see ``psclient.keras._backend``).

Keras on JAX runs ``fit``'s step jitted and stateless: the step takes the variables' values as
arguments and returns the new ones, and the optimizer's ``stateless_apply`` collects what its
``apply`` assigned. The exchange with the shards (or the ring) is host code: it runs inside the
compiled step as an ordered ``jax.experimental.io_callback`` that takes the step's gradients and
returns the shards' new values, which the step assigns (recorded by Keras's stateless scope and
handed back as the step's new state). So ``fit`` stays compiled (``jit_compile=True``, Keras's
default on JAX) and nothing leaves the step but the callback. Shapes in a jitted step are static:
a ``keras.layers.Embedding`` table's gradient is dense on JAX (the whole table travels);
``psclient.keras.Embedding`` reads its rows through an unordered ``io_callback`` in a ``custom_vjp``
whose backward pass hands the rows' gradient to host code through another (its output, the anchor's
zero gradient, is an input of the exchange's callback, which so runs after it and pushes the rows).
The non-trainable state that the glue shares through the shards (BatchNorm statistics) is not in the
optimizer's stateless scope (it sees it as it was before the forward pass and does not hand it
back): the parameter server's ``fit`` wraps the train step, and the step's one exchange runs after
it with its gradients and its new state (``DeferredExchanges.defer_state``); all-reduce training's
``fit`` averages the new state over the ring after the step the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

from psclient.keras._backend import EagerAdapter, HostFn, OutputSpec, RowKeeper, RowLookup, unsupported


class Adapter(EagerAdapter):
    """JAX: jitted stateless steps, host code in an ordered ``io_callback``."""

    name = "jax"
    # Keras's JAX step (jitted or not) is stateless: the optimizer's ``stateless_apply`` sees the
    # non-trainable state as it was before the forward pass and hands back only its own assignments.
    shared_state_in_step = False
    host_row_gradients = True

    @property
    def id_bits(self) -> int:
        return 64 if jax.config.jax_enable_x64 else 31

    def tracing(self, *tensors: Any) -> bool:
        return any(isinstance(t, jax.core.Tracer) for t in tensors)

    def values_in_step(self, *tensors: Any) -> bool:
        return not self.tracing(*(t.value if hasattr(t, "value") else t for t in tensors))

    def pending_step(self, model: Any) -> None:
        if model is not None and not getattr(model, "variables", None):
            super().pending_step(model)
        raise unsupported(
            f"a model that only its own jitted train_step builds ({getattr(model, 'name', '?')!r}): build it "
            "before fit (call it on a batch, or model.build(input_shape))"
        )

    def prepare_fit(self, worker: Any, model: Any, what: str) -> None:
        """Wraps the model's (stateless) train step so that a worker's exchange carries the shared
        non-trainable state the step computed (``DeferredExchanges.defer_state``): the exchange runs after
        the step, with its new state (a ``PSWorker``'s also with its gradients), and its values replace
        those in the state the step returns."""
        defer = getattr(worker, "defer_state", None)
        if defer is None or getattr(model, "_psclient_state_step", False):
            return
        original = model.train_step

        def train_step(state: Any, data: Any) -> Any:
            with defer() as deferred:
                logs, (trainable, non_trainable, optimizer, metrics) = original(state, data)
            if not deferred:
                return logs, (trainable, non_trainable, optimizer, metrics)
            where = {id(v): i for i, v in enumerate(model.trainable_variables)}
            state_where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
            trainable, non_trainable = list(trainable), list(non_trainable)

            def state_of(v: Any) -> Any:  # another model's state (one worker, two models): as it is
                return non_trainable[state_where[id(v)]] if id(v) in state_where else v.value

            for exchange in deferred:
                new_trainable, new_state = exchange(state_of)
                for var, value in new_trainable:
                    trainable[where[id(var)]] = value
                for var, value in new_state:
                    if id(var) in state_where:
                        non_trainable[state_where[id(var)]] = value
            return logs, (trainable, non_trainable, optimizer, metrics)

        model.train_step = train_step
        model._psclient_state_step = True
        if getattr(model, "train_function", None) is not None:  # fit made it before on_train_begin
            model.make_train_function(force=True)

    def read_rate(self, rate: Any) -> float | None:
        # Keras's JAX fit keeps the state in the step's arguments and empties the variables until a
        # callback reads the model (which writes the state back: a callback that sets the rate does).
        if getattr(rate, "_value", 0) is None:
            return None
        return super().read_rate(rate)

    def lookup_rows(
        self, ids: Any, anchor: Any, lookup: RowLookup, keep: RowKeeper, width: int, dtype: str
    ) -> Any:
        # Static shapes: the batch's ids as they come (not deduplicated: the host does that), their rows.
        rows_spec = jax.ShapeDtypeStruct((ids.shape[0], width), np.dtype(dtype))
        anchor_spec = jax.ShapeDtypeStruct(anchor.shape, anchor.dtype)

        def read(i: Any) -> np.ndarray:
            return np.asarray(lookup(np.asarray(i)), rows_spec.dtype).reshape(rows_spec.shape)

        def caught(i: Any, grad: Any) -> np.ndarray:
            keep(np.asarray(i), np.asarray(grad))
            return np.zeros(anchor_spec.shape, anchor_spec.dtype)

        # NOTE: unordered callbacks (jax 0.10 accepts ordered ones in a custom_vjp too; older releases
        # refused them): the lookup's output is the step's input, and the backward's callback runs
        # before the exchange's by data (its output, the anchor's gradient, is an input of the exchange).
        @jax.custom_vjp
        def rows(a: Any, i: Any) -> Any:
            return io_callback(read, rows_spec, i, ordered=False)

        def forward(a: Any, i: Any) -> tuple[Any, Any]:
            return rows(a, i), i

        def backward(i: Any, grad: Any) -> tuple[Any, None]:
            return io_callback(caught, anchor_spec, i, grad, ordered=False), None

        rows.defvjp(forward, backward)
        return rows(anchor, ids)

    def host_call(
        self, fn: HostFn, inputs: Sequence[Any], outputs: Sequence[OutputSpec], name: str
    ) -> list[Any]:
        if not self.tracing(*inputs):
            return super().host_call(fn, inputs, outputs, name)
        if any(d is None for shape, _ in outputs for d in shape):
            raise ValueError(f"{name}: a jitted JAX step needs static output shapes, got {list(outputs)}")
        specs = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for shape, dtype in outputs]

        def callback(*arrays: Any) -> list[np.ndarray]:
            got = fn(*[np.asarray(a) for a in arrays])
            return [np.asarray(a, spec.dtype).reshape(spec.shape) for a, spec in zip(got, specs, strict=True)]

        return list(io_callback(callback, specs, *inputs, ordered=True))


__all__ = ["Adapter"]
