"""psclient.keras.Embedding: a table that lives only on the shards, trained by model.fit through real shards.

The worker holds no table-sized variable, only the batch's rows are created/sent (untouched rows keep
the initializer's values on the shards), bad ids give a clear error, and sync mode keeps one step per batch.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

keras = pytest.importorskip("keras")

import psclient.keras as psk  # noqa: E402
from pscore.embedding import init_rows  # noqa: E402

ROWS, DIM = 100_000, 16


def _model(worker: psk.PSWorker, name: str, **kwargs: object) -> tuple[keras.Model, psk.Embedding]:
    emb = psk.Embedding(ROWS, DIM, worker=worker, name="emb", **kwargs)
    model = keras.Sequential(
        [keras.Input((4,), dtype="int32"), emb, keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)],
        name=name,
    )
    return model, emb


def _data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 500, size=(n, 4)).astype(np.int32) * 7  # ids < 3500, spread over the table
    y = (x % 2).mean(axis=1, keepdims=True).astype(np.float32)  # learnable only through the rows
    return x, y


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_trains_without_a_table_on_the_worker(make_cluster, var_name, mode) -> None:
    cluster = make_cluster(num_shards=2, server_args=("--mode", mode, "--total-replicas", "1"))
    x, y = _data()
    with psk.PSWorker(cluster.addresses, overlap=False) as worker:
        model, emb = _model(worker, var_name)
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.05), worker), loss="mse")
        hist = model.fit(x, y, batch_size=32, epochs=6, verbose=0, callbacks=[worker.callback()])
        losses = hist.history["loss"]
        assert losses[-1] < 0.5 * losses[0], losses
        assert max(int(np.prod(w.shape)) for w in model.weights) < 1000  # no 100_000 x 16 copy here
        name = emb.table_name
        info = worker.client.list_variables([name])[name]
        assert all(i.spec.HasField("table") for i in info)
        assert sum(i.spec.table.rows for i in info) == ROWS
        touched = np.unique(x)
        untouched = np.setdiff1d(np.arange(0, 5000), touched)
        got = worker.client.lookup(name, untouched)
        np.testing.assert_array_equal(got, init_rows(name, untouched, DIM, np.float32, "uniform"))
        trained = worker.client.lookup(name, touched)
        assert not np.allclose(trained, init_rows(name, touched, DIM, np.float32, "uniform"))
        pred = model.predict(x[:8], verbose=0)  # inference reads the shards' rows too
        assert pred.shape == (8, 1)
        fresh, _ = _model(worker, var_name)
        psk.load_from_ps(fresh, worker.client)  # the table is skipped: it has no local variable
        np.testing.assert_allclose(fresh.layers[-1].kernel.numpy(), model.layers[-1].kernel.numpy())


class _TappedBatches(keras.callbacks.Callback):
    """Counts the batches ``prefetch_rows`` asked rows for, and at each step's begin but the epoch's first
    (Keras makes the epoch's iterator in that step) waits, at most 20 s, until the batch after it was."""

    def __init__(self, emb: psk.Embedding, batches: int = 8) -> None:
        super().__init__()
        self.batches, self.late, self._asked = batches, 0, threading.Semaphore(0)
        self._seen = 0  # batches of this epoch asked for, as far as waited for
        start = emb.start_prefetch

        def counted(ids: object) -> bool:
            try:
                return start(ids)
            finally:
                self._asked.release()

        emb.start_prefetch = counted  # what tf.data's thread calls: counted, then done as before

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        self._seen = 0

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        while batch and self._seen < min(batch + 2, self.batches):
            if not self._asked.acquire(timeout=20):
                self.late += 1
                return
            self._seen += 1


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_prefetch_reads_each_batchs_rows_with_the_push_of_the_step_before(
    make_cluster, var_name, overlap: bool
) -> None:
    import tensorflow as tf

    cluster = make_cluster(num_shards=2)
    x, y = _data()
    # async; overlapped: the step's exchange and its layers share one future; not: the step waits for its
    # exchange, which hands the rows it read to the layer
    with psk.PSWorker(cluster.addresses, overlap=overlap) as worker:
        model, emb = _model(worker, var_name)
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.05), worker), loss="mse")
        # A batch's rows are read with the step before's push when tf.data prepared it before that push:
        # a race the push often wins on a loaded machine with so small a model. Two elements ahead
        # (depth=2) and a callback that waits until the next batch was prepared decide it from each
        # epoch's third batch on; the second races the first step; the first misses (no push before it).
        tapped = _TappedBatches(emb)
        ds = psk.prefetch_rows(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), model, depth=2)
        hist = model.fit(ds, epochs=6, verbose=0, shuffle=False, callbacks=[tapped, worker.callback()])
        losses = hist.history["loss"]
        assert losses[-1] < 0.5 * losses[0], losses
        assert tapped.late == 0, f"{tapped.late} steps began before tf.data prepared the batch after them"
        stats = emb.prefetch_stats
        assert stats["hits"] + stats["misses"] == 6 * 8, stats  # one lookup per step
        assert 6 * 6 <= stats["hits"] <= 6 * 7, stats
        # Rows read with a push are the shards' rows after it, as a lookup reads them; ids no push read
        # (other data) are read in the step.
        ids = np.unique(x[:5])
        assert emb.start_prefetch(ids)
        before = emb.prefetch_stats
        model.fit(x[:32], y[:32], batch_size=32, verbose=0, callbacks=[worker.callback()])  # its push: ids
        np.testing.assert_array_equal(emb._lookup(ids), worker.client.lookup(emb.table_name, ids))
        assert emb.prefetch_stats["hits"] == before["hits"] + 1
        assert model.predict(x[:3] + 1, verbose=0).shape == (3, 1)
        assert emb.prefetch_stats["misses"] == before["misses"] + 2  # the fit's step, predict's batch
    with pytest.raises(ValueError, match=r"no psclient\.keras\.Embedding"):
        psk.prefetch_rows(ds, keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))


def test_bad_ids_give_a_clear_error(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=2)
    x, y = _data(32)
    x[3, 1] = ROWS + 5
    with psk.PSWorker(cluster.addresses) as worker:
        model, _ = _model(worker, var_name)
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.SGD(0.1), worker), loss="mse")
        with pytest.raises(Exception, match=rf"id {ROWS + 5} is out of range \[0, {ROWS}\)"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[worker.callback()])


def test_sync_one_step_per_batch_and_own_optimizer(make_cluster, var_name) -> None:
    import tensorflow as tf

    cluster = make_cluster(
        num_shards=2, server_args=("--mode", "sync", "--replicas-to-aggregate", "1", "--total-replicas", "1")
    )
    x, y = _data(128)
    with psk.PSWorker(cluster.addresses) as worker:
        model, emb = _model(
            worker, var_name, optimizer=keras.optimizers.SGD(0.5), embeddings_initializer="zeros"
        )
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.01), worker), loss="mse")
        ds = psk.prefetch_rows(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), model)
        model.fit(ds, epochs=2, verbose=0, shuffle=False, callbacks=[worker.callback()])
        assert worker.step == 8 and worker.stale_steps == 0
        assert emb.prefetch_stats == {"hits": 0, "misses": 8}  # sync mode never reads ahead
        name = emb.table_name
        assert worker.client.list_variables([name])[name][0].spec.optimizer.name.lower() == "sgd"
        assert np.any(worker.client.lookup(name, np.unique(x)))  # moved from zeros
        assert not np.any(worker.client.lookup(name, np.array([1, 2, 3])))  # never in a batch


def test_the_chief_creates_the_table_another_worker_finds_it_and_a_tape_loop_trains(
    make_cluster, var_name
) -> None:
    import tensorflow as tf

    cluster = make_cluster(num_shards=2)
    x, y = _data(32)
    with (
        psk.PSWorker(cluster.addresses, worker_index=0, num_workers=2) as chief,
        psk.PSWorker(cluster.addresses, worker_index=1, num_workers=2, attach_timeout=10) as other,
    ):
        models = []
        for worker in (chief, other):  # the chief first: the other waits for what it creates
            model, emb = _model(worker, var_name, optimizer=psk.server_optimizer("sgd"))
            worker.attach(model, optimizer=keras.optimizers.SGD(0.1))
            models.append((model, emb))
        name = models[0][1].table_name
        assert name == models[1][1].table_name
        before = chief.client.lookup(name, np.unique(x))

        @tf.function
        def graph_step(model: keras.Model, worker: psk.PSWorker) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            worker.apply_gradients(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        with tf.GradientTape() as tape:  # eager, on the chief
            loss = tf.reduce_mean((models[0][0](x, training=True) - y) ** 2)
        variables = models[0][0].trainable_variables
        chief.apply_gradients(tape.gradient(loss, variables), variables)
        graph_step(models[1][0], other)  # in a tf.function, on the other worker
        other.finish()
        after = chief.client.lookup(name, np.unique(x))
        assert not np.allclose(before, after)
        assert chief.client.status()[0].mode == "async"


def test_loss_scaling_is_refused(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=1)
    with psk.PSWorker(cluster.addresses) as worker:
        model, _ = _model(worker, var_name)
        opt = psk.DistributedOptimizer(
            keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()), worker
        )
        model.compile(optimizer=opt, loss="mse")
        with pytest.raises(ValueError, match="loss scaling"):
            worker.attach(model)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_steps_per_execution_trains_exactly_as_one_step_per_call(make_cluster, var_name, mode) -> None:
    """``compile(steps_per_execution=4)`` (Keras runs 4 steps per call of the step function, and the
    callbacks once per call): every step still looks up, pushes and counts, with the same result."""
    import tensorflow as tf

    x, y = _data(8 * 32 + 16)  # 8 full batches and a partial one per epoch: a short last execution
    results = {}
    for spe in (1, 4):
        # The same names: the same initial rows.
        sync = ("--replicas-to-aggregate", "1", "--total-replicas", "1") if mode == "sync" else ()
        cluster = make_cluster(num_shards=2, server_args=("--mode", mode, *sync))
        keras.utils.set_random_seed(0)  # the same initial Dense weights
        with psk.PSWorker(cluster.addresses, overlap=False) as worker:
            model, emb = _model(worker, var_name)
            model.compile(
                optimizer=psk.DistributedOptimizer(keras.optimizers.Adagrad(0.2), worker),
                loss="mse",
                steps_per_execution=spe,
            )
            ds = psk.prefetch_rows(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), model)
            cb = worker.callback()
            hist = model.fit(ds, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
            assert worker.step == 2 * 9 and cb.steps == 2 * 9  # every step pushed, and counted
            rows = worker.client.lookup(emb.table_name, np.unique(x))
            results[spe] = (hist.history["loss"], rows, model.layers[-1].kernel.numpy())
        cluster.stop()
    np.testing.assert_allclose(results[4][0], results[1][0], rtol=1e-5)
    np.testing.assert_allclose(results[4][1], results[1][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[4][2], results[1][2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_regularizer_runs_on_the_shards(make_cluster, var_name, dynamic: bool) -> None:
    cluster = make_cluster(num_shards=2)
    x, y = _data(n=64)
    # exact: every row of a fixed table decays on every push; a dynamic table's regularizer is lazy
    with psk.PSWorker(cluster.addresses, overlap=False, table_regularization="exact") as worker:
        emb = psk.Embedding(
            None if dynamic else ROWS, DIM, worker=worker, name="emb",
            embeddings_regularizer=keras.regularizers.l2(0.5),
        )  # fmt: skip
        model = keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                emb,
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1),
            ],
            name=var_name,
        )
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.SGD(0.1), worker), loss="mse")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[worker.callback()])
        name = emb.table_name
        (piece, *_) = worker.client.list_variables([name])[name]
        reg = piece.spec.dynamic.regularizer if dynamic else piece.spec.table.regularizer
        assert reg.l2 == pytest.approx(0.5) and reg.every_row is not dynamic
        if not dynamic:  # a row no batch read: SGD(0.1) on 2 * 0.5 * w, twice: w * 0.9 ** 2
            np.testing.assert_allclose(
                worker.client.lookup(name, np.array([1])),
                init_rows(name, np.array([1]), DIM, np.float32, "uniform") * 0.81,
                rtol=1e-5,
            )
    bad = keras.regularizers.OrthogonalRegularizer(0.1)
    with psk.PSWorker(cluster.addresses) as worker:
        model, emb = _model(worker, var_name + "_bad", embeddings_regularizer=bad)
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.SGD(0.1), worker), loss="mse")
        with pytest.raises(ValueError, match="cannot run on the shards"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[worker.callback()])


@pytest.mark.parametrize("sliced", [False, True], ids=["dense", "indexed-slices"])
def test_the_rows_gradient_is_the_sum_per_distinct_id(sliced: bool) -> None:
    """The backward's sum: each distinct id's row gradient is the sum of its looked-up rows' gradients, also
    when only some of the looked-up rows got one (the layer's output read by a gather: an ``IndexedSlices``
    gradient)."""
    import tensorflow as tf

    from psclient.keras._embedding import _summed_rows

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 40, size=300).astype(np.int64)
    dy = rng.standard_normal((300, DIM)).astype(np.float32)
    unique, where = tf.unique(tf.constant(ids))
    at = np.sort(rng.choice(300, size=120, replace=False)) if sliced else np.arange(300)
    grad = tf.IndexedSlices(tf.constant(dy[at]), tf.constant(at)) if sliced else tf.constant(dy)
    summed = _summed_rows(grad, where, tf.shape(unique)[0]).numpy()
    expected = np.zeros((len(unique), DIM), np.float32)
    np.add.at(expected, where.numpy()[at], dy[at])
    np.testing.assert_allclose(summed, expected, rtol=1e-5, atol=1e-5)
