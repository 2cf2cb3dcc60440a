"""Every PromQL expression tokq ships (dashboards, recording and alert rules, the k8s
autoscaler) parses and names only series that tokq.metrics defines, or that a recording rule
in deploy/prometheus/rules defines from them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tokq import metrics

promql_parser = pytest.importorskip("promql_parser", reason="pip install promql-parser")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
# What Grafana substitutes before the query reaches Prometheus.
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def interpolate(expr: str) -> str:
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    # template variables appear only inside label matcher strings, which stay valid PromQL
    assert "$" not in re.sub(r'"[^"]*"', '""', expr), f"uninterpolated variable in {expr}"
    return expr


def selected_names(expr: str) -> set[str]:
    """Metric names read by ``expr``; a selector without a name fails the test."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets") or []:
                out.append((f"{path.name}: {panel['title']}", interpolate(target["expr"])))
        for var in board["templating"]["list"]:
            if var["type"] == "query":  # label_values(<selector>, <label>) is Grafana's, not PromQL
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
                assert m, f"{path.name} variable {var['name']}: unexpected query {var['query']}"
                out.append((f"{path.name}: ${var['name']}", m.group(1)))
    return out


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def test_every_dashboard_query_parses_and_names_defined_metrics():
    exprs = dashboard_exprs()
    assert len(exprs) > 25
    defined = set(metrics.series_names())
    for where, expr in exprs:
        unknown = selected_names(expr) - defined
        assert not unknown, f"{where} reads undefined series {unknown}"


def test_every_rule_parses_and_names_defined_metrics_or_recorded_series():
    from prometheus_client import ProcessCollector

    # prometheus_client's process metrics, which every tokq process exports beside its own (Linux)
    process = {s.name for family in ProcessCollector(registry=None).collect() for s in family.samples}
    assert "process_start_time_seconds" in process
    # and Prometheus's own per-target series
    allowed = set(metrics.series_names()) | recorded_names() | process | {"up"}
    assert len(rules()) > 15
    for rule in rules():
        unknown = selected_names(rule["expr"]) - allowed
        assert not unknown, f"{rule.get('record') or rule.get('alert')} reads {unknown}"


def test_recorded_names_follow_level_metric_operation():
    for name in recorded_names():
        level, metric, operation = name.split(":")
        assert metric.startswith("tokq_") and level and operation, name


def test_autoscaler_query_names_a_defined_metric():
    scaled = yaml.safe_load((DEPLOY / "k8s" / "autoscaler.yaml").read_text())
    for trigger in scaled["spec"]["triggers"]:
        names = selected_names(trigger["metadata"]["query"])
        assert names and names <= set(metrics.series_names())


def test_error_code_sets_agree_with_metrics_module():
    """The server-error regex in rules and dashboards is tokq.metrics.ERROR_CODES exactly."""
    wanted = "|".join(metrics.ERROR_CODES)
    texts = [p.read_text() for p in RULE_FILES + DASHBOARDS]
    found = [m for text in texts for m in re.findall(r'code=~\\?"([A-Z_|]+)\\?"', text)]
    assert found and all(f == wanted for f in found), found


def test_a_wrong_name_would_be_caught():
    """The checker itself: a typo'd metric is reported, a histogram suffix is accepted."""
    defined = set(metrics.series_names())
    assert selected_names("rate(tokq_worker_batch_tokens_bucket[1m])") <= defined
    assert not selected_names("rate(tokq_worker_batch_token_bucket[1m])") <= defined
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(tokq_worker_batches_total[1m])")
