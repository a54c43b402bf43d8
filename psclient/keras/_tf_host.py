"""A host function (numpy in, numpy out) staged in a TensorFlow graph: ``tf.numpy_function``, its small
outputs packed. TensorFlow only: the Keras glue's TensorFlow adapter and the Horovod drop-in import it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from psclient.keras._backend import HostFn, OutputSpec

# A host call's outputs of at most this many bytes, of a fixed shape, leave it together: one flat array per
# dtype, split in the graph (issue 42). TensorFlow converts each output of a ``numpy_function`` in Python
# (``FuncRegistry._convert``: about 24 calls an output, a version string parsed by a regular expression
# each time), so a step's exchange of six small variables paid ~145 calls for them; the copy into the
# flat array costs less than that below this size, and a larger output goes alone (no copy).
PACK_MAX_BYTES = 64 * 1024


class Packing:
    """How a host call's small outputs of one dtype leave it in one flat array (``wrap``) and become the
    outputs again in the graph (``unpack``: ``tf.split`` and reshapes, no Python per step)."""

    def __init__(
        self, outputs: Sequence[OutputSpec], groups: dict[np.dtype[Any], list[int]], name: str
    ) -> None:
        self.name = name
        self.outputs = [(shape, np.dtype(dtype)) for shape, dtype in outputs]
        self.groups = list(groups.items())  # (dtype, the outputs it packs)
        grouped = {i for _, members in self.groups for i in members}
        self.alone = [i for i in range(len(outputs)) if i not in grouped]
        self.sizes = {i: int(np.prod(self.outputs[i][0])) for i in grouped}  # elements of each packed one
        self.tout = [tf.as_dtype(d) for d, _ in self.groups] + [
            tf.as_dtype(self.outputs[i][1]) for i in self.alone
        ]

    @classmethod
    def of(cls, outputs: Sequence[OutputSpec], name: str) -> Packing | None:
        """The packing of ``outputs``, or None where no two small outputs share a dtype."""
        groups: dict[np.dtype[Any], list[int]] = {}
        for i, (shape, dtype) in enumerate(outputs):
            dt = np.dtype(dtype)
            if dt.kind not in "biuf" or shape is None or any(d is None for d in shape):
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
            if self.outputs[i][0] is not None:
                tensor.set_shape(self.outputs[i][0])
            result[i] = tensor
        return result


def numpy_call(fn: HostFn, inputs: Sequence[Any], outputs: Sequence[OutputSpec], name: str) -> list[Any]:
    """``fn`` run by a ``tf.numpy_function`` named ``name`` in the graph being traced: its outputs as tensors
    of the declared dtypes and static shapes (small ones packed: ``Packing``)."""
    packing = Packing.of(outputs, name)
    if packing is not None:
        packed = tf.numpy_function(
            packing.wrap(fn), list(inputs), Tout=packing.tout, stateful=True, name=name
        )
        return packing.unpack(packed)
    out = tf.numpy_function(
        fn, list(inputs), Tout=[tf.as_dtype(dtype) for _, dtype in outputs], stateful=True, name=name
    )
    out = list(out) if isinstance(out, list | tuple) else [out]
    for tensor, (shape, _) in zip(out, outputs, strict=True):
        if shape is not None:
            tensor.set_shape(shape)
    return out


__all__ = ["PACK_MAX_BYTES", "Packing", "numpy_call"]
