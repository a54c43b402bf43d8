"""How a shard applies pushes: asynchronously (default), with a sync barrier, or with bounded staleness.

A mode sits between the servicer and the store: it decides when a validated
push is applied and when a pull may proceed.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from psserver.store import Store


@dataclass(frozen=True, slots=True)
class PushOutcome:
    applied: bool
    reason: str = ""


class Mode(abc.ABC):
    """The update discipline of a shard."""

    name: str

    def __init__(self, store: Store) -> None:
        self.store = store

    @abc.abstractmethod
    async def push(self, worker_id: str, seq: int, step: int, grads: Mapping[str, np.ndarray]) -> PushOutcome:
        """Applies (or schedules, or drops) one worker's gradients for this shard.

        Raises:
            ServerError: invalid gradients (nothing is applied), or a barrier that timed out.
        """

    async def before_pull(self, worker_id: str, step: int) -> None:  # noqa: B027 - optional hook
        """Waits until ``worker_id`` at ``step`` may read (bounded-staleness mode)."""


class AsyncMode(Mode):
    """Every push is applied on arrival, once (retries of the same ``(worker_id, seq)`` are ignored)."""

    name = "async"

    async def push(self, worker_id: str, seq: int, step: int, grads: Mapping[str, np.ndarray]) -> PushOutcome:
        pairs = self.store.validate_grads(grads)
        if not self.store.claim(worker_id, seq):
            return PushOutcome(applied=False, reason="duplicate")
        try:
            await self.store.apply(pairs)
        except BaseException:
            self.store.unclaim(worker_id, seq)
            raise
        return PushOutcome(applied=True)


def make_mode(name: str, store: Store, **options: object) -> Mode:
    """Builds the mode called ``name``.

    Raises:
        ValueError: unknown mode.
    """
    if name == "async":
        return AsyncMode(store)
    raise ValueError(f"mode {name!r} is not available")
