"""The wheel, kept working: ``python -m build`` makes an sdist and a wheel (from that sdist) with the
generated protobuf modules inside, and the wheel, installed into a fresh virtual environment outside the
source tree, runs its commands and trains.

The fresh environment does not install TensorFlow (gigabytes): a ``.pth`` line puts this environment's
``site-packages`` on its ``sys.path`` *after* its own. Python processes ``.pth`` files only in its own site
directories, so this environment's editable install of paramserver (a ``.pth`` that adds the checkout) is
not processed there and cannot shadow the wheel; the tests assert where ``psclient`` comes from.
"""

from __future__ import annotations

import json
import os
import pathlib
import site
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]
_BUILD_TIMEOUT_S = 180  # sdist, then the wheel from it, offline (--no-isolation); about 5 s quiet
_INSTALL_TIMEOUT_S = 180
_HELP_TIMEOUT_S = 60
_DEMO_TIMEOUT_S = 300  # one epoch; most of it is a TensorFlow worker starting on a loaded 2-core machine


@dataclass(frozen=True)
class Installed:
    venv: pathlib.Path
    wheel: pathlib.Path
    workdir: pathlib.Path  # outside the source tree: commands run here

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        return env


def run(args: list[str], installed: Installed, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=installed.workdir,
        env=installed.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    pytest.importorskip("build", reason="python -m build is in the dev extra")
    pytest.importorskip("hatchling", reason="the build backend (dev extra) builds offline here")
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=_BUILD_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = dist.glob("paramserver-*.whl")
    assert len(list(dist.glob("paramserver-*.tar.gz"))) == 1

    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    ours = pathlib.Path(sysconfig.get_path("purelib"))  # this environment's site-packages
    (fresh_site,) = (venv / "lib").glob("python3.*/site-packages")
    (fresh_site / "_outer_site_packages.pth").write_text(f"{ours}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workdir = base / "work"
    workdir.mkdir()
    yield Installed(venv=venv, wheel=wheel, workdir=workdir)


def test_wheel_holds_the_generated_protos_and_the_version(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    for module in ("psproto/v1/ps_pb2.py", "psproto/v1/ps_pb2_grpc.py", "psproto/v1/collective_pb2_grpc.py"):
        assert module in names
    import psclient

    assert installed.wheel.name.startswith(f"paramserver-{psclient.__version__}-")


def test_wheel_installed_outside_the_tree_runs_its_commands(installed: Installed) -> None:
    probe = run(
        [installed.bin("python"), "-c",
         "import json, psclient, psproto, psserver, importlib.metadata as m;"
         "print(json.dumps([psclient.__file__, psproto.__file__, psserver.__file__, psclient.__version__,"
         " m.version('paramserver')]))"],
        installed, _HELP_TIMEOUT_S,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    *files, version, dist_version = json.loads(probe.stdout)
    for file in files:
        assert pathlib.Path(file).is_relative_to(installed.venv), f"{file} is not the wheel's"
    assert version == dist_version
    assert str(ROOT) not in probe.stdout and site.getsitepackages()[0] not in probe.stdout
    for command in ("psserver", "psctl", "psrun"):
        proc = run([installed.bin(command), "--help"], installed, _HELP_TIMEOUT_S)
        assert proc.returncode == 0, f"{command} --help: {proc.stderr[-2000:]}"
        assert proc.stdout.startswith(f"usage: {command}"), proc.stdout[:200]


@pytest.mark.tf
def test_wheel_installed_outside_the_tree_trains_one_epoch(installed: Installed) -> None:
    result = installed.workdir / "demo.json"
    # one worker, one shard, the MLP: the wheel's shard, client, glue and trainer, at the least CPU
    small = ["--workers", "1", "--shards", "1", "--model", "mlp"]
    demo = [installed.bin("pstrain"), "demo", "--epochs", "1", *small, "--result-json", str(result)]
    proc = run(demo, installed, _DEMO_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(result.read_text())
    assert report["mode"] == "async" and report["epochs"] == 1 and report["steps"] > 0
    assert report["test_accuracy"] > 0.3, report  # ten classes: well above chance after one epoch
