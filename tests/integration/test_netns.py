"""Integration: the cluster in a box (``trainer.netns``): hosts as network namespaces with shaped,
cuttable links, a shard on one host serving a client on another, and nothing left behind.

Needs root, iproute2 and nftables; skips with the reason otherwise. No wall-clock assertions: the
rate limit is checked through the qdisc's counters, and as an upper bound only (a loaded machine is
slower, never faster).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _support import CALL_TIMEOUT_S, wait_until

from trainer import netns
from trainer.netns import Host, NetnsCluster, leftovers, netns_available

pytestmark = pytest.mark.timeout(60)

PEER = str(Path(__file__).with_name("_netns_peer.py"))
MIB = 1 << 20


def _peer(net: NetnsCluster, host: Host, *args: str) -> dict[str, object]:
    proc = net.popen(host, [sys.executable, PEER, *args], stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=CALL_TIMEOUT_S)
    assert proc.returncode == 0, f"peer {args} on {host.name} exited {proc.returncode}"
    return json.loads(out.decode().strip().splitlines()[-1])


def test_netns_available_names_root_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    ok, why = netns_available()
    assert not ok and "root" in why


def test_netns_shard_on_one_host_serves_a_client_on_another(net: NetnsCluster) -> None:
    ps, worker, _ = net.hosts
    shards = net.shards([ps]).start()
    try:
        assert shards.addresses[0].startswith(ps.address + ":")
        assert _peer(net, worker, "pushpull", shards.addresses[0]) == {"v": [-1.0] * 4}
    finally:
        shards.stop()


def test_netns_shaped_link_carries_at_most_its_rate(net: NetnsCluster) -> None:
    sender, receiver, unshaped = net.hosts
    net.shape(receiver, 50)
    ready = net.workdir / "peer.addr"
    server = net.popen(
        receiver, [sys.executable, PEER, "serve", receiver.address, str(ready)], stdout=subprocess.PIPE
    )
    addr = wait_until(lambda: ready.exists() and ready.read_text(), "the receiver's ready file")
    before = net.link_stats(receiver)["ingress"]
    _peer(net, sender, "send", str(addr), str(4 * MIB))
    out, _ = server.communicate(timeout=CALL_TIMEOUT_S)
    got = json.loads(out)
    after = net.link_stats(receiver)
    assert got["bytes"] == 4 * MIB
    assert after["ingress"]["htb"] and after["egress"]["htb"], after
    assert after["ingress"]["bytes"] - before["bytes"] >= 4 * MIB  # all of it went through the htb class
    assert after["ingress"]["overlimits"] > before["overlimits"]  # and the rate limit held it back
    # 4 MiB through 50 Mbit/s takes at least 0.67 s: an upper bound on the rate, never a lower one
    assert 4 * MIB * 8 / got["seconds"] < 1.2 * 50e6
    assert not net.link_stats(unshaped)["ingress"]["htb"]
    net.shape(receiver, None)
    assert not net.link_stats(receiver)["ingress"]["htb"]


def _class_packets(tc: list[str], dev: str) -> dict[str, int]:
    """Packets sent by each htb class of ``dev`` (``tc`` with its namespace), by class id (from the text:
    this iproute2 writes no JSON for htb classes)."""
    text = subprocess.run(
        [*tc, "-s", "class", "show", "dev", dev], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    return {c: int(p) for c, p in re.findall(r"class htb (\S+) .*?\n\s*Sent \d+ bytes (\d+) pkt", text)}


def test_netns_small_first_puts_pure_acks_in_a_class_of_their_own() -> None:
    """A 4 MiB transfer into a host shaped with ``small_first``: its data goes through the data class
    (1:10) towards it, and the receiver's ACKs through the small packets' class (1:20), not behind data."""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    with NetnsCluster(2, small_first=True) as small:
        sender, receiver = small.hosts
        small.shape(receiver, 50)
        ready = small.workdir / "peer.addr"
        server = small.popen(
            receiver, [sys.executable, PEER, "serve", receiver.address, str(ready)], stdout=subprocess.PIPE
        )
        addr = wait_until(lambda: ready.exists() and ready.read_text(), "the receiver's ready file")
        _peer(small, sender, "send", str(addr), str(4 * MIB))
        server.communicate(timeout=CALL_TIMEOUT_S)
        sent_back = _class_packets(["tc", "-n", receiver.netns], "eth0")  # the receiver's side: its ACKs
        towards = _class_packets(["tc"], receiver.veth)  # the bridge's side: the data
        assert sent_back["1:20"] > 100 and sent_back["1:20"] > 10 * sent_back["1:10"], sent_back
        assert towards["1:10"] >= 4 * MIB // 1500 and towards["1:20"] < towards["1:10"] // 10, towards
        assert small.link_stats(receiver)["ingress"]["htb"]


def _class_bytes(tc: list[str], dev: str) -> dict[str, int]:
    """Bytes sent by each htb class of ``dev``, by class id (from the text, as ``_class_packets``)."""
    text = subprocess.run(
        [*tc, "-s", "class", "show", "dev", dev], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    return {c: int(b) for c, b in re.findall(r"class htb (\S+) .*?\n\s*Sent (\d+) bytes", text)}


def test_netns_peer_queues_give_each_peer_a_class_of_its_own() -> None:
    """A host shaped with ``peer_queues`` sends 2 MiB to one peer and 1 MiB to another: each peer's
    data leaves through the class of its address's bucket, the ACKs through the small class, and the
    bridge's side (the switch port) keeps one data class. Bad ``peer_queues`` are refused."""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    for bad in (-1, 3, 512):
        with pytest.raises(ValueError, match="peer_queues"):
            NetnsCluster(peer_queues=bad)
    with NetnsCluster(3, rate_mbit=50, small_first=True, peer_queues=4) as fair:
        sender, *receivers = fair.hosts
        for i, (receiver, nbytes) in enumerate(zip(receivers, (2 * MIB, MIB), strict=True)):
            ready = fair.workdir / f"peer{i}.addr"
            server = fair.popen(
                receiver,
                [sys.executable, PEER, "serve", receiver.address, str(ready)],
                stdout=subprocess.PIPE,
            )
            addr = wait_until(
                lambda ready=ready: ready.exists() and ready.read_text(), "a receiver's ready file"
            )
            _peer(fair, sender, "send", str(addr), str(nbytes))
            assert json.loads(server.communicate(timeout=CALL_TIMEOUT_S)[0])["bytes"] == nbytes
        sent = _class_bytes(["tc", "-n", sender.netns], "eth0")
        buckets = [f"1:{0x100 + int(r.address.rsplit('.', 1)[1]) % 4:x}" for r in receivers]
        assert len(set(buckets)) == 2, buckets
        assert 2 * MIB <= sent[buckets[0]] < 3 * MIB and MIB <= sent[buckets[1]] < 2 * MIB, (buckets, sent)
        assert sent["1:20"] < MIB // 10, sent  # the sender's few ACKs
        towards = _class_bytes(["tc"], receivers[0].veth)  # the bridge's side: one data class and the ACKs'
        assert set(towards) == {"1:1", "1:10", "1:20"} and towards["1:10"] >= 2 * MIB, towards


def test_netns_cut_and_heal(net: NetnsCluster) -> None:
    ps, a, b = net.hosts
    shards = net.shards([ps]).start()
    addr = shards.addresses[0]
    try:
        net.cut(ps)
        assert _peer(net, a, "connect", addr, "1") == {"connected": False, "error": "TimeoutError"}
        net.heal(ps)
        assert _peer(net, a, "connect", addr, "5")["connected"]
        net.cut(ps, a)  # only between ps and a
        assert not _peer(net, a, "connect", addr, "1")["connected"]
        assert _peer(net, b, "connect", addr, "5")["connected"]
        net.heal(a)
        assert _peer(net, a, "connect", addr, "5")["connected"]
        assert "drop" not in net.filter_rules(ps)
    finally:
        shards.stop()


def test_netns_drop_share_rule_installs_and_clears(net: NetnsCluster) -> None:
    host = net.hosts[0]
    net.drop(host, 10)
    assert net.filter_rules(host).count("numgen random mod 100 < 10 drop") == 2  # in and out
    net.drop(host, 0)
    assert "numgen" not in net.filter_rules(host)
    with pytest.raises(ValueError, match="percent"):
        net.drop(host, 120)


def _socket_congestion(net: NetnsCluster, host: Host) -> str:
    code = (
        "import socket; s = socket.socket(); "
        "print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b'\\0').decode())"
    )
    proc = net.popen(host, [sys.executable, "-c", code], stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=CALL_TIMEOUT_S)
    return out.decode().strip()


def test_netns_hosts_use_the_congestion_control_asked_for(net: NetnsCluster) -> None:
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    if "cubic" not in available:
        pytest.skip(f"this kernel has only {available}")
    # allowed in namespaces while a cluster exists, where the machine has it but allows only others
    assert "cubic" in Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    host = net.hosts[0]
    assert net.congestion == netns.DEFAULT_CONGESTION == "cubic"
    assert net.congestion_of(host) == "cubic"
    assert _socket_congestion(net, host) == "cubic"  # what a socket opened inside the host gets


def test_netns_congestion_none_keeps_the_machines_default_sysctls_apply_and_bad_names_fail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    machine = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    idle = "net.ipv4.tcp_slow_start_after_idle"
    with NetnsCluster(1, congestion=None, sysctls={idle: "0"}) as net:
        assert net.congestion_of(net.hosts[0]) == machine
        read = net.popen(
            net.hosts[0], ["cat", "/proc/sys/net/ipv4/tcp_slow_start_after_idle"], stdout=subprocess.PIPE
        )
        assert read.communicate(timeout=CALL_TIMEOUT_S)[0].decode().strip() == "0"  # the kernel's default: 1
    with pytest.raises(ValueError, match="congestion"):
        NetnsCluster(1, congestion="cubic; reboot")
    with pytest.raises(ValueError, match="per-namespace"):
        NetnsCluster(1, sysctls={"kernel.panic": "1"})
    with caplog.at_level("WARNING", logger="trainer.netns"), NetnsCluster(2, congestion="nosuchcc") as net:
        assert [net.congestion_of(h) for h in net.hosts] == [machine, machine]  # refused: the machine's
        assert net.congestion is None and caplog.text.count("'nosuchcc' refused") == 1  # said once


def test_netns_close_removes_processes_namespaces_and_links() -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    net = NetnsCluster(2, rate_mbit=100)
    sleeper = net.popen(net.hosts[0], ["sleep", "60"])
    suffix = net.suffix
    assert len(leftovers(suffix)) == 5  # 2 namespaces, 2 veths, 1 bridge
    net.close()
    net.close()  # idempotent
    assert sleeper.poll() is not None
    assert leftovers(suffix) == []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert suffix not in names and suffix not in links


def test_netns_sigterm_removes_everything() -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    script = (
        "import sys, time\n"
        "from trainer.netns import NetnsCluster\n"
        "net = NetnsCluster(2)\n"
        "net.popen(net.hosts[1], ['sleep', '60'])\n"
        "print(net.suffix, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        suffix = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert leftovers(suffix), "the cluster was not built"
        proc.terminate()
        assert proc.wait(timeout=CALL_TIMEOUT_S) == 128 + 15
    finally:
        proc.kill()
        proc.wait(timeout=CALL_TIMEOUT_S)
        proc.stdout.close()  # type: ignore[union-attr]
    assert leftovers(suffix) == []


def test_enter_netns_moves_a_process_into_a_host(net: NetnsCluster) -> None:
    """A process started outside the cluster (psload's workers: multiprocessing children) enters a host and
    reaches a shard on another host, which the root namespace cannot."""
    ps, worker, _ = net.hosts
    shards = net.shards([ps]).start()
    host, port = shards.addresses[0].rsplit(":", 1)
    code = (
        "import socket, sys\n"
        "from trainer.netns import enter_netns\n"
        "enter_netns(sys.argv[1])\n"
        "socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=10).close()\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, worker.netns, host, port],
            capture_output=True, text=True, timeout=CALL_TIMEOUT_S, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    finally:
        shards.stop()
    with pytest.raises(netns.NetnsError, match="no-such-namespace"):
        netns.enter_netns("no-such-namespace")


def test_psload_workers_in_hosts_with_exact_counts(net: NetnsCluster, tmp_path: Path) -> None:
    """psload in one host, its worker processes (2 simulated workers each) in another: exact counts."""
    ps, worker, driver = net.hosts
    shards = net.shards([ps]).start()
    out = tmp_path / "load.json"
    try:
        proc = net.popen(
            driver,
            [sys.executable, "-m", "psload", *shards.addresses, "--workers", "1", "--clients-per-worker", "2",
             "--model", "2x16KiB", "--duration", "1", "--exact", "--worker-netns", worker.netns, "--json",
             str(out), "-q"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log, _ = proc.communicate(timeout=50)
    finally:
        shards.stop()
    assert proc.returncode == 0, log.decode()[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["workers"] == 2 and result["summary"]["errors"] == 0
    assert (
        result["counts"]["ok"] and result["counts"]["acknowledged_pushes"] == result["summary"]["steps"] > 0
    )
