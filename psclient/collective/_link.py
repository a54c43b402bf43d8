"""Transport ``"grpc"`` of a ring: the long-lived ``Exchange`` stream to the next rank (``Link``), and
the previous rank's frames from this rank's mailboxes (``GrpcTransport``).

One stream carries the frames of every operation, so an operation costs no RPC
set-up (about half of a small all-reduce's CPU time when each operation opened
its own stream). The stream has a deadline like every RPC (``lifetime_s``) and is
replaced, between operations, before that deadline can cut an operation short.
After any failure the link is reset and reopened by the next operation.

The first write on a new stream waits for the next rank's initial metadata, which
its handler sends at once (so only after auth passed): a refused stream fails that
write with the refusal's status, and no frame counts as sent before the next rank
accepted the stream.

Not thread-safe: used from the ring's event loop only, by one operation at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Final

import grpc

from psclient.collective._frame import HEADER_BYTES, FrameHeader, encode_header
from psclient.collective._service import ACCEPTED_KEY, Mailboxes
from psclient.collective._transport import RingTransport
from pscore.errors import PSError, UnavailableError, error_class
from pscore.transport import Buffer, Into

logger = logging.getLogger(__name__)

_ABORT_WRITE_S: Final[float] = 0.2
# A peer that dies mid-stream surfaces as INTERNAL ("Internal error from Core") or CANCELLED on
# this side, and one that closes as OK: all mean the link is gone.
_LINK_LOST: Final[frozenset[grpc.StatusCode]] = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED, grpc.StatusCode.OK}
)


class Link:
    """The stream to the next rank.

    Args:
        method: the channel's ``stream_unary`` multi-callable for ``Exchange``.
        metadata: call metadata (the auth token), or None.
        lifetime_s: deadline of each stream; a new one is opened when an operation
            might outlive the current one.
        close_frame: the CLOSE frame written before a deliberate half-close.
    """

    def __init__(
        self, method: Any, metadata: Sequence[tuple[str, str]] | None, lifetime_s: float, close_frame: bytes
    ) -> None:
        self._close_frame = close_frame
        self._method = method
        self._metadata = metadata
        self._lifetime = lifetime_s
        self._call: Any = None
        self._accepted = False
        self._expires = 0.0
        self._ended: asyncio.Future[tuple[grpc.StatusCode, str]] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._old: set[asyncio.Task[None]] = set()

    def ensure(self, deadline: float) -> asyncio.Future[tuple[grpc.StatusCode, str]]:
        """Makes sure a live stream outlives ``deadline`` (loop time); returns its end future.

        The future resolves with the stream's final status and details once it ends
        (it never raises); an end during an operation means the link was lost.
        """
        loop = asyncio.get_running_loop()
        if self._call is not None and (self._call.done() or self._expires < deadline + 1.0):
            self._retire()
        if self._call is None:
            self._call = self._method(timeout=self._lifetime, wait_for_ready=True, metadata=self._metadata)
            self._accepted = False
            self._expires = loop.time() + self._lifetime
            ended: asyncio.Future[tuple[grpc.StatusCode, str]] = loop.create_future()
            self._ended = ended
            self._watch = asyncio.create_task(self._watch_call(self._call, ended), name="ring link watch")
        assert self._ended is not None
        return self._ended

    @staticmethod
    async def _watch_call(call: Any, ended: asyncio.Future[tuple[grpc.StatusCode, str]]) -> None:
        code = await call.code()
        details = await call.details()
        if not ended.done():
            ended.set_result((code, details or ""))

    async def write(self, msg: bytes) -> None:
        """Writes one frame.

        Raises:
            grpc.aio.AioRpcError, asyncio.InvalidStateError: the stream is broken or was refused
                (see :meth:`status`).
        """
        if not self._accepted:
            call = self._call
            metadata = await call.initial_metadata()
            if metadata is None or ACCEPTED_KEY not in metadata:
                # Refused or ended before the handler ran: raise the call's own status. (Writing
                # now could race the status and turn it into INTERNAL.)
                await call
                raise asyncio.InvalidStateError("the next rank ended the stream without accepting it")
            self._accepted = True
        await self._call.write(msg)

    async def status(self) -> tuple[grpc.StatusCode, str]:
        """The final status of the current stream (waits for it to end; call after a failed write)."""
        assert self._ended is not None
        return await asyncio.shield(self._ended)

    def _retire(self) -> None:
        """Half-closes the current stream in the background; the next :meth:`ensure` opens a new one."""
        call, watch = self._call, self._watch
        self._call = self._ended = self._watch = None
        if call is None:
            return

        async def finish() -> None:
            try:
                if not call.done():
                    await call.write(self._close_frame)
                    await call.done_writing()
                await call
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
                logger.debug("retired ring stream ended with %s", err)
            finally:
                if watch is not None:
                    watch.cancel()

        task = asyncio.create_task(finish(), name="ring link retire")
        self._old.add(task)
        task.add_done_callback(self._old.discard)

    def reset(self) -> None:
        """Cancels the current stream (after a failure); the next :meth:`ensure` opens a new one."""
        if self._call is not None:
            self._call.cancel()
        if self._watch is not None:
            self._watch.cancel()
        self._call = self._ended = self._watch = None

    async def close(self, grace_s: float) -> None:
        """Half-closes the stream and waits up to ``grace_s`` for the next rank to read it all."""
        self._retire()
        if self._old:
            await asyncio.wait(list(self._old), timeout=grace_s)
        for t in list(self._old):
            t.cancel()


class GrpcTransport(RingTransport):
    """Transport ``"grpc"``: frames on the ``Exchange`` stream (``Link``), received into ``Mailboxes``.

    Args:
        mailboxes: where this rank's ``CollectiveService`` puts the previous rank's frames.
        link: the stream to the next rank (None in a world of one).
        next_rank, next_address: the next rank and its address (for messages).
    """

    name = "grpc"

    def __init__(self, mailboxes: Mailboxes, link: Link | None, *, next_rank: int, next_address: str) -> None:
        self._boxes = mailboxes
        self._link = link
        self._next = next_rank
        self._next_address = next_address
        self._box: asyncio.Queue[Any] | None = None
        self._sending = False  # this operation sends on the link (else the link is left alone after it)

    def _lost(self, code: grpc.StatusCode, details: str) -> PSError:
        """The error for a stream to the next rank that ended with ``code``."""
        cls = UnavailableError if code in _LINK_LOST else error_class(code)
        return cls(f"rank {self._next} ended the stream: {code.name}: {details}", address=self._next_address)

    def begin(self, seq: int, deadline: float, *, sends: bool) -> asyncio.Future[PSError] | None:
        self._box = self._boxes.open(seq)
        self._sending = sends and self._link is not None
        if not self._sending:
            return None
        assert self._link is not None
        ended = self._link.ensure(deadline)
        lost: asyncio.Future[PSError] = asyncio.get_running_loop().create_future()

        def on_end(f: asyncio.Future[tuple[grpc.StatusCode, str]]) -> None:
            if not lost.done() and not f.cancelled():
                lost.set_result(self._lost(*f.result()))

        ended.add_done_callback(on_end)
        return lost

    def end(self, seq: int) -> None:
        self._boxes.close(seq)
        self._box = None
        self._sending = False

    async def send(self, header: FrameHeader, payload: Sequence[Buffer] = ()) -> None:
        assert self._link is not None
        size = sum(len(p) for p in payload)
        msg = b"".join((encode_header(header, size), *payload))  # the one copy: into the message
        try:
            await self._link.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # A failed write reports INTERNAL; the stream's own status says why.
            raise self._lost(*(await self._link.status())) from None

    async def recv(self, into: Into[FrameHeader] | None = None) -> tuple[FrameHeader, memoryview | None]:
        assert self._box is not None
        item = await self._box.get()
        if isinstance(item, PSError):
            raise item
        header, msg = item
        return header, memoryview(msg)[HEADER_BYTES:]

    async def abort(self, header: FrameHeader | None, reason: bytes = b"") -> None:
        link = self._link
        if link is None or not self._sending:
            return
        if header is not None:
            try:
                await asyncio.wait_for(
                    link.write(encode_header(header, len(reason)) + reason), _ABORT_WRITE_S
                )
            except Exception:  # best effort only: the stream may already be broken
                logger.debug("could not send the abort frame for operation #%d", header.seq)
        # Frames of the failed operation may be in flight: start the next one on a fresh stream.
        link.reset()

    def reset(self) -> None:
        if self._link is not None:
            self._link.reset()

    async def close(self, grace_s: float) -> None:
        if self._link is not None:
            # Let the last frames reach the next rank before the channel cancels the stream.
            await self._link.close(grace_s)
