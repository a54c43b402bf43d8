"""Integration: the client API against real psserver processes (exact arithmetic, discovery, dtypes)."""

from __future__ import annotations

import numpy as np
import pytest

import psclient
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(60)


def test_ps_sgd_arithmetic_is_exact(client: psclient.PSClient, var_name: str) -> None:
    w0 = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert client.create(var_name, w0, optimizer=psclient.SGD(learning_rate=0.5)) is True
    grads = [np.full((3, 4), 2, np.float32), np.arange(12, dtype=np.float32).reshape(3, 4)]
    for g in grads:
        assert client.push({var_name: g}) is True
    expected = w0 - np.float32(0.5) * grads[0] - np.float32(0.5) * grads[1]
    np.testing.assert_array_equal(client.pull([var_name])[var_name], expected)


def test_ps_sgd_momentum_matches_the_keras_rule(client: psclient.PSClient, var_name: str) -> None:
    client.create(var_name, np.zeros(3, np.float32), optimizer=psclient.SGD(learning_rate=0.5, momentum=0.5))
    g = np.ones(3, np.float32)
    client.push({var_name: g})  # m = -0.5, w = -0.5
    client.push({var_name: g})  # m = 0.5 * -0.5 - 0.5 = -0.75, w = -1.25
    np.testing.assert_array_equal(client.pull([var_name])[var_name], -1.25)


def test_ps_push_pull_returns_updated_values(client: psclient.PSClient, var_name: str) -> None:
    a, b = f"{var_name}/a", f"{var_name}/b"
    client.create_many(
        {a: np.ones(4, np.float32), b: np.zeros((2, 2), np.float64)}, optimizer=psclient.SGD(1.0)
    )
    new = client.push_pull({a: np.full(4, 3, np.float32)})
    assert set(new) == {a}
    np.testing.assert_array_equal(new[a], -2)
    new = client.push_pull({a: np.ones(4, np.float32), b: np.ones((2, 2), np.float64)})
    np.testing.assert_array_equal(new[a], -3)
    np.testing.assert_array_equal(new[b], -1)
    assert new[b].dtype == np.float64 and new[b].shape == (2, 2)


def test_ps_pull_with_versions_increments(client: psclient.PSClient, var_name: str) -> None:
    client.create(var_name, np.zeros(2, np.float32))
    _, versions = client.pull_with_versions([var_name])
    assert versions == {var_name: 0}
    for i in range(1, 4):
        client.push({var_name: np.ones(2, np.float32)})
        _, versions = client.pull_with_versions([var_name])
        assert versions == {var_name: i}


def test_ps_pull_with_versions_of_a_partitioned_variable_is_keyed_by_its_name(
    cluster: LocalCluster, var_name: str
) -> None:
    with psclient.PSClient(cluster.addresses, partition_bytes=1024) as c:
        c.create(var_name, np.zeros((32, 16), np.float32), optimizer=psclient.SGD(1.0))
        assert len(c._async.registry.pieces[var_name]) == 2  # 2 KiB over 1 KiB partitions, one per shard
        c.push({var_name: np.ones((32, 16), np.float32)})
        values, versions = c.pull_with_versions([var_name])
    np.testing.assert_array_equal(values[var_name], -1)
    assert versions == {var_name: 1}


def test_ps_create_is_idempotent_for_an_equal_spec(client: psclient.PSClient, var_name: str) -> None:
    opt = psclient.Adam(learning_rate=1e-3)
    assert client.create(var_name, np.zeros((2, 3), np.float32), optimizer=opt) is True
    client.push({var_name: np.ones((2, 3), np.float32)})
    value = client.pull([var_name])[var_name]
    assert client.create(var_name, np.zeros((2, 3), np.float32), optimizer=psclient.Adam(1e-3)) is False
    np.testing.assert_array_equal(client.pull([var_name])[var_name], value)  # the existing value wins


@pytest.mark.parametrize(
    ("value", "optimizer"),
    [
        (np.zeros((3, 2), np.float32), psclient.Adam(1e-3)),
        (np.zeros((2, 3), np.float64), psclient.Adam(1e-3)),
        (np.zeros((2, 3), np.float32), psclient.Adam(1e-2)),
        (np.zeros((2, 3), np.float32), psclient.SGD(1e-3)),
    ],
    ids=["shape", "dtype", "learning-rate", "optimizer"],
)
def test_ps_create_with_a_different_spec_raises_already_exists(
    cluster: LocalCluster, var_name: str, value: np.ndarray, optimizer: psclient.Optimizer
) -> None:
    with psclient.PSClient(cluster.addresses) as first:
        first.create(var_name, np.zeros((2, 3), np.float32), optimizer=psclient.Adam(1e-3))
    for c in (psclient.PSClient(cluster.addresses),):  # a fresh client knows nothing but the shards
        with c, pytest.raises(psclient.AlreadyExistsError, match=var_name):
            c.create(var_name, value, optimizer=optimizer)


def test_ps_two_clients_see_the_same_values(cluster: LocalCluster, var_name: str) -> None:
    with (
        psclient.PSClient(cluster.addresses, worker_id="a") as a,
        psclient.PSClient(cluster.addresses, worker_id="b") as b,
    ):
        a.create(var_name, np.zeros(5, np.float32), optimizer=psclient.SGD(1.0))
        a.push({var_name: np.ones(5, np.float32)})
        b.push({var_name: np.ones(5, np.float32)})  # b learns the variable from the shards
        va, vb = a.pull([var_name])[var_name], b.pull([var_name])[var_name]
        np.testing.assert_array_equal(va, -2)
        np.testing.assert_array_equal(va, vb)


def test_ps_discovery_pulls_variables_created_by_someone_else(cluster: LocalCluster, var_name: str) -> None:
    names = [f"{var_name}/{i}" for i in range(6)]
    with psclient.PSClient(cluster.addresses) as creator:
        creator.create_many({n: np.full((i + 1, 3), i, np.float32) for i, n in enumerate(names)})
    with psclient.PSClient(cluster.addresses) as evaluator:
        by_name = evaluator.pull(names)
        everything = evaluator.pull()
        info = evaluator.list_variables(names)
    for i, n in enumerate(names):
        np.testing.assert_array_equal(by_name[n], np.full((i + 1, 3), i, np.float32))
        np.testing.assert_array_equal(everything[n], by_name[n])
    assert set(info) == set(names)


def test_ps_pull_without_names_returns_every_variable_on_the_shards(
    cluster: LocalCluster, var_name: str
) -> None:
    mine, theirs = f"{var_name}/mine", f"{var_name}/theirs"
    with psclient.PSClient(cluster.addresses) as a, psclient.PSClient(cluster.addresses) as b:
        a.create(mine, np.zeros(2, np.float32))
        assert mine in a.pull()
        b.create(theirs, np.ones(2, np.float32))  # after a's first pull(): a must still see it
        for c in (a, b):
            everything = c.pull()
            assert {mine, theirs} <= set(everything)
            np.testing.assert_array_equal(everything[theirs], 1)


def test_ps_variables_spread_over_both_shards(client: psclient.PSClient, var_name: str) -> None:
    names = [f"{var_name}/{i}" for i in range(8)]
    client.create_many({n: np.zeros(64, np.float32) for n in names})
    info = client.list_variables(names)
    shards = {client._async.registry.pieces[n][0].shard for n in names}
    assert set(info) == set(names) and shards == {0, 1}


def test_ps_zero_element_variable_and_scalar(client: psclient.PSClient, var_name: str) -> None:
    empty, scalar = f"{var_name}/empty", f"{var_name}/scalar"
    client.create_many(
        {empty: np.zeros((0, 7), np.float32), scalar: np.float32(3.0)}, optimizer=psclient.SGD(1.0)
    )
    out = client.push_pull({empty: np.zeros((0, 7), np.float32), scalar: np.float32(0.5)})
    assert out[empty].shape == (0, 7) and out[empty].dtype == np.float32
    assert out[scalar].shape == () and out[scalar] == 2.5
    values, versions = client.pull_with_versions([empty, scalar])
    assert values[scalar].shape == () and values[scalar] == 2.5
    assert values[empty].shape == (0, 7)
    assert versions == {empty: 1, scalar: 1}


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_ps_float16_and_float64_variables(client: psclient.PSClient, var_name: str, dtype: str) -> None:
    client.create(var_name, np.full(6, 1.5, dtype), optimizer=psclient.SGD(learning_rate=0.5))
    out = client.push_pull({var_name: np.ones(6, dtype)})
    assert out[var_name].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out[var_name], 1.0)


def test_ps_int32_variable_pulls_but_push_is_invalid(client: psclient.PSClient, var_name: str) -> None:
    client.create(var_name, np.arange(5, dtype=np.int32))
    pulled = client.pull([var_name])[var_name]
    assert pulled.dtype == np.int32
    np.testing.assert_array_equal(pulled, np.arange(5))
    with pytest.raises(psclient.InvalidArgumentError, match=var_name):
        client.push({var_name: np.ones(5, np.int32)})
    np.testing.assert_array_equal(client.pull([var_name])[var_name], np.arange(5))


def test_ps_client_is_a_context_manager_and_close_is_idempotent(cluster: LocalCluster, var_name: str) -> None:
    with psclient.PSClient(cluster.addresses, worker_id="ctx") as c:
        c.create(var_name, np.zeros(1, np.float32))
        assert c.worker_id == "ctx" and c.num_shards == 2
    c.close()
    with pytest.raises(RuntimeError):
        c.pull([var_name])


def test_ps_push_pull_future_overlaps_and_refuses_after_close(cluster: LocalCluster, var_name: str) -> None:
    with psclient.PSClient(cluster.addresses, worker_id="fut") as c:
        c.create(var_name, np.zeros(3, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        g = np.ones(3, np.float32)
        first, second = c.push_pull_future({var_name: g}), c.push_pull_future({var_name: g})
        results = [f.result(c.wait_timeout)[var_name] for f in (first, second)]
        assert sorted(float(r[0]) for r in results) == [-2.0, -1.0]  # both applied, in some order
        np.testing.assert_array_equal(c.pull([var_name])[var_name], np.full(3, -2, np.float32))
    with pytest.raises(RuntimeError):
        c.push_pull_future({var_name: g})


@pytest.mark.timeout(30)
async def test_ps_async_client_directly(cluster: LocalCluster, var_name: str) -> None:
    async with psclient.AsyncPSClient(cluster.addresses, worker_id="async-w") as c:
        assert await c.create(var_name, np.zeros((2, 2), np.float32), optimizer=psclient.SGD(0.25)) is True
        assert await c.push({var_name: np.full((2, 2), 4, np.float32)}) is True
        new = await c.push_pull({var_name: np.full((2, 2), 4, np.float32)})
        np.testing.assert_array_equal(new[var_name], -2)
        values, versions = await c.pull_with_versions([var_name])
        np.testing.assert_array_equal(values[var_name], -2)
        assert versions == {var_name: 2}
        with pytest.raises(psclient.NotFoundError):
            await c.pull([f"{var_name}/missing"])


@pytest.mark.timeout(30)
async def test_ps_async_client_fixture_concurrent_pushes(
    async_client: psclient.AsyncPSClient, var_name: str
) -> None:
    import asyncio

    await async_client.create(var_name, np.zeros(3, np.float32), optimizer=psclient.SGD(1.0))
    await asyncio.gather(*(async_client.push({var_name: np.ones(3, np.float32)}) for _ in range(20)))
    values, versions = await async_client.pull_with_versions([var_name])
    np.testing.assert_array_equal(values[var_name], -20)
    assert versions[var_name] == 20


def test_ps_pull_ema_reads_the_moving_averages(cluster: LocalCluster, var_name: str) -> None:
    # SGD lr 1, gradients of ones, momentum 0.5: values -1, -2; averages -1 (the first update), -1.5.
    ema = psclient.SGD(1.0, use_ema=True, ema_momentum=0.5)
    split, big, plain, table = (f"{var_name}/{k}" for k in ("split", "big", "plain", "table"))
    values = {split: np.zeros((32, 16), np.float32), big: np.zeros((256, 512), np.float32)}
    with psclient.PSClient(cluster.addresses, partition_bytes=1024, data_port_min_bytes=64 << 10) as c:
        c.create_many(values, optimizer=ema)  # split: in partitions; big: pulled over the data port
        c.create(plain, np.zeros(3, np.float32), optimizer=psclient.SGD(1.0))
        c.create_embedding(table, 10, 4, optimizer=ema, initializer="zeros")
        assert len(c.list_variables([split])[split]) > 1
        for _ in range(2):
            c.push({split: np.ones((32, 16), np.float32), big: np.ones((256, 512), np.float32)})
            c.push({table: psclient.Rows(np.array([3, 4]), np.ones((2, 4), np.float32))})
        averages, versions = c.pull_with_versions([split, big, table], ema=True)
        np.testing.assert_array_equal(averages[split], np.full((32, 16), -1.5, np.float32))
        np.testing.assert_array_equal(averages[big], np.full((256, 512), -1.5, np.float32))
        expected_rows = np.zeros((10, 4), np.float32)
        expected_rows[[3, 4]] = -1.5  # untouched rows keep their initial value as their average
        np.testing.assert_array_equal(averages[table], expected_rows)
        assert versions[split] == versions[big] == 2
        np.testing.assert_array_equal(c.pull([split])[split], -2)  # the values themselves
        everything = c.pull(ema=True)  # every variable that keeps an average
        assert {split, big, table} <= set(everything) and plain not in everything
        with pytest.raises(psclient.InvalidArgumentError, match=r"keeps no moving average.*use_ema=True"):
            c.pull([plain], ema=True)
