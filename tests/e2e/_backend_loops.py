"""Training outside ``fit``'s built-in step on one Keras backend (``KERAS_BACKEND``), run by
tests/e2e/test_keras_backends.py on JAX and PyTorch against an async cluster (``python _backend_loops.py
ADDR,ADDR``). The process runs as an install without TensorFlow would (an import of it raises).

One process checks what the test asserts, and prints ``RESULT {json}``:

- ``loop``: the backend's own training loop as keras-io's "Writing a training loop from scratch" writes it
  (JAX: ``jax.value_and_grad`` of ``stateless_call`` and the optimizer's ``stateless_apply`` in a jitted
  step; PyTorch: ``backward`` and ``optimizer.apply``), with ``worker.attach`` before and ``finish`` after:
  its losses and final weights against the same loop run locally (one worker, SGD, no overlap: the
  same arithmetic).
- ``gan``: a GAN's two parts with two optimizers (PyTorch: keras-io's GAN, its own ``train_step`` under
  ``fit`` with ``worker.callback()``; JAX, whose ``fit`` carries one optimizer's state: a jitted loop
  with both optimizers' ``stateless_apply``, each part attached with its optimizer first): losses and
  weights against local. ``gan_unattached_error`` (JAX): the same loop whose parts were not attached.
- ``overlap``: a ``psclient.keras.Embedding`` model trained by a ``PSWorker(overlap=True)``.
- ``string_refused``: ``key_type="string"``'s ``PSError``; ``string_ids_*``: the host-hashed ids of string
  values train a dynamic table. ``horovod_refused``: ``import psclient.horovod``'s ``PSError``.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
    sys.modules["tensorflow"] = None  # type: ignore[assignment]

import keras
import numpy as np

import psclient.keras as psk
from pscore.errors import PSError

BACKEND = keras.backend.backend()
LATENT, WIDTH, BATCH = 4, 8, 16
RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, WIDTH)).astype("float32")
Y = (X.sum(axis=1, keepdims=True) > 0).astype("float32")
REAL = (RNG.normal(size=(64, WIDTH)) * 0.5 + 1).astype("float32")  # the GAN's "images"


def mlp(name: str, inputs: int = WIDTH, outputs: int = 1) -> keras.Model:
    keras.utils.set_random_seed(1)
    layers = [keras.Input((inputs,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(outputs)]
    return keras.Sequential(layers, name=name)


def max_diff(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights(), strict=True))


def custom_loop(
    model: keras.Model, optimizer: keras.optimizers.Optimizer, x_all: np.ndarray = X, y_all: np.ndarray = Y
) -> list[float]:
    """Two epochs of 8-example steps, as keras-io writes a loop from scratch on this backend."""
    loss_fn = keras.losses.MeanSquaredError()
    losses: list[float] = []
    batches = [(x_all[i : i + 8], y_all[i : i + 8]) for _ in range(2) for i in range(0, len(x_all), 8)]
    if BACKEND == "jax":
        import jax

        def compute_loss_and_updates(trainable, non_trainable, x, y):
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            return loss_fn(y, y_pred), non_trainable

        grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

        @jax.jit
        def train_step(state, data):
            trainable, non_trainable, optimizer_variables = state
            (loss, non_trainable), grads = grad_fn(trainable, non_trainable, *data)
            trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads, trainable)
            return loss, (trainable, non_trainable, optimizer_variables)

        optimizer.build(model.trainable_variables)
        state = tuple(
            [v.value for v in vs] for vs in (model.trainable_variables, model.non_trainable_variables,
                                             optimizer.variables)
        )  # fmt: skip
        for data in batches:
            loss, state = train_step(state, data)
            losses.append(float(loss))
        for variable, value in zip(model.trainable_variables, state[0], strict=True):
            variable.assign(value)
        return losses
    import torch

    for x, y in batches:
        model.zero_grad()
        loss = loss_fn(torch.as_tensor(y), model(torch.as_tensor(x), training=True))
        loss.backward()
        grads = [v.value.grad for v in model.trainable_weights]
        with torch.no_grad():
            optimizer.apply(grads, model.trainable_weights)
        losses.append(float(loss.detach()))
    return losses


def _torch_gan() -> type:
    import torch

    class GAN(keras.Model):
        """keras-io's "Customizing what happens in fit() with PyTorch" GAN (on the CPU)."""

        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
            self.seed_generator = keras.random.SeedGenerator(1337)
            self.built = True

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def train_step(self, real_images):
            if isinstance(real_images, tuple):
                real_images = real_images[0]
            batch_size = real_images.shape[0]
            random_latent_vectors = keras.random.normal(
                (batch_size, self.latent_dim), seed=self.seed_generator
            )
            generated_images = self.generator(random_latent_vectors)
            combined_images = torch.concat([generated_images, real_images], axis=0)
            labels = torch.concat([torch.ones((batch_size, 1)), torch.zeros((batch_size, 1))], axis=0)
            labels += 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)
            self.zero_grad()
            d_loss = self.loss_fn(labels, self.discriminator(combined_images))
            d_loss.backward()
            grads = [v.value.grad for v in self.discriminator.trainable_weights]
            with torch.no_grad():
                self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
            random_latent_vectors = keras.random.normal(
                (batch_size, self.latent_dim), seed=self.seed_generator
            )
            misleading_labels = torch.zeros((batch_size, 1))
            self.zero_grad()
            g_loss = self.loss_fn(
                misleading_labels, self.discriminator(self.generator(random_latent_vectors))
            )
            g_loss.backward()
            grads = [v.value.grad for v in self.generator.trainable_weights]
            with torch.no_grad():
                self.g_optimizer.apply(grads, self.generator.trainable_weights)
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    return GAN


def gan(tag: str, worker: psk.PSWorker | None = None, attach: bool = True) -> tuple[list[float], keras.Model]:
    """Trains a GAN's two parts (two epochs) with two SGD optimizers; returns its losses and the GAN's parts
    as one model."""
    discriminator = mlp(f"discriminator_{tag}")
    generator = mlp(f"generator_{tag}", LATENT, WIDTH)
    wrap = (lambda o: psk.DistributedOptimizer(o, worker)) if worker is not None else (lambda o: o)
    d_opt, g_opt = wrap(keras.optimizers.SGD(0.05)), wrap(keras.optimizers.SGD(0.05))
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    both = keras.Sequential([generator, discriminator], name=f"gan_{tag}")
    if BACKEND == "torch":
        model = _torch_gan()(discriminator, generator, LATENT)
        model.compile(d_opt, g_opt, loss_fn)
        callbacks = [worker.callback()] if worker is not None else []
        history = model.fit(REAL, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        return history.history["d_loss"] + history.history["g_loss"], both
    import jax
    import jax.numpy as jnp

    if worker is not None and attach:
        worker.attach(discriminator, d_opt)
        worker.attach(generator, g_opt)
    d_opt.build(discriminator.trainable_variables)
    g_opt.build(generator.trainable_variables)

    def d_loss_fn(d_tv, d_ntv, images, labels):
        predictions, d_ntv = discriminator.stateless_call(d_tv, d_ntv, images)
        return loss_fn(labels, predictions), d_ntv

    def g_loss_fn(g_tv, g_ntv, d_tv, d_ntv, latent):
        images, g_ntv = generator.stateless_call(g_tv, g_ntv, latent)
        predictions, _ = discriminator.stateless_call(d_tv, d_ntv, images)
        return loss_fn(jnp.zeros((latent.shape[0], 1)), predictions), g_ntv

    @jax.jit
    def train_step(state, real_images, latent, latent2, noise):
        d_tv, d_ntv, g_tv, g_ntv, d_ov, g_ov = state
        n = real_images.shape[0]
        generated, _ = generator.stateless_call(g_tv, g_ntv, latent)
        combined = jnp.concatenate([generated, real_images])
        labels = jnp.concatenate([jnp.ones((n, 1)), jnp.zeros((n, 1))]) + 0.05 * noise
        (d_loss, d_ntv), grads = jax.value_and_grad(d_loss_fn, has_aux=True)(d_tv, d_ntv, combined, labels)
        d_tv, d_ov = d_opt.stateless_apply(d_ov, grads, d_tv)
        (g_loss, g_ntv), grads = jax.value_and_grad(g_loss_fn, has_aux=True)(
            g_tv, g_ntv, d_tv, d_ntv, latent2
        )
        g_tv, g_ov = g_opt.stateless_apply(g_ov, grads, g_tv)
        return (d_loss, g_loss), (d_tv, d_ntv, g_tv, g_ntv, d_ov, g_ov)

    parts = (
        discriminator.trainable_variables, discriminator.non_trainable_variables,
        generator.trainable_variables, generator.non_trainable_variables, d_opt.variables, g_opt.variables,
    )  # fmt: skip
    state = tuple([v.value for v in vs] for vs in parts)
    rng = np.random.default_rng(5)
    losses: list[float] = []
    for _ in range(2):
        for i in range(0, len(REAL), BATCH):
            latent, latent2 = rng.normal(size=(2, BATCH, LATENT)).astype("float32")
            noise = rng.uniform(size=(2 * BATCH, 1)).astype("float32")
            (d_loss, g_loss), state = train_step(state, REAL[i : i + BATCH], latent, latent2, noise)
            losses += [float(d_loss), float(g_loss)]
    for variables, values in ((parts[0], state[0]), (parts[2], state[2])):
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)
    if worker is not None:
        worker.finish()
    return losses, both


def embedding_model(table: keras.layers.Layer, name: str) -> keras.Model:
    keras.utils.set_random_seed(1)
    layers = [
        keras.Input((4,), dtype="int32"),
        table,
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ]
    return keras.Sequential(layers, name=name)


def main() -> None:
    addresses = sys.argv[1].split(",")
    result: dict[str, object] = {"backend": BACKEND}
    with psk.PSWorker(addresses, worker_index=0, num_workers=1) as worker:
        remote = mlp("loop_remote")
        optimizer = psk.DistributedOptimizer(keras.optimizers.SGD(0.1), worker)
        worker.attach(remote, optimizer)
        local = mlp("loop_local")
        local.set_weights(remote.get_weights())  # the shards' initial values
        result["loop_remote_losses"] = custom_loop(remote, optimizer)
        worker.finish()
        result["loop_local_losses"] = custom_loop(local, keras.optimizers.SGD(0.1))
        result["loop_weights_max_diff"] = max_diff(remote, local)

        result["gan_remote_losses"], remote = gan("remote", worker)
        result["gan_local_losses"], local = gan("local")
        result["gan_weights_max_diff"] = max_diff(remote, local)
        if BACKEND == "jax":
            try:
                gan("unattached", worker, attach=False)
                result["gan_unattached_error"] = None
            except PSError as err:
                result["gan_unattached_error"] = str(err)

        try:
            psk.Embedding(None, 4, worker=worker, key_type="string")
            result["string_refused"] = None
        except PSError as err:
            result["string_refused"] = str(err)

    # overlap: step k's push is in flight while step k+1 computes (on values from before it); the layer's
    # lookups read the rows in the step. Host-hashed string values as a dynamic table's ids.
    with psk.PSWorker(addresses, worker_index=0, num_workers=1, overlap=True) as worker:
        values = np.array([f"item:{i}" for i in range(300)])[RNG.integers(0, 300, size=(256, 4))]
        ids = psk.string_ids(values)
        y = (np.char.count(values, "1").sum(axis=1, keepdims=True) > 1).astype("float32")
        table = psk.Embedding(None, 8, worker=worker, name="items")
        model = embedding_model(table, "overlapped")
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.SGD(0.05), worker), loss="mse")
        history = model.fit(
            ids, y, batch_size=32, epochs=3, verbose=0, shuffle=False, callbacks=[worker.callback()]
        )
        result["overlap"] = worker.overlap
        result["overlap_losses"] = history.history["loss"]
        result["string_ids_dtype"] = str(ids.dtype)
        pieces = worker.client.list_variables([table.table_name])[table.table_name]
        result["string_ids_rows_on_shards"] = int(sum(p.dynamic.rows for p in pieces))
        result["string_ids_distinct"] = int(np.unique(ids).size)
        result["distinct_values"] = int(np.unique(values).size)
    try:  # Horovod's TensorFlow API, whose scripts psrun also starts
        import psclient.horovod  # noqa: F401

        result["horovod_refused"] = None
    except PSError as err:
        result["horovod_refused"] = str(err)
    result["glue_imported_tensorflow"] = sys.modules.get("tensorflow") is not None
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
