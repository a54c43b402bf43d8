"""A worker rides through shard restarts: kill -9 mid-training, restore from checkpoint, finish within bound.

The model is logistic regression in numpy on synthetic data (no TensorFlow),
trained through ``PSClient`` with pull/compute/push steps. The worker code has
no fault handling of its own: the client retries UNAVAILABLE until its
deadline, and the restarted shard restores its last checkpoint.

Bound: the killed run's test accuracy is within ``ACCURACY_BOUND`` (3 points)
of the same run without faults, and above ``MIN_ACCURACY``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import psclient
from trainer.cluster import LocalCluster

pytestmark = [pytest.mark.timeout(240), pytest.mark.e2e]

TIMEOUT_S = 30.0
ACCURACY_BOUND = 0.03
MIN_ACCURACY = 0.85
STEPS = 240
BATCH = 64


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = 32
    w_true = rng.standard_normal(d)
    x = rng.standard_normal((6000, d)).astype(np.float32)
    y = ((x @ w_true + 0.5 * rng.standard_normal(6000)) > 0).astype(np.float32)
    return x[:5000], y[:5000], x[5000:], y[5000:]


def _accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    logits = x @ params["lr/w"] + params["lr/b"][0]
    return float(np.mean((logits > 0) == (y > 0.5)))


def _train(addresses: list[str], worker: str, on_step: dict[int, object] | None = None) -> float:
    x, y, xt, yt = _data()
    rng = np.random.default_rng(1)
    with psclient.PSClient(addresses, worker, timeout=TIMEOUT_S) as c:
        c.create_many(
            {"lr/w": np.zeros(x.shape[1], np.float32), "lr/b": np.zeros(1, np.float32)},
            optimizer=psclient.Adam(learning_rate=0.05),
        )
        for step in range(STEPS):
            if on_step and step in on_step:
                on_step[step]()  # type: ignore[operator]
            idx = rng.integers(0, len(x), BATCH)
            p = c.pull()
            logits = x[idx] @ p["lr/w"] + p["lr/b"][0]
            err = (1 / (1 + np.exp(-logits)) - y[idx]).astype(np.float32)
            c.push({"lr/w": x[idx].T @ err / BATCH, "lr/b": np.array([err.mean()], np.float32)})
        return _accuracy(c.pull(), xt, yt)


def _kill_and_restart_later(cluster: LocalCluster, shard: int, delay_s: float, threads: list) -> None:
    port = int(cluster.addresses[shard].rpartition(":")[2])
    cluster.kill_shard(shard)
    t = threading.Timer(delay_s, cluster.start_shard, args=(shard,), kwargs={"port": port})
    t.start()
    threads.append(t)


def test_training_survives_kill_9_of_shards_with_accuracy_within_bound(tmp_path: Path) -> None:
    with LocalCluster(2) as ref:
        reference = _train(ref.addresses, "ref")
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.1"]
    threads: list[threading.Timer] = []
    with LocalCluster(2, args) as cluster:
        faults = {
            60: lambda: _kill_and_restart_later(cluster, 0, 0.5, threads),
            140: lambda: _kill_and_restart_later(cluster, 1, 0.3, threads),
            200: lambda: _kill_and_restart_later(cluster, 0, 0.2, threads),
        }
        try:
            accuracy = _train(cluster.addresses, "faulty", faults)
        finally:
            for t in threads:
                t.join(timeout=60)
        restored = sum("restored" in cluster.log_tail(s, 400) for s in range(2))
    print(f"accuracy: reference {reference:.4f}, with 3 kill -9 {accuracy:.4f}")
    assert restored == 2  # both shards came back from a checkpoint
    assert reference >= MIN_ACCURACY
    assert accuracy >= MIN_ACCURACY
    assert abs(accuracy - reference) <= ACCURACY_BOUND


def test_a_push_sent_while_its_shard_is_down_is_applied_once_after_restart(tmp_path: Path) -> None:
    with (
        LocalCluster(1, ["--checkpoint-dir", str(tmp_path)]) as cluster,
        psclient.PSClient(cluster.addresses, "w0", timeout=TIMEOUT_S) as c,
    ):
        c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        c.push({"v": np.ones(4, np.float32)})
        c.save_checkpoint()
        threads: list[threading.Timer] = []
        _kill_and_restart_later(cluster, 0, 1.0, threads)
        try:
            assert c.push({"v": np.ones(4, np.float32)})  # blocks, retries, lands after the restart
        finally:
            for t in threads:
                t.join(timeout=60)
        values, versions = c.pull_with_versions()
    assert versions == {"v": 2}
    np.testing.assert_array_equal(values["v"], -2)
