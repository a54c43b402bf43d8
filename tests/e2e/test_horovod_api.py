"""psclient.horovod: Horovod's TF/Keras API on the ring, checked on 2 ranks under psrun and on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _support import RUN_TIMEOUT_S, pythonpath

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_horovod_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "trainer.psrun", "-np", "2", "--timeout", str(RUN_TIMEOUT_S - 20),
           sys.executable, str(WORKER)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path_factory.mktemp("hvd"), env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = {}
    for line in proc.stdout.splitlines():
        prefix, _, rest = line.partition("<stdout>:RESULT ")
        if rest:
            results[int(prefix.strip("[]"))] = json.loads(rest)
    assert sorted(results) == [0, 1], proc.stdout[-4000:]
    return [results[0], results[1]]


def test_layout_from_psrun(ranks: list[dict[str, Any]]) -> None:
    # rank, size, local_rank, local_size, cross_rank, cross_size: two ranks on one host
    assert [r["layout"] for r in ranks] == [[0, 2, 0, 2, 0, 1], [1, 2, 1, 2, 0, 1]]


def test_tensor_collectives_follow_horovod(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["average"] == [1.5, 5.0] and r["sum"] == [3.0, 10.0] and r["max"] == [2.0, 10.0]
        assert r["grouped"] == [[3.0, 10.0], 1]
        assert r["allgather"] == [[0, 0], [1, 1], [1, 1]]  # uneven first dimensions
        assert r["broadcast"] == [1, 1] and r["keras_allreduce"] == [0.5]
        assert r["graph_broadcast"] == [1.0, 1.0]  # broadcast_variables inside a tf.function
        assert r["object"] == {"from": 1} and r["objects"] == ["rank0", "rank1"]
        assert r["size_op"] == 2  # read when the traced function runs
        assert r["elastic_synced"] == [0]  # hvd.elastic.run synced rank 0's state (no psrun elastic job)
    # Horovod's blocks: 5 rows over 2 ranks -> 3 + 2
    assert ranks[0]["reducescatter"] == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]
    assert ranks[1]["reducescatter"] == [[12.0, 14.0], [16.0, 18.0]]


def test_join_lets_the_ranks_still_training_allreduce_with_zeros(ranks: list[dict[str, Any]]) -> None:
    # Rank 0 joined first: rank 1's Average is (4 + 0) / 2, as Horovod's; Max leaves the joined rank out.
    assert ranks[1]["with_joined"] == [2.0] and ranks[1]["with_joined_max"] == [-4.0]
    assert "joined" in ranks[1]["broadcast_with_joined"]  # as Horovod: no broadcast with joined ranks
    assert ranks[0]["join"] == ranks[1]["join"] == 1  # the last rank to join
    assert ranks[0]["after_join"] == ranks[1]["after_join"] == [3.0]  # then every rank is active again


def test_distributed_optimizer_options(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:  # SGD(1.0) from 0; rank r's gradients are (r + 1) * pass
        assert r["opt_average"] == -1.5
        assert r["opt_sum"] == -3.0
        assert r["opt_fp16"] == -1.5
        assert r["opt_passes_sum"] == -4.5  # Horovod sums the backward passes by default
        assert r["opt_passes_mean"] == -2.25  # average_aggregated_gradients=True


def test_distributed_gradient_tape_in_tf_function_with_a_local_source(ranks: list[dict[str, Any]]) -> None:
    # a: averaged; b: local, divided by the size as in Horovod (scale_local_gradients)
    assert ranks[0]["tape"] == [1.5, 0.5] and ranks[1]["tape"] == [1.5, 1.0]


def test_keras_callbacks_broadcast_average_and_warm_up(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    assert r["fit_crcs"][0] == r["fit_crcs"][1]  # lazily built model, different seeds: identical after fit
    assert r["fit_losses"][0] == r["fit_losses"][1]  # MetricAverageCallback
    # warmup: lr = 0.1 / 2 * ((epoch + (batch + 1) / 4) * (2 - 1) / 2 + 1), 4 batches per epoch
    expected = [0.05 * ((e + (b + 1) / 4) / 2 + 1) for e in range(2) for b in range(4)]
    assert r["fit_rates"] == pytest.approx(expected, rel=1e-6)
    assert r["fit_lr_log"] == pytest.approx([0.075, 0.1], rel=1e-6)


def test_unsupported_features_name_the_alternative(ranks: list[dict[str, Any]]) -> None:
    adasum, global_vars, load_model, process_set, timeline = ranks[0]["errors"]
    assert "Adasum" in adasum and "hvd.Average" in adasum
    assert "broadcast_variables" in global_vars and "BroadcastGlobalVariablesCallback" in global_vars
    assert "keras.models.load_model" in load_model
    assert "psrun" in process_set
    assert "TensorBoard" in timeline


def test_one_process_without_tf_config_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import keras
    import tensorflow as tf

    import psclient.horovod as hvd

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"hvd\.init"):
        hvd.rank()
    hvd.init()
    try:
        assert hvd.is_initialized()
        assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.cross_size()) == (1, 0, 1, 1)
        assert hvd.allreduce(tf.constant([2.0])).numpy().tolist() == [2.0]
        v = keras.Variable(1.0)
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.5)).apply([tf.constant(2.0)], [v])
        assert float(v.numpy()) == 0.0
        with pytest.raises(AttributeError, match="allgather"):
            hvd.alltoall  # noqa: B018
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()


def test_layout_tells_hosts_apart_by_address() -> None:
    from psclient.horovod._state import Layout

    addresses = ["a:1", "a:2", "b:1", "b:2", "c:1"]
    got = [Layout.from_addresses(addresses, r) for r in range(5)]
    assert [(x.local_rank, x.local_size, x.cross_rank, x.cross_size) for x in got] == [
        (0, 2, 0, 3), (1, 2, 0, 2), (0, 2, 1, 3), (1, 2, 1, 2), (0, 1, 2, 3),
    ]  # fmt: skip
