"""The chart's Grafana dashboard and PrometheusRule against a real Prometheus that scrapes the
live services: every panel query evaluates and returns series, every alert rule evaluates
without error over series that exist, promtool checks the rules, and its unit tests make
each alert fire when it should and only then."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from tests.observability.conftest import Monitoring
from tests.observability.prometheus import Prometheus, promtool

HERE = Path(__file__).parent
#: What Grafana substitutes for the dashboard's variables.
VARIABLES = {"$__rate_interval": "30s", "$namespace": ".*", "$pod": ".*"}
#: A metric selector: a name of ours or of the gRPC conventions, with its matchers if any.
SELECTOR = re.compile(r"\b((?:moelora|grpc_server)_[a-z0-9_]+)(\{[^}]*\})?")


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: an unknown variable in {expr}"
            found.append((f"{panel['title']} / {target['refId']}", expr))
    return found


def test_the_dashboard_has_the_panels_operators_look_for(monitoring: Monitoring) -> None:
    titles = {p["title"] for p in monitoring.dashboard["panels"]}
    wanted = {
        "Forward requests/s", "Forward latency at the server", "Merged batch size",
        "Queue wait", "Slot occupancy", "Slot loads and evictions", "Adapter cold start",
        "Resident adapters", "Errors by code", "Requests by transport", "Uploads",
        "Bytes in and out", "Watch clients",
        "Database and object-store errors",
    }  # fmt: skip
    assert wanted <= titles
    ids = [p["id"] for p in monitoring.dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_panel_query_returns_series(monitoring: Monitoring, prometheus: Prometheus) -> None:
    empty = [name for name, expr in _queries(monitoring.dashboard) if not prometheus.query(expr)]
    assert empty == []


def _rules(monitoring: Monitoring) -> list[dict[str, Any]]:
    return [rule for group in monitoring.rules["groups"] for rule in group["rules"]]


def test_every_alert_evaluates_over_series_that_exist(
    monitoring: Monitoring, prometheus: Prometheus
) -> None:
    alerts = {rule["alert"] for rule in _rules(monitoring)}
    groups = prometheus.api("rules")["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(loaded) == alerts
    for name, rule in loaded.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)
    missing = []
    for rule in _rules(monitoring):
        for name, matchers in SELECTOR.findall(rule["expr"]):
            base = name.removesuffix("_bucket")
            if not prometheus.query(f"{name}{matchers}") and not prometheus.query(base):
                missing.append(f"{rule['alert']}: {name}{matchers}")
    assert missing == []


def test_promtool_checks_the_rules(monitoring: Monitoring, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(monitoring.rules))
    assert "SUCCESS: 9 rules found" in promtool("check", "rules", str(tmp_path / "rules.yaml"))


def test_each_alert_fires_when_it_should(monitoring: Monitoring, tmp_path: Path) -> None:
    """promtool's unit tests (alerts_test.yaml) over synthetic series, thresholds from the
    chart's defaults. Annotations are checked by `promtool check rules` above, not here."""
    rules = {"groups": [
        {**group, "rules": [{k: v for k, v in r.items() if k != "annotations"}
                            for r in group["rules"]]}
        for group in monitoring.rules["groups"]
    ]}  # fmt: skip
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    shutil.copy(HERE / "alerts_test.yaml", tmp_path)
    tested = yaml.safe_load((HERE / "alerts_test.yaml").read_text())
    covered = {t["alertname"] for case in tested["tests"] for t in case["alert_rule_test"]}
    assert covered == {rule["alert"] for rule in _rules(monitoring)}
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
