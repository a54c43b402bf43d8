"""``psctl status`` and ``python -m psclient.probe`` against real shard processes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from psclient import ctl
from psclient.admin import cluster_status
from trainer.cluster import LocalCluster


@pytest.fixture(scope="module")
def busy_cluster() -> LocalCluster:
    with LocalCluster(num_shards=2) as cluster:
        with psclient.PSClient(
            cluster.addresses, worker_id="w0", timeout=TIMEOUT_S, partition_bytes=4096
        ) as c:
            c.create_many(
                {"dense/kernel": np.zeros((64, 32), np.float32), "dense/bias": np.zeros(32, np.float32)},
                optimizer=psclient.Adam(1e-3),
            )
            for _ in range(3):
                c.push({"dense/kernel": np.ones((64, 32), np.float32), "dense/bias": np.ones(32, np.float32)})
            c.pull()
        yield cluster


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def test_status_table(busy_cluster: LocalCluster) -> None:
    proc = run("psclient.ctl", "status", *busy_cluster.addresses, "--interval", "0.2", "--timeout", "20")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "2/2 healthy" in out and "mode async" in out and "2 variable(s)" in out
    header = next(line for line in out.splitlines() if line.startswith("SHARD"))
    for col in ("ADDRESS", "HEALTH", "ROLE", "MODE", "VARS", "BYTES", "PUSH/S", "PULL/S", "UPTIME"):
        assert col in header
    # the variables' table names the shards that hold each one (indices, not a count)
    vheader = next(line for line in out.splitlines() if line.startswith("VARIABLE"))
    assert vheader.split() == ["VARIABLE", "DTYPE", "SHAPE", "SIZE", "ON", "SHARDS", "VERSION", "OPTIMIZER"]
    for address in busy_cluster.addresses:
        assert address in out
    assert out.count("SERVING") == 2
    kernel = next(line for line in out.splitlines() if line.startswith("dense/kernel"))
    # 8 KiB kernel, cut into partitions of 4 KiB over both shards, pushed three times
    assert "float32" in kernel and "64x32" in kernel and "parts" in kernel and "0,1" in kernel
    assert kernel.split()[-2] == "3" and kernel.split()[-1] == "adam"


def test_status_json_counts_and_rates(busy_cluster: LocalCluster) -> None:
    proc = run(
        "psclient.ctl",
        "status",
        "--json",
        ",".join(busy_cluster.addresses),
        "--interval",
        "0.2",
        "--timeout",
        "20",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["healthy"] == report["num_shards"] == 2
    assert [s["index"] for s in report["shards"]] == [0, 1]
    assert sum(s["pushes"] for s in report["shards"]) == 6  # 3 pushes reach both shards
    assert all(s["push_rate"] == 0.0 for s in report["shards"])  # nobody pushed during the interval
    by_name = {v["name"]: v for v in report["variables"]}
    assert by_name["dense/kernel"]["bytes"] == 64 * 32 * 4
    assert by_name["dense/kernel"]["version_min"] == by_name["dense/kernel"]["version_max"] == 3
    assert by_name["dense/bias"]["shape"] == [32]
    assert report["total_bytes"] == (64 * 32 + 32) * 4


def test_status_of_a_dead_shard_is_reported_and_exit_1(busy_cluster: LocalCluster) -> None:
    with LocalCluster(num_shards=1) as other:
        dead = other.addresses[0]
    proc = run("psclient.ctl", "status", busy_cluster.addresses[0], dead, "--interval", "0", "--timeout", "2")
    assert proc.returncode == 1
    assert "1/2 healthy" in proc.stdout and "UNREACHABLE" in proc.stdout and dead in proc.stdout


def test_status_needs_addresses(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(SystemExit) as exc:
        ctl.main(["status"])
    assert exc.value.code == 2
    assert "no shard addresses" in capsys.readouterr().err


async def test_cluster_status_api(busy_cluster: LocalCluster) -> None:
    statuses = await cluster_status(busy_cluster.addresses, timeout=TIMEOUT_S)
    assert [s.health for s in statuses] == ["SERVING", "SERVING"]
    assert {t.variable for s in statuses for t in s.tensors} == {"dense/kernel", "dense/bias"}


def test_probe_exit_codes(busy_cluster: LocalCluster) -> None:
    ok = run("psclient.probe", busy_cluster.addresses[0])
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    unknown = run("psclient.probe", busy_cluster.addresses[0], "--service", "no.such.Service")
    assert unknown.returncode == 1
    with LocalCluster(num_shards=1) as other:
        dead = other.addresses[0]
    down = run("psclient.probe", dead, "--timeout", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_status_shows_dynamic_tables_rows_and_counters(capsys: pytest.CaptureFixture[str]) -> None:
    with LocalCluster(num_shards=2) as cluster:
        with psclient.PSClient(cluster.addresses, worker_id="w0", timeout=TIMEOUT_S) as c:
            c.create_embedding("items", None, 8, capacity=4)
            c.push({"items": psclient.Rows(np.arange(50), np.ones((50, 8), np.float32))})
            c.push({"items": psclient.Rows(np.arange(50, 60), np.ones((10, 8), np.float32))})
        assert ctl.main(["status", *cluster.addresses, "--interval", "0", "--timeout", str(TIMEOUT_S)]) == 0
        out = capsys.readouterr().out
        assert (
            ctl.main(["status", "--json", *cluster.addresses, "--interval", "0", "--timeout", str(TIMEOUT_S)])
            == 0
        )
        report = json.loads(capsys.readouterr().out)
    items = next(line for line in out.splitlines() if line.startswith("items") and "dynamic" in line)
    assert "dynamic x 8" in items and "0,1" in items and "16 KiB" not in items
    header = next(line for line in out.splitlines() if line.startswith("DYNAMIC TABLE"))
    assert header.split()[2:] == [
        "ROWS",
        "CAPACITY",
        "ADMITTED",
        "EVICTED",
        "EXPIRED",
        "DROPPED",
        "INIT",
        "READS",
    ]
    counts = next(v for v in report["variables"] if v["name"] == "items")["dynamic"]
    assert counts["rows"] == 4 and counts["capacity"] == 4  # 2 per shard
    assert counts["admitted"] - counts["evicted"] == 4 and counts["evicted"] > 0
    assert counts["dropped_updates"] > 0  # 50 new ids into 2 rows per shard
    row = next(line for line in out.splitlines() if line.startswith("items") and "dynamic" not in line)
    assert row.split()[1:4] == ["4", "4", str(counts["admitted"])]
