"""Embedding tables with real shard processes: create, lookup, row-sparse pushes, errors, modes."""

from __future__ import annotations

import asyncio
import multiprocessing
import tracemalloc
from typing import Any

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from psclient import _tables
from pscore.embedding import init_rows
from trainer.cluster import LocalCluster, backups_of

pytestmark = [pytest.mark.timeout(180)]


def test_create_embedding_then_lookup_is_exact(client: psclient.PSClient, var_name: str) -> None:
    assert client.create_embedding(var_name, 11, 3, initializer=("uniform", -1.0, 1.0)) is True
    expected = init_rows(var_name, np.arange(11), 3, np.float32, ("uniform", -1.0, 1.0))
    ids = np.array([[10, 0, 3], [3, 7, 1]], np.int32)
    got = client.lookup(var_name, ids)
    assert got.shape == (2, 3, 3) and got.dtype == np.float32
    np.testing.assert_array_equal(got, expected[ids])
    # Row i on shard i % 2: each shard holds its rows, at local row i // 2.
    pieces = client.list_variables([var_name])[var_name]
    assert sorted((p.spec.name, p.spec.table.rows) for p in pieces) == [
        (f"{var_name}/rows_0", 6),
        (f"{var_name}/rows_1", 5),
    ]
    np.testing.assert_array_equal(client.pull([var_name])[var_name], expected)  # a pull gives the whole table


def test_lookup_of_distinct_ids_is_not_deduplicated_again_and_reads_the_same_rows(
    client: psclient.PSClient, var_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``distinct=True`` (ids from ``tf.unique``, as psclient.keras.Embedding passes them): the client
    skips its own np.unique, and the rows are the same; a repeated id is read twice, still right."""
    client.create_embedding(var_name, 11, 3, initializer=("uniform", -1.0, 1.0))
    expected = init_rows(var_name, np.arange(11), 3, np.float32, ("uniform", -1.0, 1.0))
    calls = []
    unique = _tables._unique_inverse  # the client's np.unique(ids, return_inverse=True)

    def counting_unique(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return unique(*args, **kwargs)

    monkeypatch.setattr(_tables, "_unique_inverse", counting_unique)
    ids = np.array([10, 0, 3, 7], np.int64)  # distinct, not sorted: tf.unique's order
    np.testing.assert_array_equal(client.lookup(var_name, ids, distinct=True), expected[ids])
    assert calls == []
    np.testing.assert_array_equal(client.lookup(var_name, ids), expected[ids])
    assert len(calls) == 1  # the default deduplicates
    twice = np.array([[3, 3], [10, 3]])
    np.testing.assert_array_equal(client.lookup(var_name, twice, distinct=True), expected[twice])
    np.testing.assert_array_equal(
        client.lookup_future(var_name, ids, distinct=True).result(TIMEOUT_S), expected[ids]
    )
    _, rows = client.push_pull_lookup({}, {var_name: ids}, distinct=True)
    np.testing.assert_array_equal(rows[var_name], expected[ids])
    _, rows = client.push_pull_lookup_future({}, {var_name: twice}, distinct=True).result(TIMEOUT_S)
    np.testing.assert_array_equal(rows[var_name], expected[twice])


def test_create_embedding_is_idempotent_and_refuses_another_spec(
    client: psclient.PSClient, var_name: str
) -> None:
    assert client.create_embedding(var_name, 5, 2, initializer="zeros") is True
    with psclient.PSClient(client.config.addresses, "other", timeout=TIMEOUT_S) as other:
        assert other.create_embedding(var_name, 5, 2, initializer="zeros") is False
        with pytest.raises(psclient.AlreadyExistsError, match="different spec"):
            other.create_embedding(var_name, 5, 3)
        with pytest.raises(psclient.AlreadyExistsError, match="different spec"):
            other.create_embedding(var_name, 5, 2, optimizer=psclient.Adagrad())


def test_a_table_bigger_than_a_message_is_created_in_chunks(make_cluster: Any, var_name: str) -> None:
    cluster = make_cluster(num_shards=2)
    with psclient.PSClient(cluster.addresses, timeout=TIMEOUT_S, chunk_bytes=64 << 10) as c:
        rows, dim = 3000, 64  # 768 KiB: many 64 KiB chunks per shard
        c.create_embedding(var_name, rows, dim, initializer=("normal", 1.0))
        ids = np.arange(rows)
        np.testing.assert_array_equal(
            c.lookup(var_name, ids), init_rows(var_name, ids, dim, np.float32, ("normal", 1.0))
        )


def test_the_shards_make_a_named_initializers_rows_and_the_client_never_holds_the_table(
    client: psclient.PSClient, var_name: str
) -> None:
    rows, dim = 400_000, 16  # 25.6 MB of rows: once computed and sent by the client
    tracemalloc.start()
    try:
        assert client.create_embedding(var_name, rows, dim, initializer=("normal", 0.1, 2.0)) is True
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"the client allocated {peak} bytes to create the table"
    ids = np.array([0, 1, 7, rows - 2, rows - 1, 123_457])
    expected = init_rows(var_name, ids, dim, np.float32, ("normal", 0.1, 2.0))
    np.testing.assert_array_equal(client.lookup(var_name, ids), expected)
    infos = client.list_variables([var_name])[var_name]
    assert {(i.spec.table.initializer.name, tuple(i.spec.table.initializer.args)) for i in infos} == {
        ("normal", (0.1, 2.0))
    }
    # A callable initializer runs on the client, and its rows are sent.
    assert client.create_embedding(var_name + "c", 7, 2, initializer=_row_id_initializer) is True
    np.testing.assert_array_equal(client.lookup(var_name + "c", [6, 1]), [[6, 6], [1, 1]])


def _row_id_initializer(ids: np.ndarray, dim: int, dtype: np.dtype) -> np.ndarray:
    return np.repeat(ids[:, None], dim, axis=1).astype(dtype)


def test_a_create_with_rows_and_an_initializer_is_refused(
    client: psclient.PSClient, raw_stubs: list[Any], var_name: str
) -> None:
    import grpc

    from pscore import codec
    from psproto.v1 import ps_pb2

    spec = ps_pb2.VariableSpec(
        name=f"{var_name}/rows_0",
        dtype=ps_pb2.DTYPE_FLOAT32,
        shape=[1, 2],
        optimizer=psclient.SGD().to_proto(),
        table=ps_pb2.TableRows(
            table=var_name, num_rows=1, dim=2, index=0, count=2, rows=1, initializer=ps_pb2.RowInitializer()
        ),
    )
    value = codec.encode(spec.name, np.zeros((1, 2), np.float32))
    request = ps_pb2.CreateVariablesRequest(variables=[spec], values=[value])
    with pytest.raises(grpc.RpcError) as err:
        raw_stubs[0].CreateVariables(iter([request]), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a value was sent, but its spec names an initializer" in err.value.details()
    assert not client.list_variables([var_name])


def test_duplicate_ids_are_summed_and_push_pull_returns_the_rows(
    client: psclient.PSClient, var_name: str
) -> None:
    client.create_embedding(var_name, 10, 2, optimizer=psclient.SGD(0.5), initializer="zeros")
    grads = np.array([[1, 2], [10, 20], [100, 200], [1000, 2000]], np.float32)
    new = client.push_pull({var_name: psclient.Rows(np.array([3, 4, 3, 9]), grads)})
    rows = new[var_name]
    assert isinstance(rows, psclient.Rows)
    np.testing.assert_array_equal(rows.ids, [3, 4, 9])
    expected = -0.5 * np.array([[101, 202], [10, 20], [1000, 2000]], np.float32)
    np.testing.assert_array_equal(rows.values, expected)
    table = client.lookup(var_name, np.arange(10))
    np.testing.assert_array_equal(table[[3, 4, 9]], expected)
    assert not table[[0, 1, 2, 5, 6, 7, 8]].any()  # untouched rows stay


@pytest.mark.parametrize(
    "options",
    # 1 KiB: each shard's push (2 x 7 rows of 128 B, and w) goes as a PushStream; or over the data port.
    [{"data_port": False}, {"data_port": False, "unary_max_bytes": 1024}, {"data_port_min_bytes": 0}],
    ids=["unary", "stream", "data-port"],
)
def test_push_pull_returns_only_the_rows_asked_for(
    cluster: Any, var_name: str, options: dict[str, Any]
) -> None:
    with psclient.PSClient(cluster.addresses, timeout=TIMEOUT_S, **options) as c:
        a, b, w = var_name + "a", var_name + "b", var_name + "w"
        c.create_embedding(a, 40, 32, optimizer=psclient.SGD(1.0), initializer="zeros")
        c.create_embedding(b, 40, 32, optimizer=psclient.SGD(1.0), initializer="zeros")
        c.create(w, np.zeros(3, np.float32), optimizer=psclient.SGD(1.0))
        ids = np.arange(0, 40, 3)
        ones = np.ones((ids.size, 32), np.float32)

        def grads() -> dict[str, Any]:
            return {a: psclient.Rows(ids, ones), b: psclient.Rows(ids, ones), w: np.ones(3, np.float32)}

        new = c.push_pull(grads(), return_rows=False)
        assert set(new) == {w}
        np.testing.assert_array_equal(new[w], [-1, -1, -1])
        new = c.push_pull(grads(), return_rows=[b])
        assert set(new) == {w, b}
        np.testing.assert_array_equal(new[b].ids, ids)
        np.testing.assert_array_equal(new[b].values, np.full((ids.size, 32), -2, np.float32))
        assert set(c.push_pull(grads(), return_rows=True)) == {w, a, b}
        for table in (a, b):  # every push was applied, returned or not
            np.testing.assert_array_equal(c.lookup(table, ids), np.full((ids.size, 32), -3, np.float32))


@pytest.mark.parametrize(
    "options",
    [{"data_port": False}, {"data_port": False, "unary_max_bytes": 1024}, {"data_port_min_bytes": 0}],
    ids=["unary", "stream", "data-port"],
)
def test_push_pull_lookup_reads_other_rows_after_the_push_in_one_exchange(
    cluster: Any, var_name: str, options: dict[str, Any]
) -> None:
    with psclient.PSClient(cluster.addresses, timeout=TIMEOUT_S, **options) as c:
        t, w = var_name + "t", var_name + "w"
        c.create_embedding(t, 40, 32, optimizer=psclient.SGD(1.0), initializer="zeros")
        c.create(w, np.zeros(3, np.float32), optimizer=psclient.SGD(1.0))
        pushed = np.arange(1, 40, 2)  # odd ids: all on shard 1
        grads = {t: psclient.Rows(pushed, np.ones((pushed.size, 32), np.float32)), w: np.ones(3, np.float32)}
        nxt = np.array([[3, 4], [0, 3]])  # shard 1 reads with the push; shard 0 (4, 0) by a Lookup
        values, rows = c.push_pull_lookup(grads, {t: nxt}, return_rows=False)
        assert set(values) == {w} and set(rows) == {t}
        np.testing.assert_array_equal(values[w], [-1, -1, -1])
        assert rows[t].shape == (2, 2, 32) and rows[t].dtype == np.float32
        np.testing.assert_array_equal(rows[t][..., 0], [[-1, 0], [0, -1]])  # after this very push
        values, rows = c.push_pull_lookup(grads, {t: [3]})  # with return_rows: both
        assert set(values) == {w, t}
        np.testing.assert_array_equal(rows[t], np.full((1, 32), -2, np.float32))
        np.testing.assert_array_equal(values[t].values, np.full((pushed.size, 32), -2, np.float32))
        # A bad id to read refuses the whole push: nothing applied anywhere.
        with pytest.raises(psclient.InvalidArgumentError, match=rf"table '{t}': id 40 is out of range"):
            c.push_pull_lookup(grads, {t: [2, 40]})
        with pytest.raises(psclient.NotFoundError):
            c.push_pull_lookup(grads, {var_name + "nope": [2]})
        np.testing.assert_array_equal(c.pull([w])[w], [-2, -2, -2])
        np.testing.assert_array_equal(c.lookup(t, [3]), np.full((1, 32), -2, np.float32))


def test_a_shard_checks_a_pushs_lookup_ids_before_it_applies_anything(
    client: psclient.PSClient, raw_stubs: list[Any], var_name: str
) -> None:
    import grpc

    from pscore import codec, embedding
    from psproto.v1 import ps_pb2

    client.create_embedding(var_name, 4, 2, optimizer=psclient.SGD(1.0), initializer="zeros")
    piece = f"{var_name}/rows_0"  # ids 0, 2 on shard 0
    grads = [codec.encode(embedding.ids_name(piece), np.array([2])),
             codec.encode(embedding.values_name(piece), np.ones((1, 2), np.float32))]  # fmt: skip

    def request(seq: int, ids: list[int]) -> ps_pb2.PushRequest:
        return ps_pb2.PushRequest(
            worker_id="raw-lookup", seq=seq, grads=grads, lookup_ids=[codec.encode(piece, np.array(ids))]
        )

    for bad in ([1], [6], [-2]):  # another shard's row, out of range
        with pytest.raises(grpc.RpcError) as err:
            raw_stubs[0].Push(request(1, bad), timeout=TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"id {bad[0]}" in err.value.details()
    np.testing.assert_array_equal(client.lookup(var_name, [2]), [[0, 0]])  # nothing applied
    resp = raw_stubs[0].Push(request(1, [2, 0, 2]), timeout=TIMEOUT_S)
    assert resp.applied and [c.name for c in resp.values] == [embedding.lookup_name(piece)]
    np.testing.assert_array_equal(codec.decode(resp.values[0]), [[-1, -1], [0, 0], [-1, -1]])
    again = raw_stubs[0].Push(request(1, [2]), timeout=TIMEOUT_S)  # a retry: not applied twice, rows read
    assert not again.applied and again.reason == "duplicate"
    np.testing.assert_array_equal(codec.decode(again.values[0]), [[-1, -1]])


def test_a_shard_omits_the_values_a_push_names_in_omit_values(
    client: psclient.PSClient, raw_stubs: list[Any], var_name: str
) -> None:
    from pscore import codec, embedding
    from psproto.v1 import ps_pb2

    a, b = var_name + "a", var_name + "b"
    for table in (a, b):
        client.create_embedding(table, 4, 2, optimizer=psclient.SGD(1.0), initializer="zeros")
    pieces = [f"{table}/rows_0" for table in (a, b)]
    grads = [
        codec.encode(name(p), arr)
        for p in pieces
        for name, arr in (
            (embedding.ids_name, np.array([2])),
            (embedding.values_name, np.ones((1, 2), np.float32)),
        )
    ]

    def request(seq: int) -> ps_pb2.PushRequest:
        return ps_pb2.PushRequest(
            worker_id="raw", seq=seq, session=7, grads=grads, return_values=True, omit_values=[pieces[0]]
        )

    unary = raw_stubs[0].Push(request(1), timeout=TIMEOUT_S)
    streamed = list(raw_stubs[0].PushStream(iter([request(2)]), timeout=TIMEOUT_S))
    for values in (unary.values, [c for r in streamed for c in r.values]):
        assert {c.name for c in values} == {embedding.ids_name(pieces[1]), embedding.values_name(pieces[1])}
    for table in (a, b):  # both pushes applied to both tables
        np.testing.assert_array_equal(client.lookup(table, [2]), [[-2, -2]])


def test_dense_and_row_gradients_in_one_push(client: psclient.PSClient, var_name: str) -> None:
    client.create_embedding(var_name + "e", 4, 2, optimizer=psclient.SGD(1.0), initializer="ones")
    client.create(var_name + "w", np.zeros(3, np.float32), optimizer=psclient.SGD(1.0))
    grads = {
        var_name + "w": np.ones(3, np.float32),
        var_name + "e": psclient.Rows([1], np.ones((1, 2), np.float32)),
    }
    new = client.push_pull(grads)
    np.testing.assert_array_equal(new[var_name + "w"], -np.ones(3, np.float32))
    np.testing.assert_array_equal(new[var_name + "e"].values, np.zeros((1, 2), np.float32))
    np.testing.assert_array_equal(client.lookup(var_name + "e", [0, 1]), [[1, 1], [0, 0]])


def test_adagrad_rows_match_the_dense_rule(client: psclient.PSClient, var_name: str) -> None:
    client.create_embedding(var_name, 6, 2, optimizer=psclient.Adagrad(0.1), initializer="ones")
    for _ in range(3):
        client.push({var_name: psclient.Rows([2, 5], np.full((2, 2), 0.5, np.float32))})
    acc = np.float32(0.1)  # Keras's initial_accumulator_value
    value = np.float32(1.0)
    for _ in range(3):
        acc = acc + np.float32(0.25)
        value = value - np.float32(0.1) * np.float32(0.5) / np.sqrt(acc + np.float32(1e-7))
    table = client.lookup(var_name, np.arange(6))
    np.testing.assert_allclose(table[[2, 5]], np.full((2, 2), value), rtol=1e-6)
    np.testing.assert_array_equal(table[[0, 1, 3, 4]], np.ones((4, 2), np.float32))


def _pusher(addresses: list[str], name: str, worker: int, pushes: int) -> None:
    with psclient.PSClient(addresses, f"w{worker}", timeout=TIMEOUT_S) as c:
        for i in range(pushes):
            ids = np.array([i % 7, (i + worker) % 7, 3, 3])  # overlapping rows, and duplicates
            c.push({name: psclient.Rows(ids, np.ones((4, 3), np.float32))})


def test_concurrent_row_pushes_from_processes_give_the_exact_total(
    cluster: LocalCluster, var_name: str
) -> None:
    workers, pushes = 4, 50
    with psclient.PSClient(cluster.addresses, "init", timeout=TIMEOUT_S) as c:
        c.create_embedding(var_name, 7, 3, optimizer=psclient.SGD(1.0), initializer="zeros")
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_pusher, args=(cluster.addresses, var_name, w, pushes)) for w in range(workers)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * workers
        expected = np.zeros(7)
        for w in range(workers):
            for i in range(pushes):
                for r in (i % 7, (i + w) % 7, 3, 3):
                    expected[r] += 1
        np.testing.assert_array_equal(
            c.lookup(var_name, np.arange(7)), -np.repeat(expected[:, None], 3, axis=1)
        )


@pytest.mark.parametrize(
    ("ids", "values", "message"),
    [
        ([1, 10], np.ones((2, 2)), "id 10 is out of range"),
        ([-3, 1], np.ones((2, 2)), "id -3 is out of range"),
        ([1.0, 2.0], np.ones((2, 2)), "not an integer"),
        ([1, 2], np.ones((2, 3)), r"must have shape \(2, 2\)"),
        ([1, 2], np.ones((3, 2)), r"must have shape \(2, 2\)"),
    ],
)
def test_bad_row_gradients_are_refused_and_change_nothing(
    client: psclient.PSClient, var_name: str, ids: Any, values: np.ndarray, message: str
) -> None:
    client.create_embedding(var_name, 10, 2, initializer="ones")
    w = var_name + "_w"
    client.create(w, np.zeros(2, np.float32), optimizer=psclient.SGD(1.0))
    with pytest.raises(psclient.InvalidArgumentError, match=message) as err:
        client.push({w: np.ones(2, np.float32), var_name: psclient.Rows(ids, values)})
    assert var_name in str(err.value)
    np.testing.assert_array_equal(client.lookup(var_name, np.arange(10)), np.ones((10, 2)))
    np.testing.assert_array_equal(client.pull([w])[w], np.zeros(2))
    with pytest.raises(psclient.InvalidArgumentError, match=f"{var_name}.*id 12 is out of range"):
        client.lookup(var_name, [3, 12, 11])
    with pytest.raises(psclient.InvalidArgumentError, match="not an integer"):
        client.lookup(var_name, [0.5])
    with pytest.raises(psclient.InvalidArgumentError, match=r"push psclient\.Rows"):
        client.push({var_name: np.ones((10, 2), np.float32)})
    with pytest.raises(psclient.InvalidArgumentError, match="not an embedding table"):
        client.push({w: psclient.Rows([0], np.ones((1, 2), np.float32))})


def _sync_args(n: int, m: int) -> list[str]:
    return [
        "--mode",
        "sync",
        "--replicas-to-aggregate",
        str(n),
        "--total-replicas",
        str(m),
        "--barrier-timeout",
        "20",
    ]


async def test_sync_mode_applies_the_mean_of_the_workers_rows(make_cluster: Any, var_name: str) -> None:
    cluster = make_cluster(num_shards=2, server_args=_sync_args(2, 2))
    async with (
        psclient.AsyncPSClient(cluster.addresses, "w0", timeout=TIMEOUT_S) as w0,
        psclient.AsyncPSClient(cluster.addresses, "w1", timeout=TIMEOUT_S) as w1,
    ):
        await w0.create_embedding(var_name, 5, 2, optimizer=psclient.SGD(1.0), initializer="zeros")
        a = np.array([[2, 2], [4, 4]], np.float32)  # w0: rows 0 and 2 (both on shard 0)
        b = np.array([[6, 6], [8, 8], [10, 10]], np.float32)  # w1: rows 1, 2, 2
        applied = await asyncio.gather(
            w0.push({var_name: psclient.Rows([0, 2], a)}, step=0),
            w1.push({var_name: psclient.Rows([1, 2, 2], b)}, step=0),
        )
        assert applied == [True, True]
        table = await w0.lookup(var_name, np.arange(5))
        # A row a worker did not push counts as zero in the mean (row 1 on shard 1: w0 sent it no rows).
        np.testing.assert_array_equal(table, -np.array([[1, 1], [3, 3], [11, 11], [0, 0], [0, 0]]))


def _adam_pushes(c: psclient.PSClient, name: str, steps: range) -> None:
    for i in steps:
        rng = np.random.default_rng(i)
        ids = rng.integers(0, 9, size=6)
        c.push({name: psclient.Rows(ids, rng.standard_normal((6, 4)).astype(np.float32))})


def test_a_table_checkpoint_restores_into_another_shard_count(tmp_path: Any, var_name: str) -> None:
    args = ["--checkpoint-dir", str(tmp_path)]
    opt = psclient.Adam(0.1)
    with LocalCluster(2, args) as two:
        with psclient.PSClient(two.addresses, "w0", timeout=TIMEOUT_S) as c:
            c.create_embedding(var_name, 9, 4, optimizer=opt)
            _adam_pushes(c, var_name, range(5))
            before = c.lookup(var_name, np.arange(9))
        assert two.stop() == [0, 0]  # SIGTERM: final checkpoints
    with LocalCluster(3, args) as three, psclient.PSClient(three.addresses, "w1", timeout=TIMEOUT_S) as c:
        np.testing.assert_array_equal(c.lookup(var_name, np.arange(9)), before)
        pieces = c.list_variables([var_name])[var_name]
        assert sorted(p.spec.table.rows for p in pieces) == [3, 3, 3]
        _adam_pushes(c, var_name, range(5, 8))  # the slots came along: same as an uninterrupted run
        restored = c.lookup(var_name, np.arange(9))
    with LocalCluster(1) as one, psclient.PSClient(one.addresses, "ref", timeout=TIMEOUT_S) as c:
        c.create_embedding(var_name, 9, 4, optimizer=opt)
        _adam_pushes(c, var_name, range(8))
        np.testing.assert_array_equal(restored, c.lookup(var_name, np.arange(9)))


def test_row_pushes_survive_kill_9_of_the_primary() -> None:
    with LocalCluster(1) as primary, backups_of(primary, ["--serve-alone"]) as backup:
        addresses = [f"{primary.addresses[0]}|{backup.addresses[0]}"]
        with psclient.PSClient(addresses, "w0", timeout=TIMEOUT_S) as c:
            c.create_embedding("t", 6, 2, optimizer=psclient.Adagrad(0.5), initializer="ones")
            rows = [psclient.Rows([i % 6, 5, 5], np.full((3, 2), 0.5, np.float32)) for i in range(30)]
            for r in rows[:15]:
                c.push({"t": r})
            primary.kill_shard(0)
            for r in rows[15:]:
                c.push({"t": r})  # fails over to the backup, which replayed every row push
            got = c.lookup("t", np.arange(6))
        with LocalCluster(1) as ref, psclient.PSClient(ref.addresses, "ref", timeout=TIMEOUT_S) as r:
            r.create_embedding("t", 6, 2, optimizer=psclient.Adagrad(0.5), initializer="ones")
            for g in rows:
                r.push({"t": g})
            np.testing.assert_array_equal(got, r.lookup("t", np.arange(6)))


def test_a_shard_refuses_a_lookup_of_rows_it_does_not_hold(
    client: psclient.PSClient, raw_stubs: list[Any], var_name: str
) -> None:
    import grpc

    from pscore import codec
    from psproto.v1 import ps_pb2

    client.create_embedding(var_name, 6, 2)
    request = ps_pb2.LookupRequest(
        ids=[codec.encode(f"{var_name}/rows_0", np.array([2, 3]))], worker_id="raw"
    )
    with pytest.raises(grpc.RpcError) as err:
        raw_stubs[0].Lookup(request, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"table {var_name!r}: id 3 is held by shard 1" in err.value.details()
    ok = ps_pb2.LookupRequest(ids=[codec.encode(f"{var_name}/rows_0", np.array([4, 0]))], worker_id="raw")
    rows = codec.decode(raw_stubs[0].Lookup(ok, timeout=TIMEOUT_S).values[0])
    np.testing.assert_array_equal(rows, client.lookup(var_name, [4, 0]))


def test_ssp_mode_applies_row_pushes(make_cluster: Any, var_name: str) -> None:
    cluster = make_cluster(
        num_shards=2, server_args=["--mode", "ssp", "--total-replicas", "1", "--staleness", "0"]
    )
    with psclient.PSClient(cluster.addresses, "w0", timeout=TIMEOUT_S) as c:
        c.create_embedding(var_name, 4, 1, optimizer=psclient.SGD(1.0), initializer="zeros")
        for step in range(3):
            new = c.push_pull({var_name: psclient.Rows([step, 3], np.ones((2, 1), np.float32))}, step=step)
            np.testing.assert_array_equal(new[var_name].ids, [step, 3])
        np.testing.assert_array_equal(c.lookup(var_name, np.arange(4), step=3), [[-1], [-1], [-1], [-3]])


@pytest.mark.parametrize("every_row", [False, True])
def test_a_tables_regularizer_runs_on_the_shards(
    client: psclient.PSClient, var_name: str, every_row: bool
) -> None:
    reg = psclient.Regularizer(l1=0.01, l2=0.25, every_row=every_row)
    assert client.create_embedding(
        var_name, 5, 2, initializer="ones", optimizer=psclient.SGD(0.5), regularizer=reg
    )
    client.push({var_name: psclient.Rows(np.array([1, 4]), np.ones((2, 2), np.float32))})
    # hand-computed SGD(0.5) on w = 1: w - 0.5 * (g + 0.01 * sign(w) + 2 * 0.25 * w)
    pushed, untouched = 1 - 0.5 * (1 + 0.01 + 0.5), 1 - 0.5 * (0.01 + 0.5)
    expected = np.ones((5, 2), np.float32)
    expected[[1, 4]] = pushed
    if every_row:
        expected[[0, 2, 3]] = untouched
    np.testing.assert_allclose(client.pull([var_name])[var_name], expected, rtol=1e-6)
    with pytest.raises(psclient.AlreadyExistsError, match="different spec"):
        client.create_embedding(var_name, 5, 2, initializer="ones", optimizer=psclient.SGD(0.5))
    assert (
        client.create_embedding(
            var_name, 5, 2, initializer="ones", optimizer=psclient.SGD(0.5), regularizer=reg
        )
        is False
    )


def test_a_dynamic_tables_regularizer_applies_to_the_pushed_rows(
    client: psclient.PSClient, var_name: str
) -> None:
    with pytest.raises(psclient.InvalidArgumentError, match="every_row is for tables of fixed size"):
        client.create_embedding(var_name, None, 2, regularizer=psclient.Regularizer(l2=0.1, every_row=True))
    reg = psclient.Regularizer(l2=0.25)
    client.create_embedding(
        var_name, None, 2, initializer="ones", optimizer=psclient.SGD(0.5), regularizer=reg
    )
    client.push({var_name: psclient.Rows(np.array([12345]), np.ones((1, 2), np.float32))})
    # the row starts at its initializer's value (1) on its first push: 1 - 0.5 * (1 + 2 * 0.25 * 1)
    np.testing.assert_allclose(client.lookup(var_name, np.array([12345])), [[0.25, 0.25]], rtol=1e-6)
