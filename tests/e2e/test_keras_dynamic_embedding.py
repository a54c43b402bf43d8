"""psclient.keras.Embedding(input_dim=None): dynamic tables (int64 ids or raw strings) trained by model.fit.

Rows are created on the shards as the batches' ids arrive (any 64-bit id, or a string feature value);
ids never seen keep reading their initializer row; strings fed to an int64 table (and the reverse) are
refused with a clear error.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
import psclient.keras as psk  # noqa: E402
from pscore.embedding import hash_keys, init_rows  # noqa: E402

DIM = 8


def _data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Wide int64 user ids, string tags, and a label learnable only through their rows."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 300, size=(n, 2)) * 1_000_000_007 + 12345  # ids far beyond any fixed table
    tags = np.array([f"tag:{t}" for t in rng.integers(0, 40, size=n * 2)]).reshape(n, 2)
    y = ((users[:, :1] // 1_000_000_007) % 2).astype(np.float32)
    return users, tags, y


def _model(worker: psk.PSWorker, name: str, **kw: object) -> tuple[keras.Model, psk.Embedding, psk.Embedding]:
    users_in = keras.Input((2,), dtype="int64", name="users")
    tags_in = keras.Input((2,), dtype="string", name="tags")
    users = psk.Embedding(None, DIM, worker=worker, name="user_emb", **kw)
    tags = psk.Embedding(None, DIM, worker=worker, name="tag_emb", key_type="string")
    pooled = keras.layers.Concatenate()(
        [
            keras.layers.GlobalAveragePooling1D()(users(users_in)),
            keras.layers.GlobalAveragePooling1D()(tags(tags_in)),
        ]
    )
    out = keras.layers.Dense(1)(pooled)
    return keras.Model({"users": users_in, "tags": tags_in}, out, name=name), users, tags


def test_dynamic_int64_and_string_tables_train_through_fit(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=2)
    users, tags, y = _data()
    with psk.PSWorker(cluster.addresses, overlap=False) as worker:
        model, user_emb, tag_emb = _model(worker, var_name, capacity=10_000, min_count=1)
        model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(0.05), worker), loss="mse")
        ds = tf.data.Dataset.from_tensor_slices(({"users": users, "tags": tags}, y)).batch(32)
        ds = psk.prefetch_rows(ds, model)  # dict inputs, int64 and string keys: read a batch ahead
        hist = model.fit(ds, epochs=5, verbose=0, shuffle=False, callbacks=[worker.callback()])
        losses = hist.history["loss"]
        assert losses[-1] < 0.5 * losses[0], losses
        for emb in (user_emb, tag_emb):
            assert emb.prefetch_stats["hits"] >= 5 * 8 // 2, emb.prefetch_stats  # read with the pushes
        assert max(int(np.prod(w.shape)) for w in model.weights) < 1000  # no table on the worker
        client = worker.client
        uname, tname = user_emb.table_name, tag_emb.table_name
        infos = client.list_variables([uname, tname])
        assert all(i.spec.HasField("dynamic") for group in infos.values() for i in group)
        assert sum(i.dynamic.rows for i in infos[uname]) == np.unique(users).size
        assert sum(i.dynamic.rows for i in infos[tname]) == np.unique(tags).size
        assert infos[uname][0].spec.dynamic.capacity == 10_000
        trained = client.lookup(uname, np.unique(users))
        assert not np.allclose(trained, init_rows(uname, np.unique(users), DIM, np.float32, "uniform"))
        unseen = np.array([7, 2**62])
        np.testing.assert_array_equal(
            client.lookup(uname, unseen), init_rows(uname, unseen, DIM, np.float32, "uniform")
        )
        np.testing.assert_array_equal(  # a string's row is its hashed id's
            client.lookup(tname, ["never seen"]),
            init_rows(tname, hash_keys(["never seen"]), DIM, np.float32, "uniform"),
        )
        pred = model.predict(ds.take(1), verbose=0)
        assert pred.shape == (32, 1)
        with pytest.raises(psclient.InvalidArgumentError, match="keyed by strings"):
            client.lookup(tname, [1, 2])


def test_strings_for_an_int64_table_and_ints_for_a_string_table_are_refused(make_cluster, var_name) -> None:
    cluster = make_cluster(num_shards=1)
    with psk.PSWorker(cluster.addresses) as worker:
        ints = psk.Embedding(None, DIM, worker=worker)
        with pytest.raises(ValueError, match="keyed by int64 ids"):
            ints(keras.ops.convert_to_tensor(np.array([["a"]])))
        strings = psk.Embedding(None, DIM, worker=worker, key_type="string")
        with pytest.raises(ValueError, match="keyed by strings"):
            strings(np.array([[1, 2]], np.int64))
        with pytest.raises(ValueError, match="options of dynamic tables"):
            psk.Embedding(100, DIM, worker=worker, capacity=10)
        with pytest.raises(ValueError, match="key_type 'bytes'"):
            psk.Embedding(None, DIM, worker=worker, key_type="bytes")
