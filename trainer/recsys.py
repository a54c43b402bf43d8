"""The wide & deep recommender of ``pstrain demo --model wide_deep``, on dynamic embedding tables.

The model (DLRM-flavoured wide & deep) scores a (user, item, category) impression:

- each of the three features has one embedding table whose rows are
  ``[vector | bias]``: 16-d vectors for users and items, 8-d for categories,
  and a 1-d "wide" bias each;
- the click logit is the sum of the three biases (wide), the dot product of
  the user and item vectors (the interaction), and a 64-unit ReLU tower over
  the three vectors (deep); trained with binary cross-entropy and Adagrad.

On the parameter server the tables are ``psclient.keras.Embedding(None, ...)``
dynamic tables: user and item ids are raw 63-bit ids and the category a raw
string (``key_type="string"``), each row created on the shards when its id
first trains (``--table-capacity`` and ``--min-count`` bound them); a worker
holds only its batch's rows. The local baseline (``--mode local``) is the same
model with full-size ``keras.layers.Embedding`` tables over the features'
dense indices. Data: ``trainer.clicks`` (a synthetic log with a known
ground-truth model, so the best reachable AUC is known).

Imports TensorFlow (through Keras).
"""

from __future__ import annotations

import time
from typing import Any

import keras
import numpy as np
from keras import layers

import psclient.keras as psk
from pscore.embedding import Rows
from trainer import clicks, data
from trainer.cluster import rss_mib

USER_DIM = ITEM_DIM = 16
CATEGORY_DIM = 8
DEEP_UNITS = 64
TABLES = ("user", "item", "category")


def wide_deep(tables: dict[str, Any], *, id_dtype: str, category_dtype: str) -> keras.Model:
    """The model over three embedding layers (``tables``: feature -> layer of rows ``[vector | bias]``)."""
    dims = {"user": USER_DIM, "item": ITEM_DIM, "category": CATEGORY_DIM}
    inputs, vectors, biases = {}, {}, []
    for feature in TABLES:
        dtype = category_dtype if feature == "category" else id_dtype
        inputs[feature] = keras.Input((1,), dtype=dtype, name=feature)
        rows = layers.Flatten(name=f"{feature}_rows")(tables[feature](inputs[feature]))
        d = dims[feature]
        vectors[feature] = layers.Lambda(lambda t, d=d: t[:, :d], name=f"{feature}_vector")(rows)
        biases.append(layers.Lambda(lambda t, d=d: t[:, d:], name=f"{feature}_bias")(rows))
    interaction = layers.Dot(axes=1, name="interaction")([vectors["user"], vectors["item"]])
    deep = layers.Concatenate(name="deep_in")([vectors[f] for f in TABLES])
    deep = layers.Dense(DEEP_UNITS, activation="relu", name="deep1")(deep)
    deep = layers.Dense(1, name="deep_out")(deep)
    logit = layers.Add(name="logit")([*biases, interaction, deep])
    click = layers.Activation("sigmoid", name="click")(logit)
    return keras.Model(inputs, click, name="wide_deep")


def ps_model(worker: psk.PSWorker, *, capacity: int | None = None, min_count: int = 1) -> keras.Model:
    """The model with dynamic tables on the shards (raw ids and the category string as keys)."""
    options: dict[str, Any] = {"worker": worker, "capacity": capacity, "min_count": min_count}
    tables = {
        "user": psk.Embedding(None, USER_DIM + 1, name="user_table", **options),
        "item": psk.Embedding(None, ITEM_DIM + 1, name="item_table", **options),
        "category": psk.Embedding(
            None, CATEGORY_DIM + 1, name="category_table", key_type="string", **options
        ),
    }
    return wide_deep(tables, id_dtype="int64", category_dtype="string")


def local_model(log: clicks.ClickLog) -> keras.Model:
    """The baseline: the same model with full-size tables over the features' dense indices."""
    tables = {
        "user": layers.Embedding(log.num_users, USER_DIM + 1, name="user_table"),
        "item": layers.Embedding(log.num_items, ITEM_DIM + 1, name="item_table"),
        "category": layers.Embedding(log.num_categories, CATEGORY_DIM + 1, name="category_table"),
    }
    return wide_deep(tables, id_dtype="int32", category_dtype="int32")


def compile_model(model: keras.Model, optimizer: Any) -> keras.Model:
    model.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=["accuracy"], jit_compile=False)
    return model


def features(log: clicks.ClickLog, *, test: bool, remote: bool) -> dict[str, np.ndarray]:
    """The model's inputs (``[n, 1]``): raw ids and strings (``remote``), or dense indices (local)."""
    split = log.test if test else log.train
    suffix = "" if remote else "_index"
    return {f: split[f + suffix].reshape(-1, 1) for f in TABLES}


def load(config: Any) -> clicks.ClickLog:
    """The click log of a ``TrainConfig`` (``synthetic_size`` training examples, ``num_users`` users)."""
    return clicks.generate(
        num_train=config.synthetic_size,
        num_test=max(2000, config.synthetic_size // 10),
        num_users=config.num_users,
        num_items=max(10, config.num_users // 10),
        seed=config.seed,
    )


def count_payload_bytes(client: Any) -> dict[str, int]:
    """Wraps a ``PSClient``'s data calls to count tensor payload bytes (``{"sent", "received"}``).

    Gradients, rows and ids sent; values, returned rows and looked-up rows received (gRPC framing
    not counted; ids counted as 8 bytes each, as they are given), lookups started ahead
    (``lookup_future``) and read with a push (``push_pull_lookup`` and its ``_future``) included.
    Returns the live counters.
    """
    box = {"sent": 0, "received": 0}

    def size(x: Any) -> int:
        if isinstance(x, Rows):
            return int(np.asarray(x.ids).nbytes + np.asarray(x.values).nbytes)
        return int(np.asarray(x).nbytes)

    def sent(grads: Any) -> None:
        box["sent"] += sum(size(g) for g in grads.values())

    def received(values: Any) -> Any:
        box["received"] += sum(size(v) for v in values.values())
        return values

    push, push_pull_future, pull, lookup = client.push, client.push_pull_future, client.pull, client.lookup
    lookup_future, push_pull_lookup_future = client.lookup_future, client.push_pull_lookup_future

    def w_push(grads: Any, **kw: Any) -> Any:
        sent(grads)
        return push(grads, **kw)

    def w_push_pull_future(grads: Any, **kw: Any) -> Any:
        sent(grads)
        fut = push_pull_future(grads, **kw)
        fut.add_done_callback(lambda f: f.exception() is None and received(f.result()))
        return fut

    def w_pull(names: Any = None, **kw: Any) -> Any:
        return received(pull(names, **kw))

    def lookup_sent(ids: Any) -> None:
        keys = np.asarray(ids)
        box["sent"] += int(keys.size * 8 if keys.dtype.kind in "OUS" else keys.nbytes)  # strings: hashed

    def w_lookup(name: str, ids: Any, **kw: Any) -> Any:
        lookup_sent(ids)
        out = lookup(name, ids, **kw)
        box["received"] += int(out.nbytes)
        return out

    def w_lookup_future(name: str, ids: Any, **kw: Any) -> Any:
        lookup_sent(ids)
        fut = lookup_future(name, ids, **kw)

        def done(f: Any) -> None:
            if not f.cancelled() and f.exception() is None:
                box["received"] += int(f.result().nbytes)

        fut.add_done_callback(done)
        return fut

    def w_push_pull_lookup_future(grads: Any, lookup: Any, **kw: Any) -> Any:
        sent(grads)
        for ids in lookup.values():
            lookup_sent(ids)
        fut = push_pull_lookup_future(grads, lookup, **kw)

        def read(f: Any) -> None:
            if not f.cancelled() and f.exception() is None:
                values, rows = f.result()
                received(values)
                box["received"] += sum(int(r.nbytes) for r in rows.values())

        fut.add_done_callback(read)
        return fut

    push_pull, push_pull_lookup = client.push_pull, client.push_pull_lookup

    def w_push_pull(grads: Any, **kw: Any) -> Any:
        sent(grads)
        return received(push_pull(grads, **kw))

    def w_push_pull_lookup(grads: Any, lookup: Any, **kw: Any) -> Any:
        sent(grads)
        for ids in lookup.values():
            lookup_sent(ids)
        values, rows = push_pull_lookup(grads, lookup, **kw)
        received(values)
        box["received"] += sum(int(r.nbytes) for r in rows.values())
        return values, rows

    client.push, client.push_pull_future, client.pull, client.lookup, client.lookup_future = (
        w_push, w_push_pull_future, w_pull, w_lookup, w_lookup_future,
    )  # fmt: skip
    client.push_pull_lookup_future = w_push_pull_lookup_future
    client.push_pull, client.push_pull_lookup = w_push_pull, w_push_pull_lookup
    return box


class _StepBytes(keras.callbacks.Callback):
    """Payload bytes of steps 2..n (not the attach and the first step's pull of every variable)."""

    def __init__(self, box: dict[str, int]) -> None:
        super().__init__()
        self.box = box
        self.steps = 0
        self.first = 0
        self.last = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.steps += 1
        total = sum(self.box.values())
        if self.steps == 1:
            self.first = total
        self.last = total

    @property
    def per_step(self) -> float:
        return (self.last - self.first) / max(1, self.steps - 1)


def train_worker(
    config: Any, ps_addresses: list[str], *, worker_index: int, num_workers: int, **worker_options: Any
) -> Any:
    """One worker of ``pstrain demo --model wide_deep``: ``fit`` on its shard of the click log.

    Returns a ``trainer.train.WorkerResult`` whose ``extra`` holds ``bytes_per_step`` (payload
    through the client, steps 2..n) and ``peak_rss_mib``.

    Raises:
        psclient.PSError: a shard failed, or a barrier timed out.
    """
    from trainer.train import EpochPrinter, WorkerResult

    log = load(config)
    with psk.PSWorker(
        ps_addresses, worker_index=worker_index, num_workers=num_workers, **worker_options
    ) as worker:
        box = count_payload_bytes(worker.client)
        keras.utils.set_random_seed(config.seed)
        model = ps_model(worker, capacity=config.table_capacity, min_count=config.min_count)
        compile_model(model, psk.DistributedOptimizer(keras.optimizers.Adagrad(config.learning_rate), worker))
        ds = data.make_dataset(
            features(log, test=False, remote=True), log.y_train, batch_size=config.batch_size,
            num_workers=num_workers, worker_index=worker_index, seed=config.seed,
        )  # fmt: skip
        printer = EpochPrinter(config.epochs, f"[worker {worker_index}] ")
        step_bytes = _StepBytes(box)
        model.fit(
            ds,
            epochs=config.epochs,
            verbose=0,
            shuffle=False,
            callbacks=[worker.callback(), printer, step_bytes],
        )
        return WorkerResult(
            worker_index=worker_index,
            **printer.summary(),
            stale_steps=worker.stale_steps,
            extra={"bytes_per_step": step_bytes.per_step, "peak_rss_mib": rss_mib(field="VmHWM")},
        )


def _scores(model: keras.Model, inputs: dict[str, np.ndarray], batch_size: int = 4096) -> np.ndarray:
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(inputs).batch(batch_size)
    return np.asarray(model.predict(ds, verbose=0)).reshape(-1)


def quality(log: clicks.ClickLog, scores: np.ndarray) -> dict[str, float]:
    """Test AUC (and the ground truth's, the best reachable), accuracy at 0.5, and log loss."""
    y = log.y_test.reshape(-1)
    p = np.clip(scores.astype(np.float64), 1e-7, 1 - 1e-7)
    return {
        "test_auc": clicks.auc(y, scores),
        "best_auc": log.best_auc,
        "test_accuracy": float(np.mean((scores > 0.5) == (y > 0.5))),
        "test_log_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))),
    }


def train_local(config: Any) -> tuple[Any, dict[str, float]]:
    """The single-process baseline with full-size tables; returns the result and its test quality."""
    from trainer.train import EpochPrinter, WorkerResult

    log = load(config)
    keras.utils.set_random_seed(config.seed)
    model = compile_model(local_model(log), keras.optimizers.Adagrad(config.learning_rate))
    ds = data.make_dataset(
        features(log, test=False, remote=False), log.y_train, batch_size=config.batch_size, seed=config.seed
    )
    printer = EpochPrinter(config.epochs, "[local] ")
    model.fit(ds, epochs=config.epochs, verbose=0, shuffle=False, callbacks=[printer])
    result = WorkerResult(worker_index=0, **printer.summary(), extra={"peak_rss_mib": rss_mib(field="VmHWM")})
    return result, quality(log, _scores(model, features(log, test=True, remote=False)))


def evaluate_from_ps(config: Any, ps_addresses: list[str], timeout: float = 60.0) -> dict[str, Any]:
    """Scores the test split with the shards' current model: quality, and each table's rows per shard.

    Raises:
        psclient.PSError: a shard failed, or the model is not on the shards.
    """
    log = load(config)
    with psk.PSWorker(
        ps_addresses,
        worker_index=1,
        num_workers=2,
        worker_id="evaluator",
        timeout=timeout,
        attach_timeout=timeout,
    ) as worker:  # not the chief: it only reads
        keras.utils.set_random_seed(config.seed)
        model = ps_model(worker, capacity=config.table_capacity, min_count=config.min_count)
        compile_model(model, psk.DistributedOptimizer(keras.optimizers.Adagrad(config.learning_rate), worker))
        worker.attach(model)
        started = time.perf_counter()
        scores = _scores(model, features(log, test=True, remote=True))
        seconds = time.perf_counter() - started
        names = {layer.name: layer.table_name for layer in model.layers if isinstance(layer, psk.Embedding)}
        listed = worker.client.list_variables(list(names.values()))
    rows = {
        layer: {
            "rows_per_shard": [int(i.dynamic.rows) for i in listed[table]],
            "admitted": sum(int(i.dynamic.admitted) for i in listed[table]),
            "evicted": sum(int(i.dynamic.evicted) for i in listed[table]),
            "dropped_updates": sum(int(i.dynamic.dropped_updates) for i in listed[table]),
        }
        for layer, table in names.items()
    }
    return {
        **quality(log, scores),
        "tables": rows,
        "distinct_train_ids": log.distinct(),
        "test_examples": int(log.y_test.size),
        "score_seconds": seconds,
    }


__all__ = ["evaluate_from_ps", "local_model", "ps_model", "train_local", "train_worker", "wide_deep"]
