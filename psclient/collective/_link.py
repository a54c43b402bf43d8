"""Link: the long-lived ``Exchange`` stream from this rank to the next one.

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
from typing import Any

import grpc

from psclient.collective._service import ACCEPTED_KEY

logger = logging.getLogger(__name__)


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
