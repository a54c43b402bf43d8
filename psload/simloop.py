"""Event loops on virtual time: one per simulated process, stepped by ``psload.simulation``.

A ``VirtualLoop`` is an asyncio event loop with no I/O and no threads: its
clock is the simulation's world clock seen through the process's own rate
and offset (clocks that drift, as ``psserver.lease`` allows), work handed to
a thread (``asyncio.to_thread``, ``run_in_executor``) runs inline, and it
never sleeps: the simulation steps it (``drain``: run what is ready at this instant) and
moves the world clock to the next timer of any loop (``next_timer``) when
nothing is ready anywhere. The code under test (``psserver``'s shard service,
replication and modes) runs on it unchanged: ``asyncio.sleep``, timeouts,
futures, queues and tasks all work, in an order fixed by the seed.

A paused process is a loop that is not stepped: its timers fall due and wait,
as a stopped process's do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
_EPSILON_S = 1e-7  # past a timer's instant, so that rounding never leaves it not quite due


class _NoIO(selectors.BaseSelector):
    """The selector of a loop that has no file descriptors: ``select`` returns at once."""

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise NotImplementedError("a simulated process has no file descriptors")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise KeyError(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return []

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return {}


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop whose time is ``world() * rate + offset`` and that runs only when stepped.

    Args:
        world: the simulation's world clock (seconds).
        rate: this process's clock rate against the world's (1.0: exact; ``psserver.lease`` allows
            1 % either way).
        offset: this process's clock at world time 0.
    """

    def __init__(self, world: Callable[[], float], *, rate: float = 1.0, offset: float = 0.0) -> None:
        super().__init__()
        self._world = world
        self.rate = rate
        self.offset = offset
        self._selector = _NoIO()

    def time(self) -> float:
        return self._world() * self.rate + self.offset

    def world_time(self, when: float) -> float:
        """The world time at which this loop's clock reads ``when``."""
        return (when - self.offset) / self.rate + _EPSILON_S

    # -- what BaseEventLoop leaves to its subclasses -------------------------------------------

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass  # call_soon_threadsafe: nothing to wake (no thread ever waits in this loop)

    def run_in_executor(  # type: ignore[override]
        self, executor: concurrent.futures.Executor | None, func: Callable[..., _T], *args: Any
    ) -> asyncio.Future[_T]:
        """Runs ``func`` now, inline (deterministic: a simulated process has no threads)."""
        future: asyncio.Future[_T] = self.create_future()
        try:
            future.set_result(func(*args))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:
            future.set_exception(err)
        return future

    # -- stepping ---------------------------------------------------------------------------------

    def drain(self, limit: int = 100_000) -> int:
        """Runs rounds until nothing is ready at this instant (at most ``limit``); returns how many ran.

        Processes share nothing but the network, whose messages take time, so
        running one until it is idle at an instant, then the next, orders them
        no less freely than interleaving their rounds would.
        """
        if not self.ready():
            return 0
        self._rounds_left = limit
        self._rounds = 0
        self.run_forever()
        return self._rounds

    _rounds_left = 0
    _rounds = 0

    def _run_once(self) -> None:  # BaseEventLoop's round, counted; the loop stops once idle (``drain``)
        super()._run_once()  # type: ignore[misc]
        self._rounds += 1
        self._rounds_left -= 1
        if self._rounds_left <= 0 or not self.ready():
            self.stop()

    def ready(self) -> bool:
        """Whether a callback is ready to run, or a timer due, at this loop's current time (a cancelled
        timer due counts: the step that drops it costs little)."""
        return bool(self._ready) or bool(self._scheduled and self._scheduled[0].when() <= self.time())

    def next_timer(self) -> float | None:
        """The world time of this loop's earliest timer (None: it has none; it may be a cancelled one)."""
        return self.world_time(self._scheduled[0].when()) if self._scheduled else None

    def abandon(self) -> None:
        """Drops every callback and timer (a killed process): nothing of it runs again."""
        for handle in list(self._ready) + list(self._scheduled):
            handle.cancel()
        self._ready.clear()
        self._scheduled.clear()
