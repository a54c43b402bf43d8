"""Frame encoding: the fixed 64-byte header is a valid protobuf ``psproto.v1.Frame``."""

from __future__ import annotations

import numpy as np
import pytest

from psclient.collective._frame import (
    HEADER_BYTES,
    FrameError,
    FrameHeader,
    decode,
    decode_header,
    encode,
    encode_header,
)
from psproto.v1 import collective_pb2

HEADER = FrameHeader(
    seq=2**40 + 3, total=10**9, kind=1, dtype=3, op=2, step=13, chunk=7, chunks=9, rank=5, world=8
)


@pytest.mark.parametrize("dtype", ["<f2", "<f4", "<f8", "<i4", "<i8"])
@pytest.mark.parametrize("size", [0, 1, 7, 1000])
def test_roundtrip_and_protobuf_parse(dtype: str, size: int) -> None:
    x = np.random.default_rng(size).standard_normal(size).astype(dtype)
    msg = encode(HEADER, x)
    assert HEADER_BYTES == 64
    header, nbytes = decode(msg)
    assert header == HEADER and nbytes == x.nbytes
    np.testing.assert_array_equal(np.frombuffer(msg, x.dtype, offset=HEADER_BYTES), x)
    parsed = collective_pb2.Frame.FromString(msg)
    assert (parsed.seq, parsed.total, parsed.step, parsed.chunk, parsed.rank, parsed.world) == (
        HEADER.seq,
        HEADER.total,
        HEADER.step,
        HEADER.chunk,
        HEADER.rank,
        HEADER.world,
    )
    assert parsed.payload == x.tobytes()


def test_encode_accepts_non_contiguous_views_by_value() -> None:
    x = np.arange(10, dtype=np.float32)
    msg = encode(HEADER, x[2:5])
    np.testing.assert_array_equal(np.frombuffer(msg, np.float32, offset=HEADER_BYTES), [2, 3, 4])


@pytest.mark.parametrize(
    "msg",
    [b"", b"\x00" * 63, collective_pb2.Frame(seq=1, payload=b"abc").SerializeToString()],
)
def test_foreign_bytes_are_rejected(msg: bytes) -> None:
    with pytest.raises(FrameError):
        decode(msg)


def test_length_mismatch_is_rejected() -> None:
    msg = encode(HEADER, np.zeros(4, np.float32))
    with pytest.raises(FrameError, match="payload bytes"):
        decode(msg[:-1])


def test_header_alone_is_the_frame_prefix_and_parses_from_a_reused_buffer() -> None:
    """The tcp transport sends encode_header() then the payload, and parses headers in place."""
    x = np.arange(5, dtype=np.float32)
    head = encode_header(HEADER, x.nbytes)
    assert len(head) == HEADER_BYTES and encode(HEADER, x) == head + x.tobytes()
    buf = bytearray(HEADER_BYTES + 100)
    buf[:HEADER_BYTES] = head
    assert decode_header(memoryview(buf)) == (HEADER, x.nbytes)
    with pytest.raises(FrameError):
        decode_header(memoryview(buf)[:10])
    with pytest.raises(FrameError):
        decode_header(bytes(HEADER_BYTES))
