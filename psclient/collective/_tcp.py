"""The raw-TCP transport of a ring (``transport="tcp"``): one plain socket per link, no gRPC copies.

gRPC stays the control plane: a rank asks the next rank for its data port with
the authenticated ``Collective.DataPort`` call, which hands out a one-time
nonce; the data port (``pscore.transport.DataPort``) accepts only a connection
that presents such a nonce and the previous rank's number (so the auth token
guards it too). Frames on the socket are the very bytes of the gRPC path's
``Frame`` messages (64-byte header, then the payload), but the payload is sent
straight from the numpy buffer and received into a preallocated buffer, or
straight into the operation's array: no Python ``bytes`` per frame, no HTTP/2
framing.

The receiver reads frames when an operation asks for them (no mailboxes): TCP's
own flow control holds the previous rank back until then. After a failed
operation both sockets of this rank are closed, and the next operation starts
on fresh connections.

With TLS settings the data connections are TLS too (``pscore.transport.TlsConn``):
the connecting rank verifies the next rank's certificate against ``tls_ca`` and
presents its own; with ``tls_client_ca`` the accepting rank requires it. The
nonce exchange then runs inside TLS.

Not thread-safe: used from the ring's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Sequence
from typing import Any, Final

import grpc

from psclient.collective._frame import HEADER_BYTES, FrameError, FrameHeader, decode_header, encode_header
from psclient.collective._transport import RingTransport
from pscore import transport
from pscore.errors import InvalidArgumentError, PSError, UnavailableError, error_class
from pscore.transport import Buffer, Conn, Into
from psproto.v1 import collective_pb2 as _pb

logger = logging.getLogger(__name__)

MAGIC: Final[bytes] = b"PSRING1\n"
_ABORT_WRITE_S: Final[float] = 0.2
_SMALL_FRAME: Final[int] = 4096  # a payload up to this is sent in one write with its header


class DataListener:
    """The data port of a rank: hands out nonces and keeps the previous rank's current connection.

    Args:
        host: the host of this rank's Collective address (the port is ephemeral).
        rank: this rank.
        prev_rank: the only rank allowed to connect.
        prev_address: its Collective address (for messages).
        max_payload: the largest frame payload in bytes (sizes the receive buffer).
        tls: the accepting side's TLS context (``transport.server_context``), or None for plaintext.
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
        self._rank = rank
        self._prev = prev_rank
        self._prev_address = prev_address
        self._port = transport.DataPort(
            host,
            magic=MAGIC,
            on_connection=self._connected,
            accept=lambda who: who == prev_rank,
            tls=tls,
            name=f"ring rank {rank} data port",
        )
        self._conn: Conn | None = None
        self._changed = asyncio.Event()
        self._buf = bytearray(HEADER_BYTES + max_payload + 64)
        self._view = memoryview(self._buf)

    @property
    def port(self) -> int:
        """The bound data port."""
        return self._port.port

    async def start(self) -> None:
        """Binds an ephemeral port on the rank's host and starts accepting. Raises: OSError."""
        await self._port.start()

    def issue_nonce(self) -> bytes:
        """A fresh one-time nonce for one connection (the oldest unused ones expire)."""
        return self._port.issue_nonce()

    def _connected(self, conn: Conn, who: int) -> None:
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
            if self._port.closed:
                raise UnavailableError(f"rank {self._rank}: the ring is closed")
            self._changed.clear()
            await self._changed.wait()
        return self._conn

    async def recv(
        self, seq: int, into: Into[FrameHeader] | None = None
    ) -> tuple[FrameHeader, memoryview | None]:
        """Reads the next frame of operation ``seq`` (older operations' frames are skipped).

        Returns the header and a view of the payload in a buffer that the next call
        reuses, or None when ``into`` gave views to receive it straight into.

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
                targets = into(header, n) if into is not None and header.seq == seq else None
                if targets is not None:
                    for target in targets:
                        await conn.recv_exactly(target)
                    return header, None
                await conn.recv_exactly(view[HEADER_BYTES : HEADER_BYTES + n])
                if header.seq >= seq:
                    return header, view[HEADER_BYTES : HEADER_BYTES + n]
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
        await self._port.close()
        self._changed.set()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class DataLink:
    """The connection to the next rank's data port.

    Args:
        method: the channel's ``unary_unary`` multi-callable for ``DataPort``.
        metadata: call metadata (the auth token), or None.
        host: the next rank's host.
        rank, world: this rank and the world size.
        next_rank, next_address: the next rank and its Collective address (for messages).
        tls: the connecting side's TLS context (``transport.client_context``), or None for plaintext.
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
        self._conn: Conn | None = None

    @property
    def connected(self) -> bool:
        """Whether a connection is open."""
        return self._conn is not None

    async def connect(self, deadline: float) -> None:
        """Opens the connection unless open: ``DataPort`` call, connect, nonce, wait for the ack.

        Raises:
            PSError: the call failed (its status as the error class), or the connection did.
        """
        if self._conn is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            reply = await self._method(
                _pb.DataPortRequest(rank=self._rank, world=self._world),
                timeout=max(0.001, deadline - loop.time()),
                wait_for_ready=True,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as err:
            raise error_class(err.code())(
                f"rank {self._next} refused the data port request: {err.code().name}: {err.details()}",
                address=self._next_address,
            ) from None
        try:
            self._conn = await transport.dial(
                self._host,
                reply.port,
                magic=MAGIC,
                nonce=reply.nonce,
                who=self._rank,
                tls=self._tls,
                timeout=deadline - loop.time(),
            )
        except (OSError, TimeoutError) as err:  # ssl.SSLError is an OSError
            raise UnavailableError(
                f"cannot open the data connection to rank {self._next} port {reply.port}: {err}",
                address=self._next_address,
            ) from None

    async def send(self, head: bytes, payload: Sequence[Buffer]) -> None:
        """Sends a frame: the header, then the payload straight from its buffers.

        Raises:
            UnavailableError: the connection broke.
        """
        conn = self._conn
        if conn is None:
            raise UnavailableError(f"no data connection to rank {self._next}", address=self._next_address)
        try:
            if sum(len(p) for p in payload) <= _SMALL_FRAME:
                await conn.sendall(b"".join((head, *payload)))
            else:
                await conn.sendall(head)
                for part in payload:
                    await conn.sendall(part)
        except OSError as err:
            raise UnavailableError(
                f"the data connection to rank {self._next} broke: {type(err).__name__}: {err}",
                address=self._next_address,
            ) from None

    def reset(self) -> None:
        """Closes the connection (after a failure); the next :meth:`connect` opens a new one."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class TcpTransport(RingTransport):
    """Transport ``"tcp"``: frames to the next rank's data port, from this rank's (see the module doc).

    Args:
        listener: this rank's data port.
        link: the connection to the next rank's data port (None in a world of one).
    """

    name = "tcp"

    def __init__(self, listener: DataListener, link: DataLink | None) -> None:
        self._listener = listener
        self._link = link
        self._seq = 0
        self._inbound: Conn | None = None  # the connection the current operation reads

    def begin(self, seq: int, deadline: float, *, sends: bool) -> None:
        self._seq = seq
        self._inbound = None

    async def connect(self, deadline: float) -> None:
        if self._link is not None:
            await self._link.connect(deadline)

    async def send(self, header: FrameHeader, payload: Sequence[Buffer] = ()) -> None:
        if self._link is None:
            raise UnavailableError("a ring of one rank sends nothing")
        await self._link.send(encode_header(header, sum(len(p) for p in payload)), payload)

    async def recv(self, into: Into[FrameHeader] | None = None) -> tuple[FrameHeader, memoryview | None]:
        self._inbound = await self._listener.connection()
        return await self._listener.recv(self._seq, into)

    async def abort(self, header: FrameHeader | None, reason: bytes = b"") -> None:
        self._listener.drop(self._inbound)  # it may hold the rest of this operation's frames
        link = self._link
        if link is None:
            return
        if header is not None and link.connected:
            try:
                await asyncio.wait_for(
                    link.send(encode_header(header, len(reason)), (reason,)), _ABORT_WRITE_S
                )
            except Exception:  # best effort only: the connection may already be broken
                logger.debug("could not send the abort frame for operation #%d", header.seq)
        link.reset()

    def reset(self) -> None:
        if self._link is not None:
            self._link.reset()

    async def close(self, grace_s: float) -> None:
        self.reset()
        await self._listener.close()


def tcp_error(err: PSError, what: str, method: str) -> PSError:
    """``err`` with ``what`` (operation, rank) in front of its message and the method set."""
    return type(err)(f"{what}: {err.details}", method=method, address=err.address)
