"""psclient._fanout.gather: results in the order given, the awaitables started in that order (the first in
the caller's task), the first error raised and the others cancelled, nothing to run."""

from __future__ import annotations

import asyncio

import pytest

from psclient._fanout import gather


def test_results_come_in_order_and_the_calls_start_in_order() -> None:
    started: list[int] = []

    async def call(i: int) -> int:
        started.append(i)
        await asyncio.sleep(0.001 * (5 - i))  # the later ones finish first
        return i * 10

    async def main() -> list[int]:
        return await gather(call(i) for i in range(5))

    assert asyncio.run(main()) == [0, 10, 20, 30, 40]
    assert started == [0, 1, 2, 3, 4]
    assert asyncio.run(_none()) == []


async def _none() -> list[int]:
    return await gather(iter(()))


@pytest.mark.parametrize("failing", [0, 2], ids=["the-callers-own", "a-task"])
def test_the_first_error_is_raised_and_the_others_are_cancelled(failing: int) -> None:
    cancelled: list[int] = []

    async def call(i: int) -> int:
        if i == failing:
            await asyncio.sleep(0.01)
            raise KeyError(f"shard {i}")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def main() -> None:
        await asyncio.wait_for(gather(call(i) for i in range(3)), 10)

    with pytest.raises(KeyError, match=f"shard {failing}"):
        asyncio.run(main())
    assert sorted(cancelled) == sorted({0, 1, 2} - {failing})
