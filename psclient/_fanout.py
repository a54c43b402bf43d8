"""Concurrent calls to shards: ``gather`` (first error raised, the rest cancelled) and ``each`` (one call
per shard, a single shard awaited without a task)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


async def gather(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Runs awaitables concurrently; on failure cancels the rest and raises the first error itself."""
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_as_coro(c)) for c in coros]
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw


async def each(fn: Callable[[int, Any], Awaitable[T]], per_shard: Mapping[int, Any]) -> list[T]:
    """``fn(shard, work)`` for every shard concurrently; a single shard is awaited directly (no tasks)."""
    if len(per_shard) == 1:
        ((shard, work),) = per_shard.items()
        return [await fn(shard, work)]
    return await gather(fn(s, w) for s, w in per_shard.items())


__all__ = ["each", "gather"]
