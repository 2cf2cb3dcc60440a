"""deploy/prometheus: promtool accepts the config and rules, the alerts' unit tests pass, and
the alerts the operators asked for exist."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install -y prometheus)")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=PROM, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_check_config():
    result = _promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(RULE_FILES)} rule files found" in result.stdout


@needs_promtool
def test_promtool_check_rules():
    result = _promtool("check", "rules", *[str(p.relative_to(PROM)) for p in RULE_FILES])
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_for_the_alerts():
    result = _promtool("test", "rules", "tests/tokq-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_catch_a_broken_alert(tmp_path):
    """The unit tests can fail: raise the error-rate threshold and they must."""
    copy = tmp_path / "prometheus"
    shutil.copytree(PROM, copy)
    alerts = copy / "rules" / "tokq-alerts.yml"
    text = alerts.read_text()
    assert "ratio_rate5m > 0.05" in text
    alerts.write_text(text.replace("ratio_rate5m > 0.05", "ratio_rate5m > 0.5"))
    result = subprocess.run([PROMTOOL, "test", "rules", "tests/tokq-rules.test.yml"], cwd=copy,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "TokqHighErrorRate" in result.stdout + result.stderr


def test_the_alerts_operators_asked_for_exist_and_are_unit_tested():
    alerts = {rule["alert"]: rule for path in RULE_FILES
              for group in yaml.safe_load(path.read_text())["groups"]
              for rule in group["rules"] if "alert" in rule}
    for name in ("TokqQueueOldestEntryAgeHigh", "TokqHighErrorRate", "TokqNoWorkerHeartbeat",
                 "TokqBatchFillRatioLow", "TokqRequeues"):
        assert name in alerts
    tests = yaml.safe_load((PROM / "tests" / "tokq-rules.test.yml").read_text())
    tested = {case["alertname"] for t in tests["tests"] for case in t.get("alert_rule_test", [])}
    assert set(alerts) <= tested, f"alerts without a unit test: {set(alerts) - tested}"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_scrape_config_has_a_job_for_gateways_and_workers():
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"tokq-gateway", "tokq-worker"} <= jobs
    assert config["rule_files"] == ["rules/*.yml"]
