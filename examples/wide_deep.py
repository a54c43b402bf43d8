"""A wide & deep click model on dynamic embedding tables, on any Keras backend (TensorFlow, JAX, PyTorch).

The model scores a (user, item, category) impression: each feature has one embedding table whose
rows are ``[vector | bias]``; the click logit is the sum of the three biases (wide), the dot product
of the user and item vectors, and a small ReLU tower over the three vectors (deep), trained with
binary cross-entropy and Adagrad, as keras-io's recommenders are.

On the parameter server (``async``, ``sync``, ``ssp``) the tables are ``psclient.keras.Embedding(None,
...)`` dynamic tables keyed by the raw ids of the log (any integer, not a dense index: a row is
created on the shards when its id first trains; a worker holds only its batch's rows). Locally and on
the ring (``allreduce``: every rank holds the whole model) they are ``keras.layers.Embedding`` tables
over the features' dense indices. Runs in every mode and on every backend, unchanged:

    python examples/wide_deep.py
    pstrain launch --mode async -- python examples/wide_deep.py
    KERAS_BACKEND=jax pstrain launch --mode sync -- python examples/wide_deep.py

Data: a synthetic click log with hidden user and item tastes, category and item effects (no
download). Worker 0 prints one ``RESULT {json}`` line: the test accuracy (clicked or not, at 0.5),
and in the parameter-server modes that of a fresh copy of the model that reads the shards' tables.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _report import report  # prints worker 0's RESULT line
from keras import layers

import psclient.keras as psk  # dist

EPOCHS = int(os.environ.get("EPOCHS", "4"))
IMPRESSIONS = int(os.environ.get("IMPRESSIONS", "24000"))
NUM_USERS, NUM_ITEMS, NUM_CATEGORIES = 600, 400, 12
DIMS = {"user": 8, "item": 8, "category": 4}
FEATURES = tuple(DIMS)


def click_log(seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``(features as dense indices, clicked)``: clicks drawn from hidden tastes and effects."""
    rng = np.random.default_rng(seed)
    taste_u, taste_i = rng.normal(size=(NUM_USERS, 3)), rng.normal(size=(NUM_ITEMS, 3))
    item_category = rng.integers(0, NUM_CATEGORIES, NUM_ITEMS)
    category_effect, item_effect = rng.normal(0, 1.0, NUM_CATEGORIES), rng.normal(0, 0.5, NUM_ITEMS)
    users = rng.integers(0, NUM_USERS, IMPRESSIONS)
    items = rng.integers(0, NUM_ITEMS, IMPRESSIONS)
    logit = np.sum(taste_u[users] * taste_i[items], axis=1) + category_effect[item_category[items]]
    logit += item_effect[items]
    clicked = (rng.random(IMPRESSIONS) < 1 / (1 + np.exp(-logit))).astype("float32")
    x = {"user": users, "item": items, "category": item_category[items]}
    return {f: v.reshape(-1, 1).astype("int32") for f, v in x.items()}, clicked


def raw_ids(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The log's own ids (sparse, unbounded): what a dynamic table is keyed by."""
    salt = {"user": 7_919, "item": 104_729, "category": 1_299_709}
    return {f: (v * 9_973 + salt[f]).astype("int32") for f, v in x.items()}


def make_model(worker: psk.PSWorker | None) -> keras.Model:
    """The wide & deep model over dynamic tables on the shards (``worker``), else over local tables."""
    sizes = {"user": NUM_USERS, "item": NUM_ITEMS, "category": NUM_CATEGORIES}
    inputs, vectors, biases = {}, {}, []
    for f in FEATURES:
        if worker is not None:  # dist: rows on the shards, created when an id first trains
            table = psk.Embedding(None, DIMS[f] + 1, worker=worker, name=f"{f}_table")
        else:
            table = layers.Embedding(sizes[f], DIMS[f] + 1, name=f"{f}_table")
        inputs[f] = keras.Input((1,), dtype="int32", name=f)
        rows = layers.Flatten()(table(inputs[f]))
        vectors[f] = layers.Lambda(lambda t, d=DIMS[f]: t[:, :d])(rows)
        biases.append(layers.Lambda(lambda t, d=DIMS[f]: t[:, d:])(rows))
    interaction = layers.Dot(axes=1)([vectors["user"], vectors["item"]])
    deep = layers.Dense(32, activation="relu")(layers.Concatenate()([vectors[f] for f in FEATURES]))
    logit = layers.Add()([*biases, interaction, layers.Dense(1)(deep)])
    return keras.Model(inputs, layers.Activation("sigmoid")(logit), name="wide_deep")


def main() -> None:
    keras.utils.set_random_seed(0)
    x, y = click_log()
    split = int(0.8 * len(y))
    dist = psk.from_env()  # dist
    remote = dist.mode in psk.MODES  # dist: dynamic tables on the shards
    if remote:
        x = raw_ids(x)
    x_train, y_train = {f: v[:split] for f, v in x.items()}, y[:split]
    x_test, y_test = {f: v[split:] for f, v in x.items()}, y[split:]
    mine = slice(dist.index, None, dist.num_workers)  # dist: this worker's part of the data
    x_train, y_train = {f: v[mine] for f, v in x_train.items()}, y_train[mine]  # dist

    model = make_model(dist.worker if remote else None)
    model.compile(
        optimizer=dist.optimizer(keras.optimizers.Adagrad(0.1 * dist.lr_scale)),  # dist
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    started = time.perf_counter()
    model.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=dist.callbacks())  # dist
    seconds = time.perf_counter() - started

    def accuracy(m: keras.Model) -> float:
        p = keras.ops.convert_to_numpy(m.predict(x_test, batch_size=1024, verbose=0)).reshape(-1)
        return float(np.mean((p > 0.5) == (y_test > 0.5)))

    result = {"mode": dist.mode, "backend": keras.backend.backend(), "test_accuracy": accuracy(model),
              "train_seconds": seconds}  # fmt: skip

    def fresh() -> keras.Model:  # an evaluator's copy: its tables read the shards' rows through the worker
        copy = make_model(dist.worker)
        dist.worker.attach(copy)
        return copy

    report(dist, result, fresh, accuracy)


if __name__ == "__main__":
    main()
