"""Helpers of the ring tests: AsyncRing ranks sharing one event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from _support import free_addresses

from psclient.collective import AsyncRing


@asynccontextmanager
async def async_rings(
    world: int,
    *,
    timeout: float = 5.0,
    per_rank: Sequence[dict[str, Any]] | None = None,
    **options: Any,
) -> AsyncIterator[list[AsyncRing]]:
    """``world`` started ranks on loopback; ``per_rank[r]`` overrides ``options`` for rank ``r``."""
    addrs = free_addresses(world)
    per_rank = per_rank or [{}] * world
    rings = [AsyncRing(addrs, r, timeout, **{**options, **per_rank[r]}) for r in range(world)]
    started: list[AsyncRing] = []
    try:
        for ring in rings:
            await ring.start()
            started.append(ring)
        yield rings
    finally:
        for ring in started:
            await ring.close()
