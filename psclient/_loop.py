"""A private asyncio event loop in a daemon thread, so synchronous callers can drive grpc.aio code."""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import contextlib
import functools
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
        self._ident = self._thread.ident  # set once started (read per ``run``: not the property each time)
        self._closed = False

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

        The hop is a task made on the loop and a lock the task's end releases: no
        ``concurrent.futures.Future`` (its condition variable and callbacks cost about forty
        Python calls a hop; this, five).

        Raises:
            TimeoutError: the coroutine did not finish in time (it is cancelled).
            RuntimeError: called from the loop's own thread, or after ``close``.
            concurrent.futures.CancelledError: the task was cancelled on the loop.
        """
        if threading.get_ident() == self._ident:
            coro.close()
            raise RuntimeError("BackgroundLoop.run called from its own loop thread (would deadlock)")
        done = _thread.allocate_lock()
        done.acquire()
        box: list[Any] = []  # the task, once the loop made it
        try:
            if self._closed:
                raise RuntimeError
            self._loop.call_soon_threadsafe(self._start, coro, done, box)
        except RuntimeError:  # closed, or closing
            coro.close()
            raise RuntimeError("the background loop is closed") from None
        try:
            finished = done.acquire(True, -1 if timeout is None else max(timeout, 0.0))
        except BaseException:  # KeyboardInterrupt in the caller: the call stops too
            self._cancel_soon(box)
            raise
        if not finished:
            self._cancel_soon(box)
            raise TimeoutError(f"operation did not finish within {timeout} s")
        task = box[0]
        if task.cancelled():
            raise concurrent.futures.CancelledError()
        return task.result()  # type: ignore[no-any-return]

    def _start(self, coro: Coroutine[Any, Any, Any], done: Any, box: list[Any]) -> None:
        """On the loop: ``run``'s task; its end releases ``done``."""
        task = self._loop.create_task(coro)
        box.append(task)
        task.add_done_callback(functools.partial(_release, done))

    def _cancel_soon(self, box: list[Any]) -> None:
        """Cancels ``run``'s task on the loop (made by then: the loop runs callbacks in order)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
            self._loop.call_soon_threadsafe(_cancel, box)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules ``coro`` on the loop without waiting; the caller waits on the returned future.

        Cheaper than handing ``run`` to a worker thread: one hop to the loop, and
        the loop completes the future directly (its task's end sets it: not
        ``run_coroutine_threadsafe``'s chain of futures). Cancelling the future
        cancels the task.

        Raises:
            RuntimeError: after ``close``.
        """
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            if self._closed or not self._thread.is_alive():
                raise RuntimeError
            self._loop.call_soon_threadsafe(self._start_for, coro, fut)
        except RuntimeError:  # closed, or closing
            coro.close()
            raise RuntimeError("the background loop is closed") from None
        return fut

    def _start_for(self, coro: Coroutine[Any, Any, Any], fut: concurrent.futures.Future[Any]) -> None:
        """On the loop: ``submit``'s task; its end sets ``fut``, and cancelling ``fut`` cancels it."""
        if fut.cancelled():  # before it started
            coro.close()
            return
        task = self._loop.create_task(coro)
        task.add_done_callback(functools.partial(_settle, fut))
        fut.add_done_callback(functools.partial(_cancel_task, self._loop, task))

    def close(self) -> None:
        """Stops the loop and joins its thread. Idempotent."""
        self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def _release(done: Any, task: asyncio.Task[Any]) -> None:
    done.release()


def _settle(fut: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    """On the loop: ``submit``'s future gets its task's outcome (unless its waiter cancelled it)."""
    if task.cancelled():
        fut.cancel()
    if not fut.set_running_or_notify_cancel():
        return
    err = task.exception()
    if err is None:
        fut.set_result(task.result())
    else:
        fut.set_exception(err)


def _cancel_task(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], fut: Any) -> None:
    """``submit``'s future is done: cancelled by its waiter, its task is cancelled on the loop."""
    if fut.cancelled() and not task.done():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
            loop.call_soon_threadsafe(task.cancel)


def _cancel(box: list[Any]) -> None:
    if box:
        box[0].cancel()
