"""Integration: the psserver process itself (CLI, imports, TF_CONFIG start, SIGTERM and health)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from _support import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psclient._retry import RetryPolicy
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(60)

SERVICE = "psproto.v1.ParameterServer"


def _psserver() -> list[str]:
    script = Path(sys.executable).with_name("psserver")
    exe = str(script) if script.exists() else shutil.which("psserver")
    return [exe] if exe else [sys.executable, "-m", "psserver"]


def test_ps_process_help_documents_the_contract() -> None:
    # --help stays fast because nothing heavy is imported: see the next test (no wall-clock assertion here)
    out = subprocess.run([*_psserver(), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for flag in (
        "--shard",
        "--num-shards",
        "--port",
        "--ready-file",
        "--mode",
        "--allow-non-finite",
        "TF_CONFIG",
    ):
        assert flag in out.stdout


def test_ps_process_server_and_client_never_import_tensorflow() -> None:
    code = (
        "import psserver.server, psserver.__main__, psclient; import sys; "
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'; "
        "assert 'keras' not in sys.modules, 'keras was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_ps_process_bad_flags_exit_2_with_a_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psserver", "--shard", "3", "--num-shards", "2"],
        capture_output=True, text=True, timeout=30,
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
    )  # fmt: skip
    assert out.returncode == 2 and "--shard" in out.stderr


def test_ps_process_sigterm_exits_0_and_health_goes_not_serving(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(num_shards=1, server_args=["--grace", "2"])
    proc = cluster.procs[0]
    assert proc is not None
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    assert proc.wait(timeout=20) == 0
    assert "listening on" in cluster.log_path(0).read_text()


def test_ps_process_shard_starts_from_tf_config_without_shard_flag(tmp_path: Path) -> None:
    port = free_port()
    tf_config = {
        "cluster": {"ps": ["127.0.0.1:1", f"127.0.0.1:{port}"], "worker": ["127.0.0.1:2"]},
        "task": {"type": "ps", "index": 1},
    }
    ready = tmp_path / "ready"
    env = {**os.environ, "TF_CONFIG": json.dumps(tf_config), "PS_HOST": "127.0.0.1"}
    log = open(tmp_path / "log", "wb")  # noqa: SIM115 - closed below, owned by the child meanwhile
    proc = subprocess.Popen(
        [sys.executable, "-m", "psserver", "--ready-file", str(ready)], env=env, stdout=log, stderr=log
    )
    log.close()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "no ready file"
            time.sleep(0.02)
        assert ready.read_text().strip() == f"127.0.0.1:{port}"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = ps_pb2_grpc.ParameterServerStub(channel).GetStatus(ps_pb2.GetStatusRequest(), timeout=10)
        assert (status.shard, status.num_shards, status.mode) == (1, 2, "async")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("wire", [{}, {"data_port": False}], ids=["data_port", "grpc"])
def test_ps_process_sigterm_ends_idle_links_and_checkpoints_well_within_grace(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, wire: dict[str, bool]
) -> None:
    # A client that pushed keeps its data connection (or, over gRPC, its PushSession stream) open; the
    # shard must not wait out the grace for it.
    import numpy as np

    import psclient

    ckpt = tmp_path / "ckpt"
    cluster = make_cluster(num_shards=1, server_args=["--checkpoint-dir", str(ckpt), "--grace", "30"])
    proc = cluster.procs[0]
    assert proc is not None
    with psclient.PSClient(cluster.addresses, worker_id="w0", timeout=20, **wire) as client:
        client.create_many({"a": np.zeros(3, np.float32), "b": np.zeros(4, np.float32)})
        assert client.push({"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0  # the grace is 30 s: only an idle link ended at once gets here
    log = cluster.log_path(0).read_text()
    assert "checkpoint 1 written" in log, log
    assert list(ckpt.glob("ckpt-*.npz")), list(ckpt.iterdir())


def test_ps_process_sigterm_ends_health_watch_streams_with_not_serving_then_unavailable(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    # gRPC's client-side health checking keeps a Watch stream open; it must not hold the shard for the grace.
    cluster = make_cluster(num_shards=1, server_args=["--grace", "30"])
    proc = cluster.procs[0]
    assert proc is not None
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        # Its deadline (15 s) comes before the grace (30 s) ends: held for the grace, it would end
        # DEADLINE_EXCEEDED; ended by the shutdown, it ends UNAVAILABLE at once.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=15)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        seen = []
        with pytest.raises(grpc.RpcError) as info:
            for response in watch:  # bounded by its deadline
                seen.append(response.status)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert proc.wait(timeout=20) == 0  # the grace is 30 s: only a stream ended at once gets here


async def test_ps_process_sigterm_releases_a_sync_barrier_with_unavailable(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    # A push waiting at a barrier that can no longer complete is told UNAVAILABLE (retried by the client),
    # not held until the grace runs out.
    import asyncio

    import numpy as np

    import psclient

    sync = ["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2", "--grace", "30"]
    cluster = make_cluster(num_shards=1, server_args=sync)
    proc = cluster.procs[0]
    assert proc is not None
    policy = RetryPolicy(enabled=False)  # see the first error itself
    async with psclient.AsyncPSClient(cluster.addresses, worker_id="w0", timeout=20, retry=policy) as w0:
        await w0.create("v", np.zeros(2, np.float32))
        waiting = asyncio.create_task(w0.push({"v": np.ones(2, np.float32)}, step=0))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # waits for the second worker
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(psclient.UnavailableError, match="shutting down"):
            await asyncio.wait_for(waiting, 20)
    assert await asyncio.to_thread(proc.wait, 20) == 0


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--data-port"])
def test_ps_process_port_in_use_is_one_line_and_exit_2(flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "psserver", "--shard", "0", "--host", "127.0.0.1", flag, str(port)],
            capture_output=True, text=True, timeout=30,
            env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
        )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"psserver: error: cannot bind {flag + ' ' if flag != '--port' else ''}"
        f"127.0.0.1:{port}: address already in use"
    ], out.stderr
