"""The replication lease: when a replicated primary may serve, and when its backup may take over.

A primary whose backup has confirmed (``psserver.replication``) serves client
calls only while it holds a lease. Every acknowledgement from the backup renews
it until ``lease_s`` after the primary *sent* the message acknowledged
(heartbeats go every ``lease_s / 4`` while no update flows). The backup, once
its primary is gone (the stream ended, or no message for ``silence_limit``),
takes over only ``backup_wait(lease_s)`` after the last message it read, so
that the primary's lease has expired first and the two never serve at once.

Why that is enough, with two clocks that run at rates within ``MAX_CLOCK_DRIFT``
(``rho``) of real time and no bound on message delay: the backup acknowledges a
message only after it has read it, so the message was sent (primary time
``s``) before the backup's last read (backup time ``r``). The primary's lease
ends, in real time, at most ``lease_s / (1 - rho)`` after ``s``; the backup waits
at least ``backup_wait / (1 + rho)`` after ``r``, which is later than ``s``. So
``backup_wait >= lease_s * (1 + rho) / (1 - rho)`` keeps the two apart whatever the
delay: counting the lease from the send (not from the acknowledgement's
arrival) is what takes the message delay out of the bound.

Both sides read ``clock()``: ``CLOCK_BOOTTIME`` on Linux (monotonic, and it goes
on counting while the machine is suspended, which ``CLOCK_MONOTONIC`` does not),
else ``time.monotonic()``. A wall clock stepped by NTP changes neither. What
the bound does not cover: a clock running faster or slower than ``rho`` (1 %:
NTP slews at most 0.05 %, quartz drifts about 0.005 %), and a primary process
paused between checking its lease and acting on it. A primary checks the lease
in the same event-loop step as it reads or writes state, and answers a push only
once the backup has acknowledged the update, so a pause can delay an answer but
never make it wrong.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

DEFAULT_LEASE_S = 2.0
MAX_CLOCK_DRIFT = 0.01  # rho: the largest rate error of either clock against real time (1 %)
HEARTBEATS_PER_LEASE = 4  # a heartbeat every lease_s / 4: three can be late or lost before it lapses
_TAKEOVER_MARGIN_S = 0.05  # on top of the bound: scheduling of the backup's own timers
_SILENCE_LEASES = 0.75  # a backup suspects its primary after 3 heartbeats' time without a message

if hasattr(time, "CLOCK_BOOTTIME"):

    def clock() -> float:
        """Seconds on the lease clock (``CLOCK_BOOTTIME``: monotonic, counts suspend)."""
        return time.clock_gettime(time.CLOCK_BOOTTIME)

else:  # pragma: no cover - not Linux

    def clock() -> float:
        """Seconds on the lease clock (``time.monotonic()``)."""
        return time.monotonic()


@contextlib.contextmanager
def use_clock(source: Callable[[], float]) -> Iterator[None]:
    """Reads the lease clock from ``source`` inside the block (the replication simulation's virtual
    clocks, ``psload.simulation``); every lease decision of ``psserver.replication`` and
    ``psserver.backup`` reads ``clock()`` through this module, so they all follow it."""
    global clock
    real = clock
    clock = source
    try:
        yield
    finally:
        clock = real


def backup_wait(lease_s: float) -> float:
    """How long after its last read from the primary a backup waits before taking over.

    >>> round(backup_wait(2.0), 3)
    2.09
    """
    return lease_s * (1 + MAX_CLOCK_DRIFT) / (1 - MAX_CLOCK_DRIFT) + _TAKEOVER_MARGIN_S


def silence_limit(lease_s: float) -> float:
    """How long a backup hears nothing from its primary before it counts it as gone (a silent death).

    A stream that ends (the primary's process died, its machine answered with
    a reset) is noticed at once; this catches a primary that stopped without
    a word (a machine gone, a partition). Three heartbeats' time: one late or
    lost heartbeat is not a death. The backup then listens one heartbeat more
    (``psserver.replication``: a backup that was itself paused reads the
    messages that waited in its socket), and takes over no earlier than
    ``backup_wait`` after its last read, so the clients of a silent primary
    reach the backup about ``backup_wait`` after the primary's last word, not
    later. Declaring early never breaks the lease (the takeover still waits
    ``backup_wait``); a false alarm on a live primary, cut from its backup
    only, costs a failover that its lapsed lease forces anyway.

    >>> silence_limit(2.0)
    1.5
    """
    return _SILENCE_LEASES * lease_s


def heartbeat_every(lease_s: float) -> float:
    """Seconds between a primary's heartbeats.

    >>> heartbeat_every(2.0)
    0.5
    """
    return lease_s / HEARTBEATS_PER_LEASE
