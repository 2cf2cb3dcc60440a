"""The Grafana dashboards: the committed JSON is what deploy/grafana/build.py makes, it has
the panels operators need, every panel reads the datasource variable, and the provisioning
files point where deploy/compose mounts the dashboards."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("grafana_foundation_sdk", reason="pip install grafana-foundation-sdk")

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
BUILD = GRAFANA / "build.py"


def _load_build():
    spec = importlib.util.spec_from_file_location("tokq_grafana_build", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


def _boards() -> dict[str, dict]:
    return {name: json.loads((build.OUT_DIR / name).read_text()) for name in build.DASHBOARDS}


def test_committed_dashboards_equal_a_fresh_build():
    for name, make in build.DASHBOARDS.items():
        committed = (build.OUT_DIR / name).read_text()
        assert committed == build.render(make()), (
            f"{name} is stale: run .venv/bin/python deploy/grafana/build.py")


def test_check_mode_fails_on_drift(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "OUT_DIR", tmp_path)
    assert build.main([]) == 0
    assert build.main(["--check"]) == 0
    board = tmp_path / "tokq-workers.json"
    board.write_text(board.read_text().replace("Batch fill ratio", "Batch fill"))
    assert build.main(["--check"]) == 1


def test_build_script_runs_as_a_command():
    result = subprocess.run([sys.executable, str(BUILD), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


REQUIRED_PANELS = {
    "tokq-overview.json": ["Request rate", "Error rate", "Embed latency", "Queue depth (tokens)",
                           "Oldest queued entry age", "Requeues and expirations"],
    "tokq-workers.json": ["Batch fill ratio", "Tokens/s per worker", "MFU",
                          "Forward time per 1,000 tokens"],
}


def test_dashboards_have_the_panels_operators_need():
    for name, board in _boards().items():
        titles = [p["title"] for p in board["panels"]]
        for title in REQUIRED_PANELS[name]:
            assert title in titles, f"{name} lacks panel {title!r}"
    overview = {p["title"]: p for p in _boards()["tokq-overview.json"]["panels"]}
    latency = [t["expr"] for t in overview["Embed latency"]["targets"]]
    assert [e.split(",")[0] for e in latency] == [
        "histogram_quantile(0.5", "histogram_quantile(0.9", "histogram_quantile(0.99"]


def test_panels_are_wired_to_the_datasource_variable_and_do_not_overlap():
    for name, board in _boards().items():
        assert board["uid"] and board["title"]
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, f"{name}: {panel['title']} off grid"
            own = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                   for y in range(pos["y"], pos["y"] + pos["h"])}
            assert not own & cells, f"{name}: {panel['title']} overlaps another panel"
            cells |= own
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], f"{name}: {panel['title']} has no query"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert target["refId"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), f"{name}: {panel['title']} repeats a refId"
    uids = [b["uid"] for b in _boards().values()]
    assert len(uids) == len(set(uids))


def test_provisioning_points_at_the_mounted_dashboards():
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/tokq.yaml").read_text())
    compose = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"])
    compose_dir = ROOT / "deploy/compose"
    by_target = {target: (compose_dir / source).resolve() for source, target in mounts.items()}
    path = providers["providers"][0]["options"]["path"]
    assert by_target[path] == build.OUT_DIR
    assert by_target["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (build.OUT_DIR / Path(home).relative_to(path)).is_file()

    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (ds,) = sources["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"]
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
