"""Text classification with an Embedding (keras-io's "text classification from scratch", on synthetic
reviews), with a learning-rate schedule callback and early stopping on a validation split.

A review is 64 token ids from a 5,000-word vocabulary drawn with a power law; a review
is positive when it holds more "positive" than "negative" words (two sets of 60 ids).
The model learns which words carry the sentiment. Runs in every mode, unchanged:

    python examples/text_classification.py
    pstrain launch --mode async -- python examples/text_classification.py

Worker 0 prints one ``RESULT {json}`` line.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _report import report  # prints worker 0's RESULT line

import psclient.keras as psk  # dist

EPOCHS = int(os.environ.get("EPOCHS", "10"))
VOCAB, LENGTH = 5000, 64


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(n, LENGTH)), VOCAB - 1).astype("int32")
    sentiment = rng.integers(0, 2, size=n)
    # sprinkle 6 sentiment words per review: mostly of its class, some of the other
    strong = rng.random((n, 6)) < 0.8
    positive = np.where(strong == (sentiment[:, None] == 1), 1, 0)
    words = np.where(positive == 1, 100, 160) + rng.integers(0, 60, size=(n, 6))
    slots = rng.permuted(np.tile(np.arange(LENGTH), (n, 1)), axis=1)[:, :6]
    np.put_along_axis(ids, slots, words.astype("int32"), axis=1)
    pos = ((ids >= 100) & (ids < 160)).sum(1)
    neg = ((ids >= 160) & (ids < 220)).sum(1)
    return ids, (pos > neg).astype("float32")


def make_model() -> keras.Model:
    inputs = keras.Input(shape=(LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 32)(inputs)
    x = keras.layers.Dropout(0.2)(x)
    x = keras.layers.Conv1D(32, 5, activation="relu")(x)
    x = keras.layers.GlobalMaxPooling1D()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = keras.layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs, name="text_cnn")


def schedule(epoch: int, lr: float) -> float:
    return lr if epoch < 3 else lr * 0.7


def main() -> None:
    keras.utils.set_random_seed(0)
    x_train, y_train = make_data(8000, seed=1)
    x_test, y_test = make_data(2000, seed=2)
    dist = psk.from_env()  # dist
    mine = slice(dist.index, None, dist.num_workers)  # dist: this worker's part of the data
    x_train, y_train = x_train[mine], y_train[mine]  # dist

    model = make_model()
    model.compile(
        optimizer=dist.optimizer(keras.optimizers.Adam(2e-3 * dist.lr_scale)),  # dist
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    callbacks = [
        keras.callbacks.LearningRateScheduler(schedule),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True),
    ]
    started = time.perf_counter()
    model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=EPOCHS,
        validation_split=0.1,
        verbose=0,
        callbacks=callbacks + dist.callbacks(),  # dist
    )
    seconds = time.perf_counter() - started

    def accuracy(m: keras.Model) -> float:
        return float(np.mean((m.predict(x_test, verbose=0)[:, 0] > 0.5) == y_test))

    result = {
        "mode": dist.mode,
        "test_accuracy": accuracy(model),
        "train_seconds": seconds,
        "final_learning_rate": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
    }
    report(dist, result, make_model, accuracy)


if __name__ == "__main__":
    main()
