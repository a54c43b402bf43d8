"""deploy/'s monitoring files: the Prometheus config and alert rules pass promtool (and the rules' unit
tests), and the Grafana dashboard is well formed with queries a real PromQL parser accepts.

promtool comes with Debian's ``prometheus`` package (``.ci/run`` installs it); without it those
tests skip. That every metric name used here is one a shard exports, and that a real
Prometheus evaluates every query, is checked in tests/integration/test_prometheus.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("promql_parser")
from _promql import (  # tests/_promql.py
    ALERTS,
    DASHBOARD,
    PROMETHEUS_CONFIG,
    alert_queries,
    dashboard_queries,
    metric_names,
)

ROOT = Path(__file__).resolve().parents[1]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL or "promtool", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


@needs_promtool
def test_promtool_checks_the_config_and_its_rule_files() -> None:
    proc = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout  # rule_files resolved next to the config
    proc = promtool("check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_alert_unit_tests_pass() -> None:
    proc = promtool("test", "rules", "tests/promtool/alerts_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_promtool
def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: the same file with one expression broken does not pass."""
    broken = tmp_path / "alerts.yml"
    broken.write_text(ALERTS.read_text().replace("expr: up{job=", "expr: sum(up{job=", 1))
    proc = promtool("check", "rules", str(broken))
    assert proc.returncode != 0 and "unclosed left parenthesis" in proc.stdout + proc.stderr


def test_alert_rules_are_complete_and_documented() -> None:
    import yaml

    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for wanted in ("PsShardDown", "PsCheckpointStale", "PsBarrierStalled", "PsReplicationLagHigh",
                   "PsHighErrorRate"):  # fmt: skip
        assert wanted in names
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == [ALERTS.name]  # loaded by the deploy config
    monitoring = (ROOT / "docs/operations/monitoring.md").read_text()
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert f"`{rule['alert']}`" in monitoring, f"docs/operations/monitoring.md omits {rule['alert']}"
    # Every rule's unit test is in the promtool test file.
    cases = yaml.safe_load((ROOT / "tests/promtool/alerts_test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case.get("alert_rule_test", [])}
    assert tested == set(names)


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert variables["shard"]["includeAll"] and variables["shard"]["allValue"] == ".*"
    boxes = []
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        box = (pos["x"], pos["y"], pos["x"] + pos["w"], pos["y"] + pos["h"])
        for other, title in boxes:
            overlap = box[0] < other[2] and other[0] < box[2] and box[1] < other[3] and other[1] < box[3]
            assert not overlap, f"panels {title!r} and {panel['title']!r} overlap"
        boxes.append((box, panel["title"]))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_query_parses_and_the_dashboard_covers_the_issue() -> None:
    used: set[str] = set()
    for query in [*dashboard_queries(), *alert_queries()]:
        try:
            names = metric_names(query.promql())
        except ValueError as err:
            raise AssertionError(f"{query.where}: {err}: {query.expr}") from err
        assert names, f"{query.where} selects no metric: {query.expr}"
        used |= names
    dashboard_names = set().union(*(metric_names(q.promql()) for q in dashboard_queries()))
    for wanted in (
        "psserver_pushes_total",  # throughput
        "psserver_rpc_latency_seconds_bucket",  # latency quantiles
        "psserver_push_staleness_bucket",  # staleness
        "psserver_barrier_wait_seconds_bucket",  # barrier waits
        "psserver_replication_ack_seconds_bucket",  # replication lag
        "psserver_checkpoint_age_seconds",  # checkpoint age
    ):
        assert wanted in dashboard_names, wanted
    with pytest.raises(ValueError):  # the parser does refuse bad PromQL
        metric_names("sum(rate(psserver_pushes_total[1m])")
