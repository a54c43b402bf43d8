"""``pstrain worker`` against shards that require an auth token: the token flag gets it through."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _support import RUN_TIMEOUT_S

from trainer.cluster import LocalCluster

pytestmark = [pytest.mark.tf, pytest.mark.e2e]


def _worker(addresses: list[str], out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "worker", "--ps", ",".join(addresses), "--worker-index", "0",
         "--num-workers", "1", "--model", "mlp", "--epochs", "1", "--timeout", "10",
         "--result-json", str(out), *extra],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip


def test_worker_with_token_trains_and_without_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token-for-the-shards\n")
    args = ["--auth-token-file", str(token)]
    with LocalCluster(2, server_args=args, workdir=tmp_path / "cluster") as cluster:
        refused = _worker(cluster.addresses, tmp_path / "refused.json")
        assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert "UnauthenticatedError" in refused.stderr

        ok = _worker(cluster.addresses, tmp_path / "ok.json", "--auth-token-file", str(token))
        assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
        result = json.loads((tmp_path / "ok.json").read_text())
        assert result["mode"] == "async" and result["steps"] > 0


def test_server_side_tls_flag_is_refused_for_a_ps_worker(tmp_path: Path) -> None:
    proc = _worker(["127.0.0.1:1"], tmp_path / "x.json", "--tls-client-ca", str(tmp_path / "ca.pem"))
    assert proc.returncode == 2
    assert "--tls-client-ca" in proc.stderr
