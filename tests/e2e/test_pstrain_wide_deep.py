"""``pstrain demo --model wide_deep``: a recommender on dynamic tables matches its full-size-table baseline.

A small click log (40k impressions, 20k users of which ~10k appear, 2k items) keeps the run short:
2 epochs reach a test AUC of about 0.647 against the ground truth's 0.80 (most users appear once, so
their rows cannot be learned), with async, sync and ssp within 0.001 of local in every run seen.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _support import RUN_TIMEOUT_S  # the run takes about 20 s on 2 cores (three TensorFlow imports)

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

SMALL = ["--model", "wide_deep", "--synthetic-size", "40000", "--users", "20000", "--epochs", "2"]


def _demo(tmp_path: Path, mode: str) -> dict[str, Any]:
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "demo", "--mode", mode, *SMALL, "--result-json", str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test AUC" in proc.stdout
    return json.loads(out.read_text())


def test_wide_deep_on_dynamic_tables_matches_the_full_size_table_baseline(tmp_path: Path) -> None:
    local = _demo(tmp_path, "local")
    ps = _demo(tmp_path, "async")
    assert ps["best_auc"] == local["best_auc"] > 0.75  # the same test set and ground truth
    assert local["test_auc"] > 0.6, local  # learned something (0.5: nothing)
    assert abs(ps["test_auc"] - local["test_auc"]) <= 0.01, (ps["test_auc"], local["test_auc"])
    for key in ("steps_per_second", "bytes_per_step", "worker_peak_rss_mib", "shard_rss_mib"):
        assert key in ps
    assert ps["steps_per_second"] > 0 and 0 < ps["bytes_per_step"] < 1 << 20
    tables = ps["tables"]
    assert (
        sum(tables["user_table"]["rows_per_shard"]) == ps["distinct_train_ids"]["user"]
    )  # every user trained
    assert sum(tables["category_table"]["rows_per_shard"]) == ps["distinct_train_ids"]["category"]
    assert all(min(t["rows_per_shard"]) > 0 for t in tables.values())  # spread over both shards
