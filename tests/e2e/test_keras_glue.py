"""psclient.keras on real shards: attach (chief creates, others attach), optimizer mapping, GradientTape."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.keras as psk  # noqa: E402


def _model(name: str) -> keras.Model:
    return keras.Sequential(
        [keras.Input(shape=(4,)), keras.layers.Dense(3, name="d1"), keras.layers.Dense(2, name="d2")],
        name=name,
    )


def test_server_optimizer_comes_from_keras_config() -> None:
    assert psk.server_optimizer(keras.optimizers.Adam(learning_rate=0.005, beta_1=0.8)) == psclient.Adam(
        learning_rate=0.005, beta_1=0.8
    )
    assert psk.server_optimizer(keras.optimizers.SGD()) == psclient.SGD(learning_rate=0.01)
    assert psk.server_optimizer("adam") == psclient.Adam()  # by name, as compile takes it
    # worker-side settings are not part of the shards' spec
    assert psk.server_optimizer(keras.optimizers.SGD(global_clipnorm=1.0)) == psclient.SGD(learning_rate=0.01)
    # the moving average of the weights is kept on the shards (issue 20)
    assert psk.server_optimizer(
        keras.optimizers.SGD(use_ema=True, ema_overwrite_frequency=5)
    ) == psclient.SGD(learning_rate=0.01, use_ema=True, ema_overwrite_frequency=5)


def test_chief_creates_others_attach_and_start_from_the_same_values(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=2)
    chief_model, other_model = _model(var_name), _model(var_name)
    other_model.set_weights([w + 1.0 for w in chief_model.get_weights()])
    errors: list[BaseException] = []
    with (
        psk.PSWorker(cluster.addresses, worker_index=0, num_workers=2) as chief,
        psk.PSWorker(cluster.addresses, worker_index=1, num_workers=2, attach_timeout=30) as other,
    ):

        def attach_other() -> None:
            try:
                other.attach(other_model, keras.optimizers.SGD(0.1))
            except BaseException as err:
                errors.append(err)

        t = threading.Thread(target=attach_other)
        t.start()  # waits for the chief
        chief.attach(chief_model, keras.optimizers.SGD(0.1))
        t.join(timeout=60)
        assert not t.is_alive() and not errors
        for a, b in zip(chief_model.get_weights(), other_model.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
        # attaching again is idempotent; another optimizer replaces the shards' one (a recompiled model)
        chief.attach(chief_model, keras.optimizers.SGD(0.1))
        chief.attach(chief_model, keras.optimizers.Adam(0.1))
        with psclient.PSClient(cluster.addresses) as client:
            infos = client.list_variables([chief.name_of(v) for v in chief_model.trainable_variables])
        assert {i[0].spec.optimizer.name for i in infos.values()} == {"adam"}


@pytest.mark.parametrize("in_graph", [False, True])
def test_gradient_tape_helper_applies_server_side_sgd(make_cluster, var_name, in_graph: bool) -> None:
    cluster = make_cluster(num_shards=2)
    model = _model(var_name)
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))
    with psk.PSWorker(cluster.addresses, overlap=False) as worker:
        worker.attach(model, keras.optimizers.SGD(learning_rate=0.5))
        before = [v.numpy().copy() for v in model.trainable_variables]

        def step() -> list[tf.Tensor]:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            worker.apply_gradients(grads, model.trainable_variables)
            return grads

        grads = tf.function(step)() if in_graph else step()
        for b, g, v in zip(before, grads, model.trainable_variables, strict=True):
            np.testing.assert_allclose(v.numpy(), b - 0.5 * g.numpy(), rtol=1e-5, atol=1e-6)
        with psclient.PSClient(cluster.addresses) as client:
            stored = client.pull([worker.name_of(v) for v in model.trainable_variables])
        for v in model.trainable_variables:
            np.testing.assert_allclose(stored[worker.name_of(v)], v.numpy(), rtol=1e-6)


@pytest.mark.parametrize("every", [None, 3])
def test_fit_with_use_ema_ends_with_the_weights_of_a_local_fit(make_cluster, var_name, every) -> None:
    """Two fits with Adam(use_ema=True) on a shard end, each, with the weights local Keras ends with: the
    moving averages, written into the model and the shards (the second fit starts from them)."""
    cluster = make_cluster(num_shards=2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = rng.normal(size=(64, 2)).astype(np.float32)

    def adam() -> keras.optimizers.Optimizer:
        return keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=every)

    local, remote = _model(var_name), _model(var_name)
    remote.set_weights(local.get_weights())
    local.compile(optimizer=adam(), loss="mse")
    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    with (
        psk.PSWorker(cluster.addresses, overlap=False) as worker,
        psclient.PSClient(cluster.addresses) as client,
    ):
        remote.compile(optimizer=psk.DistributedOptimizer(adam(), worker), loss="mse")
        names = None
        for _ in range(2):
            local.fit(x, y, **fit)
            remote.fit(x, y, callbacks=[worker.callback()], **fit)
            names = names or [worker.name_of(v) for v in remote.trainable_variables]
            stored, averages = client.pull(names), client.pull(names, ema=True)
            for mine, theirs, name in zip(
                remote.trainable_variables, local.trainable_variables, names, strict=True
            ):
                np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
                np.testing.assert_array_equal(stored[name], mine.numpy())  # the shards' variables too
                np.testing.assert_array_equal(averages[name], mine.numpy())
    kernel = local.trainable_variables[0]
    average = local.optimizer._model_variables_moving_average[0]
    np.testing.assert_array_equal(kernel.numpy(), average.numpy())  # local Keras: the model holds the average


def test_fit_without_the_callback_says_what_to_do(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=1)
    model = _model(var_name)
    with psk.PSWorker(cluster.addresses) as worker:
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.SGD(), worker), loss="mse")
        with pytest.raises(Exception, match=r"worker\.callback\(\)"):
            model.fit(np.zeros((4, 4), np.float32), np.zeros((4, 2), np.float32), verbose=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_returns_the_previous_steps_values_and_keeps_one_exchange_in_flight(
    make_cluster, var_name, overlap: bool
) -> None:
    cluster = make_cluster(num_shards=1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)], name=var_name)
    with psk.PSWorker(cluster.addresses, overlap=overlap) as worker:
        worker.attach(model, keras.optimizers.SGD(learning_rate=1.0))
        name = worker.name_of(model.trainable_variables[0])
        start = model.trainable_variables[0].numpy()
        ones = np.ones((2, 1), np.float32)
        seen = [worker.exchange([name], [ones])[0] for _ in range(3)]
        # SGD(1) with gradients of ones: the shards hold start - k after k pushes. Without overlap each step
        # gets its own push's answer; with it, step 1 waits for its own (nothing earlier) and step k > 1
        # gets step k - 1's while its own push is in flight.
        expected = [1, 2, 3] if not overlap else [1, 1, 2]
        for got, k in zip(seen, expected, strict=True):
            np.testing.assert_allclose(got, start - k)
        worker.refresh()  # drains the exchange in flight
        np.testing.assert_allclose(model.trainable_variables[0].numpy(), start - 3)
