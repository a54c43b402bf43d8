"""PushSession: many small pushes to one shard over one long-lived gRPC stream, answered in order.

A unary call costs grpc.aio ~150-250 us of CPU on each side (call setup,
metadata, HTTP/2 stream); a message on an open stream costs ~70 us. Small
pushes (the per-step gradients of most models) therefore go over a
``PushSession`` stream per shard: each request message is one whole push, each
response answers the oldest unanswered one. A failed push comes back as its
response's ``code``/``message`` and is raised as that status; a broken stream
fails every push in flight with the stream's status (UNAVAILABLE is retried by
the caller, as for a unary call: pushes are idempotent by ``(worker_id, session, seq)``).

The stream has a long deadline (every RPC has one) and is replaced by a fresh
one well before it runs out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from psclient._bulk import RequestError
from pscore.errors import status_from_number

log = logging.getLogger(__name__)

STREAM_DEADLINE_S = 3600.0  # deadline of one session stream
ROTATE_AFTER_S = 1200.0  # a session this old takes no new pushes; a fresh one does


class SessionUnsupported(Exception):
    """The shard does not implement PushSession (an older psserver): use unary Push."""


class PushSession:
    """The PushSession stream to one shard; ``push`` may be called concurrently from one event loop.

    Args:
        open_stream: starts the stream call (``stub.PushSession(timeout=..., metadata=...)``).
    """

    def __init__(self, open_stream: Callable[[], Any]) -> None:
        self._open_stream = open_stream
        self._call: Any = None
        self._opened = 0.0
        self._pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._lock = asyncio.Lock()
        self._readers: set[asyncio.Task[None]] = set()
        self.supported = True

    async def push(self, request: Any, timeout: float) -> Any:
        """Sends one whole push and waits (at most ``timeout`` s) for its response.

        Raises:
            SessionUnsupported: the shard has no PushSession.
            grpc.RpcError: the push failed (its status), or the stream broke.
        """
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:  # writes, and the order of the pending queue, follow one another
                    if self._call is None or time.monotonic() - self._opened > ROTATE_AFTER_S:
                        self._rotate()
                    call, pending = self._call, self._pending
                    future: asyncio.Future[Any] = loop.create_future()
                    future.add_done_callback(_retrieve)  # a push that timed out may still be answered
                    pending.append(future)
                    try:
                        await call.write(request)
                    except grpc.RpcError as err:
                        self._broken(call, pending, self._unsupported(err))
                    except asyncio.InvalidStateError:  # the stream had ended: fail with its status
                        self._broken(call, pending, self._unsupported(await _ended(call)))
                    except asyncio.CancelledError:  # the message may be half written: start afresh
                        cancelled = RequestError(grpc.StatusCode.CANCELLED, "write cancelled")
                        self._broken(call, pending, cancelled)
                        raise
                response = await future
        except TimeoutError:
            raise RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer to the push within {timeout:.3g} s (what its deadline had left)",
            ) from None
        if response.code:
            code = status_from_number(response.code)
            raise RequestError(code, response.message, response.reason)
        return response

    def _rotate(self) -> None:
        old = self._call
        if old is not None:  # it answers what it was sent, then ends
            closing = asyncio.ensure_future(_quietly(old.done_writing()))
            self._readers.add(closing)
            closing.add_done_callback(self._readers.discard)
        self._call = self._open_stream()
        self._opened = time.monotonic()
        self._pending = collections.deque()
        reader = asyncio.ensure_future(self._read(self._call, self._pending))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    async def _read(self, call: Any, pending: collections.deque[asyncio.Future[Any]]) -> None:
        error: BaseException | None = None
        try:
            async for response in call:
                if not pending:
                    error = RequestError(grpc.StatusCode.INTERNAL, "shard answered a push that was not sent")
                    break
                future = pending.popleft()
                if not future.done():
                    future.set_result(response)
        except grpc.RpcError as err:
            error = err
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                error = SessionUnsupported(str(err.details()))
        except asyncio.CancelledError:
            error = RequestError(grpc.StatusCode.CANCELLED, "the client is closing")
            raise
        finally:
            self._broken(call, pending, error or RequestError(grpc.StatusCode.UNAVAILABLE, "session ended"))

    def _unsupported(self, err: grpc.RpcError) -> BaseException:
        """A stream the shard refused as UNIMPLEMENTED (an older psserver): ``SessionUnsupported``.

        The reader usually sees it first; a push written just after the refusal sees it here.
        """
        if err.code() != grpc.StatusCode.UNIMPLEMENTED:
            return err
        self.supported = False
        return SessionUnsupported(str(err.details()))

    def _broken(
        self, call: Any, pending: collections.deque[asyncio.Future[Any]], error: BaseException
    ) -> None:
        """Fails every push in flight on ``call``; the next push opens a new stream."""
        if self._call is call:
            self._call = None
            with contextlib.suppress(Exception):
                call.cancel()
        while pending:
            future = pending.popleft()
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        """Ends the stream and its reader. Idempotent."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        for reader in list(self._readers):
            reader.cancel()
        for reader in list(self._readers):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


async def _ended(call: Any) -> RequestError:
    """The error for a push written to a stream that had already ended: its status (OK: UNAVAILABLE).

    Raised as an RpcError with the stream's code, so that the caller's retry policy applies (a
    stream to a shard that died or refuses, as a standby backup does, is UNAVAILABLE and retried).
    """
    try:
        code, details = await call.code(), await call.details()
    except Exception:
        code, details = grpc.StatusCode.UNAVAILABLE, ""
    if code == grpc.StatusCode.OK:
        code = grpc.StatusCode.UNAVAILABLE
    return RequestError(code, details or "the push session ended before the push was sent")


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _quietly(aw: Any) -> None:
    with contextlib.suppress(Exception):
        await aw
