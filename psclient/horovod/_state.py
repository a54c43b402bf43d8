"""The process's Horovod-style state: ``init`` reads the layout (TF_CONFIG) and opens the ring.

Horovod's API is global by design (``hvd.init()`` then ``hvd.rank()`` anywhere), so this
module holds one ``AllReduceWorker`` per process; everything else passes it down. Its ring is a
``psclient.elastic.ElasticRing`` (Horovod's ``join``); in a psrun elastic job (``psrun --min-np``)
the layout comes from psrun's rendezvous instead, and ``reset`` moves the same worker and ring
object onto each new generation of the ring (so optimizers and traced steps keep working).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from psclient.collective import Ring
from psclient.elastic import ElasticRing, ElasticSession, RendezvousClient
from psclient.elastic.rendezvous import free_loopback_address
from psclient.keras import AllReduceWorker, ring_from_tf_config

log = logging.getLogger(__name__)

_RING_TIMEOUT_S = 120.0  # deadline of each collective; covers peers that import TF slowly
JOIN_ENV = "PS_HOROVOD_JOIN"  # "0": no control round per collective; hvd.join() is then only a barrier


class UnsupportedError(NotImplementedError):
    """A Horovod feature that psclient.horovod does not provide; the message names the alternative."""


def unsupported(what: str, instead: str) -> NoReturn:
    """Raises :class:`UnsupportedError` for ``what``, naming what to use ``instead``."""
    raise UnsupportedError(f"{what} is not supported by psclient.horovod; {instead}")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where this process sits: its rank among ``addresses`` and the host-local/cross-host indices.

    Ranks whose ring addresses share a host name are on one host (Horovod's "local" ranks);
    ``cross_rank`` is this host's index among the hosts that have a rank with this ``local_rank``.

    >>> lay = Layout.from_addresses(["a:1", "a:2", "b:1", "b:2"], rank=3)
    >>> lay.local_rank, lay.local_size, lay.cross_rank, lay.cross_size
    (1, 2, 1, 2)
    """

    addresses: tuple[str, ...]
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    @property
    def size(self) -> int:
        return len(self.addresses)

    @classmethod
    def from_addresses(cls, addresses: Sequence[str], rank: int) -> Layout:
        hosts = [a.rpartition(":")[0] for a in addresses]
        mine = hosts[rank]
        local = [r for r, h in enumerate(hosts) if h == mine]
        local_rank = local.index(rank)
        by_host: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(h, []).append(r)
        peers = [h for h, ranks in by_host.items() if len(ranks) > local_rank]  # first-seen host order
        return cls(tuple(addresses), rank, local_rank, len(local), peers.index(mine), len(peers))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Layout | None:
        """The layout ``TF_CONFIG`` describes (``psrun`` and ``pstrain launch`` set it), or None without one.

        Raises:
            ValueError: TF_CONFIG is malformed or this task is not one of its workers.
        """
        if not environ.get("TF_CONFIG"):
            return None
        addresses, rank = ring_from_tf_config(environ)
        return cls.from_addresses(addresses, rank)


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worker: AllReduceWorker | None = None
        self.layout: Layout | None = None
        self.ring: ElasticRing | None = None
        self.session: ElasticSession | None = None  # in a psrun elastic job


_state = _State()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Joins the ring of this job (Horovod's ``hvd.init``); a no-op when already initialized.

    The layout comes from ``TF_CONFIG`` (``psrun`` and ``pstrain launch --mode allreduce`` set it: the
    ring addresses in rank order and this task's index), or from psrun's rendezvous in an elastic job.
    ``PS_HOROVOD_JOIN=0`` in the environment (on every rank) drops the control round that each
    collective runs for ``hvd.join``; ``join`` is then only a barrier. Without ``TF_CONFIG`` this process
    is a world of size 1 (every collective returns its input), as a script run without ``horovodrun``.

    Raises:
        UnsupportedError: ``comm`` (MPI communicators) or ``process_sets``.
        ValueError: TF_CONFIG is malformed.
        UnavailableError: this rank's ring address cannot be bound.
    """
    if comm is not None:
        unsupported("hvd.init(comm=...) (MPI communicators)", "start the ranks with psrun -np N")
    if process_sets:
        unsupported("process sets", "start one psrun job per group of ranks")
    with _state.lock:
        if _state.worker is not None:
            return
        client = RendezvousClient.from_env()
        negotiate = os.environ.get(JOIN_ENV, "1") != "0"
        session: ElasticSession | None = None
        if client is not None:  # a psrun elastic job: psrun's rendezvous forms the ring
            session = ElasticSession(client, _new_ring, negotiate=negotiate)
            ring = session.start()
            layout = Layout.from_addresses(session.assignment.addresses, session.assignment.rank)
        else:
            layout = Layout.from_env() or Layout.from_addresses([free_loopback_address()], 0)
            ring = ElasticRing(_new_ring(layout.addresses, layout.rank), negotiate=negotiate)
        _state.worker = AllReduceWorker(ring=ring)  # type: ignore[arg-type]  # the Ring's API, and join
        _state.layout, _state.ring, _state.session = layout, ring, session
    log.info("rank %d/%d joined the ring at %s", layout.rank, layout.size, layout.addresses[layout.rank])


def _new_ring(addresses: Sequence[str], rank: int) -> Ring:
    return Ring(list(addresses), rank, timeout=_RING_TIMEOUT_S)


def shutdown() -> None:
    """Leaves the ring (Horovod's ``hvd.shutdown``); idempotent, and run at exit."""
    with _state.lock:
        ring, session = _state.ring, _state.session
        _state.worker = _state.layout = _state.ring = _state.session = None
    if session is not None:
        session.close()
    if ring is not None:
        ring.close()


def elastic_session() -> ElasticSession | None:
    """This process's psrun elastic session, or None outside a psrun elastic job (or before ``init``)."""
    return _state.session


def reset() -> None:
    """Moves this rank onto psrun's next ring (the elastic run loop's reset); ``rank()``/``size()`` follow.

    Raises:
        RuntimeError: not in a psrun elastic job.
        RendezvousError: psrun ended the job.
    """
    session = _state.session
    if session is None:
        raise RuntimeError("hvd.elastic needs a psrun elastic job (psrun --min-np ...) to re-form the ring")
    a = session.reset()
    _state.layout = Layout.from_addresses(a.addresses, a.rank)


def ring_broken() -> bool:
    """Whether the current ring is broken (a collective failed, or psrun reported a lost rank)."""
    ring = _state.ring
    return ring is not None and ring.broken


atexit.register(shutdown)


def is_initialized() -> bool:
    """Whether ``init`` has run (and ``shutdown`` has not)."""
    return _state.worker is not None


def worker() -> AllReduceWorker:
    """This process's ``AllReduceWorker`` (for mixing with the psclient.keras API).

    Raises:
        ValueError: ``init`` has not run.
    """
    w = _state.worker
    if w is None:
        raise ValueError("psclient.horovod has not been initialized; use hvd.init()")
    return w


def _layout() -> Layout:
    worker()
    assert _state.layout is not None
    return _state.layout


def size() -> int:
    """The number of ranks (Horovod's ``hvd.size``). Raises ValueError before ``init``."""
    return _layout().size


def rank() -> int:
    """This process's rank (0 .. size - 1). Raises ValueError before ``init``."""
    return _layout().rank


def local_size() -> int:
    """The number of ranks on this host. Raises ValueError before ``init``."""
    return _layout().local_size


def local_rank() -> int:
    """This process's index among the ranks on this host (pick the GPU with it)."""
    return _layout().local_rank


def cross_size() -> int:
    """The number of hosts that have a rank with this process's ``local_rank``."""
    return _layout().cross_size


def cross_rank() -> int:
    """This host's index among the hosts that have a rank with this process's ``local_rank``."""
    return _layout().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    counts: dict[str, int] = {}
    for a in _layout().addresses:
        host = a.rpartition(":")[0]
        counts[host] = counts.get(host, 0) + 1
    return len(set(counts.values())) == 1


class _GlobalProcessSet:
    """Horovod's ``global_process_set``: every rank (the only process set supported)."""

    process_set_id = 0
    ranks = None

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(process_set_id=0, ranks=all)"


global_process_set = _GlobalProcessSet()


def check_process_set(process_set: Any) -> None:
    """Refuses any process set but the global one.

    Raises:
        UnsupportedError: another process set.
    """
    if process_set is not None and process_set is not global_process_set:
        unsupported("process sets", "use the global process set (start one psrun job per group of ranks)")


def ProcessSet(*args: Any, **kwargs: Any) -> NoReturn:
    """Not supported (raises UnsupportedError)."""
    unsupported("hvd.ProcessSet", "start one psrun job per group of ranks")


def add_process_set(*args: Any, **kwargs: Any) -> NoReturn:
    """Not supported (raises UnsupportedError)."""
    unsupported("hvd.add_process_set", "start one psrun job per group of ranks")


def remove_process_set(*args: Any, **kwargs: Any) -> NoReturn:
    """Not supported (raises UnsupportedError)."""
    unsupported("hvd.remove_process_set", "start one psrun job per group of ranks")


def start_timeline(*args: Any, **kwargs: Any) -> NoReturn:
    """Not supported (raises UnsupportedError)."""
    unsupported("the Horovod timeline", "profile with keras.callbacks.TensorBoard(profile_batch=...)")


def stop_timeline(*args: Any, **kwargs: Any) -> NoReturn:
    """Not supported (raises UnsupportedError)."""
    unsupported("the Horovod timeline", "profile with keras.callbacks.TensorBoard(profile_batch=...)")


def _false() -> bool:
    return False


# Horovod's build queries: no MPI, Gloo, NCCL, DDL, oneCCL, CUDA or ROCm collectives (the ring is gRPC/TCP).
mpi_threads_supported = mpi_enabled = mpi_built = gloo_enabled = gloo_built = _false
nccl_built = ddl_built = ccl_built = cuda_built = rocm_built = _false
