"""A private asyncio event loop in a daemon thread, so synchronous callers can drive grpc.aio code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where available, else the default one."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class BackgroundLoop:
    """Runs coroutines on an event loop owned by a background daemon thread.

    Thread-safe: ``run`` may be called from any thread except the loop's own.
    """

    def __init__(self, name: str = "psclient-loop") -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs ``coro`` on the loop and waits for its result (``timeout`` seconds at most).

        Raises:
            TimeoutError: the coroutine did not finish in time (it is cancelled).
            RuntimeError: called from the loop's own thread, or after ``close``.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BackgroundLoop.run called from its own loop thread (would deadlock)")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"operation did not finish within {timeout} s") from None
        except BaseException:
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules ``coro`` on the loop without waiting; the caller waits on the returned future.

        Cheaper than handing ``run`` to a worker thread: one hop to the loop, and
        the loop completes the future directly.

        Raises:
            RuntimeError: after ``close``.
        """
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the background loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        """Stops the loop and joins its thread. Idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
