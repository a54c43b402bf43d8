"""The compose file describes a working cluster: its services' commands and environments as local processes.

No Docker engine runs here, so the test does what compose would: every
service's ``command`` runs with its ``environment``, its TF_CONFIG host names
mapped to 127.0.0.1 and its fixed ports (2222, 2223, 9090) to free ephemeral ones
(as a container's own network namespace would keep them apart), the named
volume to a temporary directory, and ``depends_on: service_healthy`` honoured
by running the services' own health-check commands until they pass. The
workers train, the shards serve ``psctl status`` and metrics, and SIGTERM
leaves a checkpoint in the volume.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.e2e, pytest.mark.tf, pytest.mark.slow]

COMPOSE = Path(__file__).resolve().parents[1] / "deploy" / "docker-compose.yml"
BIN = Path(sys.executable).parent
WORKER_TIMEOUT_S = 540.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def executable(arg: str) -> str:
    if arg == "python":
        return sys.executable
    candidate = BIN / arg
    return str(candidate) if candidate.exists() else arg


def test_compose_services_run_as_local_processes(tmp_path: Path) -> None:
    import trainer.__main__ as pstrain

    if not hasattr(pstrain, "run_worker"):
        pytest.skip("pstrain has no `worker` subcommand yet")
    compose = yaml.safe_load(COMPOSE.read_text())
    services = {n: s for n, s in compose["services"].items() if not s.get("profiles")}  # not prometheus

    # TF_CONFIG addresses -> 127.0.0.1:free port; each service's own fixed ports -> its own free ports.
    addresses: dict[str, str] = {}
    for service in services.values():
        for group in json.loads(service["environment"]["TF_CONFIG"])["cluster"].values():
            for address in group:
                addresses.setdefault(address, f"127.0.0.1:{free_port()}")
    volumes = {}
    for name in compose.get("volumes", {}):
        volumes[name] = tmp_path / "volumes" / name
        volumes[name].mkdir(parents=True)

    def rewrite(name: str, service: dict, text: str) -> str:
        own = {}
        tf = json.loads(service["environment"]["TF_CONFIG"])
        task = tf["task"]
        own_address = addresses[tf["cluster"][task["type"]][task["index"]]]
        own["127.0.0.1:2222"] = own_address
        for mount in service.get("volumes", []):
            source, target = mount.split(":")[:2]
            if source in volumes:
                own[target] = str(volumes[source])
        for old, new in {**addresses, **own}.items():
            text = text.replace(old, new)
        return text

    metrics_ports: dict[str, int] = {}

    def command_of(name: str, service: dict) -> list[str]:
        cmd = [rewrite(name, service, a) for a in service["command"]]
        if "--metrics-port" in cmd:
            i = cmd.index("--metrics-port") + 1
            metrics_ports[name] = free_port()
            cmd[i] = str(metrics_ports[name])
        if "--data-port" in cmd:  # every shard's fixed data port -> its own free one
            cmd[cmd.index("--data-port") + 1] = str(free_port())
        return [executable(cmd[0]), *cmd[1:]]

    def env_of(name: str, service: dict) -> dict[str, str]:
        env = {k: rewrite(name, service, str(v)) for k, v in service.get("environment", {}).items()}
        return {**os.environ, **env, "PS_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1"}

    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}

    def start(name: str) -> None:
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "wb") as log:
            procs[name] = subprocess.Popen(
                command_of(name, services[name]), env=env_of(name, services[name]), stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def tail(name: str) -> str:
        return "\n".join(logs[name].read_text(errors="replace").splitlines()[-30:])

    def healthy(name: str) -> bool:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        argv = [executable(test[1]), *(rewrite(name, services[name], a) for a in test[2:])]
        return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0

    def deps(name: str) -> dict:
        d = services[name].get("depends_on", {})
        return {k: {"condition": "service_started"} for k in d} if isinstance(d, list) else d

    ps_names = [n for n, s in services.items() if s["command"][0] == "psserver"]
    worker_names = [n for n in services if n not in ps_names]
    try:
        for name in ps_names:
            start(name)
        for name in worker_names:  # honour depends_on: condition service_healthy
            for dep, cond in deps(name).items():
                if cond["condition"] != "service_healthy":
                    continue
                for _ in range(120):  # bounded: ~60 s
                    assert procs[dep].poll() is None, f"{dep} exited:\n{tail(dep)}"
                    if healthy(dep):
                        break
                    time.sleep(0.5)
                else:
                    pytest.fail(f"{dep} never became healthy:\n{tail(dep)}")
        for name in worker_names:
            start(name)
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        for name in worker_names:
            try:
                code = procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish in {WORKER_TIMEOUT_S:.0f}s:\n{tail(name)}")
            assert code == 0, f"{name} exited with {code}:\n{tail(name)}"
            assert re.search(r"done: [1-9]\d* steps", logs[name].read_text()), tail(name)

        ps_addresses = [
            addresses[a]
            for a in json.loads(services[ps_names[0]]["environment"]["TF_CONFIG"])["cluster"]["ps"]
        ]
        status = subprocess.run(
            [executable("psctl"), "status", "--json", "--interval", "0", *ps_addresses],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["healthy"] == 2 and report["variables"]
        assert all(s["pushes"] > 0 for s in report["shards"])
        for name in ps_names:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_ports[name]}/metrics", timeout=30) as r:
                text = r.read().decode()
            pushes = re.search(r'psserver_pushes_total\{outcome="applied",shard="\d"\} (\S+)', text)
            assert pushes and float(pushes.group(1)) > 0, text[:2000]
        for name in ps_names:  # SIGTERM: graceful stop, exit 0, a checkpoint in the volume
            procs[name].send_signal(signal.SIGTERM)
        for name in ps_names:
            assert procs[name].wait(timeout=60) == 0, tail(name)
            assert f"psserver[shard={ps_names.index(name)} " in logs[name].read_text()
        written = [p for v in volumes.values() for p in v.rglob("*") if p.is_file()]
        assert written, "no checkpoint was written into the checkpoints volume"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
