"""PSWorker setup as users meet it: TF_CONFIG gives the index and count, the shards' mode is checked,
a model's variables have stable names (the same for every copy), and a saved model loads without psclient."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

keras = pytest.importorskip("keras")

import psclient  # noqa: E402
import psclient.keras as psk  # noqa: E402


def _tf_config(index: int, kind: str = "worker") -> str:
    cluster = {"ps": ["127.0.0.1:1", "127.0.0.1:2"], "chief": ["127.0.0.1:3"], "worker": ["127.0.0.1:4"] * 2}
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def test_tf_config_gives_index_and_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", _tf_config(1))
    with psk.PSWorker() as worker:  # addresses from TF_CONFIG too; nothing is dialled yet
        assert (worker.worker_index, worker.num_workers) == (2, 3)  # the chief is worker 0
        assert worker.client.worker_id == "worker2"
    monkeypatch.setenv("TF_CONFIG", _tf_config(0, "chief"))
    with psk.PSWorker() as worker:
        assert (worker.worker_index, worker.num_workers, worker.is_chief) == (0, 3, True)


def test_several_workers_without_an_index_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="worker_index"):
        psk.PSWorker(["127.0.0.1:1"], num_workers=2)


def test_a_mode_other_than_the_shards_is_refused(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=1)  # async shards
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)], name=var_name)
    with psk.PSWorker(cluster.addresses, mode="sync") as worker, pytest.raises(ValueError, match="async"):
        worker.attach(model, keras.optimizers.SGD())
    with psk.PSWorker(cluster.addresses) as worker:  # no mode given: the shards' own
        worker.attach(model, keras.optimizers.SGD())
        assert worker.mode == "async"


def _bn_model(name: str | None = None) -> keras.Model:
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
         keras.layers.Dropout(0.5), keras.layers.Dense(2)], name=name,
    )  # fmt: skip


def test_variable_names_are_the_same_for_every_copy() -> None:
    first, second = _bn_model(), _bn_model()
    copy = keras.Sequential.from_config(first.get_config())
    assert first.name != second.name  # Keras numbers them: sequential, sequential_1
    names = [n for _, n in psk.model_variable_names(first)]
    assert names == [n for _, n in psk.model_variable_names(second)]
    assert names == [n for _, n in psk.model_variable_names(copy)]
    assert "sequential/004/batch_normalization/moving_mean" in names
    assert not any("seed_generator" in n for n in names)  # each worker keeps its own random state


def test_load_from_ps_restores_batchnorm_state_into_another_copy(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=2)
    trained = _bn_model(var_name)
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(64, 4)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(64, 2)).astype(np.float32)
    with psk.PSWorker(cluster.addresses, overlap=False) as worker:
        trained.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.01), worker), loss="mse")
        trained.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[worker.callback()])
    moving = {v.name: v.numpy() for v in trained.non_trainable_variables if "moving" in v.name}
    assert not np.allclose(moving["moving_mean"], 0.0)  # the statistics moved during training
    fresh = _bn_model(var_name)
    with psclient.PSClient(cluster.addresses) as client:
        psk.load_from_ps(fresh, client)
    for a, b in zip(trained.variables, fresh.variables, strict=True):
        if "seed_generator" not in a.path:
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    np.testing.assert_allclose(fresh.predict(x, verbose=0), trained.predict(x, verbose=0), rtol=1e-6)


def test_saved_model_loads_without_psclient(make_cluster, var_name, tmp_path) -> None:
    cluster = make_cluster(num_shards=1)
    model = _bn_model(var_name)
    with psk.PSWorker(cluster.addresses) as worker:
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.01), worker), loss="mse")
        model.fit(
            np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), verbose=0, callbacks=[worker.callback()]
        )
    path = tmp_path / "model.keras"
    model.save(path)
    code = (
        "import keras, sys, numpy as np; m = keras.models.load_model(sys.argv[1]); "
        "assert type(m.optimizer).__name__ == 'Adam', type(m.optimizer); "
        "print(float(m.predict(np.ones((1, 4), 'float32'), verbose=0).sum()))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = float(model.predict(np.ones((1, 4), np.float32), verbose=0).sum())
    assert float(out.stdout.strip().splitlines()[-1]) == pytest.approx(expected, rel=1e-6)


def test_learning_rate_callbacks_reach_the_shards(make_cluster, var_name) -> None:
    """LearningRateScheduler sets the rate on the worker's optimizer; the shards use it from the next step."""
    cluster = make_cluster(num_shards=2)
    model = _bn_model(var_name)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(64, 2)).astype(np.float32)
    with psk.PSWorker(cluster.addresses) as worker, psclient.PSClient(cluster.addresses) as client:
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.01), worker), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[worker.callback()])
        names = [worker.name_of(v) for v in model.trainable_variables]
        before = {n: v.copy() for n, v in client.pull(names).items()}
        hold = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.0)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[hold, worker.callback()])
        after = client.pull(names)
        for name in names:  # rate 0 from the first step of the second fit: nothing moved
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        assert worker.steps_done == 4 + 8
        infos = client.list_variables(names)
        assert {info[0].spec.optimizer.params["learning_rate"] for info in infos.values()} == {0.0}


def test_schedules_and_worker_side_settings_train(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=1)
    model = _bn_model(var_name)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=4, decay_rate=0.5)
    opt = keras.optimizers.Adam(schedule, global_clipnorm=1.0, gradient_accumulation_steps=2)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    with psk.PSWorker(cluster.addresses) as worker, psclient.PSClient(cluster.addresses) as client:
        model.compile(optimizer=psk.DistributedOptimizer(opt, worker), loss="mse")
        history = model.fit(x, x[:, :2] * 2, batch_size=8, epochs=4, verbose=0, callbacks=[worker.callback()])
        assert history.history["loss"][-1] < history.history["loss"][0]
        assert worker.steps_done == 4 * 8 // 2  # one push per two steps: accumulated on the worker
        spec = client.list_variables([worker.name_of(model.trainable_variables[0])])
        assert (
            next(iter(spec.values()))[0].spec.optimizer.learning_rate_schedule.name.lower()
            == "exponentialdecay"
        )


@pytest.mark.parametrize("ours_first", [False, True])
def test_early_stopping_restore_best_weights_leaves_the_shards_equal(
    make_cluster, var_name, ours_first
) -> None:
    cluster = make_cluster(num_shards=2)
    model = _bn_model(var_name)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 4)).astype(np.float32), rng.normal(size=(96, 2)).astype(np.float32)
    with psk.PSWorker(cluster.addresses) as worker, psclient.PSClient(cluster.addresses) as client:
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.05), worker), loss="mse")
        stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
        callbacks = [worker.callback(), stop] if ours_first else [stop, worker.callback()]
        model.fit(x, y, batch_size=8, epochs=8, validation_split=0.25, verbose=0, callbacks=callbacks)
        named = psk.model_variable_names(model)
        stored = client.pull([n for _, n in named])
        for var, name in named:  # the shards hold what the worker holds
            np.testing.assert_array_equal(stored[name], var.numpy(), err_msg=name)
        for var, best in zip(model.weights, stop.best_weights, strict=True):
            np.testing.assert_array_equal(var.numpy(), best, err_msg=var.path)  # the worker holds the best


@pytest.mark.parametrize(
    "mode_args", [(), ("--mode", "sync", "--replicas-to-aggregate", "1", "--total-replicas", "1")]
)
def test_embedding_layer_moves_only_the_batch_rows(make_cluster, var_name, mode_args) -> None:
    """A plain keras.layers.Embedding becomes a table spread by row over the shards: each step pushes its
    IndexedSlices gradient as rows and gets only those rows back; the shards and the worker end equal."""
    cluster = make_cluster(num_shards=2, server_args=list(mode_args))
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(1000, 8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(x), name=var_name)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, size=(64, 6)).astype(np.int32)  # rows 100.. are never touched
    y = (ids.mean(axis=1) > 50).astype(np.float32)[:, None]
    with psk.PSWorker(cluster.addresses) as worker, psclient.PSClient(cluster.addresses) as client:
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adagrad(0.5), worker), loss="mse")
        table = model.layers[1].embeddings
        initial = table.numpy().copy()
        history = model.fit(ids, y, batch_size=16, epochs=4, verbose=0, callbacks=[worker.callback()])
        assert history.history["loss"][-1] < history.history["loss"][0]
        name = worker.name_of(table)
        info = client.list_variables([name])[name]
        assert len(info) == 2 and all(i.spec.HasField("table") for i in info)  # rows on both shards
        stored = client.pull([name])[name]
        np.testing.assert_array_equal(stored, table.numpy())
        np.testing.assert_array_equal(stored[100:], initial[100:])  # untouched rows: not even sent
        assert not np.array_equal(stored[:100], initial[:100])


def test_mixed_float16_trains_with_float32_values_on_the_shards(make_cluster, var_name) -> None:
    """compile wraps the DistributedOptimizer in a LossScaleOptimizer under mixed_float16: it unscales and
    checks the gradients on the worker; the shards keep and update float32 values."""
    cluster = make_cluster(num_shards=1)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.BatchNormalization(),
             keras.layers.Dense(2), keras.layers.Activation("linear", dtype="float32")], name=var_name,
        )  # fmt: skip
    finally:
        keras.mixed_precision.set_global_policy("float32")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    with psk.PSWorker(cluster.addresses) as worker, psclient.PSClient(cluster.addresses) as client:
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.01), worker), loss="mse")
        assert isinstance(model.optimizer, keras.mixed_precision.LossScaleOptimizer)
        history = model.fit(x, x[:, :2], batch_size=16, epochs=4, verbose=0, callbacks=[worker.callback()])
        assert history.history["loss"][-1] < history.history["loss"][0]
        named = psk.model_variable_names(model)
        stored = client.pull([n for _, n in named])
        for var, name in named:
            assert stored[name].dtype == np.float32
            np.testing.assert_array_equal(stored[name], var.numpy(), err_msg=name)
