"""``PSWorker(sync_parts=N)``: a sync step pushed to each shard in N parts trains the model whole steps train.

Each part is a sync step of its own on a shard, applied once as the mean of every worker's gradients for the
variables in it, so cutting a step changes when a shard answers, not what it computes: two workers' runs,
whole and in parts, end with the same weights (a sum of two gradients does not depend on their order).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _support import in_threads

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.keras as psk  # noqa: E402

SYNC_ARGS = ("--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2")
EPOCHS, BATCH = 2, 16


def _data(index: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 20)).astype(np.float32)
    y = (x[:, :3].sum(axis=1) > 0).astype(np.int64) + (x[:, 3] > 1).astype(np.int64)
    return x[index::2], y[index::2]  # each worker its half


def _model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _train_two_workers(addresses: list[str], sync_parts: int) -> dict[int, Any]:
    """Two sync workers in threads, each ``fit`` on its half; returns each worker's final weights."""
    keras.utils.set_random_seed(11)
    # Built here (the seed is global); worker 1 takes the chief's values when it attaches.
    models = {i: _model() for i in (0, 1)}

    def run(index: int) -> list[np.ndarray]:
        with psk.PSWorker(
            addresses, worker_index=index, num_workers=2, sync_parts=sync_parts, partition_bytes=2048
        ) as worker:
            model = models[index]
            model.compile(
                optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.01), worker),
                loss="sparse_categorical_crossentropy",
            )
            x, y = _data(index)
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                      callbacks=[psk.PSCallback(worker)])  # fmt: skip
            assert worker.stale_steps == 0
            return [np.array(w) for w in model.get_weights()]

    return in_threads(run, 2)


def test_a_sync_step_in_parts_trains_the_same_weights_as_whole_steps(make_cluster) -> None:
    steps = EPOCHS * 128 // BATCH
    whole_cluster = make_cluster(num_shards=2, server_args=SYNC_ARGS)
    whole = _train_two_workers(whole_cluster.addresses, sync_parts=1)
    parts_cluster = make_cluster(num_shards=2, server_args=SYNC_ARGS)
    parts = _train_two_workers(parts_cluster.addresses, sync_parts=4)
    with psclient.PSClient(parts_cluster.addresses, "checker") as c:
        # Cut small (partition_bytes), the kernels fill the parts; each part is a step on each shard.
        assert max(len(p) for p in c.list_variables().values()) > 1
        assert {s.step for s in c.status()} == {steps * 4}
    with psclient.PSClient(whole_cluster.addresses, "checker") as c:
        assert {s.step for s in c.status()} == {steps}
    for index in (0, 1):
        for a, b in zip(parts[index], whole[index], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(parts[0], parts[1], strict=True):  # both workers hold the shards' model
        np.testing.assert_array_equal(a, b)


def test_sync_parts_refuses_a_model_with_embedding_tables_and_a_bad_count(make_cluster) -> None:
    with pytest.raises(ValueError, match="sync_parts must be an int >= 1"):
        psk.PSWorker(["127.0.0.1:1"], sync_parts=0)
    cluster = make_cluster(num_shards=1, server_args=("--mode", "sync", "--replicas-to-aggregate", "1",
                                                      "--total-replicas", "1"))  # fmt: skip
    model = keras.Sequential([keras.Input((4,), dtype="int64"), keras.layers.Embedding(100, 8),
                              keras.layers.Flatten(), keras.layers.Dense(1)])  # fmt: skip
    with (
        psk.PSWorker(cluster.addresses, sync_parts=2) as worker,
        pytest.raises(ValueError, match="embedding tables"),
    ):
        worker.attach(model, keras.optimizers.SGD(0.1))
