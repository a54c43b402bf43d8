"""``pstrain local`` and ``pstrain worker``: no TensorFlow start-up lines or Keras warnings on stderr; their
result files carry the CPU time per step and show the step compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _support import RUN_TIMEOUT_S

from trainer.cluster import LocalCluster

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

NOISE = ("cuInit", "oneDNN", "absl::InitializeLog", "cuda drivers", "UserWarning")


def _pstrain(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG")}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args, "--model", "mlp", "--epochs", "1"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env,
    )  # fmt: skip


def _assert_quiet(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    noisy = [line for line in proc.stderr.splitlines() if any(n in line for n in NOISE)]
    assert noisy == [], proc.stderr[-2000:]


def _assert_measured(result_json: Path) -> None:
    result = json.loads(result_json.read_text())
    assert result["steps"] > 4 and result["steps_per_second"] > 0
    assert result["cpu_seconds_per_step"] > 0  # this process's CPU over the timed steps
    # fit's step is a tf.function: its Python train_step runs only to trace it, not once a step
    assert 1 <= result["step_python_calls"] < result["steps"] / 2, result


def test_local_prints_no_tensorflow_banners(tmp_path: Path) -> None:
    proc = _pstrain("local", "--result-json", str(tmp_path / "local.json"))
    _assert_quiet(proc)
    assert "[local] test accuracy" in proc.stdout
    _assert_measured(tmp_path / "local.json")


def test_worker_prints_no_tensorflow_banners(tmp_path: Path) -> None:
    with LocalCluster(1, workdir=tmp_path / "cluster") as cluster:
        proc = _pstrain(
            "worker", "--ps", ",".join(cluster.addresses), "--worker-index", "0", "--num-workers", "1",
            "--result-json", str(tmp_path / "worker.json"),
        )  # fmt: skip
    _assert_quiet(proc)
    assert "[worker 0] done" in proc.stdout
    _assert_measured(tmp_path / "worker.json")
