"""Transport security shared by every service (psserver and the collective ring): TLS and token auth.

Server side::

    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(read_token_file(path))])
    port = add_port(server, "127.0.0.1:0", server_credentials(cert, key, client_ca))

Client side: ``channel_credentials(ca, cert, key)`` for ``grpc.aio.secure_channel``
and ``auth_metadata(token)`` on every call.

Token auth: every RPC must carry the metadata ``authorization: Bearer <token>``;
the comparison is constant-time (``hmac.compare_digest``). A missing or wrong
token is ``UNAUTHENTICATED`` before the request is even deserialised. Only the
standard health checks (``grpc.health.v1.Health``) stay open, so that probes
(Kubernetes, load balancers) need no secret; they reveal nothing but
SERVING/NOT_SERVING. Reflection needs the token like everything else.

TLS: ``--tls-cert``/``--tls-key`` (PEM) serve TLS; ``--tls-client-ca`` also
requires client certificates signed by that CA (mutual TLS).

This module imports only grpc, so psclient, psserver and the ring all use it.
"""

from __future__ import annotations

import errno
import hmac
import inspect
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

AUTH_HEADER = "authorization"
OPEN_METHODS: frozenset[str] = frozenset(
    {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List"}
)
_MAX_TOKEN_BYTES = 4096


def read_token_file(path: str | os.PathLike[str]) -> str:
    """Reads a shared auth token: the file's content without surrounding whitespace.

    Raises:
        ValueError: the file cannot be read, is empty, too long, or not printable ASCII.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_TOKEN_BYTES + 1)
    except OSError as err:
        raise ValueError(f"cannot read auth token file {path}: {err.strerror or err}") from err
    token = raw.strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    if len(token) > _MAX_TOKEN_BYTES:
        raise ValueError(f"auth token in {path} is longer than {_MAX_TOKEN_BYTES} bytes")
    if not all(0x21 <= b <= 0x7E for b in token):
        raise ValueError(f"auth token in {path} must be printable ASCII without spaces")
    return token.decode("ascii")


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (empty without one)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def _read(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"cannot read {what} {path}: {err.strerror or err}") from err


def server_credentials(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], client_ca: str | os.PathLike[str] | None = None
) -> grpc.ServerCredentials:
    """TLS credentials of a server; with ``client_ca``, clients must present a certificate it signed.

    Raises:
        ValueError: a file cannot be read.
    """
    pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
    ca = _read(client_ca, "TLS client CA")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(
    ca: str | os.PathLike[str] | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS credentials of a client: trust ``ca`` (default: system roots); ``cert``/``key`` for mutual TLS.

    Raises:
        ValueError: a file cannot be read, or only one of ``cert``/``key`` is given.
    """
    if (cert is None) != (key is None):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "TLS CA"),
        private_key=_read(key, "TLS key"),
        certificate_chain=_read(cert, "TLS certificate"),
    )


class BindError(OSError):
    """An address a server could not bind; the message says why ("address already in use")."""


def add_port(server: grpc.aio.Server, bind: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds ``bind`` (TLS when ``credentials`` are given); returns the port.

    Raises:
        BindError: the address could not be bound, e.g.
            ``cannot bind 127.0.0.1:50051: address already in use``.
    """
    if not bind.endswith(":0") and errno_of_bind(bind) == errno.EADDRINUSE:
        # Checked first: gRPC core would also log its own error line to stderr.
        raise BindError(errno.EADDRINUSE, f"cannot bind {bind}: address already in use")
    try:
        if credentials is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, credentials)
    except RuntimeError:  # grpc's "Failed to bind to address ...", without the reason
        port = 0
    if port == 0:
        raise BindError(errno_of_bind(bind), f"cannot bind {bind}: {why_not_bindable(bind)}")
    return port


def why_not_bindable(bind: str) -> str:
    """Why ``HOST:PORT`` cannot be bound, found by binding a plain TCP socket there (gRPC does not say)."""
    code = errno_of_bind(bind)
    if code == errno.EADDRINUSE:
        return "address already in use"
    return os.strerror(code).lower() if code else "gRPC refused it (GRPC_VERBOSITY=debug says why)"


def errno_of_bind(bind: str) -> int:
    """The errno of binding a plain TCP socket to ``HOST:PORT`` (0: it binds)."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError):
        return errno.EADDRNOTAVAIL
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as err:
            return err.errno or 0
    return 0


def _denied(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that rejects the call without reading its request."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # unknown method: do not tell an unauthenticated caller what exists
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    # No request_deserializer: the rejected payload stays raw bytes, never parsed.
    return make(deny, request_deserializer=None, response_serializer=handler.response_serializer)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call without ``authorization: Bearer <token>`` (UNAUTHENTICATED).

    Args:
        token: the shared secret.
        open_methods: full method names that need no token (default: health checks).
    """

    def __init__(self, token: str, *, open_methods: Iterable[str] = OPEN_METHODS) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._open = frozenset(open_methods)

    def authorized(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """True if ``metadata`` carries the right token (constant-time comparison)."""
        ok = False
        for key, value in metadata or ():
            if key.lower() == AUTH_HEADER:
                got = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
                ok |= hmac.compare_digest(got, self._expected)
        return ok

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method in self._open or self.authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        has = any(k.lower() == AUTH_HEADER for k, _ in handler_call_details.invocation_metadata or ())
        reason = (
            "wrong auth token" if has else "missing auth token (metadata 'authorization: Bearer <token>')"
        )
        return _denied(handler, f"{reason} for {method}")


class HandlerWrappingInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that wraps each method's handler once and reuses the wrapper on every call.

    Wrapping per call costs tens of microseconds (new closures and handler
    objects); a method's registered handler never changes, so its wrapper is
    built on the first call and kept. Subclasses implement ``wrap``.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """Returns the handler to serve ``method`` with (``handler`` itself to leave it alone)."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method or ""
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


class MalformedRequestInterceptor(HandlerWrappingInterceptor):
    """Answers INVALID_ARGUMENT to request bytes that do not parse as the method's message.

    Without it, grpc.aio reports a parse failure as UNKNOWN and logs a traceback
    per request. The handler receives raw bytes and parses them itself, so a
    malformed message never reaches the servicer. Put it after the auth
    interceptor (an unauthenticated request is never parsed at all).
    """

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.request_deserializer is None:
            return handler
        return _parsing(handler, method)


def _parsing(handler: Any, method: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    async def one(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except Exception as err:  # protobuf DecodeError and friends
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {err}")

    async def many(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for raw in raws:
            yield await one(raw, context)

    if handler.request_streaming and handler.response_streaming:
        behavior = handler.stream_stream
        field = "stream_stream"

        async def wrapped(raws: Any, context: grpc.aio.ServicerContext) -> Any:
            async for resp in behavior(many(raws, context), context):
                yield resp

    elif handler.request_streaming:
        behavior = handler.stream_unary
        field = "stream_unary"

        async def wrapped(raws: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
            return await behavior(many(raws, context), context)

    elif handler.response_streaming:
        behavior = handler.unary_stream
        field = "unary_stream"
        if not inspect.isasyncgenfunction(behavior):
            return handler  # a writer-style handler: leave it as it is

        async def wrapped(raw: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
            request = await one(raw, context)
            async for resp in behavior(request, context):
                yield resp

    else:
        behavior = handler.unary_unary
        field = "unary_unary"

        async def wrapped(raw: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
            return await behavior(await one(raw, context), context)

    if handler.request_streaming and handler.response_streaming and not inspect.isasyncgenfunction(behavior):
        return handler
    make = getattr(grpc, f"{field}_rpc_method_handler")  # the same kind, by the public API
    return make(wrapped, request_deserializer=None, response_serializer=handler.response_serializer)
