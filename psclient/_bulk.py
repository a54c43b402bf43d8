"""Pulls, pushes and lookups over a shard's raw-TCP data port (``pscore.bulk``), falling back to gRPC.

Per shard replica a ``DataLink`` keeps a few open data connections. A new one
costs a ``DataPort`` call (over the shard's authenticated gRPC channel: port and
one-time nonce), a TCP connection to that port on the shard's host (TLS with
the client's TLS settings) and the nonce handshake.

The clients on one event loop with the same credentials (psload's simulated
workers, the threads of one ``PSClient``, a Keras worker's tables) share their
``DataLink`` s (``shared_link``), and their small requests share frames: a small
request goes alone while fewer than ``SMALL_IN_FLIGHT`` small frames are in
flight; those that come meanwhile leave together in BATCH frames
(``pscore.bulk``) when the loop's turn ends, and the shard answers each (its
own result or its own error).

A failed request raises a ``RequestError`` with the status the gRPC call would
have had, so the client's retries (UNAVAILABLE: pushes are idempotent), fail
over and error types apply unchanged. ``Unusable`` means "use gRPC for this
request": the shard serves no data port (``psserver --no-data-port``, or an
older psserver), or its data port cannot be reached (a firewall that lets only
the gRPC port through). The latter is logged once per shard and tried again
after ``RETRY_AFTER_S``.

Not thread-safe: used from the client's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import re
import ssl
import time
import weakref
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import grpc

from pscore import bulk, codec, transport
from pscore.errors import ERROR_REASON_KEY, PSError, error_reason, status_from_number
from pscore.transport import Buffer, Into
from psproto.v1 import ps_pb2

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S: Final[float] = 3.0  # a data port that does not accept by then is taken as firewalled
RETRY_AFTER_S: Final[float] = 60.0  # after a failed connection, gRPC only for this long
MAX_IDLE: Final[int] = 16  # open connections kept per shard replica (requests in flight at once)
_NO_DATA_PORT: Final[frozenset[grpc.StatusCode]] = frozenset(
    {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION}
)


# A request holds at most this much written and unsent in the kernel (``Conn.limit_unsent``), or what its
# link carries in ``UNSENT_S`` if that is more (at the rate the kernel last measured it delivering):
# a push's upload is on the wire when its send returns, so the next shard's turn (``Uplink``) starts then.
# 256 KiB is 10 ms of a 200 Mbit/s link and 2 ms of 1 Gbit/s. Where the link is faster than the processes
# (loopback: 2-11 GB/s), the send returns when the bytes are queued: on loopback a 1 MiB push_pull held to
# 256 KiB unsent cost 40 % more CPU (the sender woke once per 256 KiB the shard read) and gained nothing.
NOTSENT_LOWAT: Final[int] = 256 << 10
UNSENT_S: Final[float] = 0.002
# The parts of a sync push (``AsyncPSClient.push_pull(parts=)``) take turns per shard, not on the process's
# uplink: every shard's parts go up at once, and each shard's one after the other, so that the n workers'
# part g of a shard is in (and answered) before their part g + 1 (per link: 0.70, 0.57 of the bound at
# n = 8, k = 4, 8 parts; on the process's uplink, part g of every shard in turn: 0.59, 0.58; whole pushes
# 0.49, 0.48). A part holds its turn until at most this much (or ``UNSENT_S`` of the link, if more) is
# left unsent: a part is often smaller than ``NOTSENT_LOWAT`` (8 MiB over 4 shards in 8 parts: 256 KiB),
# and with that rule its send would return at once and every part would go up at the same time. A part waits
# for the ones before it to its shard as long as its request may (its deadline), not ``STAGGER_WAIT_S``: at
# n = 8, k = 4 the last parts waited over 2 s and went up beside the others (0.73, 0.73 -> 0.75, 0.79).
PART_NOTSENT_LOWAT: Final[int] = 32 << 10
# ... and then until at most this much of it is unacknowledged (``transport.Conn.delivered``): on the wire is
# not there. Where the shard's own link is the narrow one (n workers into it), a worker's link takes a part
# faster than its share of the shard's, so the part waits in the network, not in the socket, and the next
# part, sent beside it, arrived with it: every worker's parts reached the shard together at the end and the
# answers followed, the parts gaining nothing (Keras, n = 8, k = 4, 50 Mbit/s, parts of 17-67 KB: 1.36
# steps/s a worker whole, 1.35-1.36 in 4 or 8 parts). A few segments may stay unacknowledged (a delayed ACK).
PART_DELIVERED_BYTES: Final[int] = 8 << 10
# Any other upload that took its turn on the uplink, on a slow link (the rest of it takes at least
# ``UPLOAD_WAIT_WORTH_S`` at the connection's delivery rate), stays undelivered beside at most
# ``UPLOADS_UNDELIVERED - 1`` others: it passes the turn on once one of those slots is free, and frees its own
# once at most ``UPLOAD_DELIVERED_BYTES`` of it is unacknowledged (``Turns.deliver``). A turn that ended when
# the kernel had the upload ordered the hand-overs only: with congestion windows of up to 400 KB the kernel
# took a whole 256 KiB part at once, and both rounds in flight shared every shard's queue (an answer's first
# byte 531 ms after its part left, p50, where a part takes 70 ms: n = k = 16, 30 Mbit/s, 0.74-0.78 of the
# bound). One upload undelivered at a time (each turn until delivered) was bimodal (0.74-0.92): workers that
# upload in the same cyclic order fall into step after a few stalls and then share one shard while another
# idles. Three at a time: 0.77-0.98, median 0.89 (bench/results/scaling_2026-12-07c_nk16/). Five: with
# the uploads of n workers spread over k shards, a shard's link idles for want of one about e^(-U n / k) of
# the time. With three, at n = k = 32 (8 Mbit/s) a shard had no upload coming 16 % of the time (traced) and
# the cell reached 0.69 of the bound; with five 0.5 % and 0.96 on a quiet machine, 0.74-0.81 at load 11-20
# (0.62-0.64 before; bench/results/scaling_2026-12-07d/). On a fast link (loopback, 200 Mbit/s and up with
# parts of a few hundred KiB) nothing waits: the turn ends at the hand-over.
UPLOADS_UNDELIVERED: Final[int] = 5
UPLOAD_DELIVERED_BYTES: Final[int] = 64 << 10
UPLOAD_WAIT_WORTH_S: Final[float] = 0.01
# Set (by ``push_pull``) in the tasks that send the parts of a sync push: their uploads take the parts' rules.
IN_PARTS: Final[contextvars.ContextVar[bool]] = contextvars.ContextVar("IN_PARTS", default=False)
# Smaller uploads go out at once: their turn costs more than it saves. Parts of 64 KiB and up take turns:
# 64 clients of 4 x 256 KiB on 4 shards, 16 a process, were 1.5-1.8x apart in steps/s taking turns,
# 3.3-3.8x apart without (bench/bench_many_workers.py, docs/benchmarks/scaling.md).
STAGGER_MIN_BYTES: Final[int] = 64 << 10
# An upload that waited this long for its turn while the turns stood still (a part stuck behind a shard
# that does not read) goes out beside the others (``Turns.take``); while they move, it waits for at most
# this share of its request's time left (the rest is for its answer).
STAGGER_WAIT_S: Final[float] = 2.0
TURN_WAIT_SHARE: Final[float] = 0.5
# Small requests (a request of at most BATCH_MAX_BYTES that expects an answer of at most as much) leave
# alone while fewer than SMALL_IN_FLIGHT of their frames are in flight on a link; the ones that arrive
# meanwhile wait, and leave together in BATCH frames once the event loop's turn in which they came is
# over (no timer: a lone request never waits; and never for an answer: requests waiting for each other at
# a sync barrier would wait for ever).
BATCH_MAX_BYTES: Final[int] = 64 << 10
SMALL_IN_FLIGHT: Final[int] = 2
# Requests in one BATCH frame (the rest leave in the next): a few frames in flight, not one, keep both
# processes busy. With 64 callers in one process and frames of up to 256, the callers moved in one wave (62
# in a frame): the shard served it while the client waited, then the client took the answers while the
# shard waited (1.1-1.2 of 2 cores busy). In frames of 32 the shard serves one while the client takes the
# answers of the other: 12,500-13,700 -> 33,000 1 KiB pushes/s, and no request goes alone (bench/results/
# ps_small_ops_2026-12-06_late.md).
BATCH_MAX_REQUESTS: Final[int] = 32
# A turn's waiting requests, if at least this many and no other BATCH frame is in flight, leave in two
# frames (halves of up to BATCH_MAX_REQUESTS), for the same reason: 32 callers, 30 waiting in one frame,
# 13,300-16,200 pushes/s; in two of 15, 20,000-22,400 (in frames of 8: 14,700-17,100). With a frame in
# flight the pipeline is there already: halves would only make more frames.
BATCH_SPLIT_MIN: Final[int] = 16
# A batch's tensor bytes (each request's larger way), at most: about what a large request may leave unsent.
BATCH_FRAME_BYTES: Final[int] = NOTSENT_LOWAT


class Uplink:
    """Large uploads, one at a time in the order they asked: a push's parts for its shards, and those of
    every client sharing the uplink (``process_uplink``: all the clients on an event loop of this
    process, as they share the host's link).

    Sent at once, the parts of a push share the worker's uplink and all finish at the end,
    and only then do the shards' answers start down: the link carries one direction at a
    time. Taking turns, the first shard's part is in after 1/k of the time and its answer
    comes down while the next part goes up: a round of M bytes over k shards takes about
    (1 + 1/k) M / B instead of 2 M / B. An upload whose turn did not move for
    ``STAGGER_WAIT_S`` (a part stuck behind a shard that does not read: a cut link is dropped
    after ``transport.SILENT_LINK_S``) goes out beside the others.

    Clients that each send in their own time through one FIFO link get unequal shares of it (TCP
    flows whose windows stayed open outrun those that start again): 16 simulated workers in one
    process ran 3.3x apart in steps/s. Their uploads taking turns, they ran 1.5x apart.

    Turns are per event loop: one ``Uplink`` serves clients on several loops (the blocking
    ``PSClient`` runs its own), each loop's turns apart.
    """

    def __init__(self) -> None:
        self._turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Turns] = weakref.WeakKeyDictionary()

    def turns(self) -> Turns:
        """The turns of the running event loop's uploads."""
        loop = asyncio.get_running_loop()
        turns = self._turns.get(loop)
        if turns is None:
            turns = self._turns[loop] = Turns()
        return turns

    @contextlib.asynccontextmanager
    async def turn(self, nbytes: int) -> AsyncIterator[None]:
        """Waits for the uplink (bounded), for an upload of ``nbytes``; released on exit (``Turns.take``
        as a context manager)."""
        turns = self.turns()
        got = await turns.take(nbytes)
        try:
            yield
        finally:
            if got:
                turns.release()


class Turns:
    """One event loop's turns on the uplink (``Uplink``): first come, first served; a free uplink is
    taken with no call (``busy``, ``waiting``: the caller tests them and sets ``busy`` itself)."""

    __slots__ = ("busy", "delivering", "moved", "slots", "waiting")

    def __init__(self) -> None:
        self.busy = False  # an upload holds the turn
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()  # in the order they asked
        self.delivering = 0  # uploads past their turn, not yet delivered (``deliver``)
        # Turns' holders waiting for one of those to be delivered, in the order they asked:
        self.slots: collections.deque[asyncio.Future[None]] = collections.deque()
        self.moved = 0  # turns ended and delivery slots freed so far (``take``: the turns move)

    async def take(self, nbytes: int, wait_s: float = STAGGER_WAIT_S, until: float | None = None) -> bool:
        """Waits for the turn (bounded), for an upload of ``nbytes``: True once taken (the caller then
        ``release`` s it), False for a small upload, or one that goes out beside the others.

        ``until`` None: it waits ``wait_s`` at most. Else (``time.monotonic()``) it waits as long as the
        turns move: it goes out beside the others once no turn and no delivery slot (``deliver``) has
        passed on for ``wait_s``, or at ``until``. A worker's queue of turns is as long as its rounds in
        flight: two rounds of 32 parts of 128 KiB at 8 Mbit/s take 8.4 s, and with a plain 2 s bound 83 %
        of the uploads of n = k = 32 gave up waiting and went out beside the others (every part of both
        rounds at once: 0.6 of the links' bound, RTTs of 0.6-1 s, thousands of TCP timeouts a run)."""
        if nbytes < STAGGER_MIN_BYTES:
            return False
        if not self.busy and not self.waiting:
            self.busy = True
            return True
        handed = asyncio.get_running_loop().create_future()
        self.waiting.append(handed)
        try:
            while True:
                moved = self.moved
                left = wait_s if until is None else min(wait_s, until - time.monotonic())
                if left > 0:
                    await _turn_window(handed, left)
                if handed.done() or until is None or self.moved == moved or time.monotonic() >= until:
                    break
        except BaseException:
            if not handed.cancel() and not handed.cancelled():  # handed over to a caller cancelled meanwhile
                self.release()  # pass it on
            raise
        if handed.cancel():  # not handed over: skipped by ``release`` from now on
            log.debug("an upload of %d bytes waited for its turn while the turns stood still %.3g s; sent "
                      "beside the others", nbytes, wait_s)  # fmt: skip
            return False
        return True

    async def deliver(self, conn: bulk.BulkConnection, deadline: float) -> None:
        """Called by the turn's holder once its upload is handed to the kernel, on a slow link: passes the
        turn on (``release``) once fewer than ``UPLOADS_UNDELIVERED - 1`` other uploads are still being
        delivered, then returns once at most ``UPLOAD_DELIVERED_BYTES`` of this one is unacknowledged. Each
        of the two waits lasts ``STAGGER_WAIT_S`` at most (as long as a turn is waited for), and not past
        ``deadline`` (``time.monotonic()``): uploads whose deliveries stall do not hold the uplink, nor their
        requests' answers (a worker at 8 Mbit/s among 64 hosts, n = k = 32, waited out its 60 s request
        timeout when a delivery was waited for until the deadline). A slot waited for in vain: the turn
        passes on and it returns at once."""
        try:
            if self.delivering >= UPLOADS_UNDELIVERED - 1:
                slot = asyncio.get_running_loop().create_future()
                self.slots.append(slot)
                try:
                    async with asyncio.timeout(min(max(deadline - time.monotonic(), 0.0), STAGGER_WAIT_S)):
                        await slot  # ``_delivered`` hands its slot over by its result
                except TimeoutError:
                    if slot.done() and not slot.cancelled():  # handed over as the time ran out: pass it on
                        self._delivered()
                    log.debug("an upload waited %.3g s for one of %d others to be delivered; on beside them",
                              STAGGER_WAIT_S, self.delivering)  # fmt: skip
                    return
                except BaseException:
                    if slot.done() and not slot.cancelled():  # handed over to a caller cancelled meanwhile
                        self._delivered()
                    raise
            else:
                self.delivering += 1
        finally:
            self.release()
        try:  # at most ``STAGGER_WAIT_S`` too: the request reads its answer once the wait is over
            await conn.delivered(UPLOAD_DELIVERED_BYTES, min(deadline, time.monotonic() + STAGGER_WAIT_S))
        finally:
            self._delivered()

    def _delivered(self) -> None:
        """Frees an upload's slot (``deliver``): the next waiting holder's (cancelled ones skipped), or
        nobody's."""
        self.moved += 1
        if not _hand_over(self.slots):  # else the slot passes on: delivering stays as it is
            self.delivering -= 1

    def release(self) -> None:
        """Ends the holder's turn: the next waiting upload's now (cancelled ones skipped), or nobody's."""
        self.moved += 1
        if not _hand_over(self.waiting):  # else the turn passes on: busy stays True
            self.busy = False


async def _turn_window(handed: asyncio.Future[None], seconds: float) -> None:
    """One window of ``Turns.take``'s wait: until the turn is handed over or ``seconds`` pass (``handed`` is
    not cancelled either way)."""
    await asyncio.wait((handed,), timeout=seconds)


def _hand_over(waiting: collections.deque[asyncio.Future[None]]) -> bool:
    """Wakes the first of ``waiting`` still waiting (cancelled ones skipped, and dropped): whether there was
    one (``Turns``: a turn or a delivery slot passes on to it)."""
    while waiting:
        handed = waiting.popleft()
        if not handed.done():
            handed.set_result(None)
            return True
    return False


_PROCESS_UPLINK = Uplink()


def unsent_limit(delivery_rate: int) -> int:
    """What a request may leave unsent in the kernel on a link that delivers
    ``delivery_rate`` bytes/s (0: not known yet): see ``NOTSENT_LOWAT``.

    >>> unsent_limit(0) == unsent_limit(25_000_000) == NOTSENT_LOWAT  # 200 Mbit/s
    True
    >>> unsent_limit(4_000_000_000) >> 20  # loopback: 7 MiB, more than a push's part
    7
    """
    return max(NOTSENT_LOWAT, int(delivery_rate * UNSENT_S))


def part_unsent_limit(delivery_rate: int) -> int:
    """What a sync push's part may leave unsent (``PART_NOTSENT_LOWAT``) on a link that delivers
    ``delivery_rate`` bytes/s (0: not known yet).

    >>> unsent_limit(6_250_000) >> 10, part_unsent_limit(6_250_000) >> 10  # 50 Mbit/s
    (256, 32)
    """
    return max(PART_NOTSENT_LOWAT, int(delivery_rate * UNSENT_S))


def process_uplink() -> Uplink:
    """The ``Uplink`` every client of this process takes its turns on (apart per event loop)."""
    return _PROCESS_UPLINK


def first_turn(worker_id: str) -> int:
    """The shard (modulo the shards a push goes to) where this worker's pushes start their turns.

    The worker's index, the number that ends its id (``worker3``, as ``psclient.keras`` names
    workers; ``w3``), else a hash of the id: workers 0 to k - 1 start at different shards, and,
    turning in the same order, stay on different shards at every turn, so no shard's link takes
    two workers' uploads at once while another's idles.

    >>> first_turn("worker3"), first_turn("w10")
    (3, 10)
    """
    digits = re.search(r"(\d+)$", worker_id)
    return int(digits.group(1)) if digits else zlib.crc32(worker_id.encode())


def _expire(task: asyncio.Task[object], expired: list[bool]) -> None:
    """A request's deadline passed (``DataLink.request``'s timer): its task is cancelled."""
    expired.append(True)
    task.cancel()


class _Alone(Exception):
    """The shard serves no BATCH frames (one of before them): a waiting request goes in a frame of its own."""


class Unusable(Exception):
    """The shard's data port cannot be used for this request: send it over gRPC (already logged)."""


class RequestError(grpc.RpcError):
    """A request's failure over the data port or a PushSession stream, with the status a gRPC call would
    have had (reads like an aio ``RpcError``, so that retries, failover and error types apply unchanged)."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._reason = reason

    @classmethod
    def answered(cls, head: ps_pb2.DataPortError) -> RequestError:
        """The failure the shard answered (an ERROR frame's head)."""
        return cls(status_from_number(head.code), head.message, head.reason)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The reason, as a unary call's ``ps-error-reason`` trailing metadata."""
        return ((ERROR_REASON_KEY, self._reason),) if self._reason else ()


# A small request waiting to leave in a batch (``DataLink.request``): its frame, payload, ``into``, deadline
# (time.monotonic()), its answer's future, its bytes and its timeout (a tuple: made per request, without a
# call).
_Waiting = tuple[
    bulk.Frame, Sequence[Buffer], "Into[bulk.Frame] | None", float, "asyncio.Future[bulk.Frame]", int, float
]


class DataLink:
    """The data connections to one shard replica, shared by the clients on one event loop with the same
    credentials (``shared_link``): their small requests meet here and share frames (``request``).

    Args:
        address: the replica's ``HOST:PORT`` (gRPC); the data port is on the same host.
        data_port: starts a ``DataPort`` call with the given timeout (on the replica's channel,
            with the auth token).
        tls: the client side's TLS context (``pscore.transport.client_context``), or None.
    """

    def __init__(
        self,
        address: str,
        data_port: Callable[[float], Awaitable[ps_pb2.ShardDataPortResponse]],
        tls: ssl.SSLContext | None,
    ) -> None:
        self.address = address
        self._host = address.rpartition(":")[0]
        self._data_port = data_port  # the DataPort call that opens connections (the last client's to share)
        self._tls = tls
        self._idle: list[bulk.BulkConnection] = []
        self._turns: Turns | None = None  # the uplink's turns on this link's event loop (its first upload's)
        self._part_turns = Turns()  # the turns of sync pushes' parts to this shard (``PART_NOTSENT_LOWAT``)
        self.off_until = 0.0  # time.monotonic() before which the data port is not tried (``usable``)
        self._said = False
        self._closed = False
        self._ports = [data_port]  # the DataPort calls of the clients sharing the link
        self._forget: Callable[[], None] | None = None  # takes the link out of ``shared_link`` 's registry
        self._small = 0  # small requests' frames in flight (alone or batched)
        # Whether the shard serves BATCH frames: its DataPort answer says so with every connection (until
        # the first, taken to: a batch's own connection tells, and its requests then go alone).
        self._batches_served = True
        self._waiting: collections.deque[_Waiting] = collections.deque()  # small requests to batch
        self._batches: dict[asyncio.Task[None], list[_Waiting]] = {}  # the batches in flight, by their task
        # One timer for the deadlines of every request that waited (``_expire_waiting``), not one a request:
        # armed for the earliest, it fires when that passes (requests given the same timeout come in the
        # order of their deadlines: it is armed about once a timeout).
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = 0.0  # when it fires (time.monotonic())
        # The requests in flight alone, by their task: each one's deadline and the mark its expiry leaves
        # (``_expire_alone`` cancels the task). One timer for them all too, armed for the earliest deadline
        # and again when it fires (about once a timeout), not a ``call_later`` and a ``cancel`` a request.
        self._alone: dict[asyncio.Task[Any], tuple[float, list[bool]]] = {}
        self._alone_timer: asyncio.TimerHandle | None = None
        self._alone_at = 0.0  # when it fires (time.monotonic())
        # The event loop of the link's requests (a link is shared on one loop: ``shared_link``), kept:
        # asyncio.get_running_loop() and current_task() are a getpid() system call each in Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0  # BATCH frames sent (for tests and benchmarks)

    @property
    def usable(self) -> bool:
        """Whether to try the data port now (not after a recent failure to reach it)."""
        return time.monotonic() >= self.off_until

    def _fall_back(self, why: str, *, permanent: bool) -> None:
        self.off_until = float("inf") if permanent else time.monotonic() + RETRY_AFTER_S
        for conn in self._idle:
            conn.reset()
        self._idle.clear()
        if not self._said:
            self._said = True
            level = logging.INFO if permanent else logging.WARNING
            log.log(level, "shard %s: %s; its pulls, pushes and lookups go over gRPC", self.address, why)
        else:
            log.debug("shard %s: %s; gRPC", self.address, why)

    async def _connect(self, timeout: float) -> bulk.BulkConnection:
        """A new data connection: the ``DataPort`` call, then the TCP connection and its handshake.

        The port has ``CONNECT_TIMEOUT_S`` to accept (else it is taken as firewalled); once it
        accepted, the handshake may take up to ``transport.HANDSHAKE_S`` (within ``timeout``): a
        shard that stalls (a busy or stopped process) is waited for as it would be over gRPC, and
        is not mistaken for a port out of reach.
        """
        try:
            reply = await self._data_port(timeout)
        except grpc.aio.AioRpcError as err:
            if err.code() in _NO_DATA_PORT:
                self._fall_back(f"it serves no data port ({err.details()})", permanent=True)
                raise Unusable from None
            # The shard is down, or refuses the token: as any call to it, named.
            raise RequestError(err.code(), f"DataPort call: {err.details()}", error_reason(err)) from None
        try:
            conn = await transport.dial(
                self._host,
                reply.port,
                magic=bulk.MAGIC,
                nonce=reply.nonce,
                tls=self._tls,
                timeout=min(transport.HANDSHAKE_S, timeout),
                connect_timeout=CONNECT_TIMEOUT_S,
            )
        except transport.HandshakeTimeout as err:
            if timeout <= transport.HANDSHAKE_S:  # the caller's deadline ran out, not the port's bound
                raise RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"the data port of {self.address}: {err}"
                ) from None
            self._fall_back(
                f"its data port {self._host}:{reply.port} does not answer ({err})", permanent=False
            )
            raise Unusable from None
        except (OSError, TimeoutError) as err:  # ssl.SSLError is an OSError
            why = str(err) or type(err).__name__
            self._fall_back(
                f"its data port {self._host}:{reply.port} cannot be reached ({why})", permanent=False
            )
            raise Unusable from None
        self._batches_served = reply.batches
        return bulk.BulkConnection(conn, f"the data port of {self.address}")

    async def request(
        self,
        frame: bulk.Frame,
        payload: Sequence[Buffer],
        into: Into[bulk.Frame] | None,
        timeout: float,
        uplink: Uplink | None = None,
        *,
        small: int | None = None,
    ) -> bulk.Frame:
        """Sends one request and receives its answer (its tensors through ``into``; None: an answer with no
        tensors to keep).

        With ``uplink``, the request's bytes go out in their turn (``Uplink.turn``). A ``small`` request
        (``small``: its bytes, at most ``BATCH_MAX_BYTES``, the larger way) may share a frame: it goes
        alone while fewer than
        ``SMALL_IN_FLIGHT`` small frames are in flight on the link and none waits; else it waits and
        leaves with the others that came in the same turn of the event loop, in BATCH frames
        (``_send_waiting``), where the shard serves them (its ``DataPort`` answer says so; to a shard of
        before batches every request goes alone).

        Raises:
            Unusable: use gRPC for this request.
            RequestError: the request failed: the shard's answer, a broken connection
                (UNAVAILABLE) or no answer within ``timeout`` (DEADLINE_EXCEEDED).
            grpc.RpcError: the DataPort call failed.
            Exception: what ``into`` raised.
        """
        deadline = time.monotonic() + timeout
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if small is not None and not self._batches_served:  # a shard of before batches: each goes alone
            small = None
        if small is not None and (self._small >= SMALL_IN_FLIGHT or self._waiting):
            # It waits, to leave with the others of this loop turn in a BATCH frame.
            future: asyncio.Future[bulk.Frame] = loop.create_future()
            if not self._waiting:  # the first to wait: the batches leave once this loop turn is over
                loop.call_soon(self._send_waiting)
            self._waiting.append((frame, payload, into, deadline, future, small, timeout))
            if self._expiry is None or deadline < self._expiry_at:  # the link's timer fails it in time
                self._arm_expiry(deadline)
            try:
                return await future  # cancelled: its batch, if it left, goes on for the others
            except _Alone:  # the shard turned out to serve no batches: in a frame of its own after all
                small = None
        nbytes = sum(map(len, payload))
        task = asyncio.current_task(loop)
        assert task is not None
        if small is not None:
            self._small += 1
        alone = self._alone
        try:
            while True:
                reused = bool(self._idle)
                left = max(deadline - time.monotonic(), 0.001)
                conn = self._idle.pop() if reused else await self._connect(left)
                # asyncio.timeout's work without its context manager and state machine (six Python calls a
                # request): the link's timer cancels the task at the deadline (``_expire_alone``); a cancel
                # it made ends as a timeout.
                cancelling = task.cancelling()
                expired: list[bool] = []
                alone[task] = (deadline, expired)
                if self._alone_timer is None or deadline < self._alone_at:
                    self._arm_alone(deadline)
                try:
                    in_parts = uplink is not None and IN_PARTS.get()
                    if in_parts and nbytes > PART_NOTSENT_LOWAT:
                        # a part: its turn lasts until it is (almost) on the wire (the connection keeps
                        # the lower limit for later requests: more wake-ups, nothing else)
                        limit = part_unsent_limit(conn.delivery_rate())
                        if nbytes > limit:
                            conn.limit_unsent(limit)
                    elif nbytes > NOTSENT_LOWAT:  # a smaller request is never held back
                        conn.limit_unsent(unsent_limit(conn.delivery_rate()))
                    if uplink is None or (nbytes < STAGGER_MIN_BYTES and not in_parts):  # small: no turn
                        await conn.send(frame, payload)
                    else:  # ``uplink.turn``, without its context manager; a free turn without a call
                        turns, wait_s, until = self._turns, STAGGER_WAIT_S, None
                        if in_parts:  # a sync push's part (any size): this shard's parts one at a time, each
                            # waiting for the ones before it to this same shard (bounded by the deadline)
                            turns, wait_s = self._part_turns, max(deadline - time.monotonic(), 0.001)
                        elif turns is None:
                            turns = self._turns = uplink.turns()
                        if not turns.busy and not turns.waiting:
                            turns.busy = got = True
                        else:
                            if not in_parts:  # while the turns move, for half its time left at most
                                now = time.monotonic()
                                until = now + (deadline - now) * TURN_WAIT_SHARE
                            got = await turns.take(nbytes, wait_s, until)
                        try:
                            await conn.send(frame, payload)
                            if in_parts and got:  # the next part to this shard once this one is there
                                await conn.delivered(PART_DELIVERED_BYTES, deadline)
                            elif got and conn.delivery_wait(UPLOAD_DELIVERED_BYTES) >= UPLOAD_WAIT_WORTH_S:
                                got = False  # a slow link: the turn passes on in ``deliver``
                                await turns.deliver(conn, deadline)
                        finally:
                            if got:
                                turns.release()
                    reply, _ = await conn.recv(into)
                except BaseException as exc:
                    del alone[task]
                    timed_out = isinstance(exc, TimeoutError)
                    if expired and task.uncancel() <= cancelling and isinstance(exc, asyncio.CancelledError):
                        timed_out = True  # the timer's cancel, not the caller's
                    if timed_out:
                        conn.reset()
                        raise RequestError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer from the data port within {timeout:.3g} s",
                        ) from None
                    if isinstance(exc, bulk.Closed):
                        if reused:  # an idle connection the shard closed meanwhile (a restart): a fresh one
                            continue
                        raise RequestError(
                            grpc.StatusCode.UNAVAILABLE, "the shard closed the data connection"
                        ) from None
                    conn.reset()
                    if isinstance(exc, PSError):
                        raise RequestError(exc.code, exc.details) from None
                    raise
                del alone[task]
                if expired:  # it fired as the answer came: its cancel is taken back, as asyncio.timeout does
                    task.uncancel()
                if len(self._idle) < MAX_IDLE and not self._closed:
                    self._idle.append(conn)
                else:
                    conn.reset()
                if reply.kind == bulk.ERROR:
                    raise RequestError.answered(reply.head)
                return reply
        finally:
            if small is not None:
                self._small -= 1

    def _send_waiting(self) -> None:
        """Sends the waiting requests (those given up skipped) in BATCH frames of up to
        ``BATCH_MAX_REQUESTS`` requests (half of them, from ``BATCH_SPLIT_MIN`` waiting with no frame in
        flight) and ``BATCH_FRAME_BYTES`` (more only for a lone request), each by a task of its own
        (their callers' cancellations do not touch the others)."""
        waiting = self._waiting
        most = BATCH_MAX_REQUESTS
        if len(waiting) >= BATCH_SPLIT_MIN and not self._batches:  # the shard starts on the first
            most = min(most, (len(waiting) + 1) // 2)
        while waiting:
            batch: list[_Waiting] = []
            nbytes = 0
            while waiting and len(batch) < most:
                if batch and nbytes + waiting[0][5] > BATCH_FRAME_BYTES:
                    break
                w = waiting.popleft()
                if not w[4].done():  # not given up
                    batch.append(w)
                    nbytes += w[5]
            if batch:
                self._small += 1
                assert self._loop is not None  # set by ``request``, the only caller
                task = self._loop.create_task(self._batch(batch))
                self._batches[task] = batch
                task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        del self._batches[task]

    def _arm_expiry(self, deadline: float) -> None:
        """Arms the link's timer of the waiting requests (``_expire_waiting``) for ``deadline``."""
        self._expiry_at = deadline
        self._expiry = self._timer(self._expiry, deadline, self._expire_waiting)

    def _arm_alone(self, deadline: float) -> None:
        """Arms the link's timer of the requests in flight alone (``_expire_alone``) for ``deadline``."""
        self._alone_at = deadline
        self._alone_timer = self._timer(self._alone_timer, deadline, self._expire_alone)

    def _timer(
        self, timer: asyncio.TimerHandle | None, deadline: float, fire: Callable[[], None]
    ) -> asyncio.TimerHandle:
        """A timer that calls ``fire`` at ``deadline``, in place of ``timer`` (cancelled)."""
        if timer is not None:
            timer.cancel()
        assert self._loop is not None  # set by ``request``, the only caller of the arming methods
        return self._loop.call_later(max(deadline - time.monotonic(), 0.0), fire)

    def _expire_alone(self) -> None:
        """The timer of the requests in flight alone: the task of each whose deadline passed is cancelled
        (its ``request`` ends as a timeout, DEADLINE_EXCEEDED); armed again for the earliest deadline left."""
        self._alone_timer = None
        now = time.monotonic()
        earliest = float("inf")
        for task, (deadline, expired) in list(self._alone.items()):
            if expired:  # cancelled already; ``request`` takes it out
                continue
            if deadline <= now:
                _expire(task, expired)
            elif deadline < earliest:
                earliest = deadline
        if earliest != float("inf"):
            self._arm_alone(earliest)

    def _expire_waiting(self) -> None:
        """The link's timer: every request that waited (to leave, or in a batch in flight) and whose deadline
        passed fails (DEADLINE_EXCEEDED, whether its batch left or not; the batch goes on for the others);
        the timer is armed again for the earliest deadline left."""
        self._expiry = None
        now = time.monotonic()
        earliest = float("inf")
        for waiting in (self._waiting, *self._batches.values()):
            for w in waiting:
                future = w[4]
                if future.done():
                    continue
                if w[3] <= now:
                    future.set_exception(
                        RequestError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer from the data port within {w[6]:.3g} s",
                        )
                    )
                elif w[3] < earliest:
                    earliest = w[3]
        if earliest != float("inf"):
            self._arm_expiry(earliest)

    async def _batch(self, batch: list[_Waiting]) -> None:
        """One BATCH frame's exchange: every request of ``batch`` gets its answer, or an error."""
        try:
            await self._exchange_batch(batch)
        except BaseException as exc:  # the frame failed: each request not yet answered fails with it
            if isinstance(exc, (Unusable, _Alone)):
                failure: BaseException = exc  # each goes over gRPC (its caller's ShardLink), or alone
            elif isinstance(exc, grpc.RpcError):
                failure = exc
            elif isinstance(exc, PSError):
                failure = RequestError(exc.code, exc.details)
            elif isinstance(exc, asyncio.CancelledError):
                failure = RequestError(grpc.StatusCode.CANCELLED, "the client closed the data connection")
            else:
                failure = RequestError(grpc.StatusCode.INTERNAL, f"a data port batch failed: {exc!r}")
                log.exception("shard %s: a data port batch failed", self.address)
            for w in batch:
                future = w[4]
                if not future.done():
                    future.set_exception(failure)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._small -= 1

    async def _exchange_batch(self, batch: list[_Waiting]) -> None:
        """``_batch`` 's frame out on a connection and its answers in, each to its request.

        Raises:
            Unusable, RequestError, grpc.RpcError: no connection to send it on.
        """
        payload = bulk.entries((i, w[0], w[1]) for i, w in enumerate(batch))
        frame = bulk.Frame(bulk.BATCH, ps_pb2.DataPortBatch(count=len(batch)))
        deadline = max(w[3] for w in batch)
        while True:
            reused = bool(self._idle)
            conn = (
                self._idle.pop() if reused else await self._connect(max(deadline - time.monotonic(), 0.001))
            )
            if not self._batches_served:  # the shard said so as this connection was made: each alone
                if len(self._idle) < MAX_IDLE and not self._closed:
                    self._idle.append(conn)
                else:
                    conn.reset()
                raise _Alone
            self.batches += 1
            answered = 0
            try:
                async with asyncio.timeout_at(
                    asyncio.get_running_loop().time() + deadline - time.monotonic()
                ):
                    await conn.send(frame, payload)
                    while answered < len(batch):
                        reply, view = await conn.recv(None)
                        if reply.kind != bulk.BATCHED:
                            raise RequestError(
                                grpc.StatusCode.INTERNAL,
                                f"a batch was answered by a frame of kind {reply.kind}",
                            )
                        for index, item, data in bulk.read_entries(view, reply.head.count, bulk.ANSWERS):
                            answered += 1
                            self._deliver(batch, index, item, data)
            except bulk.Closed:
                if reused and not answered:  # an idle connection the shard closed meanwhile: a fresh one
                    continue
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, "the shard closed the data connection"
                ) from None
            except TimeoutError:
                conn.reset()
                raise RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no answer from the data port by the batch's deadline"
                ) from None
            except codec.CodecError as err:
                conn.reset()
                raise RequestError(grpc.StatusCode.INTERNAL, f"a malformed batch answer: {err}") from None
            except BaseException:
                conn.reset()
                raise
            if len(self._idle) < MAX_IDLE and not self._closed:
                self._idle.append(conn)
            else:
                conn.reset()
            return

    @staticmethod
    def _deliver(
        batch: list[_Waiting], index: int, item: bulk.Frame | codec.CodecError, data: memoryview
    ) -> None:
        """One answer of a batch to its request's future: its tensors through its ``into`` (copied out of
        the frame's buffer, which the next frame reuses)."""
        if not 0 <= index < len(batch):
            raise codec.CodecError(f"an answer to request {index} of a batch of {len(batch)}")
        into, future = batch[index][2], batch[index][4]
        if future.done():  # given up (or answered twice: ignored)
            return
        if isinstance(item, codec.CodecError):
            future.set_exception(RequestError(grpc.StatusCode.INTERNAL, f"a malformed answer: {item}"))
            return
        if item.kind == bulk.ERROR:
            future.set_exception(RequestError.answered(item.head))
            return
        try:
            if into is not None:
                targets = into(item, len(data))
                if targets is not None:
                    at = 0
                    for target in targets:
                        n = len(target)
                        target[:] = data[at : at + n]
                        at += n
                    if at != len(data):
                        raise codec.CodecError(
                            f"an answer of {len(data)} payload bytes; its head describes others"
                        )
        except BaseException as err:  # what ``into`` raised is this request's error only
            future.set_exception(
                RequestError(grpc.StatusCode.INTERNAL, str(err)) if isinstance(err, codec.CodecError) else err
            )
            return
        future.set_result(item)

    def share(self, data_port: Callable[[float], Awaitable[ps_pb2.ShardDataPortResponse]]) -> None:
        """Another client uses this link (``shared_link``); its ``DataPort`` call opens connections next."""
        self._ports.append(data_port)
        self._data_port = data_port

    def release(self, data_port: Callable[[float], Awaitable[ps_pb2.ShardDataPortResponse]]) -> None:
        """A client that shared this link is done with it; the last one closes it."""
        with contextlib.suppress(ValueError):
            self._ports.remove(data_port)
        if not self._ports:
            self.close()
        elif self._data_port is data_port:  # a client that is closing opens no more connections
            self._data_port = self._ports[-1]

    def close(self) -> None:
        """Closes the idle connections, and the busy ones once their request ends (idempotent)."""
        self._closed = True
        if self._forget is not None:
            self._forget()
            self._forget = None
        for conn in self._idle:
            conn.reset()
        self._idle.clear()


# The data links of the clients on each event loop, by (replica address, credentials): ``shared_link``.
_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, object], DataLink]] = (
    weakref.WeakKeyDictionary()
)


def shared_link(
    address: str,
    credentials: object,
    data_port: Callable[[float], Awaitable[ps_pb2.ShardDataPortResponse]],
    tls: ssl.SSLContext | None,
) -> DataLink:
    """The data link to ``address`` of the clients on the running event loop that have the same
    ``credentials`` (a hashable key: the auth token and TLS files): made by the first, shared by the
    others (``DataLink.share``; each ``release`` s it), so that their small requests meet in its batches.
    Outside a running loop, a link of its own."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return DataLink(address, data_port, tls)
    links = _SHARED.get(loop)
    if links is None:
        links = _SHARED[loop] = {}
    key = (address, credentials)
    link = links.get(key)
    if link is not None and not link._closed:
        link.share(data_port)
        return link
    link = links[key] = DataLink(address, data_port, tls)

    def forget() -> None:
        if links.get(key) is link:
            del links[key]

    link._forget = forget
    return link
