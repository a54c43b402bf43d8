"""``psclient.keras.Embedding`` on one Keras backend (``KERAS_BACKEND``), run by
tests/e2e/test_keras_backends.py against a sync-mode cluster of one worker
(``python _backend_embedding.py ADDR,ADDR``).

One process checks what the test asserts, and prints ``RESULT {json}``:

- ``same_losses``: a model with a fixed table of ``ROWS`` rows on the shards, BatchNorm and a dense head,
  trained by ``fit`` with SGD, against the same model with a ``keras.layers.Embedding`` holding the
  shards' initial rows, trained locally: the losses of each epoch (row-wise SGD on the shards is
  Keras's dense SGD, whose untouched rows get zero gradients).
- the table's rows: the batches' rows trained, the others still the initializer's, and the worker
  holds no table-sized variable; ``bytes_per_step``: what a step moved (only rows).
- ``dynamic_losses``: a dynamic table (``input_dim=None``) keyed by large raw ids trains, and its rows
  are created on the shards.
- ``bad_id_error``: an id outside ``[0, input_dim)`` in ``predict``.
- with a second (async) cluster's addresses: ``prefetch_losses`` and ``prefetch_stats`` of the model
  trained on a ``tf.data`` dataset through ``prefetch_rows`` (each batch's rows read with the push of
  the step before).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import psclient.keras as psk
from pscore.embedding import init_rows

ROWS, DIM, EPOCHS, BATCH = 5_000, 8, 3, 32


def data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 300, size=(n, 4)).astype("int32") * 7  # ids < 2100: some repeat within a batch
    y = (x % 2).mean(axis=1, keepdims=True).astype("float32")  # learnable only through the rows
    return x, y


def model(table: keras.layers.Layer, name: str) -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            table,
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ],
        name=name,
    )


def main() -> None:
    addresses = sys.argv[1].split(",")
    x, y = data()
    result: dict[str, object] = {"backend": keras.backend.backend()}
    with psk.PSWorker(addresses, worker_index=0, num_workers=1) as worker:
        emb = psk.Embedding(ROWS, DIM, worker=worker, name="rows")
        remote = model(emb, "remote")
        remote.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.SGD(0.5), worker), loss="mse")
        worker.attach(remote)  # the shards' initial values, to start the local copy from
        local_table = keras.layers.Embedding(ROWS, DIM, name="rows")
        local = model(local_table, "local")
        local_table.embeddings.assign(init_rows(emb.table_name, np.arange(ROWS), DIM, np.float32, "uniform"))
        for mine, theirs in zip(local.layers[1:], remote.layers[1:], strict=True):
            mine.set_weights(theirs.get_weights())
        local.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        fit = {"batch_size": BATCH, "epochs": EPOCHS, "verbose": 0, "shuffle": False}
        result["remote_losses"] = remote.fit(x, y, callbacks=[worker.callback()], **fit).history["loss"]
        result["local_losses"] = local.fit(x, y, **fit).history["loss"]
        result["steps_done"], result["stale_steps"] = worker.steps_done, worker.stale_steps
        result["bytes_per_step"] = (worker.bytes_pushed + worker.bytes_pulled) / worker.steps_done
        result["largest_weight"] = max(int(np.prod(w.shape)) for w in remote.weights)
        touched = np.unique(x)
        got = worker.client.lookup(emb.table_name, touched)
        want = keras.ops.convert_to_numpy(local_table.embeddings)[touched]
        result["touched_rows_max_error"] = float(np.abs(got - want).max())
        untouched = np.setdiff1d(np.arange(ROWS), touched)
        initial = init_rows(emb.table_name, untouched, DIM, np.float32, "uniform")
        result["untouched_rows_unchanged"] = bool(
            np.array_equal(worker.client.lookup(emb.table_name, untouched), initial)
        )
        result["predict_max_error"] = float(
            np.abs(remote.predict(x[:64], verbose=0) - local.predict(x[:64], verbose=0)).max()
        )
        try:
            remote.predict(np.full((2, 4), ROWS + 3, "int32"), verbose=0)
            result["bad_id_error"] = None
        except Exception as err:  # wrapped by the backend (JAX: its runtime error around the callback's)
            result["bad_id_error"] = str(err)[-2000:]

        dynamic = psk.Embedding(None, DIM, worker=worker, name="dynamic_rows")
        dyn = model(dynamic, "dynamic")
        dyn.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adagrad(0.5), worker), loss="mse")
        raw = x * 100_003 + 1_000_000_007  # raw ids, no dense index (int32 on JAX: below 2**31)
        history = dyn.fit(raw, y, callbacks=[worker.callback()], **fit)
        result["dynamic_losses"] = history.history["loss"]
        pieces = worker.client.list_variables([dynamic.table_name])[dynamic.table_name]
        result["dynamic_rows_on_shards"] = int(sum(p.dynamic.rows for p in pieces))
        result["distinct_raw_ids"] = int(np.unique(raw).size)
    if (
        len(sys.argv) > 2
    ):  # an async cluster: prefetch_rows over tf.data (ids given: the model runs on JAX/torch)
        import tensorflow as tf

        with psk.PSWorker(sys.argv[2].split(","), worker_index=0, num_workers=1) as worker:
            emb = psk.Embedding(ROWS, DIM, worker=worker, name="rows")
            prefetched = model(emb, "prefetched")
            prefetched.compile(
                optimizer=psk.DistributedOptimizer(keras.optimizers.SGD(0.5), worker), loss="mse"
            )
            ds = psk.prefetch_rows(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), prefetched, ids=lambda t: t
            )
            history = prefetched.fit(ds, epochs=EPOCHS, verbose=0, callbacks=[worker.callback()])
            result["prefetch_losses"] = history.history["loss"]
            result["prefetch_stats"] = emb.prefetch_stats
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
