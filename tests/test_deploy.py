"""deploy/: the compose file validates and describes the cluster; k8s, Kubeflow and Docker files are sane.

``docker-compose config`` runs when the binary is installed (CI installs
Debian's ``docker-compose``); everything else parses the files with PyYAML.
The compose services' commands are run as local processes in
``tests/test_deploy_compose.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def tf_config(service: dict) -> dict:
    return json.loads(service["environment"]["TF_CONFIG"])


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_config_validates() -> None:
    proc = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "--profile", "observe", "config", "--services"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == {"ps0", "ps1", "worker0", "worker1", "prometheus", "grafana"}


def test_compose_describes_two_shards_and_two_workers() -> None:
    services = load_compose()["services"]
    ps = {n: s for n, s in services.items() if s.get("command", [""])[0] == "psserver"}
    workers = {n: s for n, s in services.items() if s.get("command", [])[:2] == ["pstrain", "worker"]}
    assert sorted(ps) == ["ps0", "ps1"] and sorted(workers) == ["worker0", "worker1"]
    clusters = {
        json.dumps(tf_config(s)["cluster"], sort_keys=True) for s in [*ps.values(), *workers.values()]
    }
    assert len(clusters) == 1, "every service must see the same cluster"
    cluster = json.loads(clusters.pop())
    assert cluster["ps"] == ["ps0:2222", "ps1:2222"]
    assert cluster["worker"] == ["worker0:2222", "worker1:2222"]
    for kind, group in (("ps", ps), ("worker", workers)):
        for name, service in group.items():
            task = tf_config(service)["task"]
            assert task["type"] == kind
            assert cluster[kind][task["index"]].split(":")[0] == name == service["hostname"]
    for name, service in ps.items():
        test = service["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "psclient.probe"], f"{name}: gRPC health check"
        assert "checkpoints:/checkpoints" in service["volumes"]
        cmd = service["command"]
        assert cmd[cmd.index("--checkpoint-dir") + 1] == "/checkpoints"
        assert "--metrics-port" in cmd
    for name, service in workers.items():
        deps = service["depends_on"]
        assert {d: deps[d]["condition"] for d in deps} == {"ps0": "service_healthy", "ps1": "service_healthy"}
        assert service["healthcheck"] == {"disable": True}, name
    assert "checkpoints" in load_compose()["volumes"]


def _mounts(service: dict) -> dict[str, Path]:
    """A service's bind mounts: container path -> the file or folder under deploy/."""
    out = {}
    for mount in service.get("volumes", []):
        source, target = mount.split(":")[:2]
        if source.startswith("./"):
            out[target] = DEPLOY / source
    return out


def test_prometheus_is_optional_and_scrapes_every_shard() -> None:
    services = load_compose()["services"]
    prom = services["prometheus"]
    assert prom["profiles"] == ["observe"]
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    # The config and every rule file it names are mounted, side by side as the relative paths need.
    mounts = _mounts(prom)
    config_path = prom["command"][0].removeprefix("--config.file=")
    assert mounts[config_path] == DEPLOY / "prometheus.yml"
    for rule_file in config["rule_files"]:
        mounted = mounts[str(Path(config_path).parent / rule_file)]
        assert mounted.is_file() and mounted == DEPLOY / rule_file
    targets = config["scrape_configs"][0]["static_configs"][0]["targets"]
    expected = []
    for name in ("ps0", "ps1"):
        cmd = services[name]["command"]
        expected.append(f"{name}:{cmd[cmd.index('--metrics-port') + 1]}")
    assert targets == expected


def test_grafana_is_optional_and_provisions_the_dashboard_on_prometheus() -> None:
    services = load_compose()["services"]
    grafana = services["grafana"]
    assert grafana["profiles"] == ["observe"] and grafana["depends_on"] == ["prometheus"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    prom_port = services["prometheus"]["ports"][0].split(":")[-1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{prom_port}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "paramserver.yml").read_text())["providers"]
    folder = provider["options"]["path"]
    dashboards = {target: path for target, path in mounts.items() if target.startswith(folder + "/")}
    assert list(dashboards.values()) == [DEPLOY / "grafana" / "paramserver.json"]
    assert json.loads(dashboards[f"{folder}/paramserver.json"].read_text())["uid"] == "paramserver"


def test_kubernetes_manifests() -> None:
    docs = [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] != "Kustomization"}
    assert set(by_kind) == {
        ("ConfigMap", "paramserver-cluster"), ("Service", "ps"), ("StatefulSet", "ps"),
        ("Service", "workers"), ("Job", "worker"),
    }  # fmt: skip
    config = by_kind["ConfigMap", "paramserver-cluster"]["data"]
    ps_hosts = json.loads(f"[{config['PS_HOSTS']}]")
    worker_hosts = json.loads(f"[{config['WORKER_HOSTS']}]")
    sts = by_kind["StatefulSet", "ps"]
    assert sts["spec"]["serviceName"] == "ps" and by_kind["Service", "ps"]["spec"]["clusterIP"] == "None"
    assert ps_hosts == [f"ps-{i}.ps:2222" for i in range(sts["spec"]["replicas"])]  # stable names
    container = sts["spec"]["template"]["spec"]["containers"][0]
    script = container["args"][0]
    assert "TF_CONFIG" in script and "${HOSTNAME##*-}" in script and "exec psserver" in script
    assert container["readinessProbe"]["grpc"] == {"port": 2222, "service": "psproto.v1.ParameterServer"}
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    job = by_kind["Job", "worker"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == len(worker_hosts)
    assert worker_hosts == [f"worker-{i}.workers:2222" for i in range(len(worker_hosts))]
    assert job["spec"]["template"]["spec"]["subdomain"] == "workers"
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "$JOB_COMPLETION_INDEX" in script and "exec pstrain worker" in script
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(f.name for f in (DEPLOY / "k8s").glob("*.yaml")
                                                        if f.name != "kustomization.yaml")  # fmt: skip


def _run_script(script: str, **env: str) -> list[str]:
    """Runs a manifest's shell script with ``exec`` replaced by ``echo``: the commands it would start."""
    base = {"PATH": "/usr/bin:/bin", "PS_HOSTS": '"ps-0.ps:2222", "ps-1.ps:2222"',
            "WORKER_HOSTS": '"worker-0.workers:2222", "worker-1.workers:2222"'}  # fmt: skip
    script = script.replace("exec ", "echo ") + '\necho "TF_CONFIG=$TF_CONFIG"\n'
    out = subprocess.run(
        ["sh", "-c", script], env={**base, **env}, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_kubernetes_replicated_overlay() -> None:
    overlay = DEPLOY / "k8s" / "replicated"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../", "ps-backup.yaml"]
    for patch in kustomization["patches"]:
        assert (overlay / patch["path"]).exists()
    backup = {d["kind"]: d for d in yaml.safe_load_all((overlay / "ps-backup.yaml").read_text())}
    assert backup["Service"]["spec"]["clusterIP"] == "None"
    sts = backup["StatefulSet"]
    assert sts["spec"]["serviceName"] == "ps-backup" and sts["spec"]["replicas"] == 2
    # Shard 1's three commands, as the pods would run them.
    backup_cmd, backup_cfg = _run_script(sts["spec"]["template"]["spec"]["containers"][0]["args"][0],
                                         HOSTNAME="ps-backup-1")  # fmt: skip
    assert (
        backup_cmd.split()[:1] == ["psserver"] and '--backup-of "ps-1.ps:2222"'.replace('"', "") in backup_cmd
    )
    assert json.loads(backup_cfg.removeprefix("TF_CONFIG="))["task"] == {"type": "ps", "index": 1}
    primary = yaml.safe_load((overlay / "ps-primary-patch.yaml").read_text())
    primary_cmd, _ = _run_script(
        primary["spec"]["template"]["spec"]["containers"][0]["args"][0], HOSTNAME="ps-1"
    )
    assert "--backup-at ps-backup-1.ps-backup:2222" in primary_cmd and "--checkpoint-dir" in primary_cmd
    workers = yaml.safe_load((overlay / "workers-patch.yaml").read_text())
    worker_cmd, worker_cfg = _run_script(workers["spec"]["template"]["spec"]["containers"][0]["args"][0],
                                         JOB_COMPLETION_INDEX="1")  # fmt: skip
    assert (
        "--ps ps-0.ps:2222|ps-backup-0.ps-backup:2222,ps-1.ps:2222|ps-backup-1.ps-backup:2222" in worker_cmd
    )
    assert json.loads(worker_cfg.removeprefix("TF_CONFIG="))["task"] == {"type": "worker", "index": 1}
    # The patches name what they patch in the base.
    assert (primary["kind"], primary["metadata"]["name"]) == ("StatefulSet", "ps")
    assert (workers["kind"], workers["metadata"]["name"]) == ("Job", "worker")


def test_kubeflow_tfjob() -> None:
    job = yaml.safe_load((DEPLOY / "kubeflow" / "tfjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    specs = job["spec"]["tfReplicaSpecs"]
    assert specs["PS"]["replicas"] == 2 and specs["Worker"]["replicas"] == 2
    ps = specs["PS"]["template"]["spec"]["containers"][0]
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    assert ps["name"] == worker["name"] == "tensorflow"
    assert ps["command"][0] == "psserver" and "--shard" not in ps["command"]  # TF_CONFIG from the operator
    assert worker["command"][:2] == ["pstrain", "worker"]


def test_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert any(line.startswith("RUN pip install") and ".[tf]" in line for line in lines)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    health = text[text.index("HEALTHCHECK") :]
    assert "python -m psclient.probe" in health
    for package in ("pscore", "psserver", "psclient", "trainer", "psload", "protos"):
        assert f"COPY {package} " in text
    # what the build backend reads besides the packages: the readme, and the license (license-files)
    assert "COPY pyproject.toml hatch_build.py README.md LICENSE ./" in text
