"""One rank of the all-reduce parity test (run as a process): trains a small model, saves its weights.

Usage: python _allreduce_worker.py ADDR,ADDR RANK fit|tape OUT.npz
"""

from __future__ import annotations

import sys

import numpy as np

STEPS_PER_EPOCH, EPOCHS, BATCH = 4, 2, 8


def data(rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s rows of a fixed regression problem (the test builds the global batches from it)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(world * STEPS_PER_EPOCH * BATCH, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 2)) + 0.1).astype(np.float32)
    return x[rank::world], y[rank::world]


def build(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input(shape=(4,)), keras.layers.Dense(8, activation="tanh", name="d1"),
         keras.layers.Dense(2, name="d2")],
        name="net",
    )  # fmt: skip


def optimizer():
    """SGD, whose step is proportional to the gradient: a sum instead of a mean would show."""
    import keras

    return keras.optimizers.SGD(0.05, momentum=0.9)


def main() -> int:
    addresses, rank, mode, out = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import tensorflow as tf

    import psclient.keras as psk

    x, y = data(rank, len(addresses))
    model = build(seed=100 + rank)  # a different start on each rank: rank 0's must win
    with psk.AllReduceWorker(addresses, rank, timeout=120) as worker:
        opt = psk.AllReduceOptimizer(optimizer(), worker)
        if mode == "fit":
            model.compile(optimizer=opt, loss="mse", jit_compile=False)
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                      callbacks=[worker.callback()])  # fmt: skip
        else:
            worker.broadcast_variables(model)

            @tf.function
            def step(xb: tf.Tensor, yb: tf.Tensor) -> None:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(xb) - yb) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply(grads, model.trainable_variables)

            for _ in range(EPOCHS):
                for k in range(STEPS_PER_EPOCH):
                    step(x[k * BATCH : (k + 1) * BATCH], y[k * BATCH : (k + 1) * BATCH])
        in_sync = worker.weights_in_sync(model)
        steps = worker.steps_done
    np.savez(out, *model.get_weights(), in_sync=in_sync, steps=steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
