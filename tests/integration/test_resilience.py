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
from _logreg import TIMEOUT_S, train

import psclient
from trainer.cluster import LocalCluster

pytestmark = [pytest.mark.timeout(240), pytest.mark.e2e]

ACCURACY_BOUND = 0.03
MIN_ACCURACY = 0.85


def _kill_and_restart_later(cluster: LocalCluster, shard: int, delay_s: float, threads: list) -> None:
    port = int(cluster.addresses[shard].rpartition(":")[2])
    cluster.kill_shard(shard)
    t = threading.Timer(delay_s, cluster.start_shard, args=(shard,), kwargs={"port": port})
    t.start()
    threads.append(t)


def test_training_survives_kill_9_of_shards_with_accuracy_within_bound(tmp_path: Path) -> None:
    with LocalCluster(2) as ref:
        reference, _ = train(ref.addresses, "ref")
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.1"]
    threads: list[threading.Timer] = []
    with LocalCluster(2, args) as cluster:
        faults = {
            60: lambda: _kill_and_restart_later(cluster, 0, 0.5, threads),
            140: lambda: _kill_and_restart_later(cluster, 1, 0.3, threads),
            200: lambda: _kill_and_restart_later(cluster, 0, 0.2, threads),
        }
        try:
            accuracy, _ = train(cluster.addresses, "faulty", faults)
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
