"""The PromQL of deploy/: the Grafana dashboard's and the alert rules' queries, and the metric names they use.

Shared by tests/test_monitoring.py (the queries parse; promtool) and
tests/integration/test_prometheus.py (every name a query uses is one a real shard
exports; a real Prometheus evaluates every query).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import promql_parser
import yaml
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "paramserver.json"
ALERTS = DEPLOY / "alerts.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus.yml"

# Series Prometheus adds to every scrape target itself.
PROMETHEUS_SERIES = frozenset(
    {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_samples_post_metric_relabeling",
     "scrape_series_added"}
)  # fmt: skip
# Grafana's own variables, and values for the dashboard's variables, so a query becomes plain PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$job": "psserver"}
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


@dataclass(frozen=True)
class Query:
    """One PromQL expression of deploy/ and where it comes from."""

    where: str  # "dashboard panel 'Pushes / s'", "alert PsShardDown", ...
    expr: str  # as written (Grafana variables not substituted)

    def promql(self, rate_interval: str = "1m", shard: str = ".*") -> str:
        """The expression with the dashboard's variables filled in (``$shard``: a regex matcher value)."""
        text = self.expr
        for name, value in {**GRAFANA_VARIABLES, "$__rate_interval": rate_interval}.items():
            text = text.replace(name, value)
        return text.replace("$shard", shard)


def dashboard_queries(path: Path = DASHBOARD) -> list[Query]:
    """Every panel target's ``expr`` and every query variable's selector in a Grafana dashboard."""
    dashboard = json.loads(path.read_text())
    out = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            out.append(Query(f"dashboard panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = _LABEL_VALUES.match(query.strip())
        assert match, f"variable {variable['name']}: only label_values(selector, label) is supported: {query}"
        if match["selector"]:
            out.append(Query(f"dashboard variable {variable['name']}", match["selector"]))
    return out


def _panels(panels: Iterable[dict]) -> Iterable[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # panels of a collapsed row


def alert_queries(path: Path = ALERTS) -> list[Query]:
    """Every rule's ``expr`` in a Prometheus rule file."""
    rules = yaml.safe_load(path.read_text())
    return [
        Query(f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in rules["groups"]
        for rule in group["rules"]
    ]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (parsed by a real PromQL parser; raises ValueError)."""
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)
        return None

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def exported_series(exposition: str) -> set[str]:
    """The series names a Prometheus text exposition can hold, by each family's type.

    A labelled family with no child yet exposes only its HELP and TYPE lines, so the
    names come from the type (a counter ``x`` is scraped as ``x_total``, a histogram
    as ``x_bucket``, ``x_sum``, ``x_count``) as well as from the samples present.
    """
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "info": ("_info",),
    }
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names
