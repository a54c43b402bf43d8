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
on fresh connections. No TLS: :class:`RingConfig` refuses ``transport="tcp"``
with TLS settings.

Not thread-safe: used from the ring's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from typing import Any, Final

import grpc

from psclient.collective._frame import HEADER_BYTES, FrameError, FrameHeader, decode_header
from psclient.errors import InvalidArgumentError, PSError, UnavailableError, error_class
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


class DataListener:
    """The data port of a rank: hands out nonces and accepts the previous rank's connection.

    Args:
        host: the host of this rank's Collective address (the port is ephemeral).
        rank: this rank.
        prev_rank: the only rank allowed to connect.
        prev_address: its Collective address (for messages).
        max_payload: the largest frame payload in bytes (sizes the receive buffer).
    """

    def __init__(self, host: str, *, rank: int, prev_rank: int, prev_address: str, max_payload: int) -> None:
        self._host = host
        self._rank = rank
        self._prev = prev_rank
        self._prev_address = prev_address
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._nonces: list[bytes] = []
        self._conn: socket.socket | None = None
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

    async def _handshake(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            _tune(conn)
            hello = bytearray(_HELLO.size)
            async with asyncio.timeout(_HANDSHAKE_S):
                await _recv_exactly(conn, memoryview(hello))
            magic, nonce, rank = _HELLO.unpack(hello)
            if magic != _MAGIC or nonce not in self._nonces or rank != self._prev:
                logger.warning("ring rank %d: refused a data connection without a valid nonce", self._rank)
                conn.close()
                return
            self._nonces.remove(nonce)
            await loop.sock_sendall(conn, _ACK)
        except (OSError, TimeoutError) as err:
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

    async def connection(self) -> socket.socket:
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

        Raises:
            UnavailableError: the connection broke or closed.
            InvalidArgumentError: the bytes are not a frame, or one larger than the buffer.
        """
        conn = await self.connection()
        view = self._view
        try:
            while True:
                await _recv_exactly(conn, view[:HEADER_BYTES])
                header, n = decode_header(view)
                if n > len(view) - HEADER_BYTES:
                    raise FrameError(
                        f"frame of {n} payload bytes exceeds the {len(view) - HEADER_BYTES}-byte buffer"
                    )
                target = dest(header, n) if dest is not None and header.seq == seq else None
                if target is not None:
                    await _recv_exactly(conn, target)
                    return header, None
                await _recv_exactly(conn, view[HEADER_BYTES : HEADER_BYTES + n])
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

    def drop(self, conn: socket.socket | None) -> None:
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
    ) -> None:
        self._method = method
        self._metadata = metadata
        self._host = host.strip("[]")
        self._rank = rank
        self._world = world
        self._next = next_rank
        self._next_address = next_address
        self._sock: socket.socket | None = None

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
        try:
            _tune(sock)
            await loop.sock_connect(sock, (self._host, reply.port))
            await loop.sock_sendall(sock, _HELLO.pack(_MAGIC, reply.nonce, self._rank))
            ack = bytearray(1)
            await _recv_exactly(sock, memoryview(ack))
            if bytes(ack) != _ACK:
                raise ConnectionRefusedError("bad acknowledgement")
        except OSError as err:
            sock.close()
            raise UnavailableError(
                f"cannot open the data connection to rank {self._next} port {reply.port}: {err}",
                address=self._next_address,
            ) from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    async def send(self, head: bytes, payload: memoryview) -> None:
        """Sends a frame: the header, then the payload straight from its buffer.

        Raises:
            UnavailableError: the connection broke.
        """
        sock = self._sock
        if sock is None:
            raise UnavailableError(f"no data connection to rank {self._next}", address=self._next_address)
        loop = asyncio.get_running_loop()
        try:
            if len(payload) <= 4096:
                await loop.sock_sendall(sock, head + bytes(payload))
            else:
                await loop.sock_sendall(sock, head)
                await loop.sock_sendall(sock, payload)
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
