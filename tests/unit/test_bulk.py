"""The data port's pieces that need no socket: tensor descriptions and the shard's receive-buffer pool."""

from __future__ import annotations

import numpy as np
import pytest

from pscore import bulk, codec
from psproto.v1 import ps_pb2
from psserver.dataport import BufferPool


def test_tensor_layouts_come_from_dtype_and_shape() -> None:
    chunks = [
        bulk.describe("a", np.zeros((3, 4), np.float16)),
        bulk.describe("b", np.zeros((), np.int64)),
        bulk.describe("c", np.zeros((0, 5), np.float32)),
    ]
    assert bulk.tensor_layout(chunks) == [
        ("a", np.dtype(np.float16), (3, 4), 24),
        ("b", np.dtype(np.int64), (), 8),
        ("c", np.dtype(np.float32), (0, 5), 0),
    ]


@pytest.mark.parametrize(
    ("chunk", "match"),
    [
        (ps_pb2.TensorChunk(name="x", dtype=99, shape=[2]), "unknown wire dtype"),
        (ps_pb2.TensorChunk(name="x", dtype=ps_pb2.DTYPE_FLOAT32, shape=[-1]), "negative"),
        (ps_pb2.TensorChunk(name="x", dtype=ps_pb2.DTYPE_FLOAT32, shape=[4], offset=2), "whole"),
        (ps_pb2.TensorChunk(name="x", dtype=ps_pb2.DTYPE_FLOAT32, shape=[1], data=b"abcd"), "whole"),
    ],
)
def test_malformed_descriptions_are_codec_errors(chunk: ps_pb2.TensorChunk, match: str) -> None:
    with pytest.raises(codec.CodecError, match=match):
        bulk.tensor_layout([chunk])


def test_payload_views_are_the_arrays_bytes_not_copies() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    (view,) = bulk.payload_of([a])
    assert len(view) == 24 and view.obj is not None
    a[0, 0] = 7.0
    assert np.frombuffer(view, np.float32)[0] == 7.0


def test_the_buffer_pool_reuses_a_buffer_once_nothing_refers_to_it() -> None:
    pool = BufferPool(keep=2)
    buf = pool.take(3 << 20)
    first = id(buf)
    assert buf.nbytes >= 3 << 20
    grad = np.frombuffer(memoryview(buf)[:16], np.float32)  # a gradient still using it
    del buf
    assert id(pool.take(1 << 20)) != first
    del grad
    assert id(pool.take(2 << 20)) == first  # free again, and it fits: no new allocation
    pool.take(8 << 20)
    assert pool.held_bytes == (3 << 20) + (8 << 20)  # `keep` buffers: the smallest idle one went
