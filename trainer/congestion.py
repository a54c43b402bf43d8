"""Lets network namespaces run a TCP congestion control that the machine has but keeps to itself.

A namespace may only take as its default a congestion control named in the root namespace's
``net.ipv4.tcp_allowed_congestion_control``. Some machines build ``cubic`` in (it is listed in
``tcp_available_congestion_control``) but allow only ``reno bbr``; a ``NetnsCluster`` there would run
BBR, not what a stock cluster node runs, and every figure measured on it would be BBR's.

``CongestionAllowance.allow(name)`` adds ``name`` to the allowed list for as long as a cluster needs
it, and ``release()`` puts the list back once no cluster's namespace is left, whichever process made
them. Processes coordinate through an ``flock`` of the allowed list's own file and a record of the
original list, in ``/run/paramserver-netns`` (gone with a reboot, as the setting is) while the list is
widened. A process killed without cleaning up leaves the record; the next ``release`` on the machine
restores from it.

Needs root; where the setting cannot be written (a read-only ``/proc/sys``) ``allow`` says so and
changes nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
STATE_DIR = Path("/run/paramserver-netns")


class CongestionAllowance:
    """The machine's allowed list of congestion controls, widened while clusters need it.

    Args:
        in_use: whether a cluster still needs the widened list (``trainer.netns.clusters_exist``).
        allowed: the allowed list's sysctl file.
        available: the list of what the kernel has.
        state_dir: where the record of the original list lives while the list is widened.
    """

    def __init__(
        self,
        in_use: Callable[[], bool],
        *,
        allowed: Path = ALLOWED,
        available: Path = AVAILABLE,
        state_dir: Path = STATE_DIR,
    ) -> None:
        self._allowed = allowed
        self._available = available
        self._state_dir = state_dir
        self._record = state_dir / "allowed-congestion"
        self._in_use = in_use

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds an exclusive ``flock`` on the allowed list's own file: every process's cluster sees one
        lock, and nothing is left behind for it."""
        fd = os.open(self._allowed, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def allow(self, name: str) -> bool:
        """Makes ``name`` allowed in namespaces; True when it is (already, or now).

        False (nothing changed) when the kernel does not have ``name`` or the list cannot be written.
        Call it after the namespace that needs it exists: ``release`` keeps the list while one does.
        """
        try:
            with self._locked():
                allowed = self._allowed.read_text().split()
                if name in allowed:
                    return True
                if name not in self._available.read_text().split():
                    return False
                if not self._record.exists():  # else an earlier widening's record holds the original
                    self._state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                    self._record.write_text(" ".join(allowed) + "\n")
                self._allowed.write_text(" ".join([*allowed, name]) + "\n")
        except OSError as err:
            log.debug("cannot allow TCP congestion control %r in namespaces: %s", name, err)
            return False
        log.info(
            "allowed TCP congestion control %r in network namespaces (%s: %r -> %r) until the last "
            "cluster closes", name, self._allowed, " ".join(allowed), " ".join([*allowed, name]),
        )  # fmt: skip
        return True

    def release(self) -> None:
        """Puts the allowed list back as it was before any widening, unless a cluster still needs it.

        Call it after removing a cluster's namespaces (any process's close may be the last).
        """
        if not self._record.exists():  # nothing was widened (a record made meanwhile has its cluster)
            return
        try:
            with self._locked():
                if not self._record.exists() or self._in_use():
                    return
                original = self._record.read_text()
                self._allowed.write_text(original)
                self._record.unlink()
                with contextlib.suppress(OSError):
                    self._state_dir.rmdir()
        except OSError as err:
            log.warning("could not restore %s: %s", self._allowed, err)
            return
        log.info("restored %s to %r", self._allowed, original.strip())
