"""pscore.loopwatch: a blocked event loop is logged with where it is stuck, counted once it turns again."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from pscore.loopwatch import LoopWatch, dump_tasks_on


def _block_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call on the loop's thread: what LoopWatch is for


def test_a_blocked_loop_is_reported_with_its_stack_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    stalls: list[float] = []

    async def main() -> None:
        watch = LoopWatch("test loop", beat_s=0.05, stalled_after_s=0.3, on_stall=stalls.append)
        watch.start()
        try:
            await asyncio.sleep(0.2)  # turning: nothing to say
            _block_the_loop_for(0.8)
            for _ in range(40):  # the watcher notices the loop turning again within a few beats
                if watch.stalls:
                    break
                await asyncio.sleep(0.05)
        finally:
            watch.stop()
        assert watch.stalls == 1

    with caplog.at_level(logging.WARNING, logger="pscore.loopwatch"):
        asyncio.run(main())
    stuck = [r.getMessage() for r in caplog.records if "has not turned" in r.getMessage()]
    assert len(stuck) == 1, caplog.text
    assert "_block_the_loop_for" in stuck[0] and "time.sleep" in stuck[0]  # where it is stuck
    assert len(stalls) == 1 and 0.4 < stalls[0] < 2.0
    assert any("turns again after" in r.getMessage() for r in caplog.records)


def test_a_turning_loop_is_never_reported(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> int:
        watch = LoopWatch("test loop", beat_s=0.05, stalled_after_s=0.3)
        watch.start()
        try:
            for _ in range(10):
                _block_the_loop_for(0.02)  # short blocking steps, the loop turns between them
                await asyncio.sleep(0.05)
        finally:
            watch.stop()
        return watch.stalls

    with caplog.at_level(logging.WARNING, logger="pscore.loopwatch"):
        assert asyncio.run(main()) == 0
    assert not caplog.records


def test_bad_periods_are_refused() -> None:
    with pytest.raises(ValueError, match="beat_s"):
        LoopWatch("x", beat_s=1.0, stalled_after_s=0.5)


async def _waits_on(event: asyncio.Event) -> None:
    await event.wait()  # a wait that does not end: what the task dump is for


def test_sigusr2_lists_every_task_with_the_coroutines_it_awaits_in(capfd: pytest.CaptureFixture[str]) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        dump_tasks_on(loop)
        try:
            stuck = asyncio.create_task(_waits_on(asyncio.Event()), name="the stuck one")
            await asyncio.sleep(0)
            os.kill(os.getpid(), signal.SIGUSR2)
            for _ in range(40):  # handled on the loop within a few turns
                await asyncio.sleep(0.01)
            stuck.cancel()
        finally:
            loop.remove_signal_handler(signal.SIGUSR2)

    asyncio.run(main())
    err = capfd.readouterr().err
    assert "asyncio tasks (SIGUSR2)" in err and "end of the tasks" in err
    (line,) = [x for x in err.splitlines() if x.startswith("the stuck one:")]
    assert "_waits_on (test_loopwatch.py:" in line and "-> wait (locks.py:" in line  # outermost first
