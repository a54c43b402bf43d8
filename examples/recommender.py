"""keras-io's "Collaborative filtering for movie recommendations": a subclassed ``RecommenderNet``.

The model is written as the published example writes it: a subclassed ``keras.Model``
built by its first batch (no ``Input``, no ``build`` call), with user and movie
``Embedding`` tables, one-number bias tables, and an L2 regularizer on the tables
(``embeddings_regularizer=keras.regularizers.l2(1e-6)``). It trains on a synthetic
ratings table (users and movies with hidden tastes and a few popular items, ratings
scaled to [0, 1] as in the example). Runs in every mode, unchanged:

    python examples/recommender.py
    pstrain launch --mode async -- python examples/recommender.py

Worker 0 prints one ``RESULT {json}`` line: the validation loss (binary cross-entropy,
the example's loss), and in the parameter-server modes the bytes each step moved.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _report import report  # prints worker 0's RESULT line

import psclient.keras as psk  # dist

EPOCHS = int(os.environ.get("EPOCHS", "5"))
NUM_USERS, NUM_MOVIES, EMBEDDING_SIZE = 2_000, 1_500, 32


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = keras.layers.Embedding(
            num_users,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = keras.layers.Embedding(num_users, 1)
        self.movie_embedding = keras.layers.Embedding(
            num_movies,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = keras.layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = tf.reduce_sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot_user_movie + user_bias + movie_bias
        return keras.ops.sigmoid(x)


def ratings(seed: int = 0, n: int = int(os.environ.get("RATINGS", "40000"))) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic MovieLens: (user, movie) pairs, popular movies rated more, ratings in [0, 1]."""
    rng = np.random.default_rng(seed)
    taste_u = rng.normal(size=(NUM_USERS, 4))
    taste_m = rng.normal(size=(NUM_MOVIES, 4))
    quality = rng.normal(0, 0.5, NUM_MOVIES)
    popularity = rng.zipf(1.3, NUM_MOVIES).astype(np.float64)
    users = rng.integers(0, NUM_USERS, n)
    movies = rng.choice(NUM_MOVIES, n, p=popularity / popularity.sum())
    score = np.sum(taste_u[users] * taste_m[movies], axis=1) / 2 + quality[movies] + rng.normal(0, 0.5, n)
    stars = np.clip(np.round(3 + score), 0.5, 5.0)
    x = np.stack([users, movies], axis=1).astype("int64")
    y = ((stars - 0.5) / 4.5).astype("float32")  # min-max scaled, as the example does
    return x, y


def make_model() -> RecommenderNet:
    return RecommenderNet(NUM_USERS, NUM_MOVIES, EMBEDDING_SIZE, name="recommender_net")


def main() -> None:
    keras.utils.set_random_seed(0)
    x, y = ratings()
    split = int(0.9 * len(x))
    x_train, x_val, y_train, y_val = x[:split], x[split:], y[:split], y[split:]
    dist = psk.from_env()  # dist
    mine = slice(dist.index, None, dist.num_workers)  # dist: this worker's part of the data
    x_train, y_train = x_train[mine], y_train[mine]  # dist

    model = make_model()
    model.compile(
        loss=keras.losses.BinaryCrossentropy(),
        optimizer=dist.optimizer(keras.optimizers.Adam(learning_rate=0.001 * dist.lr_scale)),  # dist
    )
    started = time.perf_counter()
    model.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=dist.callbacks())  # dist
    seconds = time.perf_counter() - started

    def val_loss(m: keras.Model) -> float:
        pred = keras.ops.convert_to_numpy(m(x_val))
        return float(
            keras.ops.convert_to_numpy(keras.losses.binary_crossentropy(y_val[:, None], pred)).mean()
        )

    result = {"mode": dist.mode, "val_loss": val_loss(model), "train_seconds": seconds}
    worker = dist.worker
    if dist.mode in psk.MODES and worker.steps_done:  # what one step moved: gradients out, values back
        result["bytes_per_step"] = (worker.bytes_pushed + worker.bytes_pulled) / worker.steps_done

    def fresh() -> keras.Model:
        m = make_model()
        m(x_val[:1])  # builds it (a fresh copy loads from the shards)
        return m

    report(dist, result, fresh, lambda m: -val_loss(m), key="loaded_neg_val_loss")


if __name__ == "__main__":
    main()
