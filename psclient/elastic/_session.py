"""ElasticSession: one worker process's membership in a psrun elastic job (rendezvous, ring, watcher)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from psclient.collective import Ring
from psclient.elastic._errors import RendezvousError
from psclient.elastic._ring import ElasticRing
from psclient.elastic.rendezvous import Assignment, RendezvousClient, held_loopback_address

log = logging.getLogger(__name__)

_WATCH_RETRY_S: Final[float] = 1.0  # after psrun could not be reached
_BEHIND_S: Final[float] = 0.2  # psrun has a newer generation than this rank's ring: it is re-forming


class ElasticSession:
    """This worker's place in a psrun elastic job.

    ``start`` waits for the first ring psrun forms and returns it as an :class:`ElasticRing`; a
    watcher thread then long-polls psrun and breaks the ring's generation as soon as psrun reports a
    lost rank (so a collective waiting for that rank fails at once). ``reset`` forms the next ring
    (after a failure, or when ranks are waiting to join) and continues the same ``ElasticRing`` on it.

    Args:
        client: the rendezvous client (``RendezvousClient.from_env()``).
        ring_factory: makes this rank's ``Ring`` from ``(addresses, rank)`` (timeouts, security, transport).
        negotiate: the ring's control round (see :class:`ElasticRing`).

    Thread-safety: ``start``, ``reset`` and ``hosts_updated`` from the training thread only.
    """

    def __init__(
        self,
        client: RendezvousClient,
        ring_factory: Callable[[Sequence[str], int], Ring],
        *,
        negotiate: bool = True,
    ) -> None:
        self._client = client
        self._negotiate = negotiate
        self._factory = ring_factory
        self._ring: ElasticRing | None = None
        self._assignment: Assignment | None = None
        self._update_seen = 0  # the largest membership-update count psrun has reported (watcher thread)
        self._update_base = 0  # the count when this ring was formed (the same on every rank)
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def assignment(self) -> Assignment:
        """The current ring's generation, addresses and this worker's rank.

        Raises:
            RuntimeError: before ``start``.
        """
        if self._assignment is None:
            raise RuntimeError("the elastic session has not started")
        return self._assignment

    @property
    def ring(self) -> ElasticRing:
        """The ring (the same object across generations).

        Raises:
            RuntimeError: before ``start``.
        """
        if self._ring is None:
            raise RuntimeError("the elastic session has not started")
        return self._ring

    def start(self) -> ElasticRing:
        """Joins the job's first ring this worker is part of (a new worker: the next one psrun forms).

        Raises:
            RendezvousError: psrun ended the job, or formed no ring within its elastic timeout.
            UnavailableError: this rank's ring address cannot be bound.
        """
        ring = self._form(after=0)
        generation = self.assignment.generation
        self._ring = ElasticRing(
            ring, generation=generation, elastic=True, on_break=self._report, negotiate=self._negotiate
        )
        self._watcher = threading.Thread(target=self._watch, name="psclient-elastic-watch", daemon=True)
        self._watcher.start()
        return self._ring

    def reset(self) -> Assignment:
        """Forms the next ring with the ranks that are left (and new ones) and continues on it.

        Raises:
            RendezvousError: psrun ended the job (e.g. fewer than --min-np ranks are left).
            UnavailableError: this rank's ring address cannot be bound.
        """
        ring = self._form(after=self.ring.generation, update=not self.ring.broken)
        self.ring.replace(ring, self.assignment.generation)
        log.info(
            "rank %d/%d: ring generation %d formed",
            self.assignment.rank,
            len(self.assignment.addresses),
            self.assignment.generation,
        )
        return self.assignment

    def hosts_updated(self) -> bool:
        """Whether ranks are waiting to join (a collective: every rank gets the same answer at a commit).

        Raises:
            HorovodInternalError: the ring broke.
        """
        seen = np.array([self._update_seen], np.int64)
        agreed = int(self.ring.allreduce(seen, "max")[0])
        if agreed > self._update_base:
            self._update_base = agreed
            return True
        return False

    def close(self) -> None:
        """Stops the watcher (the ring is closed by its owner)."""
        self._closed.set()

    def _form(self, after: int, update: bool = False) -> Ring:
        with held_loopback_address() as address:  # held until this rank's ring has bound it
            assignment = self._client.join(address, after, update=update)
            ring = self._factory(list(assignment.addresses), assignment.rank)
        self._assignment = assignment
        self._update_base = assignment.update
        self._update_seen = max(self._update_seen, assignment.update)
        return ring

    def _report(self, generation: int, reason: str) -> None:
        def send() -> None:
            try:
                self._client.abort(generation, reason)
            except RendezvousError as err:
                log.warning("could not tell psrun that generation %d broke: %s", generation, err)

        threading.Thread(target=send, name="psclient-elastic-abort", daemon=True).start()

    def _watch(self) -> None:
        ring = self.ring
        while not self._closed.is_set():
            generation, broken = ring.generation, ring.broken
            try:
                event = self._client.watch(generation, broken, self._update_seen)
            except RendezvousError as err:
                log.debug("watching psrun: %s", err)
                self._closed.wait(_WATCH_RETRY_S)
                continue
            self._update_seen = max(self._update_seen, event.update)
            if event.generation == generation and event.broken:
                ring.interrupt(generation, event.reason, event.lost)
            elif event.generation > generation:
                ring.interrupt(generation, f"psrun formed generation {event.generation}")
                self._closed.wait(_BEHIND_S)
