"""psclient._loop.BackgroundLoop.run and .submit: a result, an error, a timeout or a cancel that cancels,
a closed loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from psclient._loop import BackgroundLoop


@pytest.fixture
def bg() -> BackgroundLoop:
    loop = BackgroundLoop("test-loop")
    yield loop
    loop.close()


async def _answer(x: int) -> int:
    await asyncio.sleep(0)
    return x + 1


async def _fail() -> None:
    await asyncio.sleep(0)
    raise KeyError("nope")


def test_run_returns_the_result_and_raises_the_error(bg: BackgroundLoop) -> None:
    assert bg.run(_answer(1)) == 2
    assert bg.run(_answer(2), timeout=5.0) == 3
    with pytest.raises(KeyError, match="nope"):
        bg.run(_fail())


def test_a_timeout_cancels_the_coroutine(bg: BackgroundLoop) -> None:
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="did not finish within"):
        bg.run(forever(), timeout=0.05)
    assert cancelled.wait(5.0)
    assert bg.run(_answer(0)) == 1  # the loop goes on serving


def test_run_from_the_loop_thread_and_after_close_is_refused(bg: BackgroundLoop) -> None:
    async def inside() -> None:
        coro = _answer(0)
        with pytest.raises(RuntimeError, match="own loop thread"):
            bg.run(coro)

    bg.run(inside())
    bg.close()
    with pytest.raises(RuntimeError, match="closed"):
        bg.run(_answer(0))


def test_submit_gives_a_future_of_the_result_or_the_error(bg: BackgroundLoop) -> None:
    futures = [bg.submit(_answer(i)) for i in range(20)]
    assert [f.result(5.0) for f in futures] == list(range(1, 21))
    failed = bg.submit(_fail())
    with pytest.raises(KeyError, match="nope"):
        failed.result(5.0)
    assert isinstance(failed.exception(), KeyError)


def test_cancelling_a_submitted_future_cancels_its_coroutine(bg: BackgroundLoop) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fut = bg.submit(forever())
    assert started.wait(5.0)
    assert fut.cancel()
    assert cancelled.wait(5.0)
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(5.0)
    assert bg.submit(_answer(0)).result(5.0) == 1  # the loop goes on serving
    bg.close()
    coro = _answer(0)
    with pytest.raises(RuntimeError, match="closed"):
        bg.submit(coro)
