"""The glue's JAX adapter (see ``psclient.keras._backend``).

Keras on JAX runs ``fit``'s step jitted and stateless: the step takes the variables' values as
arguments and returns the new ones, and the optimizer's ``stateless_apply`` collects what its
``apply`` assigned. The exchange with the shards (or the ring) is host code: it runs inside the
compiled step as an ordered ``jax.experimental.io_callback`` that takes the step's gradients and
returns the shards' new values, which the step assigns (recorded by Keras's stateless scope and
handed back as the step's new state). So ``fit`` stays compiled (``jit_compile=True``, Keras's
default on JAX) and nothing leaves the step but the callback. Shapes in a jitted step are static:
an Embedding table's gradient is dense on JAX (the whole table travels). The non-trainable state that
the TensorFlow glue shares through the shards (BatchNorm statistics) is refused with a clear error:
the optimizer's stateless scope sees it as it was before the forward pass and does not hand it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

from psclient.keras._backend import EagerAdapter, HostFn, OutputSpec, unsupported


class Adapter(EagerAdapter):
    """JAX: jitted stateless steps, host code in an ordered ``io_callback``."""

    name = "jax"
    # Keras's JAX step (jitted or not) is stateless: the optimizer's ``stateless_apply`` sees the
    # non-trainable state as it was before the forward pass and hands back only its own assignments.
    shared_state_in_step = False

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

    def read_rate(self, rate: Any) -> float | None:
        # Keras's JAX fit keeps the state in the step's arguments and empties the variables until a
        # callback reads the model (which writes the state back: a callback that sets the rate does).
        if getattr(rate, "_value", 0) is None:
            return None
        return super().read_rate(rate)

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
