"""The raw-TCP data plane of a ring (transport ``"tcp"``): one plain socket per link, no gRPC copies.

gRPC stays the control plane: a rank asks the next rank for its data port with
the authenticated ``Collective.DataPort`` call, which hands out a one-time
nonce; the data plane accepts only a connection that presents such a nonce
(so the auth token guards it too). Frames on the socket are the very bytes of
the gRPC path's ``Frame`` messages (64-byte header, then the payload), but the
payload is sent straight from the numpy buffer (``sock_sendall`` of a
memoryview) and received into a preallocated buffer (``sock_recv_into``): no
Python ``bytes`` per frame, no HTTP/2 framing.

The receiver reads frames when an operation asks for them (no mailboxes): TCP's
own flow control holds the previous rank back until then. After a failed
operation both sockets of this rank are closed, and the next operation starts
on fresh connections.

With TLS settings the data connections are TLS too (:class:`TlsConn`: the
standard library's ``ssl`` over memory BIOs, so the socket stays on the event
loop's ``sock_*`` calls): the connecting rank verifies the next rank's
certificate against ``tls_ca`` and presents its own; with ``tls_client_ca`` the
accepting rank requires it. The nonce exchange then runs inside TLS.

Not thread-safe: used from the ring's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import struct
from typing import Any, Final

import grpc

from psclient.collective._frame import HEADER_BYTES, FrameError, FrameHeader, decode_header
from pscore.errors import InvalidArgumentError, PSError, UnavailableError, error_class
from psproto.v1 import collective_pb2 as _pb

logger = logging.getLogger(__name__)

NONCE_BYTES: Final[int] = 16
_MAGIC: Final[bytes] = b"PSRING1\n"
_HELLO: Final = struct.Struct(f"<8s{NONCE_BYTES}sI")  # magic, nonce, rank
_ACK: Final[bytes] = b"\x01"
_HANDSHAKE_S: Final[float] = 10.0
_MAX_NONCES: Final[int] = 64


def _tune(sock: socket.socket) -> None:
    # Socket buffer sizes stay with the kernel's autotuning (setting them turns it off).
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from ``sock``.

    Raises:
        ConnectionError: the peer closed the connection first.
    """
    loop = asyncio.get_running_loop()
    got, n = 0, len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionResetError("connection closed by the peer")
        got += k


_TLS_RECORD_BYTES: Final[int] = 256 << 10  # plaintext per SSLObject.write; ciphertext read per recv


class Conn:
    """A plain data connection: the socket, driven by the event loop's ``sock_*`` calls."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def handshake(self) -> None:
        """Nothing to negotiate on a plain connection."""

    async def sendall(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def recv_exactly(self, view: memoryview) -> None:
        await _recv_exactly(self.sock, view)

    def close(self) -> None:
        self.sock.close()


class TlsConn(Conn):
    """A TLS data connection: ``ssl.SSLObject`` over memory BIOs on a non-blocking socket.

    Args:
        sock: the connected socket.
        context: the side's ``ssl.SSLContext``.
        server_side: True on the accepting rank.
        server_hostname: the name the peer's certificate must carry (connecting side).
    """

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        super().__init__(sock)
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        self._rbuf = memoryview(bytearray(_TLS_RECORD_BYTES))

    async def handshake(self) -> None:
        """Runs the TLS handshake. Raises: ssl.SSLError (refused), OSError."""
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
        await self._flush()

    async def _flush(self) -> None:
        data = self._out.read()
        if data:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def _fill(self) -> None:
        n = await asyncio.get_running_loop().sock_recv_into(self.sock, self._rbuf)
        if n == 0:
            raise ConnectionResetError("connection closed by the peer")
        self._in.write(self._rbuf[:n])

    async def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _TLS_RECORD_BYTES):
            self._tls.write(view[start : start + _TLS_RECORD_BYTES])
            await self._flush()

    async def recv_exactly(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            try:
                k = self._tls.read(n - got, view[got:])
            except ssl.SSLWantReadError:
                await self._fill()
                continue
            except ssl.SSLZeroReturnError:
                k = 0
            if k == 0:
                raise ConnectionResetError("connection closed by the peer")
            got += k


def server_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The accepting side's TLS context: this rank's certificate; ``client_ca`` requires client certs."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """The connecting side's TLS context: trust ``ca`` (default: system roots), present ``cert``."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert and key:
        context.load_cert_chain(cert, key)
    return context


class DataListener:
    """The data port of a rank: hands out nonces and accepts the previous rank's connection.

    Args:
        host: the host of this rank's Collective address (the port is ephemeral).
        rank: this rank.
        prev_rank: the only rank allowed to connect.
        prev_address: its Collective address (for messages).
        max_payload: the largest frame payload in bytes (sizes the receive buffer).
        tls: the accepting side's TLS context (``server_context``), or None for plaintext.
    """

    def __init__(
        self,
        host: str,
        *,
        rank: int,
        prev_rank: int,
        prev_address: str,
        max_payload: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._host = host
        self._tls = tls
        self._rank = rank
        self._prev = prev_rank
        self._prev_address = prev_address
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._nonces: list[bytes] = []
        self._conn: Conn | None = None
        self._changed = asyncio.Event()
        self._buf = bytearray(HEADER_BYTES + max_payload + 64)
        self._view = memoryview(self._buf)
        self._closed = False

    @property
    def port(self) -> int:
        """The bound data port."""
        assert self._sock is not None
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        """Binds an ephemeral port on the rank's host and starts accepting.

        Raises:
            OSError: the host cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self._host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self._host.strip("[]"), 0))
            sock.listen(8)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._accept_task = asyncio.create_task(self._accept_loop(), name="ring data accept")

    def issue_nonce(self) -> bytes:
        """A fresh one-time nonce for one connection (the oldest unused ones expire)."""
        nonce = os.urandom(NONCE_BYTES)
        self._nonces.append(nonce)
        del self._nonces[:-_MAX_NONCES]
        return nonce

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as err:  # pragma: no cover - e.g. out of file descriptors
                logger.warning("ring rank %d: data port accept failed: %s", self._rank, err)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._handshake(conn), name="ring data handshake")
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, sock: socket.socket) -> None:
        conn: Conn = Conn(sock)
        try:
            _tune(sock)
            if self._tls is not None:
                conn = TlsConn(sock, self._tls, server_side=True)
            hello = bytearray(_HELLO.size)
            async with asyncio.timeout(_HANDSHAKE_S):
                await conn.handshake()
                await conn.recv_exactly(memoryview(hello))
            magic, nonce, rank = _HELLO.unpack(hello)
            if magic != _MAGIC or nonce not in self._nonces or rank != self._prev:
                logger.warning("ring rank %d: refused a data connection without a valid nonce", self._rank)
                conn.close()
                return
            self._nonces.remove(nonce)
            await conn.sendall(_ACK)
        except (OSError, TimeoutError) as err:  # ssl.SSLError is an OSError
            logger.debug("ring rank %d: data handshake failed: %s", self._rank, err)
            conn.close()
            return
        if self._closed:
            conn.close()
            return
        old, self._conn = self._conn, conn
        if old is not None:
            old.close()
        self._changed.set()

    async def connection(self) -> Conn:
        """The current connection from the previous rank (waits for one).

        Raises:
            UnavailableError: the ring is closed.
        """
        while self._conn is None:
            if self._closed:
                raise UnavailableError(f"rank {self._rank}: the ring is closed")
            self._changed.clear()
            await self._changed.wait()
        return self._conn

    async def recv(self, seq: int, dest: Any = None) -> tuple[FrameHeader, memoryview | None]:
        """Reads the next frame of operation ``seq`` (older operations' frames are skipped).

        Returns the header and a view of the whole frame (header and payload) in a
        buffer that the next call reuses. ``dest(header, payload_bytes)`` may return
        a writable memoryview of exactly the payload's length to receive the payload
        straight into; the returned frame view is then None.

        A connection that ends between frames is replaced by the previous rank's next
        one (waited for: the caller bounds the wait with the operation's deadline).

        Raises:
            UnavailableError: the connection broke inside a frame, or the ring closed.
            InvalidArgumentError: the bytes are not a frame, or one larger than the buffer.
        """
        conn = await self.connection()
        view = self._view
        try:
            while True:
                try:
                    await conn.recv_exactly(view[:HEADER_BYTES])
                except OSError:
                    # It ended between frames: the previous rank closes its connection after a failed
                    # operation and opens a new one for its next; wait for that one. The caller's
                    # deadline bounds the wait (a dead previous rank is then a deadline error naming it).
                    self.drop(conn)
                    conn = await self.connection()
                    continue
                header, n = decode_header(view)
                if n > len(view) - HEADER_BYTES:
                    raise FrameError(
                        f"frame of {n} payload bytes exceeds the {len(view) - HEADER_BYTES}-byte buffer"
                    )
                target = dest(header, n) if dest is not None and header.seq == seq else None
                if target is not None:
                    await conn.recv_exactly(target)
                    return header, None
                await conn.recv_exactly(view[HEADER_BYTES : HEADER_BYTES + n])
                if header.seq >= seq:
                    return header, view[: HEADER_BYTES + n]
        except FrameError as err:
            self.drop(conn)
            raise InvalidArgumentError(
                f"rank {self._rank}: bad frame from rank {self._prev}: {err}", address=self._prev_address
            ) from None
        except OSError as err:
            self.drop(conn)
            raise UnavailableError(
                f"the connection from rank {self._prev} broke (peer died, closed or aborted): {err}",
                address=self._prev_address,
            ) from None

    def drop(self, conn: Conn | None) -> None:
        """Closes ``conn`` if it is still the current connection (after a failure)."""
        if conn is not None and conn is self._conn:
            self._conn = None
            conn.close()

    async def close(self) -> None:
        """Stops accepting and closes every socket (idempotent)."""
        self._closed = True
        self._changed.set()
        tasks = [t for t in (self._accept_task, *self._handshakes) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._sock is not None:
            self._sock.close()


class DataLink:
    """The connection to the next rank's data port.

    Args:
        method: the channel's ``unary_unary`` multi-callable for ``DataPort``.
        metadata: call metadata (the auth token), or None.
        host: the next rank's host.
        rank, world: this rank and the world size.
        next_rank, next_address: the next rank and its Collective address (for messages).
        tls: the connecting side's TLS context (``client_context``), or None for plaintext.
    """

    def __init__(
        self,
        method: Any,
        metadata: Any,
        host: str,
        *,
        rank: int,
        world: int,
        next_rank: int,
        next_address: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._tls = tls
        self._method = method
        self._metadata = metadata
        self._host = host.strip("[]")
        self._rank = rank
        self._world = world
        self._next = next_rank
        self._next_address = next_address
        self._sock: Conn | None = None

    @property
    def connected(self) -> bool:
        """Whether a connection is open."""
        return self._sock is not None

    async def connect(self, deadline: float) -> None:
        """Opens the connection unless open: ``DataPort`` call, connect, nonce, wait for the ack.

        Raises:
            PSError: the call failed (its status as the error class), or the connection did.
        """
        if self._sock is not None:
            return
        loop = asyncio.get_running_loop()
        timeout = max(0.001, deadline - loop.time())
        try:
            reply = await self._method(
                _pb.DataPortRequest(rank=self._rank, world=self._world),
                timeout=timeout,
                wait_for_ready=True,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as err:
            raise error_class(err.code())(
                f"rank {self._next} refused the data port request: {err.code().name}: {err.details()}",
                address=self._next_address,
            ) from None
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        conn: Conn = Conn(sock)
        try:
            _tune(sock)
            await loop.sock_connect(sock, (self._host, reply.port))
            if self._tls is not None:
                conn = TlsConn(sock, self._tls, server_side=False, server_hostname=self._host)
                async with asyncio.timeout(max(0.001, deadline - loop.time())):
                    await conn.handshake()
            await conn.sendall(_HELLO.pack(_MAGIC, reply.nonce, self._rank))
            ack = bytearray(1)
            await conn.recv_exactly(memoryview(ack))
            if bytes(ack) != _ACK:
                raise ConnectionRefusedError("bad acknowledgement")
        except (OSError, TimeoutError) as err:  # ssl.SSLError is an OSError
            conn.close()
            raise UnavailableError(
                f"cannot open the data connection to rank {self._next} port {reply.port}: {err}",
                address=self._next_address,
            ) from None
        except BaseException:
            conn.close()
            raise
        self._sock = conn

    async def send(self, head: bytes, payload: memoryview) -> None:
        """Sends a frame: the header, then the payload straight from its buffer.

        Raises:
            UnavailableError: the connection broke.
        """
        conn = self._sock
        if conn is None:
            raise UnavailableError(f"no data connection to rank {self._next}", address=self._next_address)
        try:
            if len(payload) <= 4096:
                await conn.sendall(head + bytes(payload))
            else:
                await conn.sendall(head)
                await conn.sendall(payload)
        except OSError as err:
            raise UnavailableError(
                f"the data connection to rank {self._next} broke: {type(err).__name__}: {err}",
                address=self._next_address,
            ) from None

    def reset(self) -> None:
        """Closes the connection (after a failure); the next :meth:`connect` opens a new one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def tcp_error(err: PSError, what: str, method: str) -> PSError:
    """``err`` with ``what`` (operation, rank) in front of its message and the method set."""
    return type(err)(f"{what}: {err.details}", method=method, address=err.address)
