"""psrun's elastic mode as processes (TF-free workers: _elastic_worker.py): loss, restart, discovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _support import pythonpath

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_elastic_worker.py")
_RUN_S = 120


def _psrun(
    args: list[str], env: dict[str, str], cwd: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    cmd = [
        sys.executable,
        "-m",
        "trainer.psrun",
        *args,
        "--timeout",
        str(_RUN_S - 20),
        sys.executable,
        str(WORKER),
    ]
    full_env = {**os.environ, **env, "PYTHONPATH": pythonpath(ROOT)}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=_RUN_S)
    results = {}
    for line in proc.stdout.splitlines():
        _, _, rest = line.partition("<stdout>:RESULT ")
        if rest:
            result = json.loads(rest)
            results[result["worker"]] = result
    return proc, results


def _agree(results: dict[str, Any], world: int) -> None:
    # Every step added 1 on each rank and the ranks checked they agree: no step lost or applied twice.
    steps = next(iter(results.values()))["step"]
    for r in results.values():
        assert r["step"] == steps and r["w"] == [float(steps)] * 3 and r["world"] == world, r


def test_survivors_of_a_sigkilled_rank_restore_their_commit_and_go_on(tmp_path: Path) -> None:
    env = {"STEPS": "30", "KILL_WORKER": "1", "KILL_AT": "10"}
    proc, results = _psrun(["-np", "3", "--min-np", "2"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(results) == ["0", "2"], proc.stdout[-2000:]
    _agree(results, 2)
    assert results["0"]["step"] == 30
    for r in results.values():
        assert r["worlds"] == [3, 2] and r["generation"] == 2, r
    assert [results["0"]["rank"], results["2"]["rank"]] == [0, 1]  # re-ranked
    assert "worker 1 exited with status -9" in proc.stderr
    assert "lost rank(s) [1]" in proc.stderr or "rank 1 ended the stream" in proc.stderr, proc.stderr[-4000:]


def test_a_failed_slot_gets_a_new_rank_after_its_cooldown_which_joins_at_a_commit(tmp_path: Path) -> None:
    env = {"STEPS": "20", "STEP_S": "0.02", "KILL_WORKER": "1", "KILL_AT": "5", "MIN_WORLD": "3"}
    args = ["-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "0.5", "1"]
    proc, results = _psrun(args, env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(results) == ["0", "2", "3"], proc.stdout[-2000:]
    assert "started worker 3 (pid" in proc.stderr and "in slot 1" in proc.stderr
    _agree(results, 3)
    assert results["0"]["worlds"] == [3, 2, 3] and results["0"]["generation"] == 3
    assert results["3"]["worlds"] == [3] and results["3"]["rank"] == 2  # synced from rank 0, then trained


def test_a_host_discovery_script_that_adds_a_slot_adds_a_rank(tmp_path: Path) -> None:
    script, mark = tmp_path / "discover.sh", tmp_path / "training"
    # localhost:2 until the ranks have committed a step, then localhost:3 (psrun runs it every second)
    script.write_text(f"#!/bin/sh\nif [ -e {mark} ]; then echo localhost:3; else echo localhost:2; fi\n")
    script.chmod(0o755)
    env = {"STEPS": "10", "STEP_S": "0.02", "MIN_WORLD": "3", "MARK_FILE": str(mark)}
    proc, results = _psrun(
        ["-np", "2", "--max-np", "3", "--host-discovery-script", str(script)], env, tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(results) == ["0", "1", "2"], proc.stdout[-2000:]
    _agree(results, 3)
    assert results["0"]["worlds"] == [2, 3]


def test_fewer_ranks_than_min_np_end_the_job_with_the_lost_ranks_status(tmp_path: Path) -> None:
    env = {"STEPS": "1000", "KILL_WORKER": "1", "KILL_AT": "5"}
    proc, results = _psrun(["-np", "2", "--min-np", "2"], env, tmp_path)
    assert proc.returncode == 128 + 9, proc.stderr[-4000:]
    assert "fewer than --min-np 2" in proc.stderr
    assert not results


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "2", "--min-np", "3"], "--min-np (3) <= -np (2)"),
        (["-np", "3", "--max-np", "2"], "--max-np (2) must be >= -np (3)"),
        (["-np", "2", "--min-np", "1", "-H", "h1:1,h2:1"], "this host only"),
        (["-np", "3", "--min-np", "1", "-H", "localhost:2"], "needs 3 slots"),
    ],
)
def test_bad_elastic_flags_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "trainer.psrun", *args, sys.executable, "-c", "print('started')"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "started" not in proc.stdout
