"""Encoding and decoding of ``psproto.v1.Frame`` with a fixed 64-byte header (no protobuf copies).

Every header field of ``Frame`` is fixed-width and written in field order, and
the payload length is a varint padded to 5 bytes, so the payload always starts
at byte :data:`HEADER_BYTES`. The bytes are a valid protobuf ``Frame``:

>>> import numpy as np
>>> from psproto.v1 import collective_pb2
>>> h = FrameHeader(seq=3, total=2, kind=1, dtype=2, op=1, step=0, chunk=0, chunks=1, rank=0, world=2)
>>> msg = encode(h, np.array([1.5, 2.5], np.float32))
>>> collective_pb2.Frame.FromString(msg).seq
3
>>> decode(msg)[0] == h, np.frombuffer(msg, np.float32, offset=HEADER_BYTES).tolist()
(True, [1.5, 2.5])
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple

import numpy as np

from pscore.errors import InvalidArgumentError

# Wire types: 1 = 64-bit, 5 = 32-bit, 2 = length-delimited.
_TAGS: Final[tuple[int, ...]] = (
    (1 << 3) | 1,  # seq
    (2 << 3) | 1,  # total
    *(((f << 3) | 5) for f in range(3, 11)),  # kind dtype op step chunk chunks rank world
    (15 << 3) | 2,  # payload
)
_STRUCT: Final = struct.Struct("<BQBQ" + "BI" * 8 + "B5s")
HEADER_BYTES: Final[int] = _STRUCT.size  # 64: payload offset, 8-byte aligned
MAX_PAYLOAD_BYTES: Final[int] = (1 << 35) - 1  # what a 5-byte varint holds


class FrameError(InvalidArgumentError, ValueError):
    """Bytes that are not a frame of the fixed layout."""


class FrameHeader(NamedTuple):
    """The header fields of a frame (see ``collective.proto``)."""

    seq: int
    total: int
    kind: int
    dtype: int
    op: int
    step: int
    chunk: int
    chunks: int
    rank: int
    world: int


def _varint5(n: int) -> bytes:
    """``n`` as a varint padded to exactly 5 bytes."""
    return bytes(((n >> (7 * i)) & 0x7F) | (0x80 if i < 4 else 0) for i in range(5))


def encode(header: FrameHeader, payload: np.ndarray | bytes | memoryview) -> bytes:
    """Returns the frame bytes: the 64-byte header followed by ``payload``'s raw bytes (one copy).

    Raises:
        FrameError: the payload is larger than a 5-byte varint can describe.
    """
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    head = encode_header(header, len(view))
    return b"".join((head, view))


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[FrameHeader, int]:
    """Parses the first :data:`HEADER_BYTES` of ``buf``; returns the header and the payload length.

    Raises:
        FrameError: the bytes are not a header of the fixed layout.
    """
    if len(buf) < HEADER_BYTES:
        raise FrameError(f"frame of {len(buf)} bytes is shorter than its {HEADER_BYTES}-byte header")
    vals = _STRUCT.unpack_from(buf)
    if vals[0:21:2] != _TAGS:
        raise FrameError("frame header does not have the fixed psproto.v1.Frame layout")
    v = vals[21]
    n = v[0] & 0x7F | (v[1] & 0x7F) << 7 | (v[2] & 0x7F) << 14 | (v[3] & 0x7F) << 21 | v[4] << 28
    return FrameHeader(*vals[1:21:2]), n


def encode_header(header: FrameHeader, payload_bytes: int) -> bytes:
    """The 64-byte header of a frame whose payload has ``payload_bytes`` bytes.

    Raises:
        FrameError: the payload is larger than a 5-byte varint can describe.
    """
    if payload_bytes > MAX_PAYLOAD_BYTES:
        raise FrameError(f"payload of {payload_bytes} bytes is too large for one frame")
    h = header
    fields = (h.seq, h.total, h.kind, h.dtype, h.op, h.step, h.chunk, h.chunks, h.rank, h.world)
    return _STRUCT.pack(
        *(v for pair in zip(_TAGS, fields, strict=False) for v in pair), _TAGS[-1], _varint5(payload_bytes)
    )


def decode(msg: bytes) -> tuple[FrameHeader, int]:
    """Parses a frame's header; returns it and the payload length (the payload is ``msg[64:]``).

    Raises:
        FrameError: the bytes are not a frame of the fixed layout.
    """
    header, n = decode_header(msg)
    if n != len(msg) - HEADER_BYTES:
        raise FrameError(f"frame says {n} payload bytes but carries {len(msg) - HEADER_BYTES}")
    return header, n
