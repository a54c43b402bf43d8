"""Tells a stopped shard process from a slow one, so that a replicated shard's calls fail over from the first.

A process that is stopped (SIGSTOP, a long pause of its machine, swapping, a
VM migration, a debugger) keeps its sockets: its kernel still accepts
connections and acknowledges the bytes sent to it, so no TCP timeout fires
and a request on the data port waits for its deadline. A ``Liveness`` of a
replica watches the calls waiting on it: once one has waited ``STALL_AFTER_S``,
it asks the replica for its status (``GetStatus``, which the shard's event loop
answers at once whatever its worker threads compute), every ``STALL_AFTER_S``
while calls wait. A replica that answers within ``PROBE_TIMEOUT_S`` is alive
(a long update, a big checkpoint, a sync barrier: the calls go on waiting);
one that does not is stalled, and every call waiting on it is cancelled and
fails with ``StalledError`` (UNAVAILABLE), which fails it over to the other
replica. That one takes over once the stalled primary's lease has lapsed
(``psserver.replication``); until then it refuses, and the call is not sent
back to the stalled replica for ``REMEMBER_S``.

Only replicated shards (``PRIMARY|BACKUP``) are watched: a shard with one
address has nowhere to fail over to, and its calls wait for their deadline
as before (``psclient._reach`` says what they waited for).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

STALL_AFTER_S = 1.0  # a call waiting this long has its replica's process asked whether it still runs
PROBE_TIMEOUT_S = 1.0  # a process that does not answer its status within this is stalled
REMEMBER_S = 3.0  # a replica found stalled is not failed back to for this long


class StalledError(grpc.RpcError):
    """A call cancelled because its replica's process stopped answering (reads as an aio UNAVAILABLE)."""

    def __init__(self, address: str, waited_s: float) -> None:
        self._details = (
            f"{address} stopped answering: no answer to a status call within {PROBE_TIMEOUT_S:g} s while "
            f"this call waited {waited_s:.1f} s (its process is paused or its machine stalled); failing over"
        )
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class Liveness:
    """The calls waiting on one replica, and whether its process still answers (see the module docstring).

    Args:
        address: the replica's ``HOST:PORT``.
        probe: asks the replica for its status with the given deadline (seconds); raises grpc.RpcError.
    """

    def __init__(self, address: str, probe: Callable[[float], Awaitable[object]]) -> None:
        self.address = address
        self._probe = probe
        self._waiting: dict[asyncio.Task[object], tuple[int, float]] = {}  # task -> (cancels before, since)
        self._cancelled: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._checking: asyncio.Task[None] | None = None
        self.stalled_at = float("-inf")  # time.monotonic() of the last probe it did not answer

    def recently_stalled(self) -> bool:
        return time.monotonic() - self.stalled_at < REMEMBER_S

    def enter(self) -> asyncio.Task[object]:
        """The current task starts waiting on the replica; returns it (for ``leave``)."""
        task = asyncio.current_task()
        assert task is not None
        self._waiting[task] = (task.cancelling(), time.monotonic())
        if self._timer is None and self._checking is None:
            self._timer = asyncio.get_running_loop().call_later(STALL_AFTER_S, self._check)
        return task

    def leave(self, task: asyncio.Task[object]) -> float | None:
        """``task`` stopped waiting. Returns the seconds it waited if this watch cancelled it (its
        CancelledError is then this watch's: raise ``StalledError``), else None."""
        before, since = self._waiting.pop(task, (0, 0.0))
        ours = task in self._cancelled
        if ours:
            self._cancelled.discard(task)
            task.uncancel()
        if not self._waiting:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._checking is not None:
                self._checking.cancel()
                self._checking = None
        if ours and task.cancelling() <= before:
            return time.monotonic() - since
        return None

    def _check(self) -> None:
        self._timer = None
        if self._waiting:
            self._checking = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        stalled = False
        try:
            await self._probe(PROBE_TIMEOUT_S)
        except grpc.RpcError as err:  # any other answer (a refusal, an error) comes from a running process
            stalled = err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        self._checking = None
        if stalled:
            self.stalled_at = time.monotonic()
            for task in list(self._waiting):
                if task not in self._cancelled:
                    self._cancelled.add(task)
                    task.cancel()
        elif self._waiting:
            self._timer = asyncio.get_running_loop().call_later(STALL_AFTER_S, self._check)
