"""Dynamic embedding tables (``create_embedding(name, None, dim)``) with real shard processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S
from _support import table_stats

import psclient
from pscore.embedding import hash_keys, init_rows
from pscore.placement import dynamic_row_shard
from trainer.cluster import LocalCluster, backups_of

pytestmark = [pytest.mark.timeout(180)]


def test_rows_are_created_on_their_first_push_from_their_initializer_row(
    client: psclient.PSClient, var_name: str
) -> None:
    init = ("uniform", -1.0, 1.0)
    assert client.create_embedding(var_name, None, 3, optimizer=psclient.SGD(0.5), initializer=init) is True
    ids = np.array([[7, -(2**40)], [2**63 - 1, 7]])
    expected = init_rows(var_name, ids.reshape(-1), 3, np.float32, init).reshape(2, 2, 3)
    np.testing.assert_array_equal(client.lookup(var_name, ids), expected)
    assert table_stats(client, var_name).get("rows", 0) == 0  # a lookup creates nothing
    wide = np.arange(200, dtype=np.int64) * 1_000_003  # spread over both shards by the id's hash
    grads = np.ones((200, 3), np.float32)
    new = client.push_pull(
        {var_name: psclient.Rows(np.concatenate([wide, wide[:5]]), np.concatenate([grads, grads[:5]]))}
    )
    rows = new[var_name]
    np.testing.assert_array_equal(rows.ids, np.sort(wide))
    start = init_rows(var_name, np.sort(wide), 3, np.float32, init)
    twice = np.isin(np.sort(wide), wide[:5])[:, None]  # duplicate ids summed
    np.testing.assert_allclose(rows.values, start - 0.5 * np.where(twice, 2.0, 1.0), rtol=1e-6)
    np.testing.assert_array_equal(client.lookup(var_name, np.sort(wide)), rows.values)
    per_shard = [info.dynamic.rows for info in client.list_variables([var_name])[var_name]]
    assert sum(per_shard) == 200 and min(per_shard) > 50
    assert per_shard == [int(np.sum(dynamic_row_shard(wide, 2) == s)) for s in range(2)]


def test_create_is_idempotent_and_refuses_another_spec(client: psclient.PSClient, var_name: str) -> None:
    kw: dict[str, Any] = {"capacity": 100, "min_count": 2, "eviction": "lfu", "ttl_steps": 50}
    assert client.create_embedding(var_name, None, 4, **kw) is True
    with psclient.PSClient(client.config.addresses, "other", timeout=TIMEOUT_S) as other:
        assert other.create_embedding(var_name, None, 4, **kw) is False
        for change in ({"capacity": 101}, {"min_count": 1}, {"eviction": "lru"}, {"key_type": "string"}):
            with pytest.raises(psclient.AlreadyExistsError, match="dynamic table of dim 4"):
                other.create_embedding(var_name, None, 4, **{**kw, **change})
        with pytest.raises(psclient.AlreadyExistsError, match="different spec"):
            other.create_embedding(var_name, 10, 4)  # a fixed table of that name


def test_a_string_keyed_table_takes_str_and_bytes_keys(client: psclient.PSClient, var_name: str) -> None:
    client.create_embedding(
        var_name, None, 2, key_type="string", optimizer=psclient.SGD(1.0), initializer="zeros"
    )
    new = client.push_pull({var_name: psclient.Rows(["b", "a", "b"], np.ones((3, 2), np.float32))})[var_name]
    order = np.argsort(hash_keys(["a", "b"]))
    assert new.ids.tolist() == np.array(["a", "b"])[order].tolist()
    np.testing.assert_array_equal(new.values, -np.array([[1, 1], [2, 2]], np.float32)[order])
    got = client.lookup(var_name, np.array([["a", "b"], ["c", "a"]]))
    np.testing.assert_array_equal(got, -np.array([[[1, 1], [2, 2]], [[0, 0], [1, 1]]], np.float32))
    np.testing.assert_array_equal(client.lookup(var_name, [b"b", "b"]), -np.full((2, 2), 2, np.float32))
    np.testing.assert_array_equal(client.lookup(var_name, np.array(["a", "b"], object)), got[0])


def test_bad_keys_are_refused_and_change_nothing(client: psclient.PSClient, var_name: str) -> None:
    s, i, w = var_name + "s", var_name + "i", var_name + "w"
    client.create_embedding(s, None, 2, key_type="string", initializer="zeros")
    client.create_embedding(i, None, 2, initializer="zeros")
    client.create(w, np.zeros(2, np.float32), optimizer=psclient.SGD(1.0))
    ones = np.ones((2, 2), np.float32)
    cases = [
        (s, [1, 2], "keyed by strings; ids have dtype int64"),
        (s, [1.5, 2.5], "keyed by strings; ids have dtype float64"),
        (s, np.array([b"x", 3], object), r"key 3 \(int\) is not a str or bytes"),
        (i, ["x", "y"], "keyed by int64 ids; got strings"),
        (i, [1.0, 2.0], "dtype float64, not an integer"),
        (i, [True, False], "dtype bool, not an integer"),
    ]
    for table, ids, message in cases:
        with pytest.raises(psclient.InvalidArgumentError, match=message):
            client.push({w: np.ones(2, np.float32), table: psclient.Rows(ids, ones)})
        with pytest.raises(psclient.InvalidArgumentError, match=message):
            client.lookup(table, ids)
    with pytest.raises(psclient.InvalidArgumentError, match=r"must have shape \(2, 2\)"):
        client.push({i: psclient.Rows([1, 2], np.ones((2, 3), np.float32))})
    np.testing.assert_array_equal(client.pull([w])[w], np.zeros(2))  # nothing applied anywhere
    assert table_stats(client, s).get("admitted", 0) == table_stats(client, i).get("admitted", 0) == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"capacity": 0}, "capacity must be an int >= 1"),
        ({"capacity": 2.5}, "capacity must be an int >= 1"),
        ({"min_count": 0}, r"min_count must be an int in \[1, 65535\]"),
        ({"min_count": 1 << 16}, r"min_count must be an int in \[1, 65535\]"),
        ({"eviction": "fifo"}, "eviction 'fifo' is not 'lru' or 'lfu'"),
        ({"key_type": "uint8"}, "key_type 'uint8' is not 'int64' or 'string'"),
        ({"ttl_steps": 0}, "ttl_steps must be an int >= 1"),
        ({"ttl_seconds": -1.0}, "ttl_seconds must be a number > 0"),
        ({"initializer": lambda ids, dim, dtype: np.zeros((len(ids), dim))}, "not a callable"),
        ({"optimizer": psclient.Lamb()}, "needs the whole variable"),
    ],
)
def test_bad_dynamic_options_are_refused_and_create_nothing(
    client: psclient.PSClient, var_name: str, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(psclient.InvalidArgumentError, match=message):
        client.create_embedding(var_name, None, 4, **kw)
    assert var_name not in client.list_variables([var_name])


def test_dynamic_options_of_a_fixed_table_are_refused(client: psclient.PSClient, var_name: str) -> None:
    with pytest.raises(psclient.InvalidArgumentError, match="options of dynamic tables"):
        client.create_embedding(var_name, 100, 4, capacity=10)


def test_admission_and_eviction_over_the_wire(client: psclient.PSClient, var_name: str) -> None:
    client.create_embedding(
        var_name, None, 2, optimizer=psclient.SGD(1.0), initializer="zeros", capacity=20, min_count=2
    )
    ids = np.arange(100, dtype=np.int64)
    g = np.ones((100, 2), np.float32)
    client.push({var_name: psclient.Rows(ids, g)})  # seen once: nothing admitted
    np.testing.assert_array_equal(client.lookup(var_name, ids), np.zeros((100, 2)))
    stats = table_stats(client, var_name)
    assert stats.get("rows", 0) == 0 and stats["dropped_updates"] == 100 and stats["initializer_reads"] == 100
    client.push({var_name: psclient.Rows(ids[:10], g[:10])})  # seen twice: admitted, this update applied
    np.testing.assert_array_equal(client.lookup(var_name, ids[:10]), -np.ones((10, 2)))
    client.push({var_name: psclient.Rows(ids[10:60], g[10:60])})  # 50 admitted into 20 rows (10 per shard)
    stats = table_stats(client, var_name)
    assert stats["rows"] <= 20 and stats["capacity"] == 20
    assert stats["admitted"] - stats["evicted"] == stats["rows"]
    assert stats["evicted"] >= 10  # the first ten rows went first (least recently updated)
    np.testing.assert_array_equal(client.lookup(var_name, ids[:10]), np.zeros((10, 2)))


def test_a_pull_of_everything_leaves_dynamic_tables_out(client: psclient.PSClient, var_name: str) -> None:
    client.create_embedding(var_name, None, 2)
    client.create(var_name + "w", np.ones(3, np.float32))
    values = client.pull()
    assert var_name + "w" in values and var_name not in values
    with pytest.raises(psclient.InvalidArgumentError, match="read its rows with lookup"):
        client.pull([var_name])


def _pusher(addresses: list[str], name: str, worker: int, pushes: int) -> None:
    with psclient.PSClient(addresses, f"w{worker}", timeout=TIMEOUT_S) as c:
        for i in range(pushes):
            ids = np.array([i % 7, 10**12 + (i + worker) % 7, -3, -3])  # overlapping rows, and duplicates
            c.push({name: psclient.Rows(ids, np.ones((4, 3), np.float32))})


def test_concurrent_dynamic_row_pushes_from_processes_give_the_exact_total(
    cluster: LocalCluster, var_name: str
) -> None:
    workers, pushes = 3, 40
    with psclient.PSClient(cluster.addresses, "init", timeout=TIMEOUT_S) as c:
        c.create_embedding(var_name, None, 3, optimizer=psclient.SGD(1.0), initializer="zeros")
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_pusher, args=(cluster.addresses, var_name, w, pushes)) for w in range(workers)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * workers
        expected: dict[int, float] = {}
        for w in range(workers):
            for i in range(pushes):
                for r in (i % 7, 10**12 + (i + w) % 7, -3, -3):
                    expected[r] = expected.get(r, 0) + 1
        keys = np.array(sorted(expected))
        np.testing.assert_array_equal(
            c.lookup(var_name, keys),
            -np.repeat(np.array([expected[k] for k in keys.tolist()])[:, None], 3, axis=1),
        )


async def test_sync_mode_applies_the_mean_of_the_workers_dynamic_rows(
    make_cluster: Any, var_name: str
) -> None:
    args = [
        "--mode",
        "sync",
        "--replicas-to-aggregate",
        "2",
        "--total-replicas",
        "2",
        "--barrier-timeout",
        "20",
    ]
    cluster = make_cluster(num_shards=2, server_args=args)
    async with (
        psclient.AsyncPSClient(cluster.addresses, "w0", timeout=TIMEOUT_S) as w0,
        psclient.AsyncPSClient(cluster.addresses, "w1", timeout=TIMEOUT_S) as w1,
    ):
        await w0.create_embedding(
            var_name, None, 2, key_type="string", optimizer=psclient.SGD(1.0), initializer="zeros"
        )
        await w1.create_embedding(
            var_name, None, 2, key_type="string", optimizer=psclient.SGD(1.0), initializer="zeros"
        )
        applied = await asyncio.gather(
            w0.push({var_name: psclient.Rows(["a", "b"], np.array([[2, 2], [4, 4]], np.float32))}, step=0),
            w1.push({var_name: psclient.Rows(["b", "c"], np.array([[6, 6], [8, 8]], np.float32))}, step=0),
        )
        assert applied == [True, True]
        table = await w0.lookup(var_name, ["a", "b", "c", "d"])
        np.testing.assert_array_equal(table, -np.array([[1, 1], [5, 5], [4, 4], [0, 0]]))


def _pushes(c: psclient.PSClient, name: str, steps: range) -> None:
    for i in steps:
        rng = np.random.default_rng(i)
        ids = rng.integers(0, 40, size=12) * 1_000_003 - 7
        c.push({name: psclient.Rows(ids, rng.standard_normal((12, 4)).astype(np.float32))})


def test_a_dynamic_table_checkpoint_restores_into_another_shard_count(tmp_path: Any, var_name: str) -> None:
    args = ["--checkpoint-dir", str(tmp_path)]
    kw: dict[str, Any] = {"optimizer": psclient.Adam(0.1), "min_count": 2, "ttl_steps": 1000}
    probe = np.arange(40) * 1_000_003 - 7
    with LocalCluster(2, args) as two:
        with psclient.PSClient(two.addresses, "w0", timeout=TIMEOUT_S) as c:
            c.create_embedding(var_name, None, 4, **kw)
            _pushes(c, var_name, range(6))
            before = c.lookup(var_name, probe)
            rows = table_stats(c, var_name)["rows"]
        assert two.stop() == [0, 0]  # SIGTERM: final checkpoints
    with LocalCluster(3, args) as three, psclient.PSClient(three.addresses, "w1", timeout=TIMEOUT_S) as c:
        np.testing.assert_array_equal(c.lookup(var_name, probe), before)
        pieces = c.list_variables([var_name])[var_name]
        assert [p.spec.dynamic.count for p in pieces] == [3, 3, 3] and sum(
            p.dynamic.rows for p in pieces
        ) == rows
        _pushes(c, var_name, range(6, 10))  # slots, admission counts and push counts came along
        restored = c.lookup(var_name, probe)
    with LocalCluster(1) as one, psclient.PSClient(one.addresses, "ref", timeout=TIMEOUT_S) as c:
        c.create_embedding(var_name, None, 4, **kw)
        _pushes(c, var_name, range(10))
        np.testing.assert_array_equal(restored, c.lookup(var_name, probe))


def test_a_backup_holds_the_same_rows_after_kill_9_of_the_primary() -> None:
    kw: dict[str, Any] = {
        "optimizer": psclient.Adagrad(0.5),
        "capacity": 24,
        "min_count": 2,
        "ttl_seconds": 0.3,
    }
    rng = np.random.default_rng(0)
    pushes = [psclient.Rows(rng.integers(0, 60, 10), np.full((10, 2), 0.5, np.float32)) for _ in range(40)]
    probe = np.arange(60)
    with LocalCluster(2) as primary, backups_of(primary, ["--serve-alone"]) as backup:
        addresses = [f"{p}|{b}" for p, b in zip(primary.addresses, backup.addresses, strict=True)]
        with psclient.PSClient(addresses, "w0", timeout=TIMEOUT_S) as c:
            c.create_embedding("t", None, 2, **kw)
            for i, rows in enumerate(pushes):
                c.push({"t": rows})
                if i % 10 == 9:
                    time.sleep(0.4)  # every row outlives its TTL (by the primary's clock, replayed as is)
            before, stats = c.lookup("t", probe), table_stats(c, "t")
            assert stats["expired"] > 0 and stats["evicted"] > 0 and stats["dropped_updates"] > 0
            primary.kill_shard(0)
            primary.kill_shard(1)
            np.testing.assert_array_equal(c.lookup("t", probe), before)  # served by the promoted backups
            after = table_stats(c, "t")
            assert (after["rows"], after["admitted"], after["evicted"], after["expired"]) == (
                stats["rows"], stats["admitted"], stats["evicted"], stats["expired"],
            )  # fmt: skip
