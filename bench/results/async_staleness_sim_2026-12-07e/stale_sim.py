import collections
import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, "/work/main")
from trainer import data, models

split = data.load_digits()
xtr, ytr, xte, yte = split.x_train, split.y_train, split.x_test, split.y_test


def run(tau, n=8, epochs=6, lr=1e-3, scale=None, seed=0):
    keras.utils.set_random_seed(seed)
    m = models.mlp(xtr.shape[1:])
    m.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    opt = keras.optimizers.Adam(lr)
    opt.build(m.trainable_variables)
    lossf = keras.losses.SparseCategoricalCrossentropy()
    shards = [np.arange(i, len(xtr), n) for i in range(n)]
    bs = 32
    steps = int(np.ceil(len(shards[0]) / bs))
    hist = collections.deque(maxlen=tau + 1)

    @tf.function
    def grad(x, y):
        with tf.GradientTape() as t:
            loss = lossf(y, m(x, training=True))
        return t.gradient(loss, m.trainable_variables)

    order = [(e, s, w) for e in range(epochs) for s in range(steps) for w in range(n)]
    for _e, s, w in order:
        hist.append([v.numpy() for v in m.trainable_variables])
        stale = hist[0]  # params tau updates ago
        now = [v.numpy() for v in m.trainable_variables]
        for v, p in zip(m.trainable_variables, stale, strict=True):
            v.assign(p)
        idx = shards[w][s * bs : (s + 1) * bs]
        g = grad(xtr[idx], ytr[idx])
        for v, p in zip(m.trainable_variables, now, strict=True):
            v.assign(p)
        t = len(hist) - 1
        f = 1.0 if scale is None else scale(max(t, 1))
        opt.learning_rate.assign(lr * f)
        opt.apply_gradients(zip(g, m.trainable_variables, strict=True))
    r = m.evaluate(xte, yte, verbose=0, return_dict=True)
    rt = m.evaluate(xtr, ytr, verbose=0, return_dict=True)
    return round(r["accuracy"], 4), round(rt["loss"], 4)


cases = {
    "tau0": (0, None),
    "tau1": (1, None),
    "tau3": (3, None),
    "tau3 lr/tau": (3, lambda t: 1 / t),
    "tau7": (7, None),
    "tau7 lr/tau": (7, lambda t: 1 / t),
    "tau15": (15, None),
    "tau15 lr/tau": (15, lambda t: 1 / t),
    "tau15 lr/sqrt": (15, lambda t: t**-0.5),
    "tau23": (23, None),
}
for name in sys.argv[1].split(",") if len(sys.argv) > 1 else cases:
    tau, sc = cases[name]
    print(name, [run(tau, scale=sc, seed=s) for s in (0, 1)], flush=True)
