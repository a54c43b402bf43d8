"""psrun's elastic mode (``--min-np``/``--max-np``/``--host-discovery-script``): horovodrun's, on one host.

The driver starts worker processes in *slots* of this host and serves the rendezvous that
``psclient.elastic`` talks to (see :mod:`psclient.elastic.rendezvous` for the calls). Workers ask
to join; the driver forms *generations* of the ring from them:

- The first ring: once every started worker has asked (and at least ``min_np`` are alive).
- When a worker process exits with a failure (or a worker reports that a collective failed), the
  current generation is *broken*: psrun tells every worker (their collectives fail at once with
  ``HorovodInternalError``); the survivors restore their last commit and ask to join; the next
  generation is formed once every surviving member has asked: survivors first, in their old rank
  order (rank 0, which syncs the state, is the lowest surviving rank), then new workers.
- A new worker (a slot freed by a failure after its cooldown, or a slot the discovery script
  added) asks to join while the ring is healthy: the driver raises the *update* count; at their next
  ``state.commit()`` all members agree on it (a collective) and re-form the ring with the newcomer,
  which gets the state from rank 0 (``HostsUpdatedInterrupt``).

As horovodrun, a failed slot is blacklisted: not used again, or only after a cooldown
(``--blacklist-cooldown-range``); the job fails when fewer than ``min_np`` ranks are left and none
can come back within ``--elastic-timeout``, or after ``--reset-limit`` resets. Once a worker exits
with status 0 the job is finishing: no new ring is formed and workers still waiting to join are stopped.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import random
import secrets
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from psclient.elastic.rendezvous import ENV_ADDRESS, ENV_TOKEN, ENV_WORKER, LONG_POLL_S
from trainer import supervise
from trainer.cluster import is_local_host

log = logging.getLogger(__name__)

_POLL_S: Final[float] = 0.2  # how often the driver looks at its processes
_DISCOVER_EVERY_S: Final[float] = 1.0  # horovodrun's DISCOVER_HOSTS_FREQUENCY_SECS
_DISCOVERY_TIMEOUT_S: Final[float] = 30.0  # one run of the host discovery script
_GRACE_S: Final[float] = 5.0  # after SIGTERM, before SIGKILL
_MAX_BODY: Final[int] = 1 << 16


class Rendezvous:
    """The driver's rules: who is alive, who waits to join, and the generations of the ring.

    Thread-safe: the HTTP handlers (one thread per request) and the supervisor call it concurrently.

    Args:
        min_np: the fewest ranks a ring may have.
        max_np: the most ranks a ring may have.
        reset_limit: stop the job after this many re-formed rings (None: no limit).
    """

    def __init__(self, min_np: int, max_np: int, reset_limit: int | None = None) -> None:
        self.min_np = min_np
        self.max_np = max_np
        self.reset_limit = reset_limit
        self._cond = threading.Condition()
        self._alive: dict[str, int] = {}  # worker -> start order
        self._started = 0
        self._waiting: dict[str, str] = {}  # worker -> ring address it will listen on
        self.generation = 0
        self.members: list[str] = []
        self.addresses: list[str] = []
        self.broken: str | None = None  # why the current generation is broken
        self.lost: list[int] = []  # its ranks known to be gone
        self.update = 0
        self.resets = 0
        self.finished = False  # a worker exited with status 0
        self.stopped: str | None = None  # the job is ending: why

    # -- what the supervisor tells it -----------------------------------------

    def started(self, worker: str) -> None:
        """A worker process was started."""
        with self._cond:
            self._alive[worker] = self._started
            self._started += 1

    def exited(self, worker: str, code: int) -> None:
        """A worker process ended with ``code`` (negative: killed by that signal)."""
        with self._cond:
            self._alive.pop(worker, None)
            self._waiting.pop(worker, None)
            if code == 0:
                self.finished = True
            elif worker in self.members:
                rank = self.members.index(worker)
                self._break(f"rank {rank} (worker {worker}) exited with status {code}", rank)
            self._try_form()
            self._cond.notify_all()

    def stop(self, reason: str) -> None:
        """Ends the job: every waiting or later join is told to stop."""
        with self._cond:
            if self.stopped is None:
                self.stopped = reason
            self._cond.notify_all()

    def alive(self) -> list[str]:
        """The workers whose processes run, in start order."""
        with self._cond:
            return sorted(self._alive, key=self._alive.__getitem__)

    def waiting_outside(self) -> list[str]:
        """Workers waiting to join that are not members of the current generation."""
        with self._cond:
            return [w for w in self._waiting if w not in self.members]

    # -- what workers ask -------------------------------------------------------

    def join(
        self, worker: str, address: str, after: int, wait_s: float, *, update: bool = False
    ) -> dict[str, Any]:
        """Worker ready for a ring newer than generation ``after`` (see ``psclient.elastic.rendezvous``)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            if worker not in self._alive:
                return {"status": "stop", "reason": f"worker {worker} is not a running worker of this job"}
            if self.finished and self.stopped is None:
                return {"status": "stop", "reason": "a worker finished (exited 0): the job is ending"}
            if not (self.generation > after and worker in self.members):  # not served yet
                if worker in self.members and self.broken is None and not update:
                    # A member asks for a new ring while this one is healthy: a collective failed there.
                    self._break(f"rank {self.members.index(worker)} (worker {worker}) asked for a new ring")
                newcomer = worker not in self._waiting and worker not in self.members
                self._waiting[worker] = address
                if (
                    newcomer
                    and self.generation > 0
                    and self.broken is None
                    and len(self.members) < self.max_np
                ):
                    self.update += 1  # the members re-form the ring at their next commit
                self._try_form()
                self._cond.notify_all()
            while True:
                if self.stopped is not None:
                    return {"status": "stop", "reason": self.stopped}
                if self.generation > after and worker in self.members and worker not in self._waiting:
                    return {
                        "status": "assigned",
                        "generation": self.generation,
                        "addresses": list(self.addresses),
                        "rank": self.members.index(worker),
                        "update": self.update,
                    }
                if worker not in self._alive:
                    return {"status": "stop", "reason": f"worker {worker} was stopped"}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"status": "wait"}
                self._cond.wait(left)

    def abort(self, worker: str, generation: int, reason: str) -> None:
        """A member saw a collective of ``generation`` fail."""
        with self._cond:
            if generation == self.generation and self.broken is None and worker in self.members:
                self._break(f"rank {self.members.index(worker)} (worker {worker}): {reason}")
                self._cond.notify_all()

    def watch(self, generation: int, broken: bool, update: int, wait_s: float) -> dict[str, Any]:
        """Answers once the driver knows more than the worker does, or after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                news = (
                    self.generation != generation
                    or (self.broken is not None and not broken)
                    or self.update > update
                    or self.stopped is not None
                )
                left = deadline - time.monotonic()
                if news or left <= 0:
                    return {
                        "generation": self.generation,
                        "broken": self.broken is not None or self.stopped is not None,
                        "reason": self.broken or self.stopped or "",
                        "lost": list(self.lost),
                        "update": self.update,
                    }
                self._cond.wait(left)

    # -- internals (called with the lock held) -------------------------------

    def _break(self, reason: str, lost_rank: int | None = None) -> None:
        if self.broken is None:
            self.broken = reason
            log.warning("psrun: ring generation %d broken: %s", self.generation, reason)
        if lost_rank is not None and lost_rank not in self.lost:
            self.lost.append(lost_rank)

    def _try_form(self) -> None:
        if self.stopped is not None or self.finished:
            return
        ready = [w for w in self._waiting if w in self._alive]
        if self.generation == 0:
            if set(self._alive) - set(self._waiting) or len(ready) < self.min_np:
                return
        else:
            survivors = [m for m in self.members if m in self._alive]
            if not survivors:
                self.stop("no rank of the last ring is left to hand its state on")
                return
            if any(m not in self._waiting for m in survivors):
                return  # members still training (a healthy ring), or not yet back after a failure
            if len(ready) < self.min_np:
                return
        old = [m for m in self.members if m in self._waiting]
        new = sorted((w for w in ready if w not in self.members), key=self._alive.__getitem__)
        chosen = (old + new)[: self.max_np]
        if self.generation > 0:
            self.resets += 1
            if self.reset_limit is not None and self.resets > self.reset_limit:
                self.stop(f"the ring was re-formed {self.reset_limit} times (--reset-limit)")
                return
        self.generation += 1
        self.members = chosen
        self.addresses = [self._waiting.pop(w) for w in chosen]
        self.broken = None
        self.lost = []
        log.warning(
            "psrun: ring generation %d: %d ranks (workers %s)",
            self.generation,
            len(chosen),
            ", ".join(chosen),
        )


class RendezvousServer:
    """The rendezvous over HTTP on loopback (JSON bodies, a bearer token), in daemon threads.

    Args:
        rendezvous: the rules.
        token: the secret every request must carry.
        host: where to listen (loopback: the workers run on this host).
    """

    def __init__(self, rendezvous: Rendezvous, token: str, host: str = "127.0.0.1") -> None:
        self.rendezvous = rendezvous
        self._token = token
        handler = type("Handler", (_Handler,), {"server_ref": self})
        self._http = ThreadingHTTPServer((host, 0), handler)
        self._http.daemon_threads = True
        self.address = f"{host}:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="psrun-rendezvous", daemon=True)

    def start(self) -> RendezvousServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def authorized(self, header: str | None) -> bool:
        expected = f"Bearer {self._token}"
        return header is not None and hmac.compare_digest(header.encode(), expected.encode())


class _Handler(BaseHTTPRequestHandler):
    server_ref: RendezvousServer

    def do_POST(self) -> None:
        if not self.server_ref.authorized(self.headers.get("Authorization")):
            self._reply(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong rendezvous token"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 <= length <= _MAX_BODY:
                raise ValueError(f"body of {length} bytes")
            body = json.loads(self.rfile.read(length))
            reply = self._dispatch(self.path, body)
        except (ValueError, KeyError, TypeError) as err:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"bad request to {self.path}: {err}"})
            return
        if reply is None:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such call {self.path}"})
        else:
            self._reply(HTTPStatus.OK, reply)

    def _dispatch(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        rdv = self.server_ref.rendezvous
        if path == "/join":
            worker, address, after = str(body["worker"]), str(body["address"]), int(body["after"])
            return rdv.join(worker, address, after, LONG_POLL_S, update=bool(body.get("update", False)))
        if path == "/abort":
            rdv.abort(str(body["worker"]), int(body["generation"]), str(body["reason"])[:2000])
            return {"ok": True}
        if path == "/watch":
            return rdv.watch(int(body["generation"]), bool(body["broken"]), int(body["update"]), LONG_POLL_S)
        return None

    def _reply(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the worker is gone (killed mid long poll)
            log.debug("rendezvous: %s left before the answer to %s", self.client_address, self.path)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("rendezvous: " + format, *args)


def discover_slots(script: str, default_slots: int = 1) -> int:
    """Runs horovodrun's host discovery script; returns the slots it lists for this host.

    Each output line is ``HOST`` or ``HOST:SLOTS`` (``default_slots`` when omitted). Other hosts are
    ignored with a warning: psrun starts ranks on this host only.

    Raises:
        ValueError: the script failed, timed out, or printed a malformed line.
    """
    try:
        proc = subprocess.run(
            shlex.split(script), capture_output=True, text=True, timeout=_DISCOVERY_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"host discovery script {script!r} failed: {err}") from None
    if proc.returncode != 0:
        raise ValueError(
            f"host discovery script {script!r} exited with {proc.returncode}: {proc.stderr[-500:]}"
        )
    slots = 0
    for line in proc.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        host, sep, count = line.rpartition(":")
        if not sep:
            host, count = count, str(default_slots)
        if not host or not count.isdigit():
            raise ValueError(f"host discovery script printed {line!r}; expected HOST or HOST:SLOTS")
        if is_local_host(host):
            slots += int(count)
        else:
            log.warning("psrun: ignoring discovered host %s: psrun starts ranks on this host only", host)
    return slots


@dataclass(slots=True)
class _Slot:
    index: int
    worker: str | None = None  # the worker running in it
    blocked_until: float = 0.0  # blacklisted until then (inf: for good)
    failures: int = 0


@dataclass
class ElasticOptions:
    """psrun's elastic settings (horovodrun's names).

    Attributes:
        np_: ranks needed to start training.
        min_np: fewest ranks to go on with.
        max_np: most ranks.
        slots: slots on this host without a discovery script (``-H localhost:N``; default ``np_``).
        discovery_script: horovodrun's ``--host-discovery-script``.
        slots_per_host: slots of a discovered host line without ``:SLOTS``.
        elastic_timeout: how long to wait for ``min_np`` ranks after a loss, in seconds.
        reset_limit: end the job after this many re-formed rings.
        cooldown_range: ``(min, max)`` seconds a failed slot stays blacklisted; None: for good.
        timeout: end the job after this many seconds (status 124).
    """

    np_: int
    min_np: int
    max_np: int
    slots: int
    discovery_script: str | None = None
    slots_per_host: int = 1
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    timeout: float = 1800.0
    extra_env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raises ValueError for inconsistent counts."""
        if not 1 <= self.min_np <= self.np_:
            raise ValueError(f"need 1 <= --min-np ({self.min_np}) <= -np ({self.np_})")
        if self.discovery_script is None and self.slots < self.np_:
            raise ValueError(f"-np {self.np_} needs {self.np_} slots; -H gives {self.slots}")
        if self.max_np < self.np_:
            raise ValueError(f"--max-np ({self.max_np}) must be >= -np ({self.np_})")
        if self.cooldown_range is not None and not 0 < self.cooldown_range[0] <= self.cooldown_range[1]:
            raise ValueError("--blacklist-cooldown-range needs 0 < MIN <= MAX")


def _cooldown(slot: _Slot, cooldown_range: tuple[float, float] | None) -> float:
    """How long a slot that just failed stays blacklisted (horovodrun's: MIN * 2^failures + jitter)."""
    if cooldown_range is None:
        return float("inf")
    low, high = cooldown_range
    return min(high, low * (1 << min(slot.failures, 16)) + random.uniform(0, low))


def run_elastic(cmd: Sequence[str], opts: ElasticOptions) -> int:
    """Runs ``cmd`` as an elastic job on this host; returns its exit status.

    0 when the job finished (a worker exited 0 and no member failed after that), even if ranks were
    lost on the way; otherwise the status of the failure that ended it (1 when there is none), 124 on
    ``timeout``.

    Raises:
        ValueError: bad options, or the discovery script fails on its first run.
    """
    opts.validate()
    rdv = Rendezvous(opts.min_np, opts.max_np, opts.reset_limit)
    token = secrets.token_hex(16)
    server = RendezvousServer(rdv, token).start()
    base_env = {**os.environ, **opts.extra_env, ENV_ADDRESS: server.address, ENV_TOKEN: token}
    base_env.pop("TF_CONFIG", None)  # the ring comes from the rendezvous

    target = (
        discover_slots(opts.discovery_script, opts.slots_per_host) if opts.discovery_script else opts.slots
    )
    if target < opts.np_:
        server.close()
        raise ValueError(f"-np {opts.np_} needs {opts.np_} slots; the host discovery script gives {target}")
    slots = [_Slot(i) for i in range(target)]
    procs: dict[str, subprocess.Popen[str]] = {}
    relays: list[threading.Thread] = []
    removed: set[str] = set()
    next_worker = 0
    last_failure: int | None = None
    failure_after_finish: int | None = None
    short_since: float | None = None
    started_at = time.monotonic()
    next_discovery = started_at + _DISCOVER_EVERY_S

    def start(slot: _Slot) -> None:
        nonlocal next_worker
        worker = str(next_worker)
        next_worker += 1
        env = {**base_env, ENV_WORKER: worker}
        proc, threads = supervise.start_prefixed(cmd, env, worker)
        procs[worker] = proc
        relays.extend(threads)
        slot.worker = worker
        rdv.started(worker)
        print(
            f"psrun: started worker {worker} (pid {proc.pid}) in slot {slot.index}",
            file=sys.stderr,
            flush=True,
        )

    try:
        for slot in slots[: min(target, opts.max_np)]:
            start(slot)
        while True:
            now = time.monotonic()
            for worker, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[worker]
                slot = next(s for s in slots if s.worker == worker)
                slot.worker = None
                if worker in removed:  # stopped by psrun: not a failure of the job
                    rdv.exited(worker, -15)
                    continue
                was_finished = rdv.finished
                rdv.exited(worker, code)
                if code != 0:
                    last_failure = code
                    if was_finished:
                        failure_after_finish = code
                    slot.failures += 1
                    slot.blocked_until = now + _cooldown(slot, opts.cooldown_range)
                    print(
                        f"psrun: worker {worker} exited with status {code}; {len(procs)} running "
                        f"(--min-np {opts.min_np})",
                        file=sys.stderr,
                        flush=True,
                    )
            if rdv.finished:
                for worker in rdv.waiting_outside():
                    if worker in procs and worker not in removed:
                        removed.add(worker)
                        procs[worker].terminate()
            if opts.discovery_script is not None and now >= next_discovery:
                next_discovery = now + _DISCOVER_EVERY_S
                try:
                    target = discover_slots(opts.discovery_script, opts.slots_per_host)
                except ValueError as err:
                    log.warning("psrun: %s (keeping %d slots)", err, target)
                while len(slots) < target:
                    slots.append(_Slot(len(slots)))
                for slot in slots[target:]:  # slots the script took away: stop their workers
                    if slot.worker is not None and slot.worker not in removed and slot.worker in procs:
                        removed.add(slot.worker)
                        procs[slot.worker].terminate()
            if not rdv.finished and rdv.stopped is None:
                for slot in slots[:target]:
                    if len(procs) >= opts.max_np:
                        break
                    if slot.worker is None and slot.blocked_until <= now:
                        start(slot)
            if rdv.stopped is not None:
                print(f"psrun: stopping the job: {rdv.stopped}", file=sys.stderr, flush=True)
                return last_failure or 1
            if not procs:
                if rdv.finished:
                    return failure_after_finish or 0
                return last_failure or 1
            running = len(procs)
            if running < opts.min_np and not rdv.finished:
                comeback = [s for s in slots[:target] if s.worker is None and s.blocked_until != float("inf")]
                if not comeback and opts.discovery_script is None:
                    rdv.stop(
                        f"{running} ranks left, fewer than --min-np {opts.min_np}, and no slot can come back"
                    )
                    continue
                short_since = now if short_since is None else short_since
                if now - short_since > opts.elastic_timeout:
                    rdv.stop(f"fewer than --min-np {opts.min_np} ranks for {opts.elastic_timeout:.0f} s")
                    continue
            else:
                short_since = None
            if now - started_at > opts.timeout:
                print(
                    f"psrun: workers still running after {opts.timeout:.0f}s; stopping them", file=sys.stderr
                )
                return 124
            time.sleep(_POLL_S)
    finally:
        rdv.stop("psrun is stopping")
        supervise.stop(list(procs.values()), _GRACE_S)
        for t in relays:
            t.join(timeout=5)
        server.close()
