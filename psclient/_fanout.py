"""Concurrent calls to shards: ``gather`` (first error raised, the rest cancelled) and ``each`` (one call
per shard, a single shard awaited without a task)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


async def gather(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Runs awaitables concurrently; on failure cancels the rest and raises the first error itself.

    The first runs in the caller's task (one task fewer), and before the others start, as a first
    task would: the order they start in is the order given.
    """
    items = list(coros)
    if not items:
        return []
    first, rest = items[0], items[1:]
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_as_coro(c)) for c in rest]
            result = await first
    except BaseExceptionGroup as group:
        error = group.exceptions[0]
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        raise error from None
    return [result, *(t.result() for t in tasks)]


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw


async def each(fn: Callable[[int, Any], Awaitable[T]], per_shard: Mapping[int, Any]) -> list[T]:
    """``fn(shard, work)`` for every shard concurrently; a single shard is awaited directly (no tasks)."""
    if len(per_shard) == 1:
        ((shard, work),) = per_shard.items()
        return [await fn(shard, work)]
    return await gather(fn(s, w) for s, w in per_shard.items())


__all__ = ["each", "gather"]
