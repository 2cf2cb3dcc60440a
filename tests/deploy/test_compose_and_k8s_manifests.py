"""deploy/compose, deploy/k8s and deploy/Dockerfile hold together: commands name real tokq
subcommands, TOKQ_* variables name real config fields, mounted paths exist, and the metrics
ports agree with what Prometheus scrapes. (No container engine runs here: structure only.)"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import click
import pytest
import yaml

from tokq import cli, config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONFIG_FOR = {"gateway": config.GatewayConfig, "worker": config.WorkerConfig,
              "up": None}  # `tokq up` takes flags only


def subcommand_of(command: list[str]) -> str:
    """The tokq subcommand a container runs, checked to exist and to import."""
    if command[0] == "tokq-worker":
        assert PYPROJECT["project"]["scripts"]["tokq-worker"] == "tokq.workers.cli:main"
        return "worker"
    assert command[0] == "tokq", command
    name = command[1]
    assert name in cli.COMMANDS, f"{name} is not a tokq subcommand"
    module, attr = cli.COMMANDS[name].split(":")
    assert isinstance(getattr(importlib.import_module(module), attr), click.Command)
    return name


def check_env(subcommand: str, env: dict[str, str]) -> None:
    cls = CONFIG_FOR[subcommand]
    fields = {f.upper() for f in cls.__dataclass_fields__} if cls else set()
    if cls:  # gateways and workers also read the queue's settings (QueueConfig) from TOKQ_*
        fields |= {f.upper() for f in config.QueueConfig.__dataclass_fields__}
    for name in env:
        if name.startswith("TOKQ_"):
            assert name.removeprefix("TOKQ_") in fields, f"{name} is no {subcommand} setting"
    if cls:
        config.load(cls, env=env)  # the values parse as the config would read them
        config.load(config.QueueConfig, env=env)


def scrape_ports() -> dict[str, tuple[list[str], int]]:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    return {job["job_name"]: (sd["names"], sd["port"])
            for job in prom["scrape_configs"] for sd in job["dns_sd_configs"]}


# -- compose ------------------------------------------------------------------------------------

def _compose() -> dict:
    return yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())


def test_compose_runs_the_whole_stack_from_the_dockerfile():
    services = _compose()["services"]
    assert {"redis", "gateway", "worker", "prometheus", "grafana"} <= set(services)
    for name in ("gateway", "worker"):
        build = services[name]["build"]
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        for dep in services[name]["depends_on"]:
            assert dep in services


def test_compose_commands_and_settings_are_real():
    services = _compose()["services"]
    for name in ("gateway", "worker"):
        svc = services[name]
        assert subcommand_of(svc["command"]) == name
        check_env(name, svc["environment"])
        host = re.match(r"redis://([^:/]+):(\d+)", svc["environment"]["TOKQ_REDIS_URL"])
        assert host and host.group(1) in services


def test_compose_metrics_ports_are_the_ones_prometheus_scrapes():
    services = _compose()["services"]
    ports = scrape_ports()
    for job, service in (("tokq-gateway", "gateway"), ("tokq-worker", "worker")):
        names, port = ports[job]
        assert names == [service]
        assert int(services[service]["environment"]["TOKQ_METRICS_PORT"]) == port
    gateway = services["gateway"]
    assert f"{gateway['environment']['TOKQ_PORT']}:{gateway['environment']['TOKQ_PORT']}" in gateway["ports"]


def test_compose_mounts_exist_and_prometheus_reads_the_mounted_config():
    services = _compose()["services"]
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            assert (COMPOSE_DIR / source).exists(), f"{name} mounts missing {source}"
    prom = services["prometheus"]
    mounts = {v.split(":")[1]: COMPOSE_DIR / v.split(":")[0] for v in prom["volumes"]}
    config_file = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    mount = next(t for t in mounts if config_file.startswith(t + "/"))
    assert (mounts[mount] / Path(config_file).relative_to(mount)).resolve() == (
        DEPLOY / "prometheus" / "prometheus.yml")


def test_compose_gpu_override_reserves_a_gpu_for_the_worker():
    override = yaml.safe_load((COMPOSE_DIR / "compose.gpu.yaml").read_text())
    assert set(override["services"]) <= set(_compose()["services"])
    worker = override["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"]
    check_env("worker", worker["environment"])


# -- k8s ----------------------------------------------------------------------------------------

def _k8s() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), f"kustomization lists missing {resource}"
        docs += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    assert {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} == set(
        kustomization["resources"]), "a manifest is not listed in kustomization.yaml"
    return docs


def _kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _k8s() if d["kind"] == kind}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_k8s_deployments_run_real_subcommands_with_real_settings():
    deployments = _kind("Deployment")
    services = _kind("Service")
    ran = set()
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        assert _selects(dep["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
        for container in pod["spec"]["containers"]:
            if "command" not in container:
                continue  # redis
            sub = subcommand_of(container["command"])
            ran.add(sub)
            env = {e["name"]: e["value"] for e in container["env"]}
            check_env(sub, env)
            host, port = re.match(r"redis://([^:/]+):(\d+)", env["TOKQ_REDIS_URL"]).groups()
            assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["metrics"] == int(env["TOKQ_METRICS_PORT"])
    assert ran == {"gateway", "worker"}


def test_k8s_gateway_service_is_headless_with_one_process_per_pod():
    # README "Clients and balancing": clients balance per call over the pods' addresses, which
    # needs the DNS name to list them (headless) and each pod to be one process.
    service = _kind("Service")["tokq-gateway"]
    assert service["spec"]["clusterIP"] == "None"
    (container,) = _kind("Deployment")["tokq-gateway"]["spec"]["template"]["spec"]["containers"]
    assert "--procs" not in container["command"]


def test_k8s_worker_requests_a_gpu():
    (container,) = _kind("Deployment")["tokq-worker"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "TOKQ_DEVICE", "value": "cuda"} in container["env"]


def test_k8s_service_monitor_scrapes_gateways_and_workers_on_their_metrics_ports():
    (monitor,) = _kind("ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    scraped_pods = set()
    for svc in _kind("Service").values():
        if not _selects(selector, svc["metadata"].get("labels", {})):
            continue
        svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert endpoint_ports <= set(svc_ports), svc["metadata"]["name"]
        for dep_name, dep in _kind("Deployment").items():
            pod = dep["spec"]["template"]
            if _selects(svc["spec"]["selector"], pod["metadata"]["labels"]):
                scraped_pods.add(dep_name)
                container_ports = {p["name"]: p["containerPort"]
                                   for c in pod["spec"]["containers"] for p in c["ports"]}
                for port in endpoint_ports:
                    assert svc_ports[port]["targetPort"] in container_ports
                    assert svc_ports[port]["port"] == container_ports[svc_ports[port]["targetPort"]]
    assert scraped_pods == {"tokq-gateway", "tokq-worker"}


def test_k8s_autoscaler_scales_the_worker_deployment_on_queued_tokens():
    (scaled,) = _kind("ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] in _kind("Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "tokq-worker"
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    assert set(triggers) == {"interactive", "all"}
    assert all(t["type"] == "prometheus" for t in triggers.values())
    # interactive work alone: its lanes (light, heavy), not the batch lane
    interactive = triggers["interactive"]["metadata"]["query"]
    assert "tokq_queue_lane_queued_tokens" in interactive and 'lane=~"light|heavy"' in interactive
    assert "tokq_queue_queued_tokens" in triggers["all"]["metadata"]["query"]
    from tokq.workers.budget import DEFAULT_BUDGET

    # the comment's promise: a replica per 16 full batches of interactive work at the CUDA
    # workers' default budget, per 64 of either class
    assert int(triggers["interactive"]["metadata"]["threshold"]) == 16 * DEFAULT_BUDGET["cuda"]
    assert int(triggers["all"]["metadata"]["threshold"]) == 64 * DEFAULT_BUDGET["cuda"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


# -- Dockerfile ---------------------------------------------------------------------------------

def test_dockerfile_copies_every_package_and_runs_tokq():
    text = (DEPLOY / "Dockerfile").read_text()
    copied = {part for line in re.findall(r"^COPY (.+?) \S+$", text, re.M) for part in line.split()}
    package_dirs = {path.split("/")[0] for path in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    assert package_dirs | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    for path in copied:
        assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"
    cmd = re.search(r'^CMD (\[.*\])$', text, re.M).group(1)
    assert subcommand_of(yaml.safe_load(cmd)) == "up"
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    assert {port for _, port in scrape_ports().values()} <= exposed


@pytest.mark.parametrize("path", sorted(p.relative_to(DEPLOY) for p in DEPLOY.rglob("*.y*ml")))
def test_every_yaml_file_parses(path):
    assert list(yaml.safe_load_all((DEPLOY / path).read_text()))


def test_k8s_gateway_readiness_is_grpc_health_and_worker_liveness_is_its_heartbeat():
    (gateway,) = _kind("Deployment")["tokq-gateway"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in gateway["env"]}
    assert gateway["readinessProbe"]["grpc"]["port"] == int(env["TOKQ_PORT"])
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports["http"] == int(env["TOKQ_HTTP_PORT"]) and gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    (worker,) = _kind("Deployment")["tokq-worker"]["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "livenessProbe"):
        command = worker[probe]["exec"]["command"]
        assert subcommand_of(command) == "worker" and "--check" in command
        from tokq.workers.cli import worker_command

        assert worker_command.make_context("worker", command[1:]).params["this_host"]
