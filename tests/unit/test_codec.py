"""Unit tests of pscore.codec: numpy <-> psproto.v1 tensors (no sockets, no TF)."""

from __future__ import annotations

import numpy as np
import pytest

from pscore import codec
from psproto.v1 import ps_pb2

DTYPES = ["float16", "float32", "float64", "int32", "int64", "int8", "uint8", "bool"]
SHAPES = [(), (0,), (1,), (7,), (3, 4), (2, 0, 5), (2, 3, 4)]


def _random(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(size=shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codec_round_trip_is_exact(dtype: str, shape: tuple[int, ...]) -> None:
    x = _random(shape, dtype)
    chunk = codec.encode("v", x)
    assert chunk.name == "v" and tuple(chunk.shape) == shape and chunk.offset == 0
    assert len(chunk.data) == x.nbytes
    y = codec.decode(chunk)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, x)


def test_codec_decode_is_a_read_only_view() -> None:
    y = codec.decode(codec.encode("v", np.arange(4, dtype=np.float32)))
    assert not y.flags.writeable


def test_codec_encode_normalises_big_endian_and_non_contiguous_input() -> None:
    x = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]
    chunk = codec.encode("v", x)
    assert chunk.dtype == ps_pb2.DTYPE_FLOAT32
    y = codec.decode(chunk)
    assert y.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(y, x)


def test_codec_wire_dtype_rejects_unsupported_dtypes() -> None:
    for bad in ("complex64", "uint16", "U3", "object"):
        with pytest.raises(codec.CodecError, match="not supported"):
            codec.wire_dtype(bad)


@pytest.mark.parametrize("wire", [ps_pb2.DTYPE_UNSPECIFIED, 99, -1])
def test_codec_numpy_dtype_rejects_unknown_wire_values(wire: int) -> None:
    with pytest.raises(codec.CodecError, match="unknown wire dtype"):
        codec.numpy_dtype(wire)


def test_codec_wire_dtypes_round_trip() -> None:
    for name in DTYPES:
        assert codec.numpy_dtype(codec.wire_dtype(name)) == np.dtype(name)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": ps_pb2.DTYPE_FLOAT32, "shape": [3], "data": b"\0" * 11}, "not a whole number"),
        ({"dtype": 42, "shape": [3], "data": b"\0" * 12}, "unknown wire dtype"),
        ({"dtype": ps_pb2.DTYPE_UNSPECIFIED, "shape": [3], "data": b"\0" * 12}, "unknown wire dtype"),
        ({"dtype": ps_pb2.DTYPE_FLOAT32, "shape": [-3], "data": b""}, "negative dimension"),
        ({"dtype": ps_pb2.DTYPE_FLOAT32, "shape": [3], "offset": 2, "data": b"\0" * 8}, "fall outside"),
        ({"dtype": ps_pb2.DTYPE_FLOAT32, "shape": [3], "offset": -1, "data": b"\0" * 4}, "fall outside"),
        ({"dtype": ps_pb2.DTYPE_FLOAT32, "shape": [3], "data": b"\0" * 16}, "fall outside"),
    ],
)
def test_codec_malformed_chunks_raise_codec_error_naming_the_tensor(kwargs: dict, match: str) -> None:
    chunk = ps_pb2.TensorChunk(name="dense/kernel", **kwargs)
    with pytest.raises(codec.CodecError, match=match) as info:
        codec.Assembler().add(chunk)
    assert "dense/kernel" in str(info.value)
    with pytest.raises(codec.CodecError):
        codec.decode(chunk)


def test_codec_decode_rejects_a_partial_chunk() -> None:
    chunk = ps_pb2.TensorChunk(name="v", dtype=ps_pb2.DTYPE_FLOAT32, shape=[4], data=b"\0" * 8)
    with pytest.raises(codec.CodecError, match="whole tensor"):
        codec.decode(chunk)


def _chunks(name: str, x: np.ndarray, chunk_bytes: int) -> list[codec.WireChunk]:
    """The chunks of one tensor, as ``codec.wire_batches`` cuts it."""
    return [c for batch in codec.wire_batches([(name, x)], chunk_bytes) for c in batch]


@pytest.mark.parametrize("chunk_bytes", [1, 4, 12, 100, 1 << 20])
def test_codec_chunks_reassemble_exactly(chunk_bytes: int) -> None:
    a = _random((5, 7), "float64", seed=1)
    b = _random((13,), "int8", seed=2)
    chunks = [*_chunks("a", a, chunk_bytes), *_chunks("b", b, chunk_bytes)]
    assert all(len(c.data) <= max(chunk_bytes, 8) for c in chunks)
    rng = np.random.default_rng(3)
    asm = codec.Assembler()
    for i in rng.permutation(len(chunks)):  # arrival order does not matter
        asm.add(chunks[i])
    out = asm.result()
    assert list(out) != [] and set(out) == {"a", "b"}
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)


def test_codec_wire_batches_of_empty_tensor_yields_one_chunk() -> None:
    chunks = list(_chunks("e", np.zeros((0, 3), np.float32), 16))
    assert len(chunks) == 1
    asm = codec.Assembler()
    asm.add(chunks[0])
    assert asm.result()["e"].shape == (0, 3)


def test_codec_assembler_reports_missing_elements() -> None:
    chunks = list(_chunks("v", np.arange(10, dtype=np.float32), 16))
    asm = codec.Assembler()
    for c in chunks[:-1]:
        asm.add(c)
    with pytest.raises(codec.CodecError, match="received 8 of 10"):
        asm.result()


def test_codec_assembler_rejects_a_duplicated_chunk_even_when_the_count_adds_up() -> None:
    # Chunks [0, 4), [0, 4), [8, 10): 10 elements arrive but [4, 8) never does.
    chunks = list(_chunks("v", np.arange(10, dtype=np.float32), 16))
    asm = codec.Assembler()
    for c in (chunks[0], chunks[0], chunks[2]):
        asm.add(c)
    with pytest.raises(codec.CodecError, match="'v'"):
        asm.result()


def test_codec_assembler_rejects_more_chunks_after_a_whole_one() -> None:
    asm = codec.Assembler()
    asm.add(codec.encode("v", np.zeros(4, np.float32)))
    with pytest.raises(codec.CodecError, match="more elements"):
        asm.add(codec.encode("v", np.zeros(4, np.float32)))


def test_codec_assembler_rejects_chunks_that_disagree_on_dtype_or_shape() -> None:
    chunks = list(_chunks("v", np.zeros(10, np.float32), 16))
    asm = codec.Assembler()
    asm.add(chunks[0])
    c = chunks[1]
    other = codec.WireChunk(c.name, c.dtype, (11,), c.offset, c.data)
    with pytest.raises(codec.CodecError, match="earlier chunks"):
        asm.add(other)
    other = codec.WireChunk(c.name, ps_pb2.DTYPE_INT32, c.shape, c.offset, c.data)
    with pytest.raises(codec.CodecError, match="earlier chunks"):
        asm.add(other)


def test_codec_assembler_rejects_a_partial_chunk_of_an_absurd_shape() -> None:
    # Declares 2**50 float32 elements but sends one: must not try to allocate 4 PiB.
    chunk = ps_pb2.TensorChunk(name="v", dtype=ps_pb2.DTYPE_FLOAT32, shape=[1 << 25, 1 << 25], data=b"\0" * 4)
    with pytest.raises(codec.CodecError, match="'v'"):
        codec.Assembler().add(chunk)
