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

import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np

from pscore.errors import InvalidArgumentError
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
WIRE_DTYPES: Final[Mapping[int, np.dtype]] = _FROM_WIRE  # wire dtype -> numpy dtype (``numpy_dtype``'s table)
DTYPE_WIRES: Final[Mapping[np.dtype, int]] = _TO_WIRE  # little-endian numpy dtype -> wire (``wire_dtype``'s)

SUPPORTED_DTYPES: Final[tuple[str, ...]] = tuple(sorted(str(np.dtype(d).name) for d in _TO_WIRE))


class CodecError(InvalidArgumentError, ValueError):
    """A tensor could not be encoded or decoded (unsupported dtype, bad byte count).

    An ``InvalidArgumentError`` (a ``PSError``, as every error a client call raises) and a
    ``ValueError``, as before.
    """


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
    wire = _TO_WIRE.get(value.dtype) if type(value) is np.ndarray and value.flags.c_contiguous else None
    if wire is not None:  # a wire array already (as_wire_array and wire_dtype, without their calls)
        return ps_pb2.TensorChunk(name=name, dtype=wire, shape=value.shape, offset=0, data=value.tobytes())
    arr = as_wire_array(value)
    return ps_pb2.TensorChunk(
        name=name, dtype=wire_dtype(arr.dtype), shape=arr.shape, offset=0, data=arr.tobytes()
    )


def chunk_shape(chunk: ps_pb2.TensorChunk) -> tuple[int, ...]:
    """The shape of the whole tensor a chunk belongs to, validated.

    Raises:
        CodecError: a negative dimension.
    """
    shape = tuple(map(int, chunk.shape))  # map and min: no generator resumed per dimension
    if shape and min(shape) < 0:
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
    dtype, shape = _FROM_WIRE.get(chunk.dtype), tuple(chunk.shape)
    if (  # the common case, checked inline: a known dtype, the whole tensor, no negative dimension
        dtype is not None
        and chunk.offset == 0
        and len(data) == math.prod(shape) * dtype.itemsize
        and (not shape or min(shape) >= 0)
    ):
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    flat = chunk_elements(chunk, data)  # their errors
    shape = chunk_shape(chunk)
    if chunk.offset != 0 or flat.size != math.prod(shape):
        raise CodecError(f"tensor {chunk.name!r}: chunk does not carry the whole tensor of shape {shape}")
    return flat.reshape(shape)


class Coverage:
    """The element ranges ``[start, stop)`` received of one tensor of ``size`` elements.

    Every receiver of chunks (``Assembler``, the client's pull ``Gather``) checks
    with it that a tensor arrived whole: no element missing, none twice.
    """

    __slots__ = ("_ranges", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._ranges: list[tuple[int, int]] = []

    def add(self, start: int, count: int) -> None:
        self._ranges.append((start, start + count))

    @property
    def received(self) -> int:
        return sum(stop - start for start, stop in self._ranges)

    def check(self, name: str) -> None:
        """Raises CodecError unless every element arrived exactly once."""
        if len(self._ranges) == 1 and self._ranges[0] == (0, self.size):  # arrived whole, in one chunk
            return
        ranges = sorted(self._ranges)
        received = sum(stop - start for start, stop in ranges)
        if received != self.size:
            raise CodecError(f"tensor {name!r}: received {received} of {self.size} elements")
        end = 0
        for start, stop in ranges:
            if start != end:
                raise CodecError(
                    f"tensor {name!r}: elements [{min(start, end)}, {max(start, end)}) were "
                    f"{'received twice' if start < end else 'never received'}"
                )
            end = stop


class Assembler:
    """Collects the chunks of several tensors into whole arrays.

    A tensor that arrives in a single chunk is kept as a zero-copy view; one
    that arrives in pieces is copied into one preallocated buffer.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._coverage: dict[str, Coverage] = {}  # catches gaps and overlaps
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
                self._specs[name], self._coverage[name] = (dtype, shape), Coverage(total)
                self._coverage[name].add(0, total)
                return
            try:
                self._arrays[name] = np.empty(shape, dtype=dtype)
            except (MemoryError, ValueError) as err:
                raise CodecError(
                    f"tensor {name!r}: cannot hold shape {shape} of {dtype.name} ({total} elements): {err}"
                ) from None
            self._specs[name], self._coverage[name] = (dtype, shape), Coverage(total)
        elif known != (dtype, shape):
            raise CodecError(
                f"tensor {name!r}: chunk says {dtype.name}{list(shape)}, earlier chunks said "
                f"{known[0].name}{list(known[1])}"
            )
        arr = self._arrays[name]
        if not arr.flags.writeable:
            raise CodecError(f"tensor {name!r}: received more elements than its shape {shape} holds")
        arr.reshape(-1)[chunk.offset : chunk.offset + elems.size] = elems
        self._coverage[name].add(chunk.offset, elems.size)

    def result(self) -> dict[str, np.ndarray]:
        """Returns the whole tensors, in arrival order.

        Raises:
            CodecError: a tensor is missing elements, or got some twice.
        """
        for name in self._arrays:
            self._coverage[name].check(name)
        return dict(self._arrays)


# -- zero-copy wire framing ------------------------------------------------------
#
# Big pulls and pushes skip protobuf's copies of tensor bytes. A message is
# sent as the bytes protobuf itself would produce: the header fields serialized
# by protobuf, then each TensorChunk as a length-delimited field whose ``data``
# comes straight from the array (one copy, into the outgoing message). Parsing
# splits a received message the other way: the header fields go through
# protobuf, each chunk's ``data`` stays a zero-copy view of the received bytes.
# The wire format is exactly ``ps.proto``'s, so either side may use plain
# protobuf instead.

_LEN = 2
_SMALL_MESSAGE = 32 << 10  # below this, protobuf's C parser beats scanning fields in Python


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CodecError("malformed message: varint longer than 10 bytes")


_DATA_KEY = _varint(5 << 3 | _LEN)  # TensorChunk.data


class WireChunk:
    """A ``TensorChunk`` whose ``data`` is a zero-copy byte view (of an array, or of a received message).

    Reads like ``ps_pb2.TensorChunk`` (``name``, ``dtype``, ``shape``,
    ``offset``, ``data``), so ``chunk_elements``, ``decode`` and ``Assembler``
    take either.
    """

    __slots__ = ("data", "dtype", "name", "offset", "shape")

    def __init__(self, name: str, dtype: int, shape: tuple[int, ...], offset: int, data: memoryview) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.offset = offset
        self.data = data

    @classmethod
    def of(cls, name: str, value: np.ndarray, start: int = 0, stop: int | None = None) -> WireChunk:
        """Elements ``[start, stop)`` (flat, C order) of a C-contiguous little-endian array, not copied."""
        flat = value.reshape(-1)[start:stop]
        return cls(name, wire_dtype(value.dtype), value.shape, start, memoryview(flat).cast("B"))

    def __repr__(self) -> str:
        return f"WireChunk({self.name!r}, shape={list(self.shape)}, offset={self.offset}, {len(self.data)} B)"


@functools.lru_cache(maxsize=4096)
def _chunk_head(name: str, dtype: int, shape: tuple[int, ...], offset: int, nbytes: int) -> bytes:
    head = ps_pb2.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset).SerializeToString()
    return head + _DATA_KEY + _varint(nbytes)


@functools.lru_cache(maxsize=64)
def _field_key(message: type, field: str) -> tuple[bytes, int]:
    number = message.DESCRIPTOR.fields_by_name[field].number
    return _varint(number << 3 | _LEN), number


class WireMessage:
    """A psproto message (``header``) plus its repeated ``TensorChunk`` field as ``WireChunk`` s.

    Attribute reads fall through to ``header`` (``msg.worker_id``), except the
    chunk field, which is the list of chunks (``msg.grads``). Made by
    ``parse`` on receipt, or by a sender; ``serialize`` makes the wire bytes.
    """

    def __init__(self, header: Any, field: str, chunks: list[Any]) -> None:
        self.header = header
        self.field = field
        self.chunks = chunks
        setattr(self, field, chunks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["header"], name)

    def serialize(self) -> bytes:
        """The message's protobuf wire bytes (copies each chunk's data once)."""
        key, _ = _field_key(type(self.header), self.field)
        parts: list[Any] = [self.header.SerializeToString()]
        for c in self.chunks:
            data = c.data
            nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
            head = _chunk_head(c.name, int(c.dtype), tuple(c.shape), int(c.offset), nbytes)
            parts += (key, _varint(len(head) + nbytes), head, data)
        return b"".join(parts)

    def __repr__(self) -> str:
        return f"WireMessage({type(self.header).__name__}, {self.field}={self.chunks!r})"


def serialize(message: Any) -> bytes:
    """gRPC serializer for psproto messages and ``WireMessage`` s (also passes ``bytes`` through)."""
    if isinstance(message, WireMessage):
        return message.serialize()
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


def parse(message: type, buf: bytes, field: str) -> Any:
    """Parses ``message`` from wire bytes, keeping ``field`` (repeated TensorChunk) as zero-copy views.

    Small messages go through protobuf and come back as the plain message;
    bigger ones as a ``WireMessage``. Either reads the same.

    Raises:
        CodecError: the bytes are not a well-formed message.
    """
    if len(buf) < _SMALL_MESSAGE:
        try:
            return message.FromString(buf)
        except Exception as err:  # protobuf's DecodeError
            raise CodecError(f"malformed {message.__name__}: {err}") from None
    view = memoryview(buf)
    _, number = _field_key(message, field)
    try:
        rest: list[memoryview] = []
        chunks = [_parse_chunk(view[start:end]) for start, end in _split_fields(view, number, rest)]
        header = message.FromString(b"".join(rest))
    except CodecError:
        raise
    except Exception as err:  # IndexError on truncation, protobuf's DecodeError, bad UTF-8
        raise CodecError(f"malformed {message.__name__}: {err}") from None
    return WireMessage(header, field, chunks)


def _split_fields(view: memoryview, number: int, rest: list[memoryview]) -> Iterator[tuple[int, int]]:
    """Yields the payload spans of length-delimited field ``number``; other fields go to ``rest``."""
    pos, end = 0, len(view)
    while pos < end:
        start = pos
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LEN:
            length, pos = _read_varint(view, pos)
            if field == number:
                if pos + length > end:
                    raise CodecError("malformed message: truncated field")
                yield pos, pos + length
                pos += length
                continue
            pos += length
        else:
            raise CodecError(f"malformed message: wire type {wire_type}")
        if pos > end:
            raise CodecError("malformed message: truncated field")
        rest.append(view[start:pos])


def _parse_chunk(view: memoryview) -> WireChunk:
    data_spans: list[tuple[int, int]] = []
    rest: list[memoryview] = []
    data_spans.extend(_split_fields(view, 5, rest))
    head = ps_pb2.TensorChunk.FromString(b"".join(rest))
    data = view[data_spans[-1][0] : data_spans[-1][1]] if data_spans else memoryview(b"")
    return WireChunk(head.name, head.dtype, tuple(head.shape), head.offset, data)


def wire_batches(tensors: list[tuple[str, np.ndarray]], chunk_bytes: int) -> Iterator[list[WireChunk]]:
    """The one chunker: cuts tensors into zero-copy chunks, batched into lists of about ``chunk_bytes`` each.

    A chunk holds at least one element, an empty tensor one empty chunk; a
    tensor's first chunk has ``offset == 0`` (receivers pair versions with those).

    >>> [[c.data.nbytes for c in b] for b in wire_batches([("v", np.zeros(10, np.float32))], 16)]
    [[16], [16], [8]]
    """
    batch: list[WireChunk] = []
    budget = chunk_bytes
    for name, value in tensors:
        t = as_wire_array(value)
        size, itemsize = t.size, max(1, t.itemsize)
        if size == 0:
            batch.append(WireChunk.of(name, t))
            continue
        start = 0
        while start < size:
            n = min(size - start, max(1, budget // itemsize))
            batch.append(WireChunk.of(name, t, start, start + n))
            budget -= n * itemsize
            start += n
            if budget <= 0:
                yield batch
                batch, budget = [], chunk_bytes
    if batch:
        yield batch
