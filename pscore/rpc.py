"""Stubs and server handlers built from the generated service descriptors, with ``codec`` framing.

One place decides how every message of a service travels: a message with a
repeated ``TensorChunk`` field is parsed by ``codec.parse`` (tensor bytes kept
as zero-copy views), any other with its protobuf class; everything is
serialized by ``codec.serialize`` (so a sender may pass a ``codec.WireMessage``).
No method path or message type is written by hand: adding an RPC to the
``.proto`` file is enough for both sides.

Client::

    stub = rpc.Stub(channel)                 # psproto.v1.ParameterServer
    response = await stub.Pull(ps_pb2.PullRequest(names=["w"]))

Server::

    handlers = rpc.method_handlers(servicer)  # name -> grpc.RpcMethodHandler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(rpc.service_name(), handlers),))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory

from pscore import codec
from psproto.v1 import ps_pb2

PARAMETER_SERVER = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
_TENSOR_CHUNK = ps_pb2.TensorChunk.DESCRIPTOR.full_name


@dataclass(frozen=True)
class Method:
    """One RPC of a service, as its descriptor declares it."""

    name: str
    path: str  # "/package.Service/Method"
    request: type
    response: type
    client_streaming: bool
    server_streaming: bool

    @property
    def kind(self) -> str:
        """``unary_unary``, ``unary_stream``, ``stream_unary`` or ``stream_stream``."""
        sides = (
            "stream" if self.client_streaming else "unary",
            "stream" if self.server_streaming else "unary",
        )
        return "_".join(sides)


def service_name(service: _descriptor.ServiceDescriptor = PARAMETER_SERVER) -> str:
    """The service's full name, as gRPC routes it (``psproto.v1.ParameterServer``)."""
    return service.full_name


def methods(service: _descriptor.ServiceDescriptor = PARAMETER_SERVER) -> list[Method]:
    """Every method of ``service``, in declaration order."""
    return [
        Method(
            m.name,
            f"/{service.full_name}/{m.name}",
            message_factory.GetMessageClass(m.input_type),
            message_factory.GetMessageClass(m.output_type),
            m.client_streaming,
            m.server_streaming,
        )
        for m in service.methods
    ]


def tensor_field(message: type) -> str | None:
    """The name of ``message``'s repeated ``TensorChunk`` field (None when it has none)."""
    for field in message.DESCRIPTOR.fields:
        if field.message_type is not None and field.message_type.full_name == _TENSOR_CHUNK:
            return field.name
    return None


def deserializer(message: type) -> Callable[[bytes], Any]:
    """The parser for ``message``: ``codec.parse`` when it carries tensors, else its protobuf class.

    Either raises on bytes that do not parse (``codec.CodecError`` or protobuf's ``DecodeError``).
    """
    field = tensor_field(message)
    if field is None:
        return message.FromString
    return functools.partial(codec.parse, message, field=field)


class Stub:
    """A client stub with one multi-callable attribute per method of ``service`` (``stub.Pull(...)``).

    Same calling convention as the generated stub (``timeout=``, ``metadata=``,
    ``wait_for_ready=``), with ``codec`` framing: requests may be
    ``codec.WireMessage`` s and tensor-carrying responses arrive as zero-copy views.
    """

    def __init__(self, channel: grpc.aio.Channel, service: _descriptor.ServiceDescriptor = PARAMETER_SERVER):
        for m in methods(service):
            make = getattr(channel, m.kind)
            setattr(
                self,
                m.name,
                make(
                    m.path, request_serializer=codec.serialize, response_deserializer=deserializer(m.response)
                ),
            )

    def __getattr__(self, name: str) -> Any:  # only reached for a method the service does not have
        raise AttributeError(f"the service has no method {name!r}")


_MAKERS: Mapping[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def method_handlers(
    servicer: object,
    service: _descriptor.ServiceDescriptor = PARAMETER_SERVER,
    *,
    raw_requests: Collection[str] = (),
) -> dict[str, grpc.RpcMethodHandler]:
    """A handler for every method of ``service``, calling ``servicer.<Method>(request, context)``.

    Requests are parsed with ``deserializer`` (a handler that parses bytes itself
    is named in ``raw_requests`` and receives them unparsed); responses are
    serialized with ``codec.serialize``. Bytes that do not parse are answered
    INVALID_ARGUMENT by ``pscore.security.MalformedRequestInterceptor``.
    """
    handlers = {}
    for m in methods(service):
        parse = None if m.name in raw_requests else deserializer(m.request)
        handlers[m.name] = _MAKERS[m.kind](
            getattr(servicer, m.name), request_deserializer=parse, response_serializer=codec.serialize
        )
    return handlers
