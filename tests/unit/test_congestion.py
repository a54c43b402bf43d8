"""trainer.congestion: the allowed list is widened while clusters exist and put back by the last close.

Real files stand in for the two sysctl files (the kernel's would change the machine for every test
running beside this one); the record is a real file in a temporary directory, the lock an flock of
the stand-in list.
"""

from __future__ import annotations

import threading
from pathlib import Path

from trainer.congestion import CongestionAllowance
from trainer.netns import _netns_name, clusters_exist


class Machine:
    """The two sysctl files, a state directory and whether a cluster namespace exists."""

    def __init__(self, root: Path, allowed: str = "reno bbr", available: str = "reno bbr cubic") -> None:
        self.allowed = root / "allowed"
        self.available = root / "available"
        self.state = root / "state"
        self.allowed.write_text(allowed + "\n")
        self.available.write_text(available + "\n")
        self.clusters = 0

    def allowance(self) -> CongestionAllowance:
        return CongestionAllowance(
            lambda: self.clusters > 0,
            allowed=self.allowed,
            available=self.available,
            state_dir=self.state,
        )

    def allowed_now(self) -> list[str]:
        return self.allowed.read_text().split()


def test_a_congestion_control_the_kernel_has_is_allowed_until_the_last_cluster_goes(tmp_path: Path) -> None:
    m = Machine(tmp_path)
    m.clusters = 2  # two clusters (any processes), each made its namespaces before asking
    assert m.allowance().allow("cubic")
    assert m.allowed_now() == ["reno", "bbr", "cubic"]
    assert m.allowance().allow("cubic")  # the second cluster: already allowed, nothing written
    assert m.allowed_now() == ["reno", "bbr", "cubic"]
    m.clusters = 1
    m.allowance().release()  # the first closes: the other still needs it
    assert m.allowed_now() == ["reno", "bbr", "cubic"]
    m.clusters = 0
    m.allowance().release()  # the last closes
    assert m.allowed_now() == ["reno", "bbr"]
    assert not m.state.exists()  # nothing left behind
    m.allowance().release()  # idempotent
    assert m.allowed_now() == ["reno", "bbr"]


def test_the_original_list_is_kept_across_widenings_and_a_crashed_process_is_restored_after(
    tmp_path: Path,
) -> None:
    m = Machine(tmp_path, available="reno bbr cubic htcp")
    m.clusters = 1
    assert m.allowance().allow("cubic")
    assert m.allowance().allow("htcp")  # a second widening must not record the widened list as the original
    assert m.allowed_now() == ["reno", "bbr", "cubic", "htcp"]
    # the processes that widened were killed: their namespaces went, their close never ran
    m.clusters = 0
    m.allowance().release()  # any later close on the machine restores
    assert m.allowed_now() == ["reno", "bbr"]


def test_a_congestion_control_the_kernel_lacks_or_an_unwritable_list_changes_nothing(tmp_path: Path) -> None:
    m = Machine(tmp_path)
    m.clusters = 1
    assert not m.allowance().allow("nosuchcc")
    assert m.allowed_now() == ["reno", "bbr"]
    assert not (m.state / "allowed-congestion").exists()
    m.allowed.unlink()
    m.allowed.mkdir()  # a list nobody can read or write as a file (root writes a read-only file anyway)
    assert not m.allowance().allow("cubic")
    m.allowance().release()  # nothing to restore; no error


def test_concurrent_widenings_record_the_original_once(tmp_path: Path) -> None:
    m = Machine(tmp_path)
    m.clusters = 8
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(m.allowance().allow("cubic"))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [True] * 8
    assert m.allowed_now() == ["reno", "bbr", "cubic"]
    assert (m.state / "allowed-congestion").read_text().split() == ["reno", "bbr"]


def test_clusters_exist_sees_only_cluster_namespaces(tmp_path: Path) -> None:
    assert not clusters_exist(tmp_path / "missing")
    (tmp_path / "psprobe1a2b3c").touch()  # netns_available's probe
    (tmp_path / "other").touch()
    assert not clusters_exist(tmp_path)
    (tmp_path / _netns_name("1a2b3c", 0)).touch()  # the name a cluster's host gets
    assert clusters_exist(tmp_path)


def test_allow_of_an_allowed_name_needs_no_record(tmp_path: Path) -> None:
    m = Machine(tmp_path, allowed="reno bbr cubic")
    assert m.allowance().allow("cubic")
    assert not (m.state / "allowed-congestion").exists()


def _neigh(root: Path, thresh2: int = 512, thresh3: int = 1024) -> Path:
    neigh = root / "neigh"
    neigh.mkdir()
    (neigh / "gc_thresh2").write_text(f"{thresh2}\n")
    (neigh / "gc_thresh3").write_text(f"{thresh3}\n")
    return neigh


def test_the_arp_table_gets_room_for_a_cluster_until_the_last_cluster_goes(tmp_path: Path) -> None:
    from trainer.congestion import NeighbourRoom

    neigh = _neigh(tmp_path)
    clusters = [1]
    room = NeighbourRoom(lambda: bool(clusters), neigh_dir=neigh, state_dir=tmp_path / "state")
    assert room.fit(16)  # 240 entries: room already
    assert (neigh / "gc_thresh3").read_text().strip() == "1024"
    assert room.fit(64)  # 64 x 63 = 4,032
    assert [(neigh / f).read_text().strip() for f in ("gc_thresh2", "gc_thresh3")] == ["4032", "8064"]
    assert room.fit(40)  # never lowered
    assert (neigh / "gc_thresh2").read_text().strip() == "4032"
    room.release()  # a cluster still exists: kept
    assert (neigh / "gc_thresh3").read_text().strip() == "8064"
    clusters.clear()
    room.release()
    assert [(neigh / f).read_text().strip() for f in ("gc_thresh2", "gc_thresh3")] == ["512", "1024"]
    assert not (tmp_path / "state").exists()


def test_an_unwritable_arp_table_limit_changes_nothing(tmp_path: Path) -> None:
    from trainer.congestion import NeighbourRoom

    room = NeighbourRoom(lambda: True, neigh_dir=tmp_path / "missing", state_dir=tmp_path / "state")
    assert not room.fit(64)
    assert not (tmp_path / "state").exists()
