"""Horovod's elastic Keras example (examples/horovod/tensorflow2_keras_mnist_elastic.py) under psrun --min-np.

Three ranks train; one is SIGKILLed in the middle of a step. The other two must finish on a ring of
two, with identical weights, and reach the accuracy of the same job without the failure (both jobs
seeded alike, so they differ only by the failure).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _support import RUN_TIMEOUT_S, pythonpath

# Two jobs run one after the other, each bounded by RUN_TIMEOUT_S: the test as a whole gets both bounds
# (the suite's default of 300 s cut a loaded run off inside the second job, which was still training).
pytestmark = [pytest.mark.tf, pytest.mark.e2e, pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)]

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("_horovod_probe.py")
EXAMPLE = ROOT / "examples" / "horovod" / "tensorflow2_keras_mnist_elastic.py"
# 20 steps per epoch on 3 ranks (30 on 2), 3 epochs: a run takes ~25 s alone on 2 CPU cores.
SHORT = {"EPOCHS": "3", "STEPS_PER_EPOCH": "60", "PROBE_SEED": "7", "TF_CPP_MIN_LOG_LEVEL": "2"}
KILL = {"KILL_WORKER": "1", "KILL_AT_BATCH": "25"}  # worker 1, in epoch 2 (its 25th batch, counting fit's 1)
ACCURACY_GAP = 0.02  # the bound: within 2 points of the run without the failure


def _elastic_job(
    cwd: Path, extra: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], dict[int, tuple[int, float]]]:
    cmd = [sys.executable, "-m", "trainer.psrun", "-np", "3", "--min-np", "2",
           "--timeout", str(RUN_TIMEOUT_S - 20), sys.executable, str(PROBE), str(EXAMPLE)]  # fmt: skip
    env = {**os.environ, **SHORT, **extra, "PYTHONPATH": pythonpath(ROOT)}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    pattern = r"^\[\d+\]<stdout>:PROBE rank=(?P<rank>\d+) crc=(?P<crc>\d+) accuracy=(?P<acc>[\d.]+)"
    probes = {
        int(m["rank"]): (int(m["crc"]), float(m["acc"])) for m in re.finditer(pattern, proc.stdout, re.M)
    }
    return proc, probes


def test_elastic_keras_example_survives_a_killed_rank(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "killed").mkdir()
    _, reference = _elastic_job(tmp_path / "ok", {})
    proc, survivors = _elastic_job(tmp_path / "killed", KILL)

    assert sorted(reference) == [0, 1, 2] and len({crc for crc, _ in reference.values()}) == 1, reference
    # Worker 1 died by SIGKILL; the two others re-formed a ring of two (re-ranked 0 and 1) and finished.
    assert "worker 1 exited with status -9" in proc.stderr, proc.stderr[-4000:]
    assert re.search(r"ring generation 2: 2 ranks \(workers 0, 2\)", proc.stderr), proc.stderr[-4000:]
    assert sorted(survivors) == [0, 1], proc.stdout[-4000:]
    assert survivors[0][0] == survivors[1][0], f"survivors ended with different weights: {survivors}"
    accuracy, ref_accuracy = survivors[0][1], reference[0][1]
    assert accuracy > 0.8, survivors  # it learned (10 classes: chance is 0.1)
    assert abs(accuracy - ref_accuracy) <= ACCURACY_GAP, (
        f"after the failure {accuracy:.4f}, without {ref_accuracy:.4f}"
    )
