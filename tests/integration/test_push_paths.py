"""Integration: every gRPC way to push (Push, PushSession, PushStream) hands the shard's one push routine
(``ShardService.push``) the same request header, every ``PushRequest`` field included.

The header is filled from ``PushRequest``'s descriptor, so a field added to the
proto is covered here without a change: a path that copies the header field by
field, and forgets the new one, fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S
from google.protobuf.descriptor import FieldDescriptor

from pscore import codec
from pscore.errors import status_number
from psproto.v1 import ps_pb2, ps_pb2_grpc
from psserver.config import ServerConfig
from psserver.server import Shard, start

pytestmark = pytest.mark.timeout(60)


def _value(field: Any, n: int) -> Any:
    """A value of ``field``'s type that is not its default (``n`` tells repeated entries apart)."""
    if field.message_type is not None:  # TensorChunk (lookup_ids): ids of a piece no shard holds
        return codec.encode(f"{field.name}/{n}", np.arange(n + 2, dtype=np.int64))
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{n}"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return f"{field.name}-{n}".encode()
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return 20.5 + n  # timeout_s: long enough for the call
    if field.type == FieldDescriptor.TYPE_ENUM:
        return 1
    return 3 + n  # every integer type


def _header() -> ps_pb2.PushRequest:
    """A push header with every field but the gradients set (repeated ones twice)."""
    header = ps_pb2.PushRequest()
    for field in ps_pb2.PushRequest.DESCRIPTOR.fields:
        if field.name == "grads":
            continue
        if field.is_repeated:
            for n in range(2):
                value = _value(field, n)
                target = getattr(header, field.name)
                target.add().CopyFrom(value) if field.message_type is not None else target.append(value)
        elif field.message_type is not None:
            getattr(header, field.name).CopyFrom(_value(field, 0))
        else:
            setattr(header, field.name, _value(field, 0))
    return header


def _piece(name: str, value: np.ndarray, start: int, stop: int) -> ps_pb2.TensorChunk:
    """Elements ``start:stop`` of flat ``value`` as a chunk of the whole tensor."""
    chunk = codec.encode(name, value)
    chunk.offset, chunk.data = start, value.reshape(-1)[start:stop].tobytes()
    return chunk


def _without_grads(request: Any) -> ps_pb2.PushRequest:
    header = ps_pb2.PushRequest()
    header.CopyFrom(request.header if isinstance(request, codec.WireMessage) else request)
    header.ClearField("grads")
    return header


@pytest.fixture
async def shard() -> AsyncIterator[Shard]:
    shard = await start(ServerConfig(shard=0, port=0, data_port=None))
    try:
        yield shard
    finally:
        await shard.stop(0)


@pytest.mark.parametrize("grad_bytes", [64, 256 << 10], ids=["small", "large"])  # large: a codec.WireMessage
async def test_push_paths_hand_the_push_routine_every_header_field(
    shard: Shard, monkeypatch: pytest.MonkeyPatch, grad_bytes: int
) -> None:
    header = _header()
    set_fields = {f.name for f, _ in header.ListFields()}
    assert set_fields == {f.name for f in ps_pb2.PushRequest.DESCRIPTOR.fields} - {"grads"}
    grad = np.ones(grad_bytes // 4, np.float32)
    request = ps_pb2.PushRequest()
    request.CopyFrom(header)
    request.grads.append(codec.encode("v", grad))

    seen: list[ps_pb2.PushRequest] = []
    assert shard.service is not None
    routine = shard.service.push

    async def recorded(request: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(_without_grads(request))
        return await routine(request, *args, **kwargs)

    monkeypatch.setattr(shard.service, "push", recorded)

    async with grpc.aio.insecure_channel(shard.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Push(request, timeout=CALL_TIMEOUT_S)
        (session,) = [r async for r in stub.PushSession(iter([request]), timeout=CALL_TIMEOUT_S)]
        # The header rides on the first message with half the gradient, the rest on a second one.
        first = ps_pb2.PushRequest()
        first.CopyFrom(header)
        first.grads.append(_piece("v", grad, 0, grad.size // 2))
        messages = [first, ps_pb2.PushRequest(grads=[_piece("v", grad, grad.size // 2, grad.size)])]
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            [r async for r in stub.PushStream(iter(messages), timeout=CALL_TIMEOUT_S)]

    assert len(seen) == 3
    for path, got in zip(["Push", "PushSession", "PushStream"], seen, strict=True):
        missing = set_fields - {f.name for f, _ in got.ListFields()}
        assert not missing, f"{path} dropped {sorted(missing)}"
        assert got == header, f"{path} changed the header:\n{got}\nsent:\n{header}"
    # The lookup names a piece the shard does not hold: every path fails the same way, nothing applied.
    assert unary.value.code() == streamed.value.code() == grpc.StatusCode.NOT_FOUND
    assert session.code == status_number(grpc.StatusCode.NOT_FOUND)
    assert shard.store.pushes == 0
