"""``pstrain demo`` end to end: each mode trains the CNN on digits to within 2 points of local."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

EPOCHS = 12
RUN_TIMEOUT_S = 400  # a run takes ~20-40 s on 2 loaded cores


def _demo(tmp_path: Path, mode: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "demo", "--mode", mode, "--epochs", str(EPOCHS),
         "--result-json", str(out), *extra],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"epoch {EPOCHS}/{EPOCHS}" in proc.stdout  # per-epoch progress is shown
    assert "test accuracy" in proc.stdout
    result = json.loads(out.read_text())
    for key in ("test_accuracy", "mode", "epochs", "steps_per_second"):
        assert key in result
    assert result["mode"] == mode and result["epochs"] == EPOCHS and result["steps_per_second"] > 0
    return result


@pytest.fixture(scope="module")
def local_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    return float(_demo(tmp_path_factory.mktemp("local"), "local")["test_accuracy"])


@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_mode_matches_local_baseline(mode: str, local_accuracy: float, tmp_path: Path) -> None:
    result = _demo(tmp_path, mode)
    assert result["workers"] == 2 and len(result["per_worker"]) == 2
    assert result["test_accuracy"] >= local_accuracy - 0.02, (result["test_accuracy"], local_accuracy)
    assert result["test_accuracy"] >= 0.93


def test_allreduce_mode_is_a_clean_hook(tmp_path: Path) -> None:
    from trainer.demo import allreduce_available

    if allreduce_available():
        pytest.skip("trainer.allreduce_loop exists: its own tests cover it")
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "demo", "--mode", "allreduce"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "not available yet" in proc.stderr
