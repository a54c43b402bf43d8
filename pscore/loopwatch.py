"""Says when an event loop stops turning, and where it is stuck, instead of letting calls time out silently.

A shard serves every call from one asyncio event loop. Code that blocks that
loop (a long computation, a blocking system call, a lock held by another
thread) stops every call at once, and the clients see only their deadlines
pass. ``LoopWatch`` notices: the loop stamps a heartbeat every
``beat_s``; a daemon thread checks it, and once it is older than
``stalled_after_s`` logs a WARNING with the loop thread's stack, then one line
when the loop turns again, with how long it was blocked.

Cost: one timer callback per ``beat_s`` on the loop, one thread that sleeps.

The module also installs ``dump_stacks_on``: a signal (SIGUSR1 by default)
that writes every thread's stack to stderr (``faulthandler``), for a process
that looks hung from outside; and ``dump_tasks_on``: a signal (SIGUSR2) that
writes every task of a running event loop with the coroutines it awaits in, for
a process whose loop turns but whose calls hang (a wait that never ends).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

BEAT_S = 0.25
STALLED_AFTER_S = 2.0


class LoopWatch:
    """Watches one running event loop from a daemon thread (``start`` on the loop, ``stop`` to end).

    Args:
        name: what the log lines call the loop (e.g. ``"shard 0"``).
        beat_s: how often the loop stamps its heartbeat.
        stalled_after_s: a heartbeat this old is reported as a stall.
        on_stall: called (from the watching thread) with the seconds blocked when a stall ends.
    """

    def __init__(
        self,
        name: str,
        *,
        beat_s: float = BEAT_S,
        stalled_after_s: float = STALLED_AFTER_S,
        on_stall: Callable[[float], None] | None = None,
    ) -> None:
        if not 0 < beat_s < stalled_after_s:
            raise ValueError(f"need 0 < beat_s < stalled_after_s, got {beat_s} and {stalled_after_s}")
        self.name = name
        self.beat_s = beat_s
        self.stalled_after_s = stalled_after_s
        self.on_stall = on_stall
        self.stalls = 0  # stalls seen so far
        self._last = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts watching the running loop (call from the loop's thread)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._last = time.monotonic()
        self._beat()
        self._thread = threading.Thread(target=self._watch, name=f"loopwatch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops watching. Idempotent."""
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.beat_s + 1.0)

    def _beat(self) -> None:
        self._last = time.monotonic()
        if not self._stop.is_set() and self._loop is not None:
            self._timer = self._loop.call_later(self.beat_s, self._beat)

    def _watch(self) -> None:
        stalled_since: float | None = None  # the heartbeat's age when the stall was reported
        while not self._stop.wait(self.beat_s):
            last = self._last
            age = time.monotonic() - last
            if stalled_since is None and age > self.stalled_after_s:
                stalled_since = last
                log.warning(
                    "%s: the event loop has not turned for %.1f s; every call waits. It is at:\n%s",
                    self.name, age, self._loop_stack(),
                )  # fmt: skip
            elif stalled_since is not None and last != stalled_since:
                blocked = last - stalled_since
                stalled_since = None
                self.stalls += 1
                log.warning("%s: the event loop turns again after %.1f s blocked", self.name, blocked)
                if self.on_stall is not None:
                    self.on_stall(blocked)

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "  (the loop's thread has no frame)"
        return "".join(traceback.format_stack(frame)).rstrip()


def dump_stacks_on(signum: int = signal.SIGUSR1) -> None:
    """Makes ``signum`` write every thread's Python stack to stderr (``kill -USR1 PID``), then carry on."""
    faulthandler.register(signum, all_threads=True, chain=False)


def dump_tasks_on(loop: asyncio.AbstractEventLoop, signum: int = signal.SIGUSR2) -> None:
    """Makes ``signum`` write every task of ``loop`` and where each awaits to stderr, then carry on.

    Handled on the loop (``add_signal_handler``), so a blocked loop answers
    only once it turns again (``dump_stacks_on`` shows a blocked one).
    """
    loop.add_signal_handler(signum, _dump_tasks, loop)


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    print(f"--- {len(tasks)} asyncio tasks (SIGUSR2) ---", file=sys.stderr)
    for task in tasks:
        print(f"{task.get_name()}: {_awaiting(task.get_coro())}", file=sys.stderr)
    print("--- end of the tasks ---", file=sys.stderr, flush=True)


def _awaiting(coro: object) -> str:
    """Where a task's coroutine waits: each coroutine it awaits in, outermost first (Task.get_stack gives
    only the outermost; Task.print_stack fails on a frame without a line number, as gRPC's are)."""
    steps = []
    for _ in range(32):  # bounded: a chain of awaits is short
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            steps.append(type(coro).__name__ if coro is not None else "?")
            break
        steps.append(
            f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno})"
        )
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if coro is None:
            break
    return " -> ".join(steps)
