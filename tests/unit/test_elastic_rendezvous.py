"""psrun's elastic rules (trainer.elastic.Rendezvous) and options, without processes or sockets."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from trainer.elastic import ElasticOptions, Rendezvous, discover_slots
from trainer.psrun import build_parser


def _join(rdv: Rendezvous, worker: str, after: int = 0, **kw: Any) -> dict[str, Any]:
    return rdv.join(worker, f"127.0.0.1:{7000 + int(worker)}", after, 0.0, **kw)


def _started(min_np: int, max_np: int, workers: int, reset_limit: int | None = None) -> Rendezvous:
    rdv = Rendezvous(min_np, max_np, reset_limit)
    for w in range(workers):
        rdv.started(str(w))
    return rdv


def _first_ring(rdv: Rendezvous, workers: int) -> list[dict[str, Any]]:
    for w in range(workers):
        _join(rdv, str(w))
    return [_join(rdv, str(w)) for w in range(workers)]  # asking again returns the assignment


def test_first_ring_forms_once_every_started_worker_asked() -> None:
    rdv = _started(2, 3, 3)
    assert _join(rdv, "0")["status"] == "wait"
    assert _join(rdv, "2")["status"] == "wait"
    assert rdv.generation == 0
    third = _join(rdv, "1")
    assert third["status"] == "assigned" and third["generation"] == 1
    assert third["addresses"] == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
    assert [a["rank"] for a in _first_ring(rdv, 3)] == [0, 1, 2]


def test_a_lost_member_breaks_the_ring_and_the_survivors_form_a_smaller_one_keeping_their_order() -> None:
    rdv = _started(2, 3, 3)
    _first_ring(rdv, 3)
    watch = rdv.watch(1, False, 0, 0.0)
    assert not watch["broken"]
    rdv.exited("0", -9)  # rank 0 dies: worker 1 becomes the new rank 0
    watch = rdv.watch(1, False, 0, 0.0)
    assert watch["broken"] and watch["lost"] == [0] and "status -9" in watch["reason"]
    assert _join(rdv, "2", after=1)["status"] == "wait"  # worker 1 is not back yet
    got = _join(rdv, "1", after=1)
    assert got["status"] == "assigned" and got["generation"] == 2 and got["rank"] == 0
    assert _join(rdv, "2", after=1)["rank"] == 1
    assert rdv.resets == 1


def test_a_member_asking_again_reports_its_failure_to_the_others() -> None:
    rdv = _started(2, 3, 3)
    _first_ring(rdv, 3)
    _join(rdv, "1", after=1)  # its collective failed
    assert rdv.watch(1, False, 0, 0.0)["broken"]
    rdv.abort("2", 1, "late report")  # the first reason stays
    assert "asked for a new ring" in (rdv.broken or "")


def test_a_new_worker_waits_for_the_next_commit_then_joins_after_the_survivors() -> None:
    rdv = _started(2, 3, 2)
    _first_ring(rdv, 2)
    rdv.started("2")
    assert _join(rdv, "2")["status"] == "wait"
    watch = rdv.watch(1, False, 0, 0.0)
    assert not watch["broken"] and watch["update"] == 1  # members re-form at their next commit
    assert _join(rdv, "2")["status"] == "wait" and rdv.update == 1  # asking again does not count twice
    _join(rdv, "1", after=1, update=True)
    assert rdv.broken is None  # re-forming at a commit is not a failure
    got = _join(rdv, "0", after=1, update=True)
    assert got["generation"] == 2 and got["rank"] == 0 and got["update"] == 1
    assert _join(rdv, "2")["rank"] == 2 and _join(rdv, "1", after=1)["rank"] == 1


def test_max_np_leaves_extra_workers_waiting_without_asking_for_a_reset() -> None:
    rdv = _started(1, 2, 2)
    _first_ring(rdv, 2)
    rdv.started("2")
    assert _join(rdv, "2")["status"] == "wait"
    assert rdv.update == 0


def test_fewer_than_min_np_survivors_wait_and_no_survivor_stops_the_job() -> None:
    rdv = _started(2, 3, 3)
    _first_ring(rdv, 3)
    rdv.exited("1", 1)
    rdv.exited("2", -9)
    assert _join(rdv, "0", after=1)["status"] == "wait"  # one rank, --min-np 2: wait for a new one
    rdv.started("3")
    assert _join(rdv, "3")["status"] == "assigned"  # the survivor first, the newcomer second
    assert _join(rdv, "0", after=1)["rank"] == 0
    rdv.exited("0", -9)
    rdv.exited("3", -9)
    assert "no rank of the last ring" in (rdv.stopped or "")


def test_reset_limit_stops_the_job() -> None:
    rdv = _started(1, 2, 2, reset_limit=0)
    _first_ring(rdv, 2)
    rdv.exited("1", -9)
    stop = _join(rdv, "0", after=1)
    assert stop["status"] == "stop" and "--reset-limit" in stop["reason"]


def test_a_finished_worker_ends_the_job_no_new_ring_is_formed() -> None:
    rdv = _started(1, 2, 2)
    _first_ring(rdv, 2)
    rdv.exited("0", 0)
    assert rdv.finished and rdv.broken is None  # a rank that finished did not break the ring
    assert _join(rdv, "1", after=1)["status"] == "stop"


def test_join_long_polls_until_the_ring_forms() -> None:
    rdv = _started(2, 2, 2)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(rdv.join("0", "127.0.0.1:7000", 0, 30.0)))
    t.start()
    _join(rdv, "1")
    t.join(timeout=30)
    assert got["status"] == "assigned" and got["rank"] == 0


def test_unknown_worker_is_told_to_stop() -> None:
    assert _join(_started(1, 1, 1), "5")["status"] == "stop"


def test_options_are_checked_like_horovodrun() -> None:
    with pytest.raises(ValueError, match="min-np"):
        ElasticOptions(np_=2, min_np=3, max_np=3, slots=3).validate()
    with pytest.raises(ValueError, match="max-np"):
        ElasticOptions(np_=3, min_np=1, max_np=2, slots=3).validate()
    with pytest.raises(ValueError, match="slots"):
        ElasticOptions(np_=3, min_np=1, max_np=3, slots=2).validate()
    args = build_parser().parse_args(
        ["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "5", "x"]
    )
    assert (args.min_np, args.blacklist_cooldown_range) == (1, [1.0, 5.0])


def test_discovery_script_counts_this_hosts_slots(tmp_path: Any) -> None:
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:3\necho 127.0.0.1\necho elsewhere.example:4\n")
    script.chmod(0o755)
    assert discover_slots(str(script)) == 4  # 3 + 1 (default slots); the other host is ignored
    script.write_text("#!/bin/sh\necho 'localhost:x'\n")
    with pytest.raises(ValueError, match="HOST:SLOTS"):
        discover_slots(str(script))
    script.write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(ValueError, match="exited with 3"):
        discover_slots(str(script))
