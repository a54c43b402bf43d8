"""Frame transports: the one interface tensor bytes move through, and its raw-TCP pieces.

``FrameTransport`` is what the ring collective (``psclient.collective``: frames to
the next rank, from the previous one, over gRPC or raw TCP) and the shards' bulk
data path (``pscore.bulk``: requests and replies over raw TCP) send and receive
frames through. A frame is a header (whose type each protocol defines) and a
payload of raw bytes, sent straight from the caller's buffers and received
straight into the caller's (``Into``).

The raw-TCP pieces both use:

- a data port (``DataPort``): a listening socket on an ephemeral port that only
  accepts a connection presenting a one-time nonce. The nonce is handed out by
  an authenticated gRPC call of the service the port belongs to (the control
  plane: ``Collective.DataPort``, ``ParameterServer.DataPort``), so the auth token
  guards the data port too;
- ``dial``: opens a connection to a data port and presents the nonce;
- ``Conn`` / ``TlsConn``: the connection, driven by the event loop's ``sock_*``
  calls (no Python ``bytes`` per frame, no HTTP/2 framing); with TLS the
  standard library's ``ssl`` over memory BIOs, with the same certificates and
  checks as the gRPC side (``server_context``, ``client_context``).

The handshake, after TLS when configured: the connecting side sends ``magic``
(8 bytes naming the protocol), the nonce and a 32-bit ``who`` (the ring: its
rank); the port answers one byte ``0x01`` if it accepts, else closes.

Not thread-safe: everything runs on one event loop.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import ssl
import struct
import sys
import termios
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Generic, TypeVar

log = logging.getLogger(__name__)

NONCE_BYTES: Final[int] = 16
MAGIC_BYTES: Final[int] = 8
_HELLO: Final = struct.Struct(f"<{MAGIC_BYTES}s{NONCE_BYTES}sI")  # magic, nonce, who
_ACK: Final[bytes] = b"\x01"
HANDSHAKE_S: Final[float] = 10.0  # a connection that does not finish its handshake by then is closed
_TLS_RECORD_BYTES: Final[int] = 256 << 10  # plaintext per SSLObject.write; ciphertext read per recv

H = TypeVar("H")
Buffer = bytes | bytearray | memoryview
# into(header, payload_bytes): writable views whose lengths add up to payload_bytes, to receive the
# payload straight into (in order), or None to have it returned in the transport's own buffer.
Into = Callable[[H, int], Sequence[memoryview] | None]


class HandshakeTimeout(TimeoutError):
    """``dial``: the port accepted the TCP connection, but the handshake did not finish in time."""


class FrameTransport(abc.ABC, Generic[H]):
    """Moves frames (a header, then a payload of raw bytes) out to a peer and in from a peer, in order.

    Implementations: the ring's ``GrpcTransport`` and ``TcpTransport``
    (``psclient.collective``), and the shards' ``pscore.bulk.BulkConnection``.
    Errors are ``pscore.errors.PSError`` s whose message names the peer.
    """

    @abc.abstractmethod
    async def send(self, header: H, payload: Sequence[Buffer] = ()) -> None:
        """Sends one frame: ``header``, then the buffers of ``payload`` back to back, not copied.

        Raises:
            PSError: the connection broke or the peer refused it (UnavailableError, or its status).
        """

    @abc.abstractmethod
    async def recv(self, into: Into[H] | None = None) -> tuple[H, memoryview | None]:
        """Receives the next frame: its header, and its payload.

        ``into(header, nbytes)`` may give writable views to receive the payload
        straight into (the payload is then returned as None); otherwise it is a
        view of the transport's buffer, valid until the next ``recv``.

        Raises:
            PSError: the connection broke, or the bytes are not a frame (InvalidArgumentError).
        """

    async def abort(self, header: H | None, reason: bytes = b"") -> None:
        """After a failed exchange: sends ``header`` with ``reason`` as its payload (best effort,
        bounded in time) when given, so that the peer fails fast with the cause; then ``reset``."""
        self.reset()

    @abc.abstractmethod
    def reset(self) -> None:
        """Drops the connection(s) after a failure; the next ``send`` / ``recv`` starts on fresh ones."""


# A peer that acknowledges nothing for this long (a cut link: no reset, no answer) drops the connection
# (TCP_USER_TIMEOUT; keepalive probes every second while idle), so a call waiting on it fails and is
# retried or failed over, instead of waiting for its deadline: about when a replicated shard's backup
# takes over (psserver.lease: about 2 s after its primary's last word, with the default lease). Not much
# less: under heavy packet loss a stream can go seconds between retransmissions (200 ms, doubling: four
# losses of one segment in a row wait 3 s), and a drop costs a retry.
SILENT_LINK_S = 3.0


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay, a silent peer dropped after ``SILENT_LINK_S``; buffer sizes stay
    autotuned by the kernel (setting them stops that)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", 1),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", int(SILENT_LINK_S)),
        ("TCP_USER_TIMEOUT", int(SILENT_LINK_S * 1000)),
    ):
        if hasattr(socket, option):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def family_of(host: str) -> socket.AddressFamily:
    """``AF_INET6`` for an IPv6 literal (bracketed or not), else ``AF_INET``."""
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


READ_AHEAD_BYTES = 64 << 10  # a plain connection's read-ahead buffer (see ``Conn.recv_exactly``)
ANSWER_WAITS = 3  # answers whose first read waits before trying, after one that tried in vain (``Conn``)
_MAX_UNSENT_LIMIT = (1 << 31) - 1  # TCP_NOTSENT_LOWAT is a C int
_MAX_IOV = 512  # views per recvmsg_into at most (the system's IOV_MAX is 1024 on Linux)
# A read that waits for the rest of a payload asks the kernel to wake it only once this much of it is in
# (SO_RCVLOWAT; the rest, when less). Without it the loop wakes for every packet that arrives: on a slow link
# a 256 KiB payload took ~180 wake-ups (one segment each), on loopback one or two. Linux grows the receive
# buffer to hold the mark, and a closing or failing peer still wakes the reader at once.
_RCVLOWAT_BYTES = 128 << 10
# Linux's struct tcp_info: tcpi_delivery_rate (u64) sits at byte 160 (since 4.9; older kernels return less).
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_TCP_INFO_BYTES = 232
_DELIVERY_RATE = struct.Struct("=Q")
_DELIVERY_RATE_AT = 160
# ``Conn.queued``: the send queue's bytes (SIOCOUTQ, the same request as the terminals' TIOCOUTQ), a C int.
_OUTQ_ARG = bytes(4)
# ``Conn.delivered`` asks the kernel again after half the time the rest takes at the measured rate, within
# these bounds: a few asks an upload. Capped at 20 ms, each of the 160 uploads on the way at n = k = 32
# (8 Mbit/s, 0.5-1 s each) asked 25-50 times, and the cell used 1.0-1.2 cores at 0.74-0.96 of the bound;
# at half the rest, 0.76-1.0 cores at 0.77-0.97 (bench/results/scaling_2026-12-07d/).
_DELIVERED_POLL_MIN_S = 0.003
_DELIVERED_POLL_MAX_S = 0.25


class Conn:
    """A plain data connection: the (non-blocking) socket, read and written at once when it can be, and
    through the event loop's ``sock_*`` calls when it has to wait.

    uvloop's ``sock_recv_into`` always registers a reader and waits a loop iteration, even for bytes
    that have already arrived (a frame's head and payload right after its prefix): a direct
    ``recv_into`` first saves that, about a third of a small request's cost.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._ahead: memoryview | None = None  # bytes read past what was asked (made on first use)
        self._lo = self._hi = 0  # ``_ahead[_lo:_hi]`` is read and not yet taken
        self._unsent_limit = 0  # the TCP_NOTSENT_LOWAT set on the socket (0: none, the system's default)
        # The loop's reader or writer callback of a move in progress (``_moved``): (loop, fd, writer).
        self._watch: tuple[asyncio.AbstractEventLoop, int, bool] | None = None
        self._rcvlowat = 1  # SO_RCVLOWAT as set on the socket (1: the system's default)
        # What ``send_views`` and ``recv_views`` return when all moved at once: a future made done once (an
        # awaited done future returns at once), not one a call: asyncio.get_running_loop() is a getpid()
        # system call in Python 3.11 (its fork check), on every call.
        self._moved_now: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # ``_loop_now``
        # A small read that waits (``recv_exactly``) is woken by the loop's reader callback ``_readable``,
        # registered on the first wait and kept between waits (``_reader_fd``: its descriptor, -1: none),
        # where uvloop's ``sock_recv_into`` registers and removes one at every call (epoll_ctl system calls:
        # about six a request, each side).
        self._reader_fd = -1
        self._waiter: asyncio.Future[None] | None = None  # the wait ``_readable`` ends
        # Set by a user whose peer sends nothing before it answers what was just sent (a request and its
        # answer, one at a time on the connection: ``bulk.BulkConnection.send``); cleared by the next read.
        # That read's try at once finds nothing where the peer has not run since the send (a system call and
        # a caught BlockingIOError, each side of a round trip): after such a try, the first reads of the next
        # ``ANSWER_WAITS`` answers wait for the socket to turn readable before they try; then one tries at
        # once again (where the peer ran meanwhile, a loaded machine, the answer is there: no wait at all).
        self.answer_due = False
        self._answer_waits = 0

    def limit_unsent(self, nbytes: int) -> None:
        """Holds at most ``nbytes`` written and not yet sent in the kernel (``TCP_NOTSENT_LOWAT``, where
        the system has it; 0: no limit): ``sendall`` then returns when the data is on the wire but that
        much, not when it is queued (whole megabytes with the kernel's autotuned buffers), so a sender
        can take turns between connections. The bytes in flight (the congestion window) are not limited.
        """
        nbytes = min(max(nbytes, 0), _MAX_UNSENT_LIMIT)
        if nbytes != self._unsent_limit and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, nbytes)
            self._unsent_limit = nbytes

    def delivery_rate(self) -> int:
        """The rate the kernel last measured the connection delivering at, bytes/s (``TCP_INFO``'s
        ``tcpi_delivery_rate``, Linux); 0 where it is not known (no data acknowledged yet, another system).
        """
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
        except (AttributeError, OSError):
            return 0
        if len(info) < _DELIVERY_RATE.size + _DELIVERY_RATE_AT:
            return 0
        return int(_DELIVERY_RATE.unpack_from(info, _DELIVERY_RATE_AT)[0])

    def queued(self) -> int:
        """Bytes written and not yet acknowledged by the peer: unsent and in flight (``SIOCOUTQ``, Linux);
        0 where the system does not say."""
        try:
            return int.from_bytes(fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, _OUTQ_ARG), sys.byteorder)
        except (OSError, ValueError):
            return 0

    def delivery_wait(self, nbytes: int) -> float:
        """Seconds the bytes written beyond the last ``nbytes`` not yet acknowledged by the peer take at the
        rate the kernel last measured (``queued``, ``delivery_rate``): 0 where there are none, or where the
        rate is not known yet (no data acknowledged, another system)."""
        left = self.queued() - nbytes
        if left <= 0:
            return 0.0
        rate = self.delivery_rate()
        return left / rate if rate > 0 else 0.0

    async def delivered(self, nbytes: int, deadline: float) -> None:
        """Returns once at most ``nbytes`` written are not yet acknowledged by the peer (``queued``), or at
        ``deadline`` (``time.monotonic()``): the data reached the other end, not only the wire. The kernel
        has no event for that: it sleeps half as long as the rest takes at the connection's delivery rate
        (at least ``_DELIVERED_POLL_MIN_S``, at most ``_DELIVERED_POLL_MAX_S``) and asks again."""
        left = self.queued() - nbytes
        rate = 0
        while left > 0:
            now = time.monotonic()
            if now >= deadline:
                return
            rate = rate or self.delivery_rate()
            wait = left / rate / 2 if rate > 0 else _DELIVERED_POLL_MIN_S
            await asyncio.sleep(min(max(wait, _DELIVERED_POLL_MIN_S), _DELIVERED_POLL_MAX_S, deadline - now))
            left = self.queued() - nbytes

    async def handshake(self) -> None:
        """Nothing to negotiate on a plain connection."""

    async def sendall(self, data: Buffer) -> None:
        """Sends every byte of ``data``. Raises: OSError."""
        view = memoryview(data).cast("B")
        try:
            sent = self.sock.send(view)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(view):
            await asyncio.get_running_loop().sock_sendall(self.sock, view[sent:])

    def send_views(self, parts: Sequence[Buffer]) -> Awaitable[None]:
        """Sends every byte of ``parts``, back to back, not copied: as many as the socket takes in one
        system call (``sendmsg``). Returns what to await: a future done at once when the socket took all
        of it, else one a writer callback of the loop finishes once it has sent the rest (the awaiting
        task wakes once, and no coroutine of this connection is on its chain).

        Raises: OSError (at once, or from the future).
        """
        rest = []
        for part in parts:
            view = memoryview(part).cast("B")
            if len(view):
                rest.append(view)
        if not rest or self._move(rest, None, True):  # all taken at once (the common case): no callback
            return self._moved_now or self._done_now()
        return self._moved(rest, writer=True)

    def _loop_now(self) -> asyncio.AbstractEventLoop:
        """The event loop the connection is used on (kept from its first use: one loop uses it)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _wait_readable(self) -> asyncio.Future[None]:
        """A future done once the socket turns readable (``_reader_fd``)."""
        loop = self._loop or self._loop_now()  # ``_loop_now``'s common case without its call
        waiter = self._waiter = loop.create_future()
        if self._reader_fd < 0:
            fd = self._reader_fd = self.sock.fileno()
            loop.add_reader(fd, self._readable)
        return waiter

    def _readable(self) -> None:
        """The loop's reader callback: ends the wait; with none (or a cancelled one), the socket is no
        longer watched (a level-triggered reader would fire again at every loop turn)."""
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():
            self._stop_reading()
            return
        waiter.set_result(None)

    def _stop_reading(self) -> None:
        """Removes ``_readable`` from the loop (none registered: nothing)."""
        fd = self._reader_fd
        if fd >= 0:
            self._reader_fd = -1
            self._waiter = None
            self._loop_now().remove_reader(fd)

    def _done_now(self) -> asyncio.Future[None]:
        """``_moved_now``, made on first use."""
        done = self._moved_now = self._loop_now().create_future()
        done.set_result(None)
        return done

    async def recv_exactly(self, view: memoryview) -> None:
        """Fills ``view``. Raises: ConnectionError (the peer closed first), OSError.

        A read for fewer than ``READ_AHEAD_BYTES / 2`` bytes asks the socket for up to
        ``READ_AHEAD_BYTES``: a small frame's prefix, head and payload then come in one system
        call, and the next reads take them from memory. A larger read goes straight into ``view``.
        """
        got, n = 0, len(view)
        due, self.answer_due = self.answer_due, False  # the first read of an answer (``answer_due``)
        if self._hi > self._lo:
            got = min(n, self._hi - self._lo)
            view[:got] = self._ahead[self._lo : self._lo + got]  # type: ignore[index]
            self._lo += got
            due = False
        while got < n:
            need = n - got
            ahead = need < READ_AHEAD_BYTES // 2
            if ahead and self._ahead is None:
                self._ahead = memoryview(bytearray(READ_AHEAD_BYTES))
            target = self._ahead if ahead else view[got:]
            probe = due and not self._answer_waits  # an answer's first read, tried at once
            if due and not probe:  # the last such try found nothing yet: wait for the answer to begin
                self._answer_waits -= 1
                try:
                    await self._wait_readable()
                except BaseException:  # cancelled: the socket is no longer watched
                    self._stop_reading()
                    raise
            due = False
            try:
                k = self.sock.recv_into(target)
            except (BlockingIOError, InterruptedError):
                if probe:  # in vain: the first reads of the next answers wait first
                    self._answer_waits = ANSWER_WAITS
                if not ahead:  # the rest of a large read: filled by the loop, this task woken once
                    try:
                        await self._moved([view[got:]], writer=False)
                    except BaseException:  # cancelled (or failed): the loop stops reading into ``view``
                        self._unwatch()
                        raise
                    return
                try:
                    await self._wait_readable()
                except BaseException:  # cancelled: the socket is no longer watched
                    self._stop_reading()
                    raise
                continue
            if k == 0:
                raise ConnectionResetError("connection closed by the peer")
            if ahead:
                take = min(k, need)
                view[got : got + take] = self._ahead[:take]  # type: ignore[index]
                self._lo, self._hi = take, k
                k = take
            got += k

    def recv_views(self, views: Sequence[memoryview]) -> Awaitable[None]:
        """Fills ``views`` in order (a frame's payload, straight into its tensors): from what was read
        ahead first, then from the socket, as many views as it holds bytes for in one system call
        (``recvmsg_into``). Returns what to await: a future done at once when every view is full, else one
        a reader callback of the loop finishes once it has filled the rest (the awaiting task wakes once,
        and no coroutine of this connection is on its chain).

        Raises: ConnectionError (the peer closed first), OSError (at once, or from the future).
        """
        rest: list[memoryview] = []
        lo, hi = self._lo, self._hi
        for view in views:
            n = len(view)
            if hi > lo and n:
                take = min(n, hi - lo)
                view[:take] = self._ahead[lo : lo + take]  # type: ignore[index]
                lo += take
                if take == n:
                    continue
                view = view[take:]
            if n:
                rest.append(view)
        self._lo = lo
        if not rest or self._move(rest):  # all here at once: no callback
            return self._moved_now or self._done_now()
        return self._moved(rest, writer=False)

    def _move(
        self, rest: list[memoryview], done: asyncio.Future[None] | None = None, writer: bool = False
    ) -> bool:
        """Reads what the socket holds into ``rest`` (the views still to fill, in order), or with ``writer``
        sends what it takes of them: the views done are dropped, a partly done one cut to what is left.
        True once every one is done. As the loop's reader or writer callback (``done`` given), finishes
        ``done`` then (see ``_settle``).

        Raises (without ``done``): ConnectionResetError (the peer closed first), OSError.
        """
        if done is not None and done.cancelled():  # its waiter is gone (and dropped the connection)
            self._unwatch()
            return True
        sock = self.sock
        try:
            while rest:
                try:
                    k = sock.sendmsg(rest[:_MAX_IOV]) if writer else sock.recvmsg_into(rest[:_MAX_IOV])[0]
                except (BlockingIOError, InterruptedError):
                    if done is not None and not writer and self._rcvlowat > 1:  # wake for the next mark
                        left = sum(map(len, rest))
                        if left < self._rcvlowat:
                            self._rcvlowat = left
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, left)
                    return False
                if k == 0 and not writer:
                    raise ConnectionResetError("connection closed by the peer")
                while k:
                    n = len(rest[0])
                    if k < n:
                        rest[0] = rest[0][k:]
                        break
                    del rest[0]
                    k -= n
        except OSError as err:
            if done is None:
                raise
            self._settle(done, err)
            return True
        if done is not None:
            self._settle(done, None)
        return True

    def _moved(self, rest: list[memoryview], *, writer: bool) -> asyncio.Future[None]:
        """A future of ``rest`` moved (``_move`` did what it could already), finished by ``_move`` itself,
        called by the loop each time the socket turns readable (writable with ``writer``): one call an
        event, and the waiting task is woken once."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        self._watch = (loop, fd, writer)
        if not writer and self._reader_fd >= 0:  # ``add_reader`` below replaces ``_readable``
            self._reader_fd = -1
            self._waiter = None
        if writer:
            loop.add_writer(fd, self._move, rest, done, True)
        else:
            left = sum(map(len, rest))
            if left > READ_AHEAD_BYTES:  # a payload's rest: woken once per _RCVLOWAT_BYTES, not per packet
                self._rcvlowat = min(left, _RCVLOWAT_BYTES)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, self._rcvlowat)
            loop.add_reader(fd, self._move, rest, done, False)
        return done

    def _settle(self, done: asyncio.Future[None], err: OSError | None) -> None:
        """Ends a callback's watch and finishes ``done`` (with ``err``, if any; a cancelled one stays so)."""
        self._unwatch()
        if done.done():
            return
        if err is None:
            done.set_result(None)
        else:
            done.set_exception(err)

    def _unwatch(self) -> None:
        """Removes the loop's reader or writer callback of a move in progress (none: nothing)."""
        watch = self._watch
        if watch is not None:
            self._watch = None
            loop, fd, writer = watch
            if writer:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)
                if self._rcvlowat > 1:  # the next read (a frame's prefix) wakes at its first byte again
                    self._rcvlowat = 1
                    with contextlib.suppress(OSError):  # closed already
                        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    def close(self) -> None:
        self._unwatch()  # a move cancelled with its caller: the loop no longer watches the socket
        self._stop_reading()
        self.sock.close()


class TlsConn(Conn):
    """A TLS data connection: ``ssl.SSLObject`` over memory BIOs on a non-blocking socket.

    Args:
        sock: the connected socket.
        context: the side's ``ssl.SSLContext``.
        server_side: True on the accepting side.
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

    async def sendall(self, data: Buffer) -> None:
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

    async def send_views(self, parts: Sequence[Buffer]) -> None:
        """Sends ``parts`` in order, one after the other (records are encrypted one at a time)."""
        for part in parts:
            await self.sendall(part)

    async def recv_views(self, views: Sequence[memoryview]) -> None:
        """Fills ``views`` in order, one after the other (records are decrypted one at a time)."""
        for view in views:
            if len(view):
                await self.recv_exactly(view)


def server_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The accepting side's TLS context: this process's certificate; ``client_ca`` requires client certs."""
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


class DataPort:
    """A listening socket on an ephemeral port that accepts only connections presenting a one-time nonce.

    Args:
        host: the host to bind (that of the service's gRPC address).
        port: the port to bind (0: an ephemeral one).
        magic: the 8 bytes that open a connection of this protocol.
        on_connection: ``on_connection(conn, who)``, called (on the loop) with each accepted connection.
        accept: ``accept(who)``: whether a connection that says it is ``who`` may connect (default: any).
        tls: the accepting side's TLS context (``server_context``), or None for plaintext.
        max_nonces: nonces kept unused at most (the oldest expire first).
        nonce_ttl_s: seconds a nonce stays valid (None: until it is one of the oldest).
        name: what log lines call this port.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        magic: bytes,
        on_connection: Callable[[Conn, int], Awaitable[None] | None],
        accept: Callable[[int], bool] = lambda who: True,
        tls: ssl.SSLContext | None = None,
        max_nonces: int = 64,
        nonce_ttl_s: float | None = None,
        name: str = "data port",
    ) -> None:
        if len(magic) != MAGIC_BYTES:
            raise ValueError(f"magic must be {MAGIC_BYTES} bytes")
        self._host = host.strip("[]")
        self._bind_port = port
        self._magic = magic
        self._on_connection = on_connection
        self._accept = accept
        self._tls = tls
        self._max_nonces = max_nonces
        self._ttl = nonce_ttl_s
        self._name = name
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._nonces: dict[bytes, float] = {}  # nonce -> when issued (time.monotonic())
        self.closed = False

    @property
    def port(self) -> int:
        """The bound port."""
        assert self._sock is not None
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        """Binds the port (an ephemeral one for 0) on the host and starts accepting.

        Raises:
            OSError: the address cannot be bound (in use, or not this machine's).
        """
        sock = socket.socket(family_of(self._host), socket.SOCK_STREAM)
        try:
            if self._bind_port:  # a fixed port: rebind at once after a restart
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._bind_port))
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._accept_task = asyncio.create_task(self._accept_loop(), name=f"{self._name} accept")

    def issue_nonce(self) -> bytes:
        """A fresh one-time nonce for one connection (the oldest unused ones expire)."""
        nonce = os.urandom(NONCE_BYTES)
        self._nonces[nonce] = time.monotonic()
        while len(self._nonces) > self._max_nonces:
            del self._nonces[next(iter(self._nonces))]
        return nonce

    def _redeem(self, nonce: bytes) -> bool:
        issued = self._nonces.pop(nonce, None)
        if issued is None:
            return False
        return self._ttl is None or time.monotonic() - issued <= self._ttl

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as err:  # pragma: no cover - e.g. out of file descriptors
                log.warning("%s: accept failed: %s", self._name, err)
                await asyncio.sleep(0.1)
                continue
            self.spawn(self._handshake(sock), f"{self._name} connection")
            # and every connection already waiting, in this turn of the loop: one accept per turn falls
            # behind a busy loop when many clients connect at once, and theirs give up (psclient: 3 s)
            while True:
                try:
                    sock, _ = self._sock.accept()
                except OSError:  # BlockingIOError: none waiting
                    break
                sock.setblocking(False)
                self.spawn(self._handshake(sock), f"{self._name} connection")

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Runs ``coro`` as a task that ``close`` cancels."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _handshake(self, sock: socket.socket) -> None:
        conn: Conn = Conn(sock)
        try:
            tune_socket(sock)
            if self._tls is not None:
                conn = TlsConn(sock, self._tls, server_side=True)
            hello = bytearray(_HELLO.size)
            async with asyncio.timeout(HANDSHAKE_S):
                await conn.handshake()
                await conn.recv_exactly(memoryview(hello))
            magic, nonce, who = _HELLO.unpack(hello)
            if magic != self._magic or not self._accept(who) or not self._redeem(nonce):
                log.warning("%s: refused a connection without a valid nonce", self._name)
                conn.close()
                return
            await conn.sendall(_ACK)
        except (OSError, TimeoutError) as err:  # ssl.SSLError is an OSError
            log.debug("%s: handshake failed: %s", self._name, err)
            conn.close()
            return
        if self.closed:
            conn.close()
            return
        served = self._on_connection(conn, who)
        if served is not None:
            await served

    def stop_accepting(self) -> None:
        """Closes the listening socket; connections already accepted go on (idempotent)."""
        self.closed = True
        if self._accept_task is not None:
            self._accept_task.cancel()
        if self._sock is not None:
            self._sock.close()

    async def close(self) -> None:
        """Stops accepting and cancels the connection tasks (idempotent); the owner closes its connections."""
        self.closed = True
        tasks = [t for t in (self._accept_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()


async def dial(
    host: str,
    port: int,
    *,
    magic: bytes,
    nonce: bytes,
    who: int = 0,
    tls: ssl.SSLContext | None = None,
    timeout: float = HANDSHAKE_S,
    connect_timeout: float | None = None,
) -> Conn:
    """Connects to a ``DataPort`` and presents ``nonce``; returns the accepted connection.

    Args:
        host: the data port's host (that of the service's gRPC address).
        port: the port the control-plane call gave.
        magic: the protocol's 8 bytes.
        nonce: the one-time nonce the control-plane call gave.
        who: what this side says it is (the ring: its rank).
        tls: the connecting side's TLS context (``client_context``), or None for plaintext.
        timeout: bound of the whole connect and handshake, seconds.
        connect_timeout: bound of the TCP connection alone (default ``timeout``): a port that
            does not accept by then is unreachable. Once it accepted, the handshake has the rest
            of ``timeout`` (a port that accepted is reachable; its process may be busy).

    Raises:
        OSError: no connection (refused, unreachable, TLS refused: ``ssl.SSLError``), or the
            port closed it without acknowledging (a wrong nonce).
        TimeoutError: no connection within ``connect_timeout``; ``HandshakeTimeout``: connected,
            but no acknowledgement within ``timeout``.
    """
    loop = asyncio.get_running_loop()
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    sock = socket.socket(family_of(host), socket.SOCK_STREAM)
    conn: Conn = Conn(sock)
    try:
        tune_socket(sock)
        connect_s = timeout if connect_timeout is None else min(connect_timeout, timeout)
        async with asyncio.timeout(max(connect_s, 0.001)):
            await loop.sock_connect(sock, (host, port))
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                if tls is not None:
                    conn = TlsConn(sock, tls, server_side=False, server_hostname=host)
                    await conn.handshake()
                await conn.sendall(_HELLO.pack(magic, nonce, who))
                ack = bytearray(1)
                await conn.recv_exactly(memoryview(ack))
        except TimeoutError:
            raise HandshakeTimeout(
                f"{host}:{port} accepted the connection but did not finish its handshake in {timeout:.3g} s"
            ) from None
        if bytes(ack) != _ACK:
            raise ConnectionRefusedError("bad acknowledgement")
    except BaseException:
        conn.close()
        raise
    return conn
