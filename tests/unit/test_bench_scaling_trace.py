"""bench_scaling's timeline summary (``--trace``): how long shards had 0, 1, 2 uploaders at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_scaling as bs


def test_busy_counts_overlaps_within_the_window() -> None:
    # [0, 4): one interval over [1, 3), two over [2, 3): 0 open 2 s, 1 open 1 s, 2 open 1 s
    assert bs._busy([(1.0, 3.0), (2.0, 5.0)], 0.0, 4.0) == pytest.approx([1.0, 2.0, 1.0])
    assert bs._busy([], 0.0, 2.0) == pytest.approx([2.0])


def test_trace_summary_reads_collisions(tmp_path: Path) -> None:
    # two workers over [0, 2): both upload to shard a in [0, 1) (a collision; shard b idle), then one each
    def part(shard: str, up: float, sent: float) -> dict[str, float | str]:
        return {"shard": shard, "asked": up, "up": up, "sent": sent, "answer": sent, "end": sent + 0.5}

    w0 = [part("a", 0.0, 1.0), part("b", 1.0, 2.0)]
    w1 = [part("a", 0.0, 1.0), part("a", 1.0, 2.0)]
    files = []
    for i, events in enumerate((w0, w1)):
        files.append(tmp_path / f"w{i}.json")
        files[-1].write_text(json.dumps(events))
    summary = bs.trace_summary(files)
    # window [0, 2.5); shard a: 2 uploaders for 1 s, 1 for 1 s, 0 for 0.5; b: 1 for 1 s, 0 for 1.5 s
    assert summary["shard_uploaders"] == pytest.approx([0.4, 0.4, 0.2], abs=1e-3)
    assert summary["worker_up"] == pytest.approx(0.8, abs=1e-3)
    assert summary["answer_wait_ms"] == [0.0, 0.0]


def test_trace_summary_without_events_is_empty(tmp_path: Path) -> None:
    (tmp_path / "w0.json").write_text("[]")
    assert bs.trace_summary([tmp_path / "w0.json", tmp_path / "missing.json"]) == {}


def test_a_collision_that_moves_on_together_counts_as_repeated() -> None:
    def part(shard: str, up: float, sent: float) -> dict[str, float | str]:
        return {"shard": shard, "up": up, "sent": sent}

    # both on a, then both on b (repeated), then apart: 2 collisions, the first repeated
    w0 = [part("a", 0.0, 1.0), part("b", 1.0, 2.0), part("c", 2.0, 3.0)]
    w1 = [part("a", 0.1, 1.1), part("b", 1.1, 2.1), part("d", 2.1, 3.1)]
    assert bs._collisions_repeated([w0, w1]) == [2, 1]
    # a brush (under 30 % of the shorter part) is no collision
    assert bs._collisions_repeated([[part("a", 0.0, 1.0)], [part("a", 0.9, 2.0)]]) == [0, 0]


def test_trace_summary_takes_requests_that_never_went_up_and_reads_turns_and_deliveries(
    tmp_path: Path,
) -> None:
    # w0's first request failed before its upload (no "up", no "answer": a retry); its others waited for
    # their turns 0.5 s and 1.5 s, and were delivered 0.2 s and 0.4 s after they left
    w0 = [
        {"shard": "a", "asked": 0.0, "end": 0.1},
        {"shard": "a", "asked": 0.0, "up": 0.5, "sent": 0.5, "delivered": 0.7, "answer": 0.8, "end": 1.0},
        {"shard": "b", "asked": 0.0, "up": 1.5, "sent": 1.5, "delivered": 1.9, "answer": 2.0, "end": 2.2},
    ]
    (tmp_path / "w0.json").write_text(json.dumps(w0))
    summary = bs.trace_summary([tmp_path / "w0.json"])
    assert summary["seconds"] == pytest.approx(1.7)
    assert summary["turn_wait_ms"] == pytest.approx([1500.0, 1500.0])  # of two: the upper (cm.percentile)
    assert summary["delivered_ms"] == pytest.approx([400.0, 400.0])
