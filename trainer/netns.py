"""NetnsCluster: a cluster of hosts in one box, made of network namespaces on a private bridge.

Each host is a network namespace with one veth link to a bridge of the cluster's own. A link can be
rate-limited in both directions (``htb`` on each end of the veth), cut and healed, or made to drop a
share of packets (``nftables`` inside the host's namespace). Shards, backups, workers and any other
process run inside a host through ``ip netns exec``. Everything made is removed on exit: ``close()``,
the context manager, ``atexit`` and SIGTERM/SIGHUP all lead to the same idempotent cleanup, which
touches only the namespaces, veths and bridge it created (its names carry a random suffix, so two
clusters coexist). There is no delay emulation (``netem``).

Needs root, ``ip`` and ``tc`` (iproute2) and ``nft`` (nftables); ``netns_available()`` says why not.

Example:
    ok, why = netns_available()
    with NetnsCluster(rate_mbit=100) as net:
        ps, worker = net.add_host("ps0"), net.add_host("w0")
        shards = net.shards([ps]).start()  # psserver on ps's address, inside its namespace
        proc = net.popen(worker, [sys.executable, "train.py", shards.addresses[0]])
        net.cut(ps, worker)  # worker and ps no longer reach each other
        net.heal(ps)
        shards.stop()

Not thread-safe: build and change a cluster from one thread.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.cluster import LocalCluster
from trainer.congestion import CongestionAllowance, NeighbourRoom

log = logging.getLogger(__name__)

_CMD_TIMEOUT_S = 15.0  # one ip/tc/nft call takes milliseconds; this covers a loaded machine
_TERM_GRACE_S = 5.0  # processes get this long after SIGTERM before SIGKILL
_KILL_WAIT_S = 5.0  # and this long to vanish after SIGKILL
_MAX_HOSTS = 250  # host addresses .1-.250 of the cluster's /24
_NFT_TABLE = "psnetns"
_HOST_IF = "eth0"  # the veth end inside a host
# Packets shorter than this (IP total length; a power of two: the u32 filter masks the high bits) go first
# on a link shaped with ``small_first``: pure ACKs (52 bytes with timestamps, up to 88 with SACK blocks).
SMALL_PACKET_BYTES = 128
_SMALL_SHARE = 0.05  # the small packets' class's guaranteed share of the rate (it may borrow all of it)
_PEER_QUANTUM = 3028  # bytes a peer's class sends a turn (two full frames; a 64 KiB TSO frame overdraws it)
_SUBNET_FMT = "10.77.{}.0/24"  # a private range; the third octet comes from the cluster's suffix
# Linux's default TCP congestion control, and what a stock cluster node runs. A namespace inherits the
# machine's default otherwise, which on some kernels is bbr: BBRv1 paces at its own estimate of the
# rate and fills a shaped link to 0.88-0.91 in on-off traffic where cubic fills it to 0.92-0.95
# (docs/benchmarks/scaling.md, "Congestion control").
DEFAULT_CONGESTION = "cubic"
_CC_SYSCTL = "/proc/sys/net/ipv4/tcp_congestion_control"


class NetnsError(RuntimeError):
    """A namespace, link, shaping or filter command failed; the message carries the command's stderr."""


def _netns_name(suffix: str, index: int) -> str:
    """The namespace of a cluster's host: ``ps<suffix>-<index>``, the suffix 6 hex digits."""
    return f"ps{suffix}-{index}"


_CLUSTER_NETNS = re.compile(r"ps[0-9a-f]{6}-\d+")  # what ``_netns_name`` makes


def clusters_exist(netns_dir: Path = Path("/run/netns")) -> bool:
    """Whether any ``NetnsCluster``'s namespace, of any process, exists on this machine."""
    try:
        return any(_CLUSTER_NETNS.fullmatch(p.name) for p in netns_dir.iterdir())
    except OSError:
        return False


def netns_available() -> tuple[bool, str]:
    """Whether this machine can build a ``NetnsCluster``, and if not, why (a reason for ``pytest.skip``)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root (this process is not)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed (package {package})"
    return _probe_netns()


@functools.cache
def _probe_netns() -> tuple[bool, str]:
    """Makes and removes one namespace (once per process)."""
    probe = f"psprobe{secrets.token_hex(3)}"
    try:
        _sh(["ip", "netns", "add", probe])
    except NetnsError as e:
        return False, f"cannot create a network namespace: {e}"
    finally:
        with contextlib.suppress(NetnsError):
            _sh(["ip", "netns", "del", probe], check=False)
    return True, ""


_CLONE_NEWNET = 0x40000000  # from <sched.h>


def enter_netns(netns: str) -> None:
    """Moves the calling thread into the network namespace ``netns`` (``setns(2)``; ``Host.netns``).

    For a process that a ``NetnsCluster`` did not start itself (a ``multiprocessing`` child): call it
    first, before any socket or thread exists; threads started afterwards inherit the namespace.

    Raises:
        NetnsError: no such namespace, or the process may not enter it (not root).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsError(f"network namespace {netns!r}: {e}") from e
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns into {netns!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _sh(argv: Sequence[str], *, check: bool = True, stdin: str | None = None) -> str:
    """Runs one command (bounded in time); returns its stdout.

    Raises:
        NetnsError: it failed (with ``check``), could not start, or timed out.
    """
    try:
        proc = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(argv)}: {e}") from e
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


@dataclass(slots=True, eq=False)
class Host:
    """One host: a network namespace ``netns`` with address ``address`` on the cluster's bridge.

    ``veth`` is the link's end on the bridge side (in the root namespace); inside the host the link is
    ``eth0``.
    """

    name: str
    index: int
    netns: str
    address: str
    veth: str
    rate_mbit: float | None = None
    cut_all: bool = False
    cut_peers: set[str] = field(default_factory=set)
    drop_percent: float = 0.0

    @property
    def launcher(self) -> list[str]:
        """The command prefix that runs a command inside this host."""
        return ["ip", "netns", "exec", self.netns]


class NetnsCluster:
    """Hosts made of network namespaces on a bridge of their own, with shaped, cuttable links.

    Args:
        num_hosts: hosts to make up front (named ``h0``, ``h1``, ...); more with ``add_host``.
        rate_mbit: every new host's link rate in Mbit/s, each direction (``None``: unshaped).
        burst_kib: the token bucket's burst in KiB (default: ``htb``'s own, from the rate).
        congestion: every host's TCP congestion control (default ``"cubic"``, Linux's own default;
            ``None``: whatever the machine's default is, which a namespace inherits). Where the
            kernel refuses it in a namespace (not built in, or not in the root namespace's
            ``tcp_allowed_congestion_control``), the hosts keep the machine's default and a
            warning says so: ``congestion_of(host)`` tells what a host runs.
        sysctls: more per-namespace settings for every host, ``{"net.ipv4.tcp_slow_start_after_idle":
            "0"}`` (a new namespace starts from the kernel's defaults, not the machine's settings).
        workdir: where logs and ready files go (default: a temporary directory, removed on close).
        small_first: every shaped link puts packets under ``SMALL_PACKET_BYTES`` (pure ACKs) in a class
            of their own that goes first, as a switch port's small queue does (see ``shape``); False:
            one queue for all.
        peer_queues: on each host's own side of its link, its data goes to this many queues by the
            peer's address (the last octet's low bits: each of up to ``peer_queues`` peers a queue of
            its own) served in turn, as a Linux host's per-flow default qdisc (fq_codel) serves its
            connections; 0 (default): one FIFO. A power of two up to 256. The bridge's side (the switch
            port) stays one FIFO. See ``shape`` for why a FIFO at the sender is unfair.

    Raises:
        NetnsError: the machine cannot make namespaces (see ``netns_available``) or a command failed.
    """

    def __init__(
        self,
        num_hosts: int = 0,
        *,
        rate_mbit: float | None = None,
        burst_kib: float | None = None,
        congestion: str | None = DEFAULT_CONGESTION,
        sysctls: Mapping[str, str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        small_first: bool = False,
        peer_queues: int = 0,
    ) -> None:
        if peer_queues < 0 or peer_queues > 256 or peer_queues & (peer_queues - 1):
            raise ValueError(f"peer_queues must be 0 or a power of two up to 256, got {peer_queues!r}")
        if congestion is not None and not congestion.isidentifier():
            raise ValueError(f"congestion must name a TCP congestion control ('cubic'), got {congestion!r}")
        for key in sysctls or {}:
            if not key.startswith("net.") or not all(part.isidentifier() for part in key.split(".")):
                raise ValueError(f"sysctls: {key!r} is not a per-namespace net.* setting")
        self.suffix = secrets.token_hex(3)
        octet = int(hashlib.sha256(self.suffix.encode()).hexdigest(), 16) % 250 + 1
        self.subnet = _SUBNET_FMT.format(octet)
        self._prefix = self.subnet.rsplit(".", 1)[0]
        self.bridge = f"psbr{self.suffix}"
        self.rate_mbit = rate_mbit
        self.burst_kib = burst_kib
        self.small_first = small_first
        self.peer_queues = peer_queues
        self.congestion = congestion
        self.sysctls = dict(sysctls or {})
        self.hosts: list[Host] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="psnetns-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._closed = False
        self._close_lock = threading.Lock()
        atexit.register(self.close)
        _open_clusters.add(self.suffix)
        _install_signal_handlers()
        try:
            _sh(["ip", "link", "add", self.bridge, "type", "bridge"])
            _sh(["ip", "link", "set", self.bridge, "up"])
            for i in range(num_hosts):
                self.add_host(f"h{i}")
        except BaseException:
            self.close()
            raise
        log.info("netns cluster %s: bridge %s, subnet %s", self.suffix, self.bridge, self.subnet)

    # ------------------------------------------------------------------ hosts and links

    def add_host(self, name: str | None = None, *, rate_mbit: float | None = None) -> Host:
        """Makes a host: a namespace, a veth to the bridge, the next address; shaped to ``rate_mbit``
        (default: the cluster's rate).

        Raises:
            NetnsError: a command failed, or the cluster already has 250 hosts.
        """
        index = len(self.hosts)
        if index >= _MAX_HOSTS:
            raise NetnsError(f"a cluster holds at most {_MAX_HOSTS} hosts")
        host = Host(
            name=name or f"h{index}",
            index=index,
            netns=_netns_name(self.suffix, index),
            address=f"{self._prefix}.{index + 1}",
            veth=f"psv{self.suffix}-{index}",
        )
        self.hosts.append(host)  # before the commands: close() removes what was half made
        ns = ["ip", "-n", host.netns]
        _sh(["ip", "netns", "add", host.netns])
        _sh(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", _HOST_IF, "netns", host.netns])
        _sh(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        _sh([*ns, "addr", "add", f"{host.address}/24", "dev", _HOST_IF])
        _sh([*ns, "link", "set", _HOST_IF, "up"])
        _sh([*ns, "link", "set", "lo", "up"])
        if self.congestion is not None:
            self._set_congestion(host, self.congestion)
        for key, value in self.sysctls.items():
            _sh([*host.launcher, "tee", "/proc/sys/" + key.replace(".", "/")], stdin=str(value))
        NeighbourRoom(clusters_exist).fit(len(self.hosts))  # past ~32 hosts the machine's ARP table is short
        rate = rate_mbit if rate_mbit is not None else self.rate_mbit
        if rate is not None:
            self.shape(host, rate, self.burst_kib)
        log.debug("host %s: netns %s, %s", host.name, host.netns, host.address)
        return host

    def _set_congestion(self, host: Host, name: str) -> None:
        """Sets the TCP congestion control of ``host``'s namespace (each namespace has its own). One the
        kernel has but does not allow namespaces is allowed while clusters exist (``trainer.congestion``);
        where the kernel refuses even so, warns once and leaves the machine's default."""
        CongestionAllowance(clusters_exist).allow(name)  # after the namespace exists: see ``release``
        try:
            _sh([*host.launcher, "tee", _CC_SYSCTL], stdin=name)
        except NetnsError as e:
            allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
            log.warning(
                "netns cluster %s: TCP congestion control %r refused in host %s (a namespace may use %s); "
                "the hosts keep the machine's default: %s", self.suffix, name, host.name, allowed, e,
            )  # fmt: skip
            self.congestion = None

    def congestion_of(self, host: Host) -> str:
        """The TCP congestion control new connections in ``host`` use.

        Raises:
            NetnsError: the namespace cannot be read.
        """
        return _sh([*host.launcher, "cat", _CC_SYSCTL]).strip()

    def host(self, name: str) -> Host:
        """The host called ``name``.

        Raises:
            KeyError: no such host.
        """
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def _link_ends(self, host: Host) -> list[list[str]]:
        """``tc`` prefixes of the link's two ends: egress of the host, and egress towards it (its ingress)."""
        return [["tc", "-n", host.netns], ["tc"]]

    def _link_devs(self, host: Host) -> list[str]:
        return [_HOST_IF, host.veth]

    def shape(self, host: Host, rate_mbit: float | None, burst_kib: float | None = None) -> None:
        """Limits ``host``'s link to ``rate_mbit`` Mbit/s in each direction (``None``: no limit).

        An ``htb`` class at the root of both veth ends: the host's side shapes what it sends, the
        bridge's side what it receives. With ``small_first`` (the cluster's), the class is the parent
        of two: packets under ``SMALL_PACKET_BYTES`` (IP total length; pure ACKs are 52-88 bytes) go
        to one that is served first (htb ``prio 0``, a ``u32`` filter), the rest to the other; both
        share the rate. With one queue a connection's ACKs wait behind the data the host sends the
        other way (up to 1,000 packets: smoothed RTTs of 18-81 ms on links of 0.02-5 ms).

        With ``peer_queues`` (the cluster's), the host's side puts its data in one class per peer
        bucket (``u32`` on the destination's last octet), served in turn (htb's round robin, a small
        quantum). In one FIFO at the sender, TCP's small queues (TSQ) keep each connection to ~2 of its
        own frames in the qdisc and TSO autosizing sizes them by its pacing rate (cwnd / RTT): a
        connection that fell behind gets a share of the link in proportion to its rate, sends ~4
        segments an RTT and is never cwnd-limited enough to grow (a shard's answers to one worker at
        0.2-0.3 Mbit/s for 13 s of a 30 Mbit/s link shared by 16; docs/benchmarks/scaling.md). This
        kernel has no fair-queueing qdisc (fq_codel, fq, sfq), hence the classes.

        Raises:
            NetnsError: ``tc`` failed.
        """
        for tc, dev in zip(self._link_ends(host), self._link_devs(host), strict=True):
            _sh([*tc, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate_mbit is not None:
                _sh([*tc, "-batch", "-"], stdin="\n".join(self._htb_lines(dev, rate_mbit, burst_kib)) + "\n")
        host.rate_mbit = rate_mbit

    def _htb_lines(self, dev: str, rate_mbit: float, burst_kib: float | None) -> list[str]:
        """The ``tc -batch`` lines that shape ``dev`` (one end of a host's link): see ``shape``."""
        burst = f" burst {burst_kib}kb cburst {burst_kib}kb" if burst_kib else ""
        peers = self.peer_queues if dev == _HOST_IF else 0
        lines = [f"qdisc add dev {dev} root handle 1: htb default 10"]
        top = f"htb rate {rate_mbit}mbit ceil {rate_mbit}mbit quantum 60000{burst}"
        if not self.small_first and not peers:
            return [*lines, f"class add dev {dev} parent 1: classid 1:10 {top}"]
        lines.append(f"class add dev {dev} parent 1: classid 1:1 {top}")
        small = rate_mbit * _SMALL_SHARE if self.small_first else 0.0
        classes = [("1:20", small, 0, 60000)] if self.small_first else []
        data = (rate_mbit - small) / (1 + peers)  # the default class (not IP: ARP) and each peer's
        classes += [("1:10", data, 1, 60000)] + [
            (f"1:{0x100 + b:x}", data, 1, _PEER_QUANTUM) for b in range(peers)
        ]
        for classid, share, prio, quantum in classes:
            lines.append(
                f"class add dev {dev} parent 1:1 classid {classid} htb rate {share:g}mbit "
                f"ceil {rate_mbit}mbit prio {prio} quantum {quantum}{burst}"
            )
        filt = f"filter add dev {dev} parent 1: protocol ip"
        if self.small_first:  # short, TCP, flags ACK only (a 20-byte IP header)
            lines.append(
                f"{filt} prio 1 u32 match u16 0 {0x10000 - SMALL_PACKET_BYTES:#06x} at 2 "
                "match u8 6 0xff at 9 match u8 0x10 0xff at 33 flowid 1:20"
            )
        for b in range(peers):  # the destination address's last octet, its low bits
            lines.append(f"{filt} prio 2 u32 match u8 {b} {peers - 1:#x} at 19 flowid 1:{0x100 + b:x}")
        return lines

    def link_stats(self, host: Host) -> dict[str, dict[str, int]]:
        """Root qdisc counters of ``host``'s link: ``{"egress": {...}, "ingress": {...}}``, each with
        ``bytes``, ``packets``, ``drops`` and ``overlimits`` (overlimits > 0: the rate limit engaged).

        Raises:
            NetnsError: ``tc`` failed.
        """
        out: dict[str, dict[str, int]] = {}
        for key, tc, dev in zip(
            ("egress", "ingress"), self._link_ends(host), self._link_devs(host), strict=True
        ):
            qdiscs = json.loads(_sh([*tc, "-s", "-j", "qdisc", "show", "dev", dev]) or "[]")
            root = next((q for q in qdiscs if q.get("root")), {})
            out[key] = {k: int(root.get(k, 0)) for k in ("bytes", "packets", "drops", "overlimits")}
            out[key]["htb"] = int(root.get("kind") == "htb")
        return out

    def cut(self, host: Host, other: Host | None = None) -> None:
        """Drops every packet to and from ``host`` (loopback excepted), or only those between ``host``
        and ``other``. Established connections stall; new ones time out.

        Raises:
            NetnsError: ``nft`` failed.
        """
        if other is None:
            host.cut_all = True
            self._apply_filter(host)
            return
        host.cut_peers.add(other.address)
        other.cut_peers.add(host.address)
        self._apply_filter(host)
        self._apply_filter(other)

    def heal(self, host: Host, other: Host | None = None) -> None:
        """Undoes ``cut(host, other)``; without ``other``, every cut involving ``host``.

        Raises:
            NetnsError: ``nft`` failed.
        """
        peers = [other] if other is not None else [h for h in self.hosts if h.address in host.cut_peers]
        if other is None:
            host.cut_all = False
        for peer in peers:
            host.cut_peers.discard(peer.address)
            peer.cut_peers.discard(host.address)
            self._apply_filter(peer)
        self._apply_filter(host)

    def drop(self, host: Host, percent: float) -> None:
        """Drops ``percent`` % of ``host``'s packets at random, each direction (0: none).

        Raises:
            ValueError: ``percent`` is outside [0, 100].
            NetnsError: ``nft`` failed.
        """
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be in [0, 100], got {percent}")
        host.drop_percent = percent
        self._apply_filter(host)

    def filter_rules(self, host: Host) -> str:
        """The nftables table that ``host`` has now, as ``nft list`` prints it ("" when none)."""
        return _sh([*host.launcher, "nft", "list", "table", "inet", _NFT_TABLE], check=False)

    def _apply_filter(self, host: Host) -> None:
        """Replaces the host's nftables table with one made from its cut and drop state (atomically)."""
        rules: dict[str, list[str]] = {"input": [], "output": []}
        for chain, way, lo in (("input", "saddr", "iifname"), ("output", "daddr", "oifname")):
            rules[chain].append(f'{lo} "lo" accept')
            if host.cut_all:
                rules[chain].append("drop")
            if host.cut_peers:
                rules[chain].append(f"ip {way} {{ {', '.join(sorted(host.cut_peers))} }} drop")
            if host.drop_percent > 0:
                rules[chain].append(f"numgen random mod 100 < {round(host.drop_percent)} drop")
        script = [
            f"table inet {_NFT_TABLE}",
            f"delete table inet {_NFT_TABLE}",
            f"table inet {_NFT_TABLE} {{",
        ]
        for chain, body in rules.items():
            script.append(f"  chain {chain} {{ type filter hook {chain} priority 0; policy accept;")
            script.extend(f"    {r}" for r in body)
            script.append("  }")
        script.append("}")
        _sh([*host.launcher, "nft", "-f", "-"], stdin="\n".join(script) + "\n")

    # ------------------------------------------------------------------ processes

    def popen(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        log_name: str | None = None,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """Starts ``argv`` inside ``host``; its stdout and stderr go to ``workdir/<log_name>.log`` unless
        ``kwargs`` redirect them. The process is killed on ``close()`` if it still runs.
        """
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if "stdout" in kwargs:
            proc = subprocess.Popen([*host.launcher, *argv], env=full_env, **kwargs)
        else:
            with open(self.workdir / f"{log_name or host.name}.log", "ab") as logf:
                proc = subprocess.Popen(
                    [*host.launcher, *argv], env=full_env, stdout=logf, stderr=subprocess.STDOUT, **kwargs
                )
        self.procs.append(proc)
        return proc

    def shards(
        self,
        hosts: Sequence[Host],
        server_args: Sequence[str] = (),
        *,
        shard_args: dict[int, Sequence[str]] | None = None,
        env: dict[str, str] | None = None,
    ) -> LocalCluster:
        """A ``LocalCluster`` (not started) with shard ``i`` on ``hosts[i]``: bound to its address, started
        inside its namespace. Backups are shards too: ``shard_args={i: ["--backup-of", primary]}``.
        """
        workdir = Path(tempfile.mkdtemp(prefix="shards-", dir=self.workdir))
        return LocalCluster(
            len(hosts),
            server_args,
            shard_args=shard_args,
            workdir=workdir,
            env=env,
            hosts=[h.address for h in hosts],
            launchers=[h.launcher for h in hosts],
        )

    def pids(self, host: Host) -> list[int]:
        """Every process running inside ``host`` now."""
        out = _sh(["ip", "netns", "pids", host.netns], check=False)
        return [int(p) for p in out.split()]

    def kill_all(self, host: Host) -> None:
        """SIGTERMs every process inside ``host``, SIGKILLs what is left after a grace period (bounded)."""
        for sig, wait_s in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, _KILL_WAIT_S)):
            pids = self.pids(host)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                self._reap()
                pids = self.pids(host)
                time.sleep(0.02)
            if not pids:
                return
        log.warning("processes %s in %s survived SIGKILL", pids, host.netns)

    def _reap(self) -> None:
        for proc in self.procs:
            proc.poll()

    def _stop_own_processes(self) -> None:
        """Stops what ``popen`` started and ``kill_all`` did not see: a process started just before
        ``close`` may still be ``ip netns exec`` in the root namespace, not yet listed in its host."""
        for sig, wait_s in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, _KILL_WAIT_S)):
            running = [proc for proc in self.procs if proc.poll() is None]
            for proc in running:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
            for proc in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=wait_s)
            if all(proc.returncode is not None for proc in running):
                return
        log.warning("processes %s survived SIGKILL", [p.pid for p in self.procs if p.returncode is None])

    # ------------------------------------------------------------------ cleanup

    def close(self) -> None:
        """Kills every process in the hosts, removes the namespaces, veths and bridge; idempotent."""
        if not self._close_lock.acquire(blocking=False):
            return  # another close (a signal during close) is running
        try:
            if self._closed:
                return
            self._closed = True
            for host in self.hosts:
                self.kill_all(host)
            self._stop_own_processes()
            for host in self.hosts:
                _sh(["ip", "netns", "del", host.netns], check=False)
                _sh(["ip", "link", "del", host.veth], check=False)  # gone with the namespace, usually
            _sh(["ip", "link", "del", self.bridge], check=False)
            NeighbourRoom(clusters_exist).release()  # the ARP limits as they were, if the last cluster
            CongestionAllowance(clusters_exist).release()  # the allowed list as it was, if the last cluster
            if self._tmp is not None:
                self._tmp.cleanup()
            log.info("netns cluster %s removed", self.suffix)
        finally:
            _open_clusters.discard(self.suffix)
            if not _open_clusters:
                _restore_signal_handlers()
            atexit.unregister(self.close)
            self._close_lock.release()

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_open_clusters: set[str] = set()  # suffixes of the clusters not closed yet, in this process
_old_handlers: dict[int, Any] = {}


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise SystemExit (so ``with`` blocks and atexit clean up) while a cluster is
    open, where they had the default action and this is the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            _old_handlers[sig] = signal.signal(sig, _exit_on_signal)


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, old in list(_old_handlers.items()):
        if signal.getsignal(sig) is _exit_on_signal:
            signal.signal(sig, old)
        del _old_handlers[sig]


def leftovers(suffix: str = "") -> list[str]:
    """Namespaces, veths and bridges of ``NetnsCluster``s (of the one with ``suffix``, if given) that exist
    now: for tests, and to find what a SIGKILLed run left (remove those with ``ip netns del`` and
    ``ip link del``)."""
    names = [line.split()[0] for line in _sh(["ip", "netns", "list"], check=False).splitlines() if line]
    found = [
        n for n in names if n.startswith(f"ps{suffix}") and n.count("-") == 1 and not n.startswith("psprobe")
    ]
    for line in _sh(["ip", "-o", "link", "show"], check=False).splitlines():
        ifname = line.split(":")[1].strip().split("@")[0]
        if ifname.startswith((f"psbr{suffix}", f"psv{suffix}")):
            found.append(ifname)
    return found
