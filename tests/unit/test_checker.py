"""psload.checker on hand-made histories: each anomaly it must find, and the valid histories it must pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from psload import history
from psload.checker import FINAL, check
from psload.history import Op, Recorder

P, B = "10.77.1.1:7000", "10.77.1.2:7000"


def push(process: str, t0: float, t1: float | None, var: str, *, ok: bool = True, step: int = 0) -> Op:
    op = Op(process, "push", t0, t1, "ok" if ok else "error", deadline_s=10.0, writes=[var], step=step)
    if ok:
        op.applied = True
    else:
        op.error_type, op.error = "DeadlineExceededError", f"no answer from the primary {P} within 10 s"
    return op


def pull(process: str, t0: float, t1: float, **counts: float) -> Op:
    reads = {f"nem/{k}": v for k, v in counts.items()}
    return Op(
        process,
        "pull",
        t0,
        t1,
        "ok",
        deadline_s=10.0,
        reads=reads,
        versions={k: int(v) for k, v in reads.items()},
    )


def final(**counts: float) -> Op:
    return pull(FINAL, 100.0, 100.1, **counts)


def status(address: str, t0: float, t1: float, lease_s: float, role: str = "primary") -> Op:
    return Op("monitor", "status", t0, t1, "ok", deadline_s=2.0, address=address, role=role, lease_s=lease_s)


def valid_async() -> list[Op]:
    return [
        push("c0", 1.0, 1.1, "nem/c0"),
        push("c1", 1.0, 1.2, "nem/c1"),
        push("c0", 1.2, 1.3, "nem/c0"),
        pull("c1", 1.4, 1.5, c0=2, c1=1),
        push("c1", 1.6, 11.0, "nem/c1", ok=False),  # outcome unknown: applied here
        pull("c0", 11.5, 11.6, c0=2, c1=2),
        final(c0=2, c1=2),
    ]


def test_a_valid_history_has_no_anomaly() -> None:
    report = check(valid_async(), addresses=[P, B])
    assert report.ok, report.summary()
    assert report.stats["pushes_ok"] == 3 and report.stats["pushes_failed"] == 1
    assert any("within [1, 2]" in n for n in report.notes), report.notes


def test_a_push_of_unknown_outcome_may_be_lost() -> None:
    ops = [*valid_async()[:-2], final(c0=2, c1=1)]
    assert check(ops).ok


def test_a_lost_acknowledged_push() -> None:
    ops = [*valid_async()[:-2], final(c0=1, c1=1)]
    report = check(ops)
    assert report.kinds() == {"lost": 1}, report.summary()
    assert "nem/c0" in report.anomalies[0].message and "2 acknowledged" in report.anomalies[0].message


def test_a_push_applied_twice() -> None:
    ops = [*valid_async()[:-2], final(c0=3, c1=2)]
    assert check(ops).kinds() == {"applied_twice": 1}


def test_no_final_read() -> None:
    assert check(valid_async()[:-1]).kinds() == {"no_final_read": 1}


def test_a_read_behind_an_acknowledged_push() -> None:
    ops = [*valid_async(), pull("c1", 1.35, 1.38, c0=1, c1=1)]  # began after c0's 2nd push was acked
    report = check(ops)
    assert report.kinds() == {"stale_read": 1}, report.summary()
    assert "2 were acknowledged before it began (the last by c0" in report.anomalies[0].message


def test_a_read_concurrent_with_a_push_may_miss_it() -> None:
    ops = [*valid_async(), pull("c1", 1.25, 1.4, c0=1, c1=1)]  # c0's 2nd push acked at 1.3, after it began
    assert check(ops).ok


def test_a_read_of_a_push_not_yet_invoked() -> None:
    ops = [*valid_async(), pull("c1", 0.5, 0.9, c0=1)]
    assert check(ops).kinds() == {"phantom_read": 1}


def test_counts_must_be_whole_and_match_versions() -> None:
    odd = pull("c0", 1.25, 1.28, c0=1.5)
    wrong = pull("c0", 1.4, 1.5, c0=2)
    wrong.versions["nem/c0"] = 3
    assert check([*valid_async(), odd, wrong]).kinds() == {"not_integral": 1, "version_mismatch": 1}


def test_calls_are_bounded() -> None:
    slow = push("c0", 20.0, 36.0, "nem/c0", ok=False)  # deadline 10 s + slack 5 s
    hung = push("c0", 40.0, None, "nem/c0")
    hung.outcome = ""
    report = check([*valid_async(), slow, hung])
    assert report.kinds() == {"unbounded": 1, "incomplete": 1}, report.summary()


def test_errors_name_a_replica() -> None:
    nameless = push("c0", 20.0, 21.0, "nem/c0", ok=False)
    nameless.error = "no answer to the push within 10 s"
    report = check([*valid_async(), nameless], addresses=[P, B])
    assert report.kinds() == {"nameless_error": 1}
    assert check([*valid_async(), nameless]).ok  # no addresses: not checked
    pair = push("c0", 20.0, 21.0, "nem/c0", ok=False)
    pair.error = f"no answer to the push within 10 s (PushSession on {P}|{B})"
    report = check([*valid_async(), pair], addresses=[P, B])
    assert report.kinds() == {"pair_only_error": 1}, report.summary()
    report = check([*valid_async(), pair], addresses=[P, B], replica_named=False)
    assert report.ok and report.stats["errors_naming_only_the_pair"] == 1, report.summary()
    assert any("name the pair" in n for n in report.notes)
    named = push("c0", 20.0, 21.0, "nem/c0", ok=False)
    named.error = f"shard 0: {P}, the replica asked last, gave no answer in 3.0 s (PushSession on {P}|{B})"
    assert check([*valid_async(), named], addresses=[P, B]).ok
    assert check(valid_async(), addresses=[P, B]).stats["errors_naming_only_the_pair"] == 0


def test_two_primaries_with_overlapping_leases() -> None:
    ops = [*valid_async(), status(P, 10.0, 10.1, 1.5), status(B, 11.0, 11.1, 2.0)]  # P: until 11.485
    report = check(ops)
    assert report.kinds() == {"two_primaries": 1}, report.summary()
    assert P in report.anomalies[0].message and B in report.anomalies[0].message


def test_a_lease_handed_on_is_not_two_primaries() -> None:
    ops = [
        *valid_async(),
        status(P, 10.0, 10.1, 0.5),  # P's lease surely ends by 10.495
        status(B, 10.0, 10.1, 0.0, role="orphaned"),
        status(B, 12.0, 12.1, 2.0),
        status(P, 12.0, 12.1, 0.0, role="backup"),
        status(P, 9.0, 9.2, 0.1),  # the call took longer than the lease left: nothing is sure
    ]
    assert check(ops).ok


def test_a_primary_without_a_lease_inside_anothers_lease() -> None:
    ops = [*valid_async(), status(P, 10.0, 10.1, 2.0), status(B, 10.5, 10.6, -1.0)]
    assert check(ops).kinds() == {"two_primaries": 1}


def test_sync_steps() -> None:
    ops = [
        push("c0", 1.0, 1.5, "nem/steps", step=0),
        push("c1", 1.1, 1.5, "nem/steps", step=0),
        push("c0", 1.6, 2.0, "nem/steps", step=1),
        push("c1", 1.6, 12.0, "nem/steps", step=1, ok=False),
        push("c1", 12.1, 12.2, "nem/steps", step=1),  # the retry of step 1: stale, answered done
        pull("c0", 2.1, 2.2, steps=2),
        push("c0", 12.3, 22.3, "nem/steps", step=2, ok=False),
    ]
    assert check([*ops, final(steps=2)], mode="sync").ok
    assert check([*ops, final(steps=3)], mode="sync").ok  # step 2's outcome is unknown
    assert check([*ops, final(steps=1)], mode="sync").kinds() == {"lost": 1}
    assert check([*ops, final(steps=4)], mode="sync").kinds() == {"applied_twice": 1}
    stale = pull("c1", 2.05, 2.1, steps=1)  # began after step 1 was acknowledged to c0
    assert check([*ops, stale, final(steps=2)], mode="sync").kinds() == {"stale_read": 1}


def test_reads_going_backwards_are_noted_not_anomalies() -> None:
    ops = [*valid_async(), pull("c0", 1.25, 1.28, c0=2), pull("c0", 1.29, 1.31, c0=1)]
    report = check(ops)
    assert report.ok, report.summary()
    assert report.stats["read_regressions"] == 1
    assert any("went backwards" in n for n in report.notes)


def test_the_recorder_records_outcomes_and_round_trips(tmp_path: Path) -> None:
    rec = Recorder("c0", deadline_s=3.0, errors=(ValueError,))
    with rec.call("push", writes=["nem/c0"]) as op:
        op.applied = True
    with rec.call("pull") as op:
        raise ValueError(f"no answer from {P}")
    with pytest.raises(KeyError), rec.call("pull"):
        raise KeyError("a bug propagates")
    assert [op.outcome for op in rec.ops] == ["ok", "error", "error"]
    assert rec.ops[1].error_type == "ValueError" and P in rec.ops[1].error
    assert all(op.complete is not None and op.complete >= op.invoke for op in rec.ops)
    rec.dump(tmp_path / "c0.jsonl")
    assert history.load([tmp_path / "c0.jsonl"]) == rec.ops


def test_a_push_answered_false_in_async_mode_was_applied() -> None:
    retried = push("c0", 20.0, 21.0, "nem/c0")
    retried.applied = False  # a retry the shard recognised: its first attempt was applied
    ops = [*valid_async()[:-1], retried]
    assert check([*ops, final(c0=3, c1=2)]).ok
    assert check([*ops, final(c0=2, c1=2)]).kinds() == {"lost": 1}
    assert check([*ops, final(c0=3, c1=2)]).stats["pushes_answered_false"] == 1


def test_a_failed_runs_timeline_lays_the_ops_faults_and_role_changes_around_the_anomaly_in_order() -> None:
    from types import SimpleNamespace

    from psload.nemesis import Fault, timeline

    ops = [
        push("c0", 1.0, 1.1, "nem/c0", step=0),
        push("c0", 2.0, 2.1, "nem/c0", step=1),
        Op("monitor", "status", 2.5, 2.51, "ok", address=P, role="primary"),
        Op("monitor", "status", 2.6, 2.61, "ok", address=P, role="primary"),  # no change: not shown
        Op("monitor", "status", 3.5, 3.51, "ok", address=B, role="primary"),
        pull(FINAL, 10.0, 10.1, c0=1),  # within the last 40 s of the final read: shown
    ]
    report = check(ops, mode="sync", addresses=(P, B))
    assert not report.ok, report.summary()  # two acknowledged, the final read counts one
    nemesis = SimpleNamespace(t0=0.0, faults=[Fault("kill", P, start_s=3.0, end_s=4.0)])
    lines = timeline(ops, report, nemesis).splitlines()  # type: ignore[arg-type]
    texts = [line.split(" ", 1)[1] for line in lines]
    assert [t.split(" -> ")[0] for t in texts] == [
        "c0 push step 0 ['nem/c0']",
        "c0 push step 1 ['nem/c0']",
        f"status {P}: primary",  # the second read of the same role is left out
        f"fault kill {P} starts",
        f"status {B}: primary",
        f"fault kill {P} heals",
        'final pull {"nem/c0": 1}',
    ]
    assert texts[0].endswith("applied=True")
    stamps = [line.split(" ", 1)[0] for line in lines]  # wall-clock HH:MM:SS.mmm, as the servers' logs
    assert stamps == sorted(stamps) and all(len(t) == 12 for t in stamps)
