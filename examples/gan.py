"""A GAN with its own ``train_step`` and two optimizers (keras-io's "GAN overriding Model.train_step"),
on a one-dimensional mixture of two Gaussians so the result can be measured.

The generator maps noise to samples; the discriminator tells them from real ones. Each
has its own optimizer, applied in ``train_step``. The score is how close the generated
distribution's mean, spread and the share of samples in each mode come to the real
data's (1.0: equal). Runs in every mode, unchanged:

    python examples/gan.py
    pstrain launch --mode sync -- python examples/gan.py

Worker 0 prints one ``RESULT {json}`` line.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _report import report  # prints worker 0's RESULT line

import psclient.keras as psk  # dist

EPOCHS = int(os.environ.get("EPOCHS", "12"))
LATENT = 8


def real_samples(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centre = np.where(rng.random(n) < 0.3, -2.0, 2.0)
    return (centre + rng.normal(0, 0.5, n)).astype("float32")[:, None]


def mlp(inputs: int, name: str) -> keras.Model:
    hidden = [keras.layers.Dense(32, activation="relu") for _ in range(2)]
    return keras.Sequential([keras.Input((inputs,)), *hidden, keras.layers.Dense(1)], name=name)


class GAN(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = mlp(LATENT, "generator")
        self.discriminator = mlp(1, "discriminator")
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real):
        batch = tf.shape(real)[0]
        noise = keras.random.normal((batch, LATENT), seed=self.seed_generator)
        fake = self.generator(noise)
        samples = tf.concat([fake, real], axis=0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(samples))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights, strict=True))

        noise = keras.random.normal((batch, LATENT), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def score(generator: keras.Model) -> float:
    """1.0 when the generated samples' mean, spread and share below 0 equal the real data's."""
    real = real_samples(20000, seed=9)[:, 0]
    noise = np.random.default_rng(5).normal(size=(20000, LATENT)).astype("float32")
    fake = keras.ops.convert_to_numpy(generator(noise))[:, 0]
    gap = (
        abs(fake.mean() - real.mean())
        + abs(fake.std() - real.std())
        + abs((fake < 0).mean() - (real < 0).mean())
    )
    return float(np.exp(-gap))


def make_gan() -> GAN:
    gan = GAN(name="gan")
    gan.generator.build((None, LATENT))
    gan.discriminator.build((None, 1))
    return gan


def main() -> None:
    keras.utils.set_random_seed(0)
    data = real_samples(16384, seed=1)
    dist = psk.from_env()  # dist
    data = data[dist.index :: dist.num_workers]  # dist: this worker's part of the data
    keras.utils.set_random_seed(dist.index)  # dist: each worker draws its own noise

    gan = make_gan()
    gan.compile(
        d_optimizer=dist.optimizer(keras.optimizers.Adam(5e-4, beta_1=0.5)),  # dist
        g_optimizer=dist.optimizer(keras.optimizers.Adam(5e-4, beta_1=0.5)),  # dist
    )
    started = time.perf_counter()
    gan.fit(data, batch_size=64, epochs=EPOCHS, verbose=0, callbacks=dist.callbacks())  # dist
    result = {
        "mode": dist.mode,
        "score": score(gan.generator),
        "train_seconds": time.perf_counter() - started,
    }
    report(dist, result, make_gan, lambda fresh: score(fresh.generator), key="loaded_score")


if __name__ == "__main__":
    main()
