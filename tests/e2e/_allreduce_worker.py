"""One rank of the all-reduce e2e tests (run as a process).

Usage:
    python _allreduce_worker.py ADDR,ADDR RANK fit|tape OUT.npz
        the parity run: trains a small model, saves its weights.
    python _allreduce_worker.py ADDRS RANK scenarios NAME,NAME,... OUT_DIR
        runs the named scenarios one after another, each on its own ring (ADDRS holds WORLD addresses per
        scenario, in order), and writes OUT_DIR/NAME.rankR.json (error, in_sync, losses, ...).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

STEPS_PER_EPOCH, EPOCHS, BATCH = 4, 2, 8
SCENARIO_TIMEOUT_S = (
    30.0  # each collective's deadline in a scenario: a rank that failed alone stalls no longer
)


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
    if sys.argv[3] == "scenarios":
        return run_scenarios(
            sys.argv[1].split(","), int(sys.argv[2]), sys.argv[4].split(","), Path(sys.argv[5])
        )
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


# -- scenarios (issue 9) ---------------------------------------------------------------------------

S_STEPS, S_BATCH, S_EPOCHS = 6, 8, 3


def rank_data(rank: int, world: int = 2, steps: int = S_STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s rows of a regression problem; the inputs' mean differs per rank (BatchNorm sees it)."""
    rng = np.random.default_rng(11)
    w = rng.normal(size=(4, 2))
    x = rng.normal(size=(world * steps * S_BATCH, 4)).astype(np.float32)
    x = x[rank::world] + np.float32(rank)  # per-rank shift: batch statistics differ between ranks
    return x, (np.tanh(x) @ w + 0.1).astype(np.float32)


def mlp(seed: int, *, batchnorm: bool = False, built: bool = True, dropout: bool = False):
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input(shape=(4,))] if built else []
    layers.append(keras.layers.Dense(16, activation="relu", name="h1"))
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    if dropout:
        layers.append(keras.layers.Dropout(0.1, name="drop"))
    layers.append(keras.layers.Dense(2, name="out", dtype="float32"))
    return keras.Sequential(layers, name="mlp")


def fit(model: Any, opt: Any, worker: Any, rank: int, *, epochs: int = S_EPOCHS) -> dict[str, Any]:
    """Compiles and fits on the rank's data with the callback; the per-epoch losses and whether in sync."""
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x, y = rank_data(rank)
    hist = model.fit(x, y, batch_size=S_BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[worker.callback()])  # fmt: skip
    return {"losses": [float(v) for v in hist.history["loss"]], "in_sync": worker.weights_in_sync(model)}


def trains_with(make_optimizer: Callable[[Any], Any]) -> Callable[[Any, int, Path], dict[str, Any]]:
    def scenario(worker: Any, rank: int, out: Path) -> dict[str, Any]:
        import psclient.keras as psk

        opt = make_optimizer(worker)
        if not isinstance(opt, psk.AllReduceOptimizer) and not hasattr(opt, "inner_optimizer"):
            opt = psk.AllReduceOptimizer(opt, worker)
        return fit(mlp(100 + rank), opt, worker, rank)

    return scenario


def s_batchnorm_fit(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    import keras

    import psclient.keras as psk

    model = mlp(100 + rank, batchnorm=True)
    result = fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker), worker, rank)
    bn = model.get_layer("bn")
    result["moving_mean"] = np.asarray(bn.moving_mean).tolist()
    result["moving_variance"] = np.asarray(bn.moving_variance).tolist()
    return result


def s_batchnorm_tape(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    import psclient.keras as psk

    model = mlp(100 + rank, batchnorm=True)
    opt = psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker)
    worker.broadcast_variables(model)
    opt.attach(model)

    @tf.function
    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    x, y = rank_data(rank)
    losses = [float(step(x[k * S_BATCH : (k + 1) * S_BATCH], y[k * S_BATCH : (k + 1) * S_BATCH]))
              for _ in range(S_EPOCHS) for k in range(S_STEPS)]  # fmt: skip
    bn = model.get_layer("bn")
    return {"losses": [losses[0], losses[-1]], "in_sync": worker.weights_in_sync(model),
            "moving_mean": np.asarray(bn.moving_mean).tolist()}  # fmt: skip


def s_custom_train_step(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    import psclient.keras as psk

    class Net(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.h = keras.layers.Dense(16, activation="relu")
            self.bn = keras.layers.BatchNormalization()
            self.o = keras.layers.Dense(2)

        def call(self, x: Any, training: bool = False) -> Any:
            return self.o(self.bn(self.h(x), training=training))

        def train_step(self, data: Any) -> dict[str, Any]:
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

    keras.utils.set_random_seed(100 + rank)
    model = Net()
    model(np.zeros((1, 4), np.float32))
    return fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker), worker, rank)


def s_two_optimizers(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    """examples/gan.py's shape: ``compile(a_optimizer=, b_optimizer=)`` (no compiled AllReduceOptimizer),
    and a train_step that applies each to its own sub-model's variables, one after the other."""
    import keras
    import tensorflow as tf

    import psclient.keras as psk

    class TwoParts(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            dense = keras.layers.Dense
            self.a = keras.Sequential([keras.Input((4,)), dense(16, activation="relu")], name="a")
            self.b = keras.Sequential([keras.Input((16,)), dense(2)], name="b")
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def compile(self, a_optimizer: Any, b_optimizer: Any) -> None:
            super().compile(jit_compile=False)
            self.a_optimizer, self.b_optimizer = a_optimizer, b_optimizer

        @property
        def metrics(self) -> list[Any]:
            return [self.loss_tracker]

        def call(self, x: Any, training: bool = False) -> Any:
            return self.b(self.a(x))

        def train_step(self, data: Any) -> dict[str, Any]:
            x, y = data
            for part, opt in ((self.b, self.b_optimizer), (self.a, self.a_optimizer)):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((self(x, training=True) - y) ** 2)
                grads = tape.gradient(loss, part.trainable_weights)
                opt.apply_gradients(zip(grads, part.trainable_weights, strict=True))
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    keras.utils.set_random_seed(100 + rank)
    model = TwoParts()
    model.compile(
        a_optimizer=psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker),
        b_optimizer=psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker),
    )
    x, y = rank_data(rank)
    hist = model.fit(x, y, batch_size=S_BATCH, epochs=S_EPOCHS, shuffle=False, verbose=0,
                     callbacks=[worker.callback()])  # fmt: skip
    iterations = [int(o.iterations.numpy()) for o in (model.a_optimizer, model.b_optimizer)]
    return {"losses": [float(v) for v in hist.history["loss"]], "in_sync": worker.weights_in_sync(model),
            "iterations": iterations, "steps": worker.steps_done}  # fmt: skip


def s_lazy(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    """Horovod's Keras MNIST example's shape: a Sequential without Input, built by fit's first step."""
    import keras

    import psclient.keras as psk

    model = mlp(100 + rank, built=False, batchnorm=True, dropout=True)
    return fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker), worker, rank)


def s_scalar_variable(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    import keras

    import psclient.keras as psk

    v = keras.Variable(float(rank + 1))
    worker.broadcast_variables([v])
    result = {"shape": list(v.shape), "value": float(v.numpy())}
    model = mlp(100 + rank)
    first = fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker), worker, rank)
    x, y = rank_data(rank)  # a second fit: the optimizer (and its 0-d iterations) is built and broadcast
    hist = model.fit(
        x, y, batch_size=S_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[worker.callback()]
    )
    result.update(losses=first["losses"] + hist.history["loss"], in_sync=worker.weights_in_sync(model),
                  iterations=int(model.optimizer.iterations.numpy()))  # fmt: skip
    return result


def s_loss_scale_outer(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    """LossScaleOptimizer(AllReduceOptimizer(...)), and rank 1's first batch overflows: both ranks skip it."""
    import keras

    import psclient.keras as psk

    opt = keras.mixed_precision.LossScaleOptimizer(
        psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker)
    )
    model = mlp(100 + rank)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x, y = rank_data(rank)
    if rank == 1:
        x[:S_BATCH] = 1e30  # an inf loss on this rank only
    hist = model.fit(x, y, batch_size=S_BATCH, epochs=S_EPOCHS, shuffle=False, verbose=0,
                     callbacks=[worker.callback()])  # fmt: skip
    return {"losses": [float(v) for v in hist.history["loss"]], "in_sync": worker.weights_in_sync(model),
            "scale": float(opt.dynamic_scale.numpy()), "iterations": int(opt.iterations.numpy())}  # fmt: skip


def s_mixed_float16(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    import keras

    import psclient.keras as psk

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp(100 + rank, batchnorm=True)
        result = fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker), worker, rank)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result["serialized"] = keras.saving.serialize_keras_object(model.optimizer)
    return result


def s_transfer(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    """Freeze the base, fit, unfreeze, recompile with a fresh AllReduceOptimizer, fit again."""
    import keras

    import psclient.keras as psk

    model = mlp(100 + rank, batchnorm=True)
    base = [model.get_layer("h1"), model.get_layer("bn")]
    for layer in base:
        layer.trainable = False
    first = fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker), worker, rank)
    frozen = [np.asarray(v).tolist() for v in model.get_layer("h1").weights]
    for layer in base:
        layer.trainable = True
    second = fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-3), worker), worker, rank)
    return {"losses": first["losses"] + second["losses"], "in_sync": first["in_sync"] and second["in_sync"],
            "frozen_after_first": frozen}  # fmt: skip


def s_frozen_layer(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    import keras

    import psclient.keras as psk

    model = mlp(100 + rank, batchnorm=True)
    model.get_layer("h1").trainable = False
    model.get_layer("bn").trainable = False
    initial = [np.asarray(v).tolist() for v in model.get_layer("h1").weights]
    result = fit(model, psk.AllReduceOptimizer(keras.optimizers.Adam(1e-2), worker), worker, rank)
    result["frozen"] = [np.asarray(v).tolist() for v in model.get_layer("h1").weights]
    result["initial"] = initial
    return result


def s_save_load(worker: Any, rank: int, out: Path) -> dict[str, Any]:
    """Saves (rank 0) a model trained with AllReduceOptimizer(Adam) and with a registered custom optimizer."""
    import keras

    import psclient.keras as psk

    result: dict[str, Any] = {"in_sync": True, "losses": []}
    for name, make in (
        ("adam", lambda: keras.optimizers.Adam(1e-2)),
        ("custom", lambda: custom_optimizer()(1e-2)),
    ):
        model = mlp(100 + rank)
        r = fit(model, psk.AllReduceOptimizer(make(), worker), worker, rank)
        result["in_sync"] = result["in_sync"] and r["in_sync"]
        result["losses"] = r["losses"]
        result[f"{name}_serialized"] = keras.saving.serialize_keras_object(model.optimizer)
        result[f"{name}_plain_serialized"] = keras.saving.serialize_keras_object(make())
        if rank == 0:
            model.save(out / f"{name}.keras")
            np.savez(out / f"{name}.npz", *model.get_weights())
    return result


_CUSTOM: list[type] = []


def custom_optimizer() -> type:
    """``MyAdam``: a user's own optimizer class, registered for serialization (once per process)."""
    if not _CUSTOM:
        import keras

        @keras.saving.register_keras_serializable("psclient_tests")
        class MyAdam(keras.optimizers.Adam):
            pass

        _CUSTOM.append(MyAdam)
    return _CUSTOM[0]


def _optimizer_scenarios() -> dict[str, Callable[[Any, int, Path], dict[str, Any]]]:
    import keras

    import psclient.keras as psk

    opts = keras.optimizers
    return {
        "schedule": trains_with(lambda w: opts.Adam(opts.schedules.CosineDecay(1e-2, 1000))),
        "loss_scale_inner": trains_with(
            lambda w: psk.AllReduceOptimizer(keras.mixed_precision.LossScaleOptimizer(opts.Adam(1e-2)), w)
        ),
        "weight_decay": trains_with(lambda w: opts.AdamW(1e-2, weight_decay=0.01)),
        "clipnorm": trains_with(lambda w: opts.SGD(0.05, clipnorm=1.0)),
        "global_clipnorm": trains_with(lambda w: opts.Adam(1e-2, global_clipnorm=1.0)),
        "accumulation": trains_with(lambda w: opts.Adam(1e-2, gradient_accumulation_steps=2)),
        "ema": trains_with(
            lambda w: opts.Adam(1e-2, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=5)
        ),
        "name": trains_with(lambda w: psk.AllReduceOptimizer("adam", w)),
    }


def scenarios() -> dict[str, Callable[[Any, int, Path], dict[str, Any]]]:
    """Every scenario, by name."""
    return {
        "batchnorm_fit": s_batchnorm_fit,
        "batchnorm_tape": s_batchnorm_tape,
        "custom_train_step": s_custom_train_step,
        "two_optimizers": s_two_optimizers,
        "lazy": s_lazy,
        "scalar_variable": s_scalar_variable,
        "loss_scale_outer": s_loss_scale_outer,
        "mixed_float16": s_mixed_float16,
        "transfer": s_transfer,
        "frozen_layer": s_frozen_layer,
        "save_load": s_save_load,
        **_optimizer_scenarios(),
    }


def run_scenarios(addresses: list[str], rank: int, names: list[str], out: Path) -> int:
    import keras

    import psclient.keras as psk

    world = len(addresses) // len(names)
    table = scenarios()
    for i, name in enumerate(names):
        ring = addresses[i * world : (i + 1) * world]
        result: dict[str, Any] = {"error": None}
        try:
            with psk.AllReduceWorker(ring, rank, timeout=SCENARIO_TIMEOUT_S) as worker:
                result.update(table[name](worker, rank, out))
        except Exception as e:  # recorded for the test, which names the scenario and shows the traceback
            result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        finally:
            keras.mixed_precision.set_global_policy("float32")
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
