"""Monitoring as people run it: a real Prometheus scrapes two real shards through deploy/prometheus.yml.

The Prometheus config is deploy/prometheus.yml with only its targets (the two
shards' ephemeral metrics ports), its intervals (1 s, to keep the test short) and
its rule file's path (absolute) rewritten: the job and the alert rules are the
deployed ones. Prometheus is Debian's ``prometheus`` package (``.ci/run`` installs
it); without it those tests skip. Every wait is bounded.

The first test needs no Prometheus: every metric name the dashboard and the alert
rules use is one that real shards export.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("promql_parser")
import yaml
from _promql import (  # tests/_promql.py
    DEPLOY,
    PROMETHEUS_CONFIG,
    PROMETHEUS_SERIES,
    alert_queries,
    dashboard_queries,
    exported_series,
    metric_names,
)
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from psserver.config import ServerConfig
from psserver.server import start
from trainer.cluster import LocalCluster

pytestmark = [pytest.mark.timeout(180)]

PROMETHEUS = shutil.which("prometheus")
POLL_S = 60.0  # bound of every wait for Prometheus to see something (it scrapes every second)
_LISTENING = re.compile(r'msg="Listening on" address=(\S+)')


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
        return resp.read().decode()


async def test_dashboard_and_alerts_use_only_names_real_shards_export(tmp_path: Path) -> None:
    # A primary that checkpoints periodically and its backup: between them, every family a shard exports.
    primary = await start(
        ServerConfig(shard=0, port=0, metrics_port=0, checkpoint_dir=str(tmp_path), checkpoint_every_s=60)
    )
    backup = await start(ServerConfig(shard=0, port=0, metrics_port=0, backup_of=primary.address))
    try:
        texts = [
            await asyncio.to_thread(fetch, f"http://127.0.0.1:{s.metrics.port}/metrics")
            for s in (primary, backup)
        ]
    finally:
        await backup.stop(0)
        await primary.stop(0)
    exported = set().union(*(exported_series(t) for t in texts))
    assert "psserver_pushes_total" in exported and "psserver_pushes" not in exported  # counters end in _total
    assert "psserver_replication_updates_applied_total" in exported  # the backup's
    assert "psserver_checkpoint_dirty" in exported  # the checkpointing primary's
    known = exported | PROMETHEUS_SERIES
    unknown = {
        q.where: sorted(metric_names(q.promql()) - known)
        for q in [*dashboard_queries(), *alert_queries()]
        if metric_names(q.promql()) - known
    }
    assert not unknown, f"queries use metric names no shard exports: {unknown}"


# -- a real Prometheus --------------------------------------------------------------------------------


@dataclass
class Scraped:
    """Two shards, a worker pushing to both, and a Prometheus scraping them."""

    cluster: LocalCluster
    metrics: list[str]  # HOST:PORT of each shard's /metrics
    url: str  # the Prometheus HTTP API
    config: dict[str, Any]
    pusher: threading.Thread
    stop: threading.Event

    def stop_pushing(self) -> None:
        self.stop.set()
        self.pusher.join(TIMEOUT_S)
        assert not self.pusher.is_alive()

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = json.loads(fetch(f"{self.url}/api/v1/{path}{query}"))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on a PromQL error)."""
        try:
            data = self.api("query", query=expr)
        except urllib.error.HTTPError as err:  # 400: bad PromQL, with Prometheus's own message
            raise AssertionError(f"{expr}: {err.read().decode()}") from err
        return data["result"]

    def poll(self, what: str, check: Any) -> Any:
        """Calls ``check()`` until it returns something truthy (at most POLL_S seconds)."""
        deadline = time.monotonic() + POLL_S
        last = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(0.25)
        raise AssertionError(f"Prometheus did not show {what} within {POLL_S:.0f}s (last: {last})")


def derived_config(targets: list[str], interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus.yml with only targets, intervals and rule paths rewritten for this machine."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = interval
    config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "psserver"]
    job["static_configs"] = [{"targets": targets}]
    return config


@contextlib.contextmanager
def prometheus(config: dict[str, Any], workdir: Path) -> Iterator[str]:
    """Runs Prometheus on 127.0.0.1, an ephemeral port; yields its URL once it is ready."""
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS or "prometheus", f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
             "--web.listen-address=127.0.0.1:0", "--log.level=info"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = None
        deadline = time.monotonic() + POLL_S
        while time.monotonic() < deadline and proc.poll() is None:
            match = _LISTENING.search(log_path.read_text(errors="replace"))
            if match:
                url = f"http://{match[1]}"
                with contextlib.suppress(OSError):
                    fetch(f"{url}/-/ready")
                    break
            time.sleep(0.1)
        else:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"Prometheus did not become ready:\n{tail}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)


def _push_until(stop: threading.Event, addresses: list[str]) -> None:
    """A worker pushing to every shard about 20 times a second until ``stop`` (at most 120 s)."""
    names = [f"mon/v{i}" for i in range(4)]  # equal sizes: placement by bytes spreads them over both shards
    with psclient.PSClient(addresses, worker_id="mon-w0", timeout=TIMEOUT_S) as c:
        c.create_many({n: np.zeros(256, np.float32) for n in names}, optimizer=psclient.SGD(0.01))
        grads = {n: np.ones(256, np.float32) for n in names}
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            c.push(grads)
            c.pull(names[:1])
            stop.wait(0.05)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    workdir = tmp_path_factory.mktemp("prometheus")
    with LocalCluster(2, ["--metrics-port", "0"], workdir=workdir / "cluster") as cluster:
        metrics = [(cluster.workdir / f"ps{i}.addr.metrics").read_text().strip() for i in range(2)]
        config = derived_config(metrics)
        stop = threading.Event()
        pusher = threading.Thread(target=_push_until, args=(stop, cluster.addresses), daemon=True)
        pusher.start()
        try:
            with prometheus(config, workdir) as url:
                yield Scraped(cluster, metrics, url, config, pusher, stop)
        finally:
            stop.set()
            pusher.join(TIMEOUT_S)


def test_the_derived_config_keeps_the_deployed_jobs_and_rules(scraped: Scraped) -> None:
    deployed = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert [j["job_name"] for j in scraped.config["scrape_configs"]] == [
        j["job_name"] for j in deployed["scrape_configs"]
    ]
    for ours, theirs in zip(scraped.config["scrape_configs"], deployed["scrape_configs"], strict=True):
        assert {k: v for k, v in ours.items() if k != "static_configs"} == {
            k: v for k, v in theirs.items() if k != "static_configs"
        }


def test_prometheus_scrapes_both_shards(scraped: Scraped) -> None:
    def both_up() -> list[dict[str, Any]]:
        result = scraped.query('up{job="psserver"} == 1')
        return result if len(result) == 2 else []

    result = scraped.poll("both shards up", both_up)
    assert sorted(r["metric"]["instance"] for r in result) == sorted(scraped.metrics)
    shards = scraped.query('psserver_uptime_seconds{job="psserver"}')
    assert {(r["metric"]["instance"], r["metric"]["shard"]) for r in shards} == {
        (scraped.metrics[0], "0"), (scraped.metrics[1], "1"),
    }  # fmt: skip


def test_push_rate_is_seen_on_every_shard(scraped: Scraped) -> None:
    def rates() -> dict[str, float]:
        result = scraped.query('rate(psserver_pushes_total{job="psserver", outcome="applied"}[30s]) > 0')
        found = {r["metric"]["shard"]: float(r["value"][1]) for r in result}
        return found if set(found) == {"0", "1"} else {}

    found = scraped.poll("rate(psserver_pushes_total[30s]) > 0 on both shards", rates)
    assert all(rate > 0 for rate in found.values())
    # The latency histogram of the pushes and pulls is there too, by method.
    p99 = "histogram_quantile(0.99, sum by (rpc, le) (rate(psserver_rpc_latency_seconds_bucket[30s]))) > 0"
    p99 = scraped.poll("push latency quantiles", lambda: scraped.query(p99))
    assert {r["metric"]["rpc"] for r in p99} >= {"Push"}


def test_alert_rules_load_and_evaluate_cleanly(scraped: Scraped) -> None:
    expected = {q.where.removeprefix("rule ") for q in alert_queries()}

    def evaluated() -> list[dict[str, Any]]:
        rules = [r for g in scraped.api("rules")["groups"] for r in g["rules"]]
        done = [r for r in rules if not r["lastEvaluation"].startswith("0001-")]
        return rules if len(done) == len(rules) == len(expected) else []

    rules = scraped.poll("every alert rule evaluated", evaluated)
    assert {r["name"] for r in rules} == expected
    for rule in rules:
        assert rule["type"] == "alerting" and rule["health"] == "ok", rule
        assert rule["state"] == "inactive", rule  # a healthy, busy cluster raises nothing


def test_every_dashboard_query_evaluates_and_the_main_panels_have_data(scraped: Scraped) -> None:
    scraped.poll("pushes on both shards", lambda: len(scraped.query("psserver_pushes_total > 0")) >= 2)
    empty = []
    for query in dashboard_queries():
        result = scraped.query(query.promql(rate_interval="30s"))  # raises on a PromQL error
        if not result:
            empty.append(query.where)
    # Panels that need sync/ssp, replication or checkpoints are empty here; the throughput, latency and
    # state panels are not.
    for panel in (
        "Shards up", "Pushes / s by shard and outcome", "Pulls / s by shard",
        "RPC latency by method (p50, p90, p99)", "Push staleness (p50, p99, mean)", "Stored bytes by shard",
        "Role", "Uptime",
    ):  # fmt: skip
        assert not any(f"panel {panel!r}" in where for where in empty), f"{panel}: no data ({empty})"


def test_a_killed_shard_raises_shard_down(scraped: Scraped) -> None:
    """Last in the module: it leaves shard 1 down."""
    scraped.stop_pushing()  # the worker would wait out its deadline on the dead shard
    scraped.cluster.kill_shard(1)

    def pending() -> list[dict[str, Any]]:
        alerts = scraped.api("alerts")["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "PsShardDown"]

    (alert,) = scraped.poll("PsShardDown for the killed shard", pending)
    assert alert["labels"]["instance"] == scraped.metrics[1] and alert["labels"]["severity"] == "critical"
    assert alert["state"] == "pending"  # `for: 1m`: firing only after a minute
    assert alert["annotations"]["summary"] == f"psserver {scraped.metrics[1]} is down"
