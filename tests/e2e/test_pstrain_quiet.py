"""``pstrain local`` and ``pstrain worker``: no TensorFlow start-up lines or Keras warnings on stderr."""

from __future__ import annotations

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


def test_local_prints_no_tensorflow_banners() -> None:
    proc = _pstrain("local")
    _assert_quiet(proc)
    assert "[local] test accuracy" in proc.stdout


def test_worker_prints_no_tensorflow_banners(tmp_path: Path) -> None:
    with LocalCluster(1, workdir=tmp_path / "cluster") as cluster:
        proc = _pstrain(
            "worker", "--ps", ",".join(cluster.addresses), "--worker-index", "0", "--num-workers", "1"
        )
    _assert_quiet(proc)
    assert "[worker 0] done" in proc.stdout
