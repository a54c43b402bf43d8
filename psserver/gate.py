"""The update gate of a shard's store: where updates wait while a snapshot or a consistent cut holds them.

Every update of the store (a push's or a sync step's gradients, an Assign, an
optimizer change) passes the gate (``passing``), which counts it in progress.
A hold (``hold``: a consistent cut, ``psserver.cut``) keeps new updates back
until released, except those a cut lets through (``let_through``); a checkpoint
snapshot (``quiesced``) holds them all and waits for those in progress, so a
snapshot never holds half of one update. The gate also knows the pushes whose
update waits at it or is being applied (``is_pending``): a snapshot must not
count them as applied, and a retry waits for its original (``left_pending``).

Everything runs on the shard's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Hashable, Iterable

from psserver.ledger import PushKey


class UpdateGate:
    """Counts the updates in progress and holds new ones back while asked to.

    Not thread-safe: call it from the shard's event loop only.
    """

    def __init__(self) -> None:
        # Updates in progress, the holds keeping new ones back, the updates a consistent cut lets
        # through, and the snapshots being read (nothing passes then).
        self._updating = 0
        self._idle: asyncio.Event | None = None  # set (and dropped) when the last update in progress ends
        self._holds = 0
        self.held = False  # True while a hold keeps updates back (an attribute: read on every push)
        self._snapshots = 0
        self._let_through: set[Hashable] = set()
        self._gate = asyncio.Event()  # replaced (and the old one set) whenever the gate changes
        # Pushes whose update waits at the gate or is being applied (a snapshot must not count them).
        self._pending: collections.Counter[PushKey] = collections.Counter()
        self._unpended: asyncio.Event | None = None  # set (and dropped) when a push leaves _pending

    @property
    def busy(self) -> bool:
        """True while an update waits at the gate with its pushes, or is in progress."""
        return bool(self._updating or self._pending)

    @contextlib.asynccontextmanager
    async def passing(self, key: Hashable = None, claims: Iterable[PushKey] = ()) -> AsyncIterator[None]:
        """Counts an update in progress; waits first while updates are held back (``hold``).

        An update whose ``key`` a consistent cut lets through (``let_through``)
        passes a held gate, unless a snapshot is being read.
        """
        claims = tuple(claims)
        await self.enter(key, claims)
        try:
            yield
        finally:
            self.leave(claims)

    async def enter(self, key: Hashable = None, claims: tuple[PushKey, ...] = ()) -> None:
        """``passing``'s way in, for a caller that calls ``leave(claims)`` once its update ends, whatever
        happens (the store's pushes: no context manager on their path). Waits only while held."""
        pending = self._pending
        for claim in claims:
            pending[claim] = pending.get(claim, 0) + 1
        if self._holds:
            try:
                while self._holds and (key is None or key not in self._let_through or self._snapshots):
                    await self._gate.wait()
            except BaseException:
                self._unpend(claims)
                raise
        self._updating += 1

    def leave(self, claims: tuple[PushKey, ...] = ()) -> None:
        """``passing``'s way out: the update that ``enter`` let in ended."""
        if len(claims) == 1 and self._pending.get(claims[0]) == 1:  # ``_unpend``'s common case, inline
            self._pending.pop(claims[0])  # pop: Counter.__delitem__ is Python
            if self._unpended is not None:
                self._unpended.set()
                self._unpended = None
        elif claims:
            self._unpend(claims)
        self._updating -= 1
        if not self._updating and self._idle is not None:
            self._idle.set()
            self._idle = None
        if self._holds:
            self._notify()  # a cut waiting for what it let through

    def hold(self) -> None:
        """Holds new updates back (pushes, assignments, optimizer changes wait) until ``release``.

        Holds nest: the gate opens when every hold is released. Updates in
        progress go on (``wait_idle`` waits for them); pulls and creates are not
        held.
        """
        self._holds += 1
        self.held = True

    def release(self) -> None:
        """Ends one ``hold``; the last one lets the waiting updates go on."""
        if self._holds <= 0:
            raise RuntimeError("UpdateGate.release without a hold")
        self._holds -= 1
        if not self._holds:
            self.held = False
            self._let_through.clear()
        self._notify()

    @property
    def updating(self) -> int:
        """Updates in progress (past the gate, not done)."""
        return self._updating

    def let_through(self, keys: Iterable[Hashable]) -> None:
        """While held, lets the updates with these keys (``passing(key=...)``) pass (a consistent cut's)."""
        self._let_through.update(keys)
        self._notify()

    async def wait_idle(self) -> None:
        """Waits until no update is in progress (bound it with a timeout)."""
        while self._updating:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()

    async def changed(self) -> None:
        """Waits for the next change of the gate, or the end of an update while held."""
        await self._gate.wait()

    def _unpend(self, claims: tuple[PushKey, ...]) -> None:
        pending = self._pending
        for claim in claims:
            left = pending[claim] - 1
            if left > 0:
                pending[claim] = left
            else:
                pending.pop(claim, None)
        if claims and self._unpended is not None:
            self._unpended.set()
            self._unpended = None

    def is_pending(self, key: PushKey) -> bool:
        """Whether push ``key``'s update waits at the gate or is being applied."""
        return key in self._pending

    async def left_pending(self, key: PushKey) -> None:
        """Waits until push ``key`` is no longer being applied (applied, or failed)."""
        while key in self._pending:
            if self._unpended is None:
                self._unpended = asyncio.Event()
            await self._unpended.wait()

    def _notify(self) -> None:
        gate, self._gate = self._gate, asyncio.Event()
        gate.set()

    @contextlib.asynccontextmanager
    async def quiesced(self, timeout_s: float = 60.0) -> AsyncIterator[set[PushKey]]:
        """Holds new updates back and waits for those in progress (checkpoint snapshots).

        Inside the block no update (push, assignment, optimizer change)
        passes, not even one a consistent cut lets through, so values, slots,
        versions and the dedup table agree. Pulls and creates go on. Yields the
        pushes claimed whose update waits at the gate (a snapshot must not count
        them as seen). Nests with ``hold``.

        Raises:
            TimeoutError: updates in progress did not finish within ``timeout_s``.
        """
        self.hold()
        self._snapshots += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self.wait_idle()
            yield set(self._pending)
        finally:
            self._snapshots -= 1
            self.release()
