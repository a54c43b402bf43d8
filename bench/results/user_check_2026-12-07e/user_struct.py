"""A user's structured-data script in the style of keras-io's structured_data_classification:
numeric features normalized by an adapted Normalization layer, a categorical feature through
StringLookup + Embedding, BatchNorm, Dropout, AdamW with weight decay, a cosine-decay schedule,
clipnorm, class weights, validation data, EarlyStopping restoring the best weights, ModelCheckpoint,
then the checkpoint reloaded and evaluated."""

import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split

import psclient.keras as psk

keras.utils.set_random_seed(1)
data = load_breast_cancer()
x = data.data.astype("float32")
y = data.target.astype("int32")
# a categorical column, as strings: the tercile of "mean radius"
edges = np.quantile(x[:, 0], [1 / 3, 2 / 3])
cat = np.array(["small", "medium", "large"])[np.digitize(x[:, 0], edges)]
idx = np.arange(len(y))
tr, te = train_test_split(idx, test_size=0.25, random_state=0, stratify=y)
tr, va = train_test_split(tr, test_size=0.2, random_state=0, stratify=y[tr])

dist = psk.from_env()
mine = tr[dist.index :: dist.num_workers]

norm = keras.layers.Normalization()
norm.adapt(x[tr])
lookup = keras.layers.StringLookup(vocabulary=["small", "medium", "large"])

num_in = keras.Input((30,), name="num")
cat_in = keras.Input((1,), name="cat", dtype="int64")
h = norm(num_in)
e = keras.layers.Flatten()(keras.layers.Embedding(4, 3)(cat_in))
h = keras.layers.Concatenate()([h, e])
h = keras.layers.Dense(32, use_bias=False)(h)
h = keras.layers.BatchNormalization()(h)
h = keras.layers.Activation("relu")(h)
h = keras.layers.Dropout(0.3)(h)
h = keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4))(h)
out = keras.layers.Dense(1, activation="sigmoid")(h)
model = keras.Model([num_in, cat_in], out)

steps = int(np.ceil(len(mine) / 32)) * 40
sched = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=steps, alpha=0.1)
opt = keras.optimizers.AdamW(learning_rate=sched, weight_decay=1e-3, clipnorm=1.0)
model.compile(
    optimizer=dist.optimizer(opt),
    loss="binary_crossentropy",
    metrics=["accuracy", keras.metrics.AUC(name="auc")],
)


def ids(s: np.ndarray) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(lookup(cat[s]))).reshape(-1, 1)


ckpt = os.path.join(tempfile.mkdtemp(), f"best-{dist.index}.keras")
early = keras.callbacks.EarlyStopping(monitor="val_auc", mode="max", patience=8, restore_best_weights=True)
best = keras.callbacks.ModelCheckpoint(ckpt, monitor="val_auc", mode="max", save_best_only=True)
w = {0: len(y[tr]) / (2 * (y[tr] == 0).sum()), 1: len(y[tr]) / (2 * (y[tr] == 1).sum())}
hist = model.fit(
    {"num": x[mine], "cat": ids(mine)},
    y[mine],
    batch_size=32,
    epochs=40,
    validation_data=({"num": x[va], "cat": ids(va)}, y[va]),
    class_weight=w,
    callbacks=[early, *dist.callbacks(best)],
    verbose=0,
)
res = model.evaluate({"num": x[te], "cat": ids(te)}, y[te], verbose=0, return_dict=True)
if dist.index == 0:
    again = keras.saving.load_model(ckpt)
    res2 = again.evaluate({"num": x[te], "cat": ids(te)}, y[te], verbose=0, return_dict=True)
    print(
        "RESULT "
        + json.dumps(
            {
                "mode": dist.mode,
                "epochs": len(hist.history["loss"]),
                "acc": round(res["accuracy"], 4),
                "auc": round(res["auc"], 4),
                "ckpt_acc": round(res2["accuracy"], 4),
                "ckpt_auc": round(res2["auc"], 4),
            }
        )
    )
dist.close()
