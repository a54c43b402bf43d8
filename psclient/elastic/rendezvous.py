"""The worker's side of psrun's elastic rendezvous: which ring to form, and news of lost or new ranks.

``psrun --min-np/--max-np`` (elastic mode) serves a small JSON-over-HTTP rendezvous on loopback
and gives every worker process its address, a secret token and a worker id in the environment
(``PSRUN_RENDEZVOUS``, ``PSRUN_RENDEZVOUS_TOKEN``, ``PSRUN_WORKER``). Calls (all ``POST``, JSON
bodies, ``Authorization: Bearer TOKEN``):

- ``/join {worker, address, after, update}``: this worker is ready for a ring newer than generation
  ``after``, listening at ``address`` (``update``: re-forming at a commit, not after a failure).
  psrun answers when it has formed one that includes the worker: ``{status: "assigned",
  generation, addresses, rank, update}``, or ``{status: "wait"}`` after a long-poll interval (ask
  again), or ``{status: "stop", reason}`` (the job ends).
- ``/abort {worker, generation, reason}``: a collective of that generation failed here.
- ``/watch {generation, broken, update}``: waits (long poll) until the generation is broken (psrun saw a
  rank exit, or a rank reported a failure), replaced, or until ranks are waiting to join (``update``
  grows); answers ``{generation, broken, reason, lost, update}``.

Standard library only (no TensorFlow, no extra dependency).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from psclient.elastic._errors import RendezvousError

ENV_ADDRESS: Final[str] = "PSRUN_RENDEZVOUS"  # HOST:PORT of psrun's rendezvous
ENV_TOKEN: Final[str] = "PSRUN_RENDEZVOUS_TOKEN"  # the secret every call carries
ENV_WORKER: Final[str] = "PSRUN_WORKER"  # this process's worker id (its start index, "0", "1", ...)
LONG_POLL_S: Final[float] = 10.0  # psrun answers a join or watch within this (then the worker asks again)
_HTTP_SLACK_S: Final[float] = 10.0  # on top of the long poll: a loaded machine
_DEFAULT_JOIN_TIMEOUT_S: Final[float] = 600.0  # horovodrun's --elastic-timeout default


@dataclass(frozen=True, slots=True)
class Assignment:
    """A ring psrun formed: its generation, the ranks' addresses in rank order, this worker's rank.

    ``update`` is psrun's count of membership updates when it formed the ring (every rank gets the same
    one; a larger count seen later means ranks are waiting to join).
    """

    generation: int
    addresses: tuple[str, ...]
    rank: int
    update: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """What psrun's ``/watch`` answered."""

    generation: int
    broken: bool
    reason: str
    lost: tuple[int, ...]
    update: int


def free_loopback_address() -> str:
    """A ``127.0.0.1:PORT`` that was free a moment ago (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def held_loopback_address() -> Iterator[str]:
    """A ``127.0.0.1:PORT`` kept bound for this process until the block ends, for a server to bind inside it.

    The holding socket sets ``SO_REUSEADDR`` and never listens, so a server that also sets it (gRPC's
    do) binds the port, while every other ``bind`` (an ephemeral one included) and ``connect`` on the
    machine is refused it: the port cannot be taken between psrun handing it to the other ranks and
    this rank's ring binding it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as hold:
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hold.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{hold.getsockname()[1]}"


class RendezvousClient:
    """Talks to psrun's rendezvous for one worker process. Methods may be called from any thread.

    Args:
        address: ``HOST:PORT`` of the rendezvous.
        token: the shared secret.
        worker: this process's worker id.
        join_timeout: how long :meth:`join` waits for a ring (psrun's ``--elastic-timeout``).
    """

    def __init__(
        self, address: str, token: str, worker: str, *, join_timeout: float = _DEFAULT_JOIN_TIMEOUT_S
    ) -> None:
        self.address = address
        self.worker = worker
        self._token = token
        self._join_timeout = join_timeout

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RendezvousClient | None:
        """The client psrun's environment describes, or None outside a psrun elastic job.

        Raises:
            ValueError: the rendezvous address is set but the token or worker id is missing.
        """
        address = environ.get(ENV_ADDRESS)
        if not address:
            return None
        token, worker = environ.get(ENV_TOKEN), environ.get(ENV_WORKER)
        if not token or not worker:
            raise ValueError(f"{ENV_ADDRESS} is set but {ENV_TOKEN} or {ENV_WORKER} is not (use psrun)")
        return cls(address, token, worker)

    def join(self, address: str, after: int, *, update: bool = False) -> Assignment:
        """Waits until psrun forms a ring newer than generation ``after`` that includes this worker.

        ``update``: every member re-forms the ring at a commit because ranks wait to join (the ring is
        not broken); otherwise a member asking again means that its ring failed.

        Raises:
            RendezvousError: psrun ended the job (the reason), refused the worker, cannot be reached, or
                formed no ring for this worker within the join timeout.
        """
        deadline = time.monotonic() + self._join_timeout
        while True:
            body = {"worker": self.worker, "address": address, "after": after, "update": update}
            reply = self._post("/join", body)
            status = reply.get("status")
            if status == "assigned":
                return Assignment(
                    int(reply["generation"]),
                    tuple(str(a) for a in reply["addresses"]),
                    int(reply["rank"]),
                    int(reply["update"]),
                )
            if status == "stop":
                raise RendezvousError(f"psrun ended the job: {reply.get('reason', '')}")
            if status != "wait":
                raise RendezvousError(f"psrun's rendezvous answered {reply!r}")
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"worker {self.worker}: no ring formed within {self._join_timeout:.0f} s "
                    "(psrun waits for --min-np ranks)"
                )

    def abort(self, generation: int, reason: str) -> None:
        """Tells psrun that a collective of ``generation`` failed here (so the other ranks stop waiting).

        Raises:
            RendezvousError: psrun cannot be reached.
        """
        self._post("/abort", {"worker": self.worker, "generation": generation, "reason": reason})

    def watch(self, generation: int, broken: bool, update: int) -> WatchEvent:
        """One long poll: returns when psrun knows more than ``(generation, broken, update)``, or later.

        Raises:
            RendezvousError: psrun cannot be reached.
        """
        reply = self._post("/watch", {"generation": generation, "broken": broken, "update": update})
        return WatchEvent(
            int(reply["generation"]),
            bool(reply["broken"]),
            str(reply.get("reason", "")),
            tuple(int(r) for r in reply.get("lost", ())),
            int(reply["update"]),
        )

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://{self.address}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._token}"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=LONG_POLL_S + _HTTP_SLACK_S) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace")
            raise RendezvousError(f"psrun's rendezvous refused {path}: HTTP {err.code}: {detail}") from None
        except (OSError, ValueError) as err:
            raise RendezvousError(f"psrun's rendezvous at {self.address} cannot be reached: {err}") from None
        if not isinstance(reply, dict):
            raise RendezvousError(f"psrun's rendezvous answered {reply!r}")
        return reply
