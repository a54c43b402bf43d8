"""numpy <-> ``psproto.v1`` tensors: raw little-endian bytes with a dtype and shape.

The wire SDK shared by the client and the server (psserver imports this module).
Decoding never copies: arrays are ``np.frombuffer`` views of the received bytes.

>>> import numpy as np
>>> chunk = encode("w", np.arange(6, dtype=np.float32).reshape(2, 3))
>>> decode(chunk)
array([[0., 1., 2.],
       [3., 4., 5.]], dtype=float32)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Final

import numpy as np

from psproto.v1 import ps_pb2

_TO_WIRE: Final[dict[np.dtype, int]] = {
    np.dtype("<f2"): ps_pb2.DTYPE_FLOAT16,
    np.dtype("<f4"): ps_pb2.DTYPE_FLOAT32,
    np.dtype("<f8"): ps_pb2.DTYPE_FLOAT64,
    np.dtype("<i4"): ps_pb2.DTYPE_INT32,
    np.dtype("<i8"): ps_pb2.DTYPE_INT64,
    np.dtype("i1"): ps_pb2.DTYPE_INT8,
    np.dtype("u1"): ps_pb2.DTYPE_UINT8,
    np.dtype("?"): ps_pb2.DTYPE_BOOL,
}
_FROM_WIRE: Final[dict[int, np.dtype]] = {v: k for k, v in _TO_WIRE.items()}

SUPPORTED_DTYPES: Final[tuple[str, ...]] = tuple(sorted(str(np.dtype(d).name) for d in _TO_WIRE))


class CodecError(ValueError):
    """A tensor could not be encoded or decoded (unsupported dtype, bad byte count)."""


def wire_dtype(dtype: np.dtype | type | str) -> int:
    """Returns the ``psproto.v1.DType`` of a numpy dtype (byte order is normalised to little-endian).

    Raises:
        CodecError: the dtype has no wire representation.
    """
    dt = np.dtype(dtype)
    dt = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    try:
        return _TO_WIRE[dt]
    except KeyError:
        raise CodecError(
            f"dtype {np.dtype(dtype).name} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def numpy_dtype(wire: int) -> np.dtype:
    """Returns the numpy dtype of a ``psproto.v1.DType`` value.

    Raises:
        CodecError: unknown or unspecified dtype.
    """
    try:
        return _FROM_WIRE[wire]
    except KeyError:
        raise CodecError(f"unknown wire dtype {wire}") from None


def as_wire_array(x: object, dtype: np.dtype | None = None) -> np.ndarray:
    """Returns ``x`` as a C-contiguous little-endian array (no copy when it already is one)."""
    arr = np.asarray(x, dtype=dtype)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # NOTE: not np.ascontiguousarray, which turns a 0-d scalar into shape (1,).
    return np.asarray(arr, order="C")


def encode(name: str, value: np.ndarray) -> ps_pb2.TensorChunk:
    """Encodes a whole array as one chunk."""
    arr = as_wire_array(value)
    return ps_pb2.TensorChunk(
        name=name, dtype=wire_dtype(arr.dtype), shape=arr.shape, offset=0, data=arr.tobytes()
    )


def iter_chunks(name: str, value: np.ndarray, chunk_bytes: int) -> Iterator[ps_pb2.TensorChunk]:
    """Cuts an array into chunks of at most ``chunk_bytes`` bytes (at least one element each).

    >>> [len(c.data) for c in iter_chunks("v", np.zeros(10, np.float32), 16)]
    [16, 16, 8]
    """
    arr = as_wire_array(value)
    flat = arr.reshape(-1)
    dtype = wire_dtype(arr.dtype)
    step = max(1, chunk_bytes // max(1, arr.itemsize))
    if flat.size == 0:
        yield ps_pb2.TensorChunk(name=name, dtype=dtype, shape=arr.shape, offset=0, data=b"")
        return
    for start in range(0, flat.size, step):
        yield ps_pb2.TensorChunk(
            name=name, dtype=dtype, shape=arr.shape, offset=start, data=flat[start : start + step].tobytes()
        )


def chunk_shape(chunk: ps_pb2.TensorChunk) -> tuple[int, ...]:
    """The shape of the whole tensor a chunk belongs to, validated.

    Raises:
        CodecError: a negative dimension.
    """
    shape = tuple(int(d) for d in chunk.shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"tensor {chunk.name!r} has a negative dimension in shape {shape}")
    return shape


def chunk_elements(chunk: ps_pb2.TensorChunk, data: bytes | None = None) -> np.ndarray:
    """Returns the chunk's elements as a flat read-only view of its bytes, validated.

    Args:
        chunk: the chunk.
        data: ``chunk.data`` if the caller already read it (each read of a
            protobuf bytes field makes a new copy).

    Raises:
        CodecError: unknown dtype, a byte count that is not a whole number of
            elements, or elements that fall outside the tensor.
    """
    try:
        dtype = numpy_dtype(chunk.dtype)
    except CodecError as err:
        raise CodecError(f"tensor {chunk.name!r}: {err}") from None
    raw = chunk.data if data is None else data
    if len(raw) % dtype.itemsize:
        raise CodecError(
            f"tensor {chunk.name!r}: {len(raw)} bytes is not a whole number of {dtype.name} elements"
        )
    shape = chunk_shape(chunk)
    total = math.prod(shape)  # Python ints: a hostile shape cannot overflow
    count = len(raw) // dtype.itemsize
    if chunk.offset < 0 or chunk.offset + count > total:
        raise CodecError(
            f"tensor {chunk.name!r}: elements [{chunk.offset}, {chunk.offset + count}) fall outside "
            f"shape {shape} ({total} elements)"
        )
    return np.frombuffer(raw, dtype=dtype)


def decode(chunk: ps_pb2.TensorChunk) -> np.ndarray:
    """Decodes a chunk that carries a whole tensor (a read-only view, no copy).

    Raises:
        CodecError: the chunk is malformed or does not carry the whole tensor.
    """
    data = chunk.data
    flat = chunk_elements(chunk, data)
    shape = chunk_shape(chunk)
    if chunk.offset != 0 or flat.size != math.prod(shape):
        raise CodecError(f"tensor {chunk.name!r}: chunk does not carry the whole tensor of shape {shape}")
    return flat.reshape(shape)


class Assembler:
    """Collects the chunks of several tensors into whole arrays.

    A tensor that arrives in a single chunk is kept as a zero-copy view; one
    that arrives in pieces is copied into one preallocated buffer.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        # Element ranges [start, stop) received per tensor: catches gaps and overlaps.
        self._ranges: dict[str, list[tuple[int, int]]] = {}
        self._specs: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}

    def add(self, chunk: ps_pb2.TensorChunk) -> None:
        """Adds one chunk.

        Raises:
            CodecError: malformed chunk, or one that disagrees with earlier chunks of its tensor.
        """
        data = chunk.data
        elems = chunk_elements(chunk, data)
        shape = chunk_shape(chunk)
        dtype = elems.dtype
        name = chunk.name
        total = math.prod(shape)
        known = self._specs.get(name)
        if known is None:
            if chunk.offset == 0 and elems.size == total:
                self._arrays[name] = elems.reshape(shape)  # zero-copy (read-only) view
                self._specs[name], self._ranges[name] = (dtype, shape), [(0, total)]
                return
            try:
                self._arrays[name] = np.empty(shape, dtype=dtype)
            except (MemoryError, ValueError) as err:
                raise CodecError(
                    f"tensor {name!r}: cannot hold shape {shape} of {dtype.name} ({total} elements): {err}"
                ) from None
            self._specs[name], self._ranges[name] = (dtype, shape), []
        elif known != (dtype, shape):
            raise CodecError(
                f"tensor {name!r}: chunk says {dtype.name}{list(shape)}, earlier chunks said "
                f"{known[0].name}{list(known[1])}"
            )
        arr = self._arrays[name]
        if not arr.flags.writeable:
            raise CodecError(f"tensor {name!r}: received more elements than its shape {shape} holds")
        arr.reshape(-1)[chunk.offset : chunk.offset + elems.size] = elems
        self._ranges[name].append((chunk.offset, chunk.offset + elems.size))

    def result(self) -> dict[str, np.ndarray]:
        """Returns the whole tensors, in arrival order.

        Raises:
            CodecError: a tensor is missing elements, or got some twice.
        """
        for name, arr in self._arrays.items():
            ranges = sorted(self._ranges[name])
            received = sum(stop - start for start, stop in ranges)
            if received != arr.size:
                raise CodecError(f"tensor {name!r}: received {received} of {arr.size} elements")
            end = 0
            for start, stop in ranges:
                if start != end:
                    raise CodecError(
                        f"tensor {name!r}: elements [{min(start, end)}, {max(start, end)}) were "
                        f"{'received twice' if start < end else 'never received'}"
                    )
                end = stop
        return dict(self._arrays)
