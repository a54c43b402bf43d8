"""The push ledger of a shard: which pushes it applied, so a retried push is applied once.

A push is identified by ``(worker_id, session, seq)``. Every client picks a
random 64-bit session once and numbers its pushes from 1, so a retry (same
session, same seq) is applied once. Per worker id the shard remembers its
sessions, newest last: a new session takes over (a restarted worker, whose
seqs start again at 1); a push of an older session is a retry of an applied
push (a duplicate) or else refused with ``WorkerIdConflictError``: two live clients
share the worker id, and silently deduplicating their pushes against each
other would drop about half of them. At most ``_RETIRED_SESSIONS`` older
sessions are remembered per worker id.

The ledger also remembers, for a while, the applied pushes that went to
several shards (``note_sent``): a consistent cut (``psserver.cut``) asks the
other shards to hold them too. Checkpoints save and load it (``dedup_state``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable, Mapping

from pscore.errors import WorkerIdConflictError

log = logging.getLogger(__name__)

_DEDUP_WINDOW = 4096  # sequence numbers remembered per session; older ones count as already applied
_RETIRED_SESSIONS = 4  # older sessions remembered per worker id (beyond the newest); older ones are forgotten
# Consistent cuts (psserver.cut): how long a session's pushes sent to several shards are remembered with
# those shards. A push's pieces go to its shards at once and are retried for at most the client's deadline
# (30 s by default), so a piece that has not arrived by then never will.
CUT_WINDOW_S = 60.0

# A push's dedup key: (worker_id, session, seq).
PushKey = tuple[str, int, int]
# The dedup table of one worker id as checkpoints hold it: [(session, floor, seen seqs)], oldest first.
SessionState = list[tuple[int, int, list[int]]]


class _SeqWindow:
    """The sequence numbers of one session's recent pushes."""

    __slots__ = ("floor", "seen", "sent")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.floor = -1  # every seq <= floor counts as seen
        # Applied pushes that went to other shards too: (seq, bitmask of their shards, time.monotonic()).
        self.sent: collections.deque[tuple[int, int, float]] | None = None

    def __contains__(self, seq: int) -> bool:
        return seq <= self.floor or seq in self.seen

    def add(self, seq: int) -> None:
        self.seen.add(seq)
        # Trimmed to the newest _DEDUP_WINDOW once it holds twice as many: amortized O(1) per push (a
        # trim at every push past the window cost O(window), 0.2 ms a push). Between trims the window
        # remembers more, never less; a seq above the floor and not seen was never applied either way.
        if len(self.seen) > 2 * _DEDUP_WINDOW:
            newest = max(self.seen)
            self.floor = max(self.floor, newest - _DEDUP_WINDOW)
            self.seen = {s for s in self.seen if s > self.floor}

    def discard(self, seq: int) -> None:
        self.seen.discard(seq)


class PushLedger:
    """The pushes one shard applied, per worker id and session.

    Not thread-safe: call it from the shard's event loop only.
    """

    def __init__(self) -> None:
        # worker_id -> session -> its window; insertion order is age: the last session is the current one.
        self._sessions: dict[str, dict[int, _SeqWindow]] = {}

    def claim(self, worker_id: str, seq: int, session: int = 0) -> bool:
        """Records push ``(worker_id, session, seq)``; False if it was already recorded (a retry).

        A session not seen before for ``worker_id`` becomes its current one.

        Raises:
            WorkerIdConflictError: a new push (not a retry) of an older session of
                ``worker_id``: another client with the same id took over.
                Nothing is recorded.
        """
        sessions = self._sessions.setdefault(worker_id, {})
        window = sessions.get(session)
        if window is None:
            window = self._take_over(worker_id, sessions, session)
        elif seq <= window.floor or seq in window.seen:  # ``seq in window``, inline
            return False
        elif (current := next(reversed(sessions))) != session:
            raise WorkerIdConflictError(
                f"worker id {worker_id!r} is used by two clients at once (sessions {session:016x} and "
                f"{current:016x}, the newer); this push of session {session:016x} is refused, nothing of "
                "it applied; give each worker its own worker_id (TF_CONFIG task index, or "
                "PSWorker(worker_index=...))"
            )
        if len(window.seen) < 2 * _DEDUP_WINDOW:  # ``window.add``, inline while it needs no trim
            window.seen.add(seq)
        else:
            window.add(seq)
        return True

    def record(self, worker_id: str, seq: int, session: int = 0) -> None:
        """Records a push its primary applied (a backup replaying it): never refuses, never a duplicate."""
        sessions = self._sessions.setdefault(worker_id, {})
        window = sessions.get(session)
        if window is None:
            window = self._take_over(worker_id, sessions, session)
        window.add(seq)

    def note_sent(self, worker_id: str, seq: int, session: int, shards: Iterable[int]) -> None:
        """Remembers an applied push that was sent to other shards too (``PushRequest.shards``).

        Kept for ``CUT_WINDOW_S`` (and at most the dedup window's length per
        session): a consistent cut asks the other shards to hold it as well
        (``sent_pushes``). A no-op for a push sent to one shard.
        """
        mask = 0
        for s in shards:
            mask |= 1 << int(s)
        if mask & (mask - 1) == 0:  # one shard (or none): nothing another shard must match
            return
        window = self._sessions.get(worker_id, {}).get(session)
        if window is None:
            return
        if window.sent is None:
            window.sent = collections.deque(maxlen=_DEDUP_WINDOW)
        window.sent.append((seq, mask, time.monotonic()))

    def sent_pushes(self, window_s: float = CUT_WINDOW_S) -> list[tuple[str, int, int, list[int]]]:
        """Pushes applied in the last ``window_s`` seconds that went to several shards.

        Returns ``(worker_id, session, shard bitmask, sorted seqs)``, one entry per
        worker session and set of shards.
        """
        since = time.monotonic() - window_s
        out = []
        for worker, sessions in self._sessions.items():
            for session, window in sessions.items():
                if not window.sent:
                    continue
                while window.sent and window.sent[0][2] < since:
                    window.sent.popleft()
                by_mask: dict[int, list[int]] = {}
                for seq, mask, _ in window.sent:
                    by_mask.setdefault(mask, []).append(seq)
                out.extend((worker, session, mask, sorted(seqs)) for mask, seqs in by_mask.items())
        return out

    def recorded(self, worker_id: str, seq: int, session: int) -> bool:
        """Whether push ``(worker_id, session, seq)`` is recorded (claimed, or older than the window)."""
        window = self._sessions.get(worker_id, {}).get(session)
        return window is not None and seq in window

    def _take_over(self, worker_id: str, sessions: dict[int, _SeqWindow], session: int) -> _SeqWindow:
        if sessions:
            log.info(
                "worker %s: session %016x takes over from session %016x (a restarted or second client)",
                worker_id, session, next(reversed(sessions)),
            )  # fmt: skip
        window = sessions[session] = _SeqWindow()
        while len(sessions) > 1 + _RETIRED_SESSIONS:
            del sessions[next(iter(sessions))]
        return window

    def unclaim(self, worker_id: str, seq: int, session: int = 0) -> None:
        """Forgets a claimed push that failed before it was applied, so a retry applies it."""
        window = self._sessions.get(worker_id, {}).get(session)
        if window is not None:
            window.discard(seq)

    def dedup_state(self) -> dict[str, SessionState]:
        """Per worker id, its sessions oldest first (the last is the current one) with their windows."""
        return {
            w: [(session, win.floor, sorted(win.seen)) for session, win in sessions.items()]
            for w, sessions in self._sessions.items()
        }

    def load_dedup_state(self, state: Mapping[str, SessionState]) -> None:
        """Replaces the dedup table with what ``dedup_state`` returned."""
        self._sessions = {}
        for worker, entries in state.items():
            sessions: dict[int, _SeqWindow] = {}
            for session, floor, seen in list(entries)[-(1 + _RETIRED_SESSIONS) :]:
                window = _SeqWindow()
                window.floor = int(floor)
                window.seen = {int(s) for s in seen}
                sessions.pop(int(session), None)  # listed twice: the later place counts
                sessions[int(session)] = window
            self._sessions[worker] = sessions
