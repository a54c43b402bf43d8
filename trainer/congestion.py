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

``NeighbourRoom`` makes room in the machine's ARP table (one for every namespace) for a cluster's hosts
the same way (``WidenedSetting``: recorded, put back by the last cluster's close).

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
NEIGH_DIR = Path("/proc/sys/net/ipv4/neigh/default")
STATE_DIR = Path("/run/paramserver-netns")


class WidenedSetting:
    """A machine-wide setting (a sysctl file) changed while clusters need it and put back after.

    The first change records the original value in ``state_dir`` (once: later changes keep that record);
    ``release`` writes it back once no cluster is left (``in_use``), whichever process made them. Changes
    and the release hold an ``flock`` of the setting's own file.

    Args:
        setting: the sysctl file.
        record: the name of the original value's record in ``state_dir``.
        in_use: whether a cluster still needs the change (``trainer.netns.clusters_exist``).
        state_dir: where the records live while a setting is changed.
    """

    def __init__(self, setting: Path, record: str, in_use: Callable[[], bool], state_dir: Path) -> None:
        self._setting = setting
        self._state_dir = state_dir
        self._record = state_dir / record
        self._in_use = in_use

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds an exclusive ``flock`` on the setting's own file: every process's cluster sees one
        lock, and nothing is left behind for it."""
        fd = os.open(self._setting, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _change(self, old: str, new: str) -> None:
        """Writes ``new`` (under the lock), recording ``old`` first unless a record holds the original."""
        if not self._record.exists():  # else an earlier change's record holds the original
            self._state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._record.write_text(old + "\n")
        self._setting.write_text(new + "\n")

    def raise_to(self, minimum: int) -> int | None:
        """A number setting at least ``minimum``: its old value if it was lower (now raised), else None.

        Raises:
            OSError: the setting cannot be read or written. ValueError: it is not a number.
        """
        with self._locked():
            old = int(self._setting.read_text())
            if old >= minimum:
                return None
            self._change(str(old), str(minimum))
            return old

    def release(self) -> None:
        """Puts the setting back as it was before any change, unless a cluster still needs it.

        Call it after removing a cluster's namespaces (any process's close may be the last).
        """
        if not self._record.exists():  # nothing was changed (a record made meanwhile has its cluster)
            return
        try:
            with self._locked():
                if not self._record.exists() or self._in_use():
                    return
                original = self._record.read_text()
                self._setting.write_text(original)
                self._record.unlink()
                with contextlib.suppress(OSError):
                    self._state_dir.rmdir()
        except OSError as err:
            log.warning("could not restore %s: %s", self._setting, err)
            return
        log.info("restored %s to %r", self._setting, original.strip())


class CongestionAllowance(WidenedSetting):
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
        super().__init__(allowed, "allowed-congestion", in_use, state_dir)
        self._allowed = allowed
        self._available = available

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
                self._change(" ".join(allowed), " ".join([*allowed, name]))
        except OSError as err:
            log.debug("cannot allow TCP congestion control %r in namespaces: %s", name, err)
            return False
        log.info(
            "allowed TCP congestion control %r in network namespaces (%s: %r -> %r) until the last "
            "cluster closes", name, self._allowed, " ".join(allowed), " ".join([*allowed, name]),
        )  # fmt: skip
        return True


class NeighbourRoom:
    """Room in the kernel's ARP table for a cluster's hosts, made while clusters need it.

    The table is one for every namespace of the machine (``net.ipv4.neigh.default.gc_thresh1-3`` are
    the machine's, 128 / 512 / 1024 by default): each host of a cluster keeps an entry per host it talks
    to, so 64 hosts where every worker talks to every shard need 2 x 32 x 32 = 2,048 entries, and past
    ``gc_thresh3`` the kernel refuses new ones ("neighbour table overflow"): connections between the hosts
    time out. ``fit(hosts)`` raises ``gc_thresh2`` (where entries start to be collected) to
    ``hosts x (hosts - 1)`` and ``gc_thresh3`` (the hard limit) to twice that (room for the machine's
    own entries and other clusters'), never lowers them (up to 23 hosts fit the defaults), and
    ``release`` puts both back once no cluster is left.

    Args:
        in_use: whether a cluster still needs the room (``trainer.netns.clusters_exist``).
        neigh_dir: the directory of the ``gc_thresh`` files.
        state_dir: where the records of the original limits live while they are raised.
    """

    def __init__(
        self, in_use: Callable[[], bool], *, neigh_dir: Path = NEIGH_DIR, state_dir: Path = STATE_DIR
    ):
        self._limits = {
            name: WidenedSetting(neigh_dir / name, f"neigh-{name}", in_use, state_dir)
            for name in ("gc_thresh2", "gc_thresh3")
        }

    def fit(self, hosts: int) -> bool:
        """Makes room for ``hosts`` hosts that may each talk to all others; True when there is (already,
        or now), False when the limits cannot be written (nothing changed then)."""
        need = hosts * (hosts - 1)
        wanted = {"gc_thresh2": need, "gc_thresh3": 2 * need}
        try:
            for name in ("gc_thresh3", "gc_thresh2"):  # the hard limit first: thresh2 <= thresh3 throughout
                old = self._limits[name].raise_to(wanted[name])
                if old is not None:
                    log.info(
                        "ARP table: %s %d -> %d for %d hosts until the last cluster closes", name, old,
                        wanted[name], hosts,
                    )  # fmt: skip
        except (OSError, ValueError) as err:
            log.debug("cannot make room in the ARP table for %d hosts: %s", hosts, err)
            return False
        return True

    def release(self) -> None:
        """Puts the limits back as they were, unless a cluster still needs them."""
        for limit in self._limits.values():
            limit.release()
