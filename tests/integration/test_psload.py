"""psload: short load runs (a local cluster it starts, and a running sync cluster) whose JSON is checked."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from psload import LoadConfig, ModelSpec, report, run_load
from psload.runner import LoadError
from trainer.cluster import LocalCluster


def check_result(result: dict, *, workers: int, shards: int, mode: str) -> None:
    cfg, s = result["config"], result["summary"]
    assert cfg["workers"] == workers and cfg["num_shards"] == shards and cfg["mode"] == mode
    assert s["steps"] > 0 and s["errors"] == 0 and s["failed_workers"] == {}
    assert s["steps_per_s"] > 0 and s["gb_per_s"] > 0
    assert s["bytes"] == s["steps"] * 2 * cfg["model_bytes"]  # push_pull: gradients out, values back
    lat = s["latency"]
    assert 0 < lat["p50_ms"] <= lat["p95_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    assert sum(int(v) for v in s["steps_per_worker"].values()) == s["steps"]
    assert len(result["shards"]) == shards
    assert sum(sh["share"] for sh in result["shards"]) == pytest.approx(1.0)
    assert all(sh["pushes"] > 0 and sh["health"] == "SERVING" for sh in result["shards"])
    assert result["balance"]["max_over_mean"] >= 1.0
    assert result["timeline"] and sum(row["steps_per_s"] for row in result["timeline"]) == s["steps"]


def test_cli_local_cluster_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    proc = subprocess.run(
        [sys.executable, "-m", "psload", "--workers", "2", "--model", "4x64KiB", "--duration", "2",
         "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    check_result(result, workers=2, shards=2, mode="async")
    assert result["config"]["local_cluster"] is True
    assert "steps/s" in proc.stderr and "GB/s" in proc.stderr  # live progress
    assert "throughput" in proc.stdout and "p99" in proc.stdout
    assert "stay on the cluster" not in proc.stdout  # the local cluster went with the run
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_run_against_a_running_cluster() -> None:
    server_args = ["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2"]
    with LocalCluster(num_shards=2, server_args=server_args) as cluster:
        live = io.StringIO()
        config = LoadConfig(
            workers=2, model=ModelSpec.parse("3x16KiB"), duration_s=1.5, addresses=tuple(cluster.addresses),
            timeout_s=30.0,
        )  # fmt: skip
        result = run_load(config, progress=live)
        check_result(result, workers=2, shards=2, mode="sync")
        # sync: both workers stop at the same step, and every step is one update on every shard
        per_worker = set(result["summary"]["steps_per_worker"].values())
        assert len(per_worker) == 1
        assert all(sh["pushes"] == per_worker.pop() for sh in result["shards"][:1])
        assert "2 workers" in live.getvalue()
        # a running cluster keeps the variables (no delete RPC): the result and the summary say so
        assert result["config"]["prefix"] == "psload" and len(result["config"]["variable_names"]) == 3
        left = next(line for line in report.format_summary(result).splitlines() if "left" in line)
        assert "3 variable(s) named psload/*" in left and "restart" in left
        with pytest.raises(LoadError, match="async"):
            run_load(LoadConfig(workers=1, duration_s=1, addresses=tuple(cluster.addresses), mode="async"))


def test_many_simulated_workers_per_process_with_exact_counts() -> None:
    """2 processes x 3 simulated workers (worker ids of their own) in sync mode: 6 replicas, counts exact
    (the warm-up pull before the clock starts is no step)."""
    server_args = ["--mode", "sync", "--replicas-to-aggregate", "6", "--total-replicas", "6"]
    with LocalCluster(num_shards=2, server_args=server_args) as cluster:
        config = LoadConfig(
            workers=2, clients_per_worker=3, model=ModelSpec.parse("2x16KiB"), duration_s=1.5,
            addresses=tuple(cluster.addresses), timeout_s=30.0, exact=True, warm_up=True,
        )  # fmt: skip
        result = run_load(config, progress=None)
    check_result(result, workers=6, shards=2, mode="sync")
    steps = result["summary"]["steps_per_worker"]
    assert sorted(steps) == [str(w) for w in range(6)] and len(set(steps.values())) == 1
    assert result["summary"]["steps_max_over_min"] == 1.0
    counts = result["counts"]
    assert counts["ok"] and counts["unit"] == "steps"
    assert set(counts["applied"].values()) == {counts["acknowledged_pushes"]} == set(steps.values())
    assert "0 lost, 0 applied twice" in report.format_summary(result)


def test_unreachable_cluster_is_a_clear_error() -> None:
    with LocalCluster(num_shards=1) as other:
        dead = other.addresses[0]
    with pytest.raises(LoadError, match="unreachable"):
        run_load(LoadConfig(workers=1, duration_s=1, addresses=(dead,), timeout_s=2.0), progress=None)


@pytest.mark.parametrize(
    ("mode", "duration", "min_kills"),
    [
        # 12 s: 4-7 kills of the primaries, alternating, at load 4-5 here (3+ in sync mode, where a step waits
        # for every worker, so each failover (the lease, 1 s here) pauses them all); the 5-minute soak with
        # 60 kills is in bench/README.md.
        ("async", 12, 3),
        ("sync", 12, 3),
    ],
)
def test_chaos_soak_loses_no_acknowledged_push(
    tmp_path: Path, mode: str, duration: int, min_kills: int
) -> None:
    """psload --chaos, short: primaries kill -9-ed every 2 s under 4 workers; the counters stay exact."""
    out = tmp_path / "chaos.json"
    # A short run is mostly warm-up: its RSS is reported, and held to the 10 % bound by the 5-minute
    # soak (bench/README.md), not here.
    proc = subprocess.run(
        [sys.executable, "-m", "psload", "--chaos", "--mode", mode, "--kill-every", "2", "--workers", "4",
         "--model", "4x16KiB", "--duration", str(duration), "--max-rss-growth", "50", "--json", str(out),
         "--quiet", "--server-arg=--lease", "--server-arg=1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    result = json.loads(out.read_text())
    chaos, s = result["chaos"], result["summary"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["config"]["mode"] == mode
    assert s["errors"] == 0 and s["failed_workers"] == {} and s["steps"] > 0
    assert len(chaos["kills"]) >= min_kills and chaos["monkey_error"] is None
    assert {k["shard"] for k in chaos["kills"]} == {0, 1}  # round robin over the shards
    assert all(k["failover_s"] is not None and k["redundant_s"] is not None for k in chaos["kills"])
    counters = chaos["counters"]
    assert counters["lost"] == 0 and counters["applied_twice"] == 0
    # async: every push adds 1; sync: every step adds 1, and every worker did every step.
    if mode == "sync":
        assert len(set(s["steps_per_worker"].values())) == 1, s["steps_per_worker"]
    acknowledged = s["steps"] if mode == "async" else s["steps"] // 4
    assert set(counters["applied"].values()) == {acknowledged} == {counters["acknowledged_pushes"]}
    assert counters["variables_with_other_versions"] == {}
    rec = chaos["recovery"]
    assert (
        0 < rec["failover_p50_s"] <= rec["failover_max_s"]
        and 0 < rec["redundant_p50_s"] <= rec["redundant_max_s"]
    )
    for who in ("shards", "workers"):
        assert chaos["rss"][who]["growth"] is not None and chaos["rss"][who]["baseline_mib"] > 0
    assert "lost" in proc.stdout and "failover p50" in proc.stdout and "rss" in proc.stdout
