"""psclient._loop.BackgroundLoop.run: a result, an error, a timeout that cancels, a closed loop."""

from __future__ import annotations

import asyncio
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
