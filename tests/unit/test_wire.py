"""Unit tests of codec's zero-copy framing (WireMessage, parse) and the pull side's Gather and ArrayPool."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from psclient import _requests as rq
from pscore import codec
from pscore.placement import plan
from psproto.v1 import ps_pb2


def _big(n: int = 40_000, dtype: str = "float32") -> np.ndarray:
    return np.arange(n, dtype=dtype)


@pytest.mark.parametrize("n", [0, 1, 100, 40_000])  # below and above the size where parse scans fields itself
def test_wire_message_is_plain_protobuf_both_ways(n: int) -> None:
    x = _big(n).reshape(-1, 1) if n else np.zeros((0, 3), np.float32)
    header = ps_pb2.PushRequest(worker_id="w0", seq=7, step=-3, return_values=True)
    half = x.size // 2
    chunks = (
        [codec.WireChunk.of("v", x, 0, half), codec.WireChunk.of("v", x, half)]
        if n
        else [codec.WireChunk.of("v", x)]
    )
    wire = codec.WireMessage(header, "grads", chunks).serialize()

    reference = ps_pb2.PushRequest.FromString(wire)  # any protobuf peer reads it
    header_fields = (reference.worker_id, reference.seq, reference.step, reference.return_values)
    assert header_fields == ("w0", 7, -3, True)
    got = [(c.name, tuple(c.shape), c.offset) for c in reference.grads]
    assert got == [("v", x.shape, c.offset) for c in chunks]
    assert b"".join(c.data for c in reference.grads) == x.tobytes()

    parsed = codec.parse(ps_pb2.PushRequest, reference.SerializeToString(), "grads")  # and reads any peer's
    assert (parsed.worker_id, parsed.seq, parsed.step, parsed.return_values) == ("w0", 7, -3, True)
    assembler = codec.Assembler()
    for c in parsed.grads:
        assembler.add(c)
    np.testing.assert_array_equal(assembler.result()["v"], x)


def test_parse_keeps_tensor_bytes_as_views_of_the_message() -> None:
    x = _big()
    wire = codec.WireMessage(
        ps_pb2.PullResponse(versions=[4]), "values", [codec.WireChunk.of("v", x)]
    ).serialize()
    parsed = codec.parse(ps_pb2.PullResponse, wire, "values")
    assert isinstance(parsed, codec.WireMessage) and list(parsed.versions) == [4]
    (chunk,) = parsed.values
    assert isinstance(chunk.data, memoryview) and chunk.data.obj is wire
    np.testing.assert_array_equal(codec.decode(chunk), x)


def test_codec_serialize_takes_protos_wire_messages_and_bytes() -> None:
    msg = ps_pb2.PullRequest(names=["a"])
    assert codec.serialize(msg) == msg.SerializeToString()
    assert codec.serialize(b"raw") == b"raw"


@pytest.mark.parametrize("cut", [1, 7, 100])
def test_parse_rejects_truncated_messages(cut: int) -> None:
    wire = codec.WireMessage(
        ps_pb2.PushRequest(worker_id="w"), "grads", [codec.WireChunk.of("v", _big())]
    ).serialize()
    with pytest.raises(codec.CodecError):
        codec.parse(ps_pb2.PushRequest, wire[:-cut], "grads")


def test_parse_rejects_garbage() -> None:
    with pytest.raises(codec.CodecError):
        codec.parse(ps_pb2.PushRequest, b"\xff" * 40_000, "grads")


def test_gather_stitches_partitions_from_chunks_in_any_order() -> None:
    x = _big(10_000).reshape(100, 100)
    pieces = plan({"v": (x.shape, x.dtype)}, num_shards=2, partition_bytes=8_000)["v"]
    assert len(pieces) == 2
    chunks = []
    for p in pieces:
        flat = x.reshape(-1)[p.offset : p.offset + p.size]
        chunks += [codec.WireChunk.of(p.stored_name, flat, s, s + 999) for s in range(0, p.size, 999)]
    gather = rq.Gather({"v": pieces}, rq.ArrayPool(min_bytes=1).take)
    for c in reversed(chunks):
        gather.add(c)
    gather.add_versions({pieces[0].stored_name: 3, pieces[1].stored_name: 2})
    out = gather.result()
    np.testing.assert_array_equal(out["v"], x)
    assert not out["v"].flags.writeable
    assert gather.versions == {"v": 2}


def test_gather_keeps_a_whole_single_chunk_as_a_view() -> None:
    x = _big(100)
    pieces = plan({"v": (x.shape, x.dtype)}, num_shards=2, partition_bytes=1 << 20)
    wire = codec.WireMessage(ps_pb2.PullResponse(), "values", [codec.WireChunk.of("v", x)]).serialize()
    gather = rq.Gather(pieces)
    gather.add(ps_pb2.PullResponse.FromString(wire).values[0])
    assert np.shares_memory(gather.result()["v"], gather.result()["v"])
    np.testing.assert_array_equal(gather.result()["v"], x)


def test_gather_rejects_missing_extra_and_mismatched_chunks() -> None:
    x = _big(100)
    pieces = plan({"v": (x.shape, x.dtype)}, num_shards=1, partition_bytes=1 << 20)
    gather = rq.Gather(pieces)
    with pytest.raises(codec.CodecError, match="not requested"):
        gather.add(codec.WireChunk.of("w", x))
    with pytest.raises(codec.CodecError, match="expected float32"):
        gather.add(codec.WireChunk.of("v", x.astype(np.float64)))
    gather.add(codec.WireChunk.of("v", x, 0, 50))
    with pytest.raises(codec.CodecError, match="received 50 of 100"):
        gather.result()
    with pytest.raises(Exception, match="not returned"):
        rq.Gather(pieces).result()


def test_gather_rejects_a_duplicated_chunk_even_when_the_count_adds_up() -> None:
    # [0, 50) twice and [50, 100) never: 100 elements arrive, half of them uninitialised memory.
    x = _big(100)
    pieces = plan({"v": (x.shape, x.dtype)}, num_shards=1, partition_bytes=1 << 20)
    gather = rq.Gather(pieces)
    gather.add(codec.WireChunk.of("v", x, 0, 50))
    gather.add(codec.WireChunk.of("v", x, 0, 50))
    with pytest.raises(codec.CodecError, match=r"elements \[50, 100\) were never received|received twice"):
        gather.result()


def test_gather_restart_forgets_a_retried_shards_chunks() -> None:
    x = _big(100)
    pieces = plan({"v": (x.shape, x.dtype)}, num_shards=1, partition_bytes=1 << 20)
    gather = rq.Gather(pieces)
    gather.add(codec.WireChunk.of("v", x, 0, 60))
    gather.restart(pieces["v"])
    gather.add(codec.WireChunk.of("v", x, 0, 60))
    gather.add(codec.WireChunk.of("v", x, 60))
    np.testing.assert_array_equal(gather.result()["v"], x)


def test_array_pool_reuses_an_array_only_after_every_reference_is_gone() -> None:
    pool = rq.ArrayPool(min_bytes=1)
    a = pool.take(1000, np.dtype(np.float32))
    view = a.reshape(10, 100)[2:]
    del a
    b = pool.take(1000, np.dtype(np.float32))
    assert not np.shares_memory(b, view)  # the view still holds the first array
    base = view.base
    del view, b
    assert sys.getrefcount(base) > 2
    del base
    c = pool.take(1000, np.dtype(np.float32))
    assert c.flags.writeable
    assert any(c is held for held in pool._free[(np.dtype(np.float32).str, 1000)])


def test_array_pool_does_not_pool_small_arrays() -> None:
    pool = rq.ArrayPool(min_bytes=1 << 20)
    pool.take(10, np.dtype(np.float32))
    assert not pool._free
