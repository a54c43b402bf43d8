"""One rank of the psclient.horovod API test (run under ``psrun -np 2``): prints ``RESULT <json>``."""

from __future__ import annotations

import json
import zlib

import keras
import numpy as np
import tensorflow as tf

import psclient.horovod as hvd
import psclient.horovod.keras as hvdk
from pscore.errors import PSError


def _raises(fn, error) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except error as err:
        return str(err)
    raise AssertionError(f"{fn} did not raise {error}")


def _sgd_after(grads_per_step: list[float], **options) -> float:  # type: ignore[no-untyped-def]
    """The value of a 0-initialized scalar after SGD(lr=1) applies these per-rank gradients."""
    v = keras.Variable(0.0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), **options)
    for g in grads_per_step:
        opt.apply([tf.constant(g)], [v])
    return float(v.numpy())


def main() -> None:
    hvd.init()
    r, out = hvd.rank(), {}
    out["layout"] = [
        hvd.rank(),
        hvd.size(),
        hvd.local_rank(),
        hvd.local_size(),
        hvd.cross_rank(),
        hvd.cross_size(),
    ]
    x = tf.constant([1.0 + r, 10.0 * r])
    out["average"] = hvd.allreduce(x).numpy().tolist()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).numpy().tolist()
    out["max"] = hvd.allreduce(x, op=hvd.Max).numpy().tolist()
    out["grouped"] = [t.numpy().tolist() for t in hvd.grouped_allreduce([x, tf.constant(r)], op=hvd.Sum)]
    out["allgather"] = hvd.allgather(tf.fill([r + 1, 2], r)).numpy().tolist()
    out["broadcast"] = hvd.broadcast(tf.constant([r, r]), root_rank=1).numpy().tolist()
    out["reducescatter"] = hvd.reducescatter(tf.reshape(tf.range(10.0), [5, 2]), op=hvd.Sum).numpy().tolist()
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["objects"] = hvd.allgather_object(f"rank{r}")
    out["keras_allreduce"] = hvdk.allreduce(np.array([float(r)])).tolist()

    @tf.function
    def graph_step(v: tf.Variable) -> tf.Tensor:
        hvd.broadcast_variables([v], root_rank=1)
        return hvd.allgather(tf.reshape(v, [1]))

    v = tf.Variable(float(r))
    out["graph_broadcast"] = graph_step(v).numpy().tolist()

    # DistributedOptimizer: rank r's gradient is (r + 1) * step.
    out["opt_average"] = _sgd_after([1.0 + r])
    out["opt_sum"] = _sgd_after([1.0 + r], op=hvd.Sum)
    out["opt_fp16"] = _sgd_after([1.0 + r], compression=hvd.Compression.fp16)
    out["opt_passes_sum"] = _sgd_after([1.0 + r, 2.0 * (1 + r)], backward_passes_per_step=2)
    out["opt_passes_mean"] = _sgd_after(
        [1.0 + r, 2.0 * (1 + r)], backward_passes_per_step=2, average_aggregated_gradients=True
    )

    # DistributedGradientTape in a tf.function, one source kept local.
    a, b = tf.Variable(1.0), tf.Variable(1.0)

    @tf.function
    def tape_step() -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = (1.0 + r) * (a + b)
        tape = hvd.DistributedGradientTape(tape)
        tape.register_local_source(b)
        return tape.gradient(loss, [a, b])

    out["tape"] = [float(g.numpy()) for g in tape_step()]

    # fit: a lazily built model with BatchNorm, Horovod's callbacks, warmup to 0.1 over 2 epochs.
    rng = np.random.default_rng(r)
    xs = rng.normal(size=(64, 4)).astype(np.float32)
    ys = (xs.sum(axis=1, keepdims=True) > 0).astype(np.float32)
    keras.utils.set_random_seed(100 + r)  # different initial weights: the broadcast must fix them
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.BatchNormalization(),
                              keras.layers.Dense(1, activation="sigmoid")])  # fmt: skip
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="binary_crossentropy")
    rates: list[float] = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: rates.append(float(model.optimizer.learning_rate.numpy()))
    )
    callbacks = [
        hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
        hvdk.callbacks.MetricAverageCallback(),
        hvdk.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2),
        record,
    ]
    history = model.fit(xs, ys, batch_size=16, epochs=2, callbacks=callbacks, verbose=0, shuffle=False)
    crc = 0
    for w in model.get_weights():
        crc = zlib.crc32(np.ascontiguousarray(w).tobytes(), crc)
    out["fit_crcs"] = hvd.allgather_object(crc)
    out["fit_losses"] = hvd.allgather_object(history.history["loss"])
    out["fit_lr_log"] = history.history["lr"]
    out["fit_rates"] = rates

    out["errors"] = [
        _raises(lambda: hvd.allreduce(x, op=hvd.Adasum), hvd.UnsupportedError),
        _raises(lambda: hvd.broadcast_global_variables(0), RuntimeError),
        _raises(lambda: hvdk.load_model("model.keras"), hvd.UnsupportedError),
        _raises(lambda: hvd.ProcessSet([0]), hvd.UnsupportedError),
        _raises(lambda: hvd.start_timeline("t.json"), hvd.UnsupportedError),
    ]
    out["size_op"] = int(tf.function(lambda: hvd.size_op())().numpy())

    # hvd.elastic outside an elastic psrun job: the state is synced from rank 0 once, then the function runs.
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, hvd_seen=[r])
    out["elastic_synced"] = hvd.elastic.run(lambda state: state.hvd_seen)(state)

    # Uneven data: rank 0 runs out first and joins; rank 1's all-reduces go on with rank 0's zeros.
    if r == 1:
        out["with_joined"] = hvd.allreduce(tf.constant([4.0])).numpy().tolist()
        out["with_joined_max"] = hvd.allreduce(tf.constant([-4.0]), op=hvd.Max).numpy().tolist()
        out["broadcast_with_joined"] = _raises(lambda: hvd.broadcast(tf.constant([1]), 1), PSError)
    out["join"] = hvd.join()
    out["after_join"] = hvd.allreduce(tf.constant([1.0 + r]), op=hvd.Sum).numpy().tolist()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
