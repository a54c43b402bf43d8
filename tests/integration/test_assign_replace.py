"""``replace_optimizer`` and ``assign`` with real shard processes (issue 9: transfer learning, EarlyStopping).

A replaced optimizer (any class) starts from fresh slots and a step count of 0,
on every piece of a partitioned variable, after a checkpoint restore and on a
backup; an assignment sets values exactly, keeps the slots and the step count,
is applied at once in sync mode, and reaches a backup; bad input is a typed
error that changes nothing on any shard.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient
from pscore import optimizers as specs
from psserver import optimizers as server
from trainer.cluster import LocalCluster, backups_of

pytestmark = pytest.mark.timeout(180)


def _rand(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _run(value: np.ndarray, grads: list[np.ndarray], opt: specs.Optimizer) -> tuple[np.ndarray, dict]:  # type: ignore[type-arg]
    """What a shard computes for ``grads`` pushed with ``opt`` from fresh slots, steps 0, 1, ..."""
    rule = server.from_config(opt)
    slots = rule.init_slots(value)
    for step, grad in enumerate(grads):
        value = rule.apply(value, grad, slots, step)
    return value, slots


def _info(c: psclient.PSClient, name: str) -> list:  # type: ignore[type-arg]
    return c.list_variables([name])[name]


# -- replace_optimizer ------------------------------------------------------------------


def test_replace_sgd_with_adam_follows_adam_from_fresh_slots(
    client: psclient.PSClient, var_name: str
) -> None:
    shape = (3, 5)
    w0 = _rand(0, shape)
    client.create(var_name, w0, optimizer=psclient.SGD(1.0, momentum=0.9))
    grads = [_rand(i + 1, shape) for i in range(5)]
    for g in grads[:2]:
        client.push({var_name: g})
    w2 = client.pull([var_name])[var_name]
    assert client.replace_optimizer(psclient.Adam(1e-2), [var_name]) == [var_name]
    (info,) = _info(client, var_name)
    assert specs.optimizer_from_proto(info.spec.optimizer) == psclient.Adam(1e-2)
    assert (info.version, info.iterations) == (2, 0)  # the version keeps counting; the step restarts
    client.push({var_name: grads[2]})
    # Adam's first step from zero slots is lr * sign(g) (up to epsilon): not so at step 2, nor with old slots.
    w3 = client.pull([var_name])[var_name]
    np.testing.assert_allclose(w3, w2 - 1e-2 * np.sign(grads[2]), rtol=1e-5, atol=1e-6)
    for g in grads[3:]:
        client.push({var_name: g})
    expected, _ = _run(w2, grads[2:], psclient.Adam(1e-2))
    np.testing.assert_array_equal(client.pull([var_name])[var_name], expected)
    (info,) = _info(client, var_name)
    assert (info.version, info.iterations) == (5, 3)


def test_replace_restarts_a_schedule_and_a_repeat_resets_again(
    client: psclient.PSClient, var_name: str
) -> None:
    w0 = _rand(0, (4,))
    schedule = specs.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    client.create(var_name, w0, optimizer=psclient.Adam(schedule))
    g = _rand(1, (4,))
    client.push({var_name: g})
    client.push({var_name: g})
    new = psclient.SGD(schedule, momentum=0.5)
    client.replace_optimizer(new, [var_name])
    client.replace_optimizer(new, [var_name])  # a retry of the same replacement: resets again
    w = client.pull([var_name])[var_name]
    client.push({var_name: g})
    client.push({var_name: g})
    expected, _ = _run(w, [g, g], new)  # the schedule at steps 0 and 1 again: 0.1, then 0.05
    np.testing.assert_array_equal(client.pull([var_name])[var_name], expected)


def test_replace_on_a_partitioned_variable_changes_every_piece(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(2)
    with psclient.PSClient(cluster.addresses, "w", timeout=TIMEOUT_S, partition_bytes=1024) as c:
        w0 = _rand(0, (1000,))
        c.create("big", w0, optimizer=psclient.SGD(1.0))
        assert {i.spec.name for i in _info(c, "big")} != {"big"}  # cut into pieces
        assert len({i.spec.partition.index for i in _info(c, "big")}) >= 2
        grads = [_rand(i + 1, (1000,)) for i in range(3)]
        c.push({"big": grads[0]})
        assert c.replace_optimizer(psclient.Adam(0.1, amsgrad=True), ["big"]) == ["big"]
        for g in grads[1:]:
            c.push({"big": g})
        infos = _info(c, "big")
        assert all(
            specs.optimizer_from_proto(i.spec.optimizer) == psclient.Adam(0.1, amsgrad=True) for i in infos
        )
        assert all((i.version, i.iterations) == (3, 2) for i in infos)
        expected, _ = _run(w0 - grads[0], grads[1:], psclient.Adam(0.1, amsgrad=True))
        np.testing.assert_array_equal(c.pull(["big"])["big"], expected)
        # Lamb needs the whole variable: refused for a partitioned one, before any shard changes.
        with pytest.raises(psclient.InvalidArgumentError, match="partitions"):
            c.replace_optimizer(psclient.Lamb(0.1), ["big"])
        assert all(
            specs.optimizer_from_proto(i.spec.optimizer) == psclient.Adam(0.1, amsgrad=True)
            for i in _info(c, "big")
        )


def test_a_replacement_survives_a_checkpoint_restore(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w0 = _rand(0, (6,))
    grads = [_rand(i + 1, (6,)) for i in range(3)]
    with LocalCluster(1, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        with psclient.PSClient(cluster.addresses, "w", timeout=TIMEOUT_S) as c:
            c.create("v", w0, optimizer=psclient.SGD(1.0))
            c.push({"v": grads[0]})
            c.replace_optimizer(psclient.Adam(0.01), ["v"])
            c.push({"v": grads[1]})
            c.save_checkpoint()
        port = int(cluster.addresses[0].rpartition(":")[2])
        cluster.kill_shard(0)
        cluster.start_shard(0, port=port)
        with psclient.PSClient(cluster.addresses, "w2", timeout=TIMEOUT_S) as c:
            (info,) = _info(c, "v")
            assert specs.optimizer_from_proto(info.spec.optimizer) == psclient.Adam(0.01)
            assert (info.version, info.iterations) == (2, 1)
            c.push({"v": grads[2]})
            got = c.pull(["v"])["v"]
    expected, _ = _run(w0 - grads[0], grads[1:], psclient.Adam(0.01))
    np.testing.assert_array_equal(got, expected)


def test_bad_replacements_are_typed_errors_and_change_nothing(
    client: psclient.PSClient, var_name: str
) -> None:
    client.create(var_name, np.zeros(3, np.float32), optimizer=psclient.SGD(0.1))
    with pytest.raises(psclient.NotFoundError, match="no_such_variable"):
        client.replace_optimizer(psclient.Adam(), [var_name, "no_such_variable"])
    with pytest.raises(psclient.InvalidArgumentError, match="psclient optimizer"):
        client.replace_optimizer("adam", [var_name])  # type: ignore[arg-type]
    (info,) = _info(client, var_name)
    assert specs.optimizer_from_proto(info.spec.optimizer) == psclient.SGD(0.1)
    assert client.replace_optimizer(psclient.Adam(), []) == []


# -- assign -------------------------------------------------------------------------------


def test_assign_then_pull_gives_the_values_exactly(client: psclient.PSClient, var_name: str) -> None:
    f, i = f"{var_name}f", f"{var_name}i"
    client.create_many(
        {f: np.zeros((2, 3), np.float32), i: np.zeros(4, np.int64)}, optimizer=psclient.SGD(1.0)
    )
    new_f = np.array([[-0.0, 1e-45, 3.5], [np.finfo(np.float32).max, -7.25, 1 / 3]], np.float32)
    new_i = np.array([1, -2, 2**40, 0], np.int64)
    client.assign({f: new_f, i: new_i})
    values, versions = client.pull_with_versions([f, i])
    assert values[f].tobytes() == new_f.tobytes() and values[i].tobytes() == new_i.tobytes()
    assert versions == {f: 1, i: 1}
    client.assign({f: new_f})  # a repeat (a retry): the same values again, the version counts it
    assert client.pull_with_versions([f])[1] == {f: 2}


async def test_the_async_client_assigns(async_client: psclient.AsyncPSClient, var_name: str) -> None:
    await async_client.create(var_name, np.zeros(4, np.float32))
    await async_client.assign({var_name: np.arange(4, dtype=np.float32)})
    np.testing.assert_array_equal((await async_client.pull([var_name]))[var_name], np.arange(4))
    await async_client.assign({})  # nothing to do


def test_assign_in_chunks_and_pieces_of_a_partitioned_variable(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(2)
    with psclient.PSClient(
        cluster.addresses,
        "w",
        timeout=TIMEOUT_S,
        partition_bytes=4096,
        chunk_bytes=1024,
        unary_max_bytes=1024,
    ) as c:
        c.create("big", np.zeros((50, 40), np.float32), optimizer=psclient.Adam(0.1))
        assert len(_info(c, "big")) >= 2
        g = _rand(1, (50, 40))
        c.push({"big": g})
        new = _rand(2, (50, 40))
        c.assign({"big": new})
        values, versions = c.pull_with_versions(["big"])
        np.testing.assert_array_equal(values["big"], new)
        assert versions == {"big": 2}
        assert all((i.version, i.iterations) == (2, 1) for i in _info(c, "big"))
        # Adam's slots and step count were kept: the next push is Adam's second step on the new value.
        c.push({"big": g})
        slots = server.from_config(psclient.Adam(0.1)).init_slots(np.zeros((50, 40), np.float32))
        server.from_config(psclient.Adam(0.1)).apply(np.zeros((50, 40), np.float32), g, slots, 0)
        expected = server.from_config(psclient.Adam(0.1)).apply(new, g, slots, 1)
        np.testing.assert_array_equal(c.pull(["big"])["big"], expected)


def test_assign_keeps_the_momentum_slot(client: psclient.PSClient, var_name: str) -> None:
    w0 = _rand(0, (8,))
    g1, g2 = _rand(1, (8,)), _rand(2, (8,))
    client.create(var_name, w0, optimizer=psclient.SGD(0.1, momentum=0.9))
    client.push({var_name: g1})
    best = _rand(3, (8,))
    client.assign({var_name: best})
    client.push({var_name: g2})
    # Keras's SGD: m = 0.9 m - 0.1 g; w += m. The momentum of the first push carries over.
    m1 = np.float32(-0.1) * g1
    expected = best + (np.float32(0.9) * m1 - np.float32(0.1) * g2)
    got = client.pull([var_name])[var_name]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    rule = server.from_config(psclient.SGD(0.1, momentum=0.9))
    slots = rule.init_slots(w0)
    rule.apply(w0, g1, slots, 0)
    np.testing.assert_array_equal(got, rule.apply(best, g2, slots, 1))


def test_bad_assignments_are_typed_errors_and_change_nothing(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(2)
    with psclient.PSClient(cluster.addresses, "w", timeout=TIMEOUT_S, partition_bytes=1024) as c:
        c.create_many({"big": np.ones(1000, np.float32), "small": np.ones(3, np.float32)})
        assert len(_info(c, "big")) >= 2
        before = c.pull_with_versions()
        nan_last = np.zeros(1000, np.float32)
        nan_last[-1] = np.nan  # in the last piece only: no other piece (nor "small") may change
        bad = [
            (
                {"small": np.zeros(3, np.float32), "nope": np.zeros(3, np.float32)},
                psclient.NotFoundError,
                "nope",
            ),
            ({"small": np.zeros(4, np.float32)}, psclient.InvalidArgumentError, "shape"),
            ({"small": np.zeros(3, np.float64)}, psclient.InvalidArgumentError, "dtype"),
            (
                {"small": np.zeros(3, np.float32), "big": nan_last},
                psclient.InvalidArgumentError,
                "non-finite",
            ),
            ({"big": np.full(1000, np.inf, np.float32)}, psclient.InvalidArgumentError, "non-finite"),
        ]
        for values, error, match in bad:
            with pytest.raises(error, match=match):
                c.assign(values)
        after = c.pull_with_versions()
        assert after[1] == before[1]
        for name in before[0]:
            np.testing.assert_array_equal(after[0][name], before[0][name])


def test_a_shard_that_allows_non_finite_values_takes_them(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(1, ["--allow-non-finite"])
    with psclient.PSClient(cluster.addresses, "w", timeout=TIMEOUT_S) as c:
        c.create("v", np.zeros(2, np.float32))
        c.assign({"v": np.array([np.nan, -np.inf], np.float32)})
        got = c.pull(["v"])["v"]
        assert np.isnan(got[0]) and got[1] == -np.inf


def test_assign_is_applied_at_once_in_sync_mode(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(1, ["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2"])
    with psclient.PSClient(cluster.addresses, "w", timeout=TIMEOUT_S) as c:
        c.create("v", np.zeros(3, np.float32))
        c.assign({"v": np.full(3, 4.0, np.float32)})  # no barrier: one worker of two, and it returns
        np.testing.assert_array_equal(c.pull(["v"])["v"], np.full(3, 4.0, np.float32))
        assert c.status()[0].step == 0  # not a step


# -- replication -------------------------------------------------------------------------


def test_the_backup_follows_assign_and_replace_bit_for_bit() -> None:
    n = (1 << 20) + 7  # just over 4 MiB: the replicated assignment is cut into several messages
    w0, g = _rand(0, (8,)), [_rand(i + 1, (8,)) for i in range(4)]
    with LocalCluster(1) as primary, backups_of(primary, ["--serve-alone"]) as backup:
        addresses = [f"{primary.addresses[0]}|{backup.addresses[0]}"]
        with psclient.PSClient(addresses, "w", timeout=TIMEOUT_S) as c:
            c.create_many(
                {"m": w0, "a": w0, "big": np.zeros(n, np.float32)},
                optimizers={"m": psclient.SGD(0.1, momentum=0.9), "a": psclient.SGD(1.0)},
            )
            c.push({"m": g[0], "a": g[0]})
            best = _rand(9, (8,))
            big = _rand(10, (n,))
            c.assign({"m": best, "big": big})
            c.replace_optimizer(psclient.Adam(0.01), ["a"])
            c.push({"m": g[1], "a": g[1]})
            primary.kill_shard(0)  # the backup takes over: values, slots and step counts as on the primary
            c.push({"m": g[2], "a": g[2]})
            c.assign({"m": best})  # retried until the client fails over to the backup
            c.push({"m": g[3], "a": g[3]})
            got = c.pull()
            infos = c.list_variables(["a", "m"])
    sgd = server.from_config(psclient.SGD(0.1, momentum=0.9))
    slots = sgd.init_slots(w0)
    m = sgd.apply(w0, g[0], slots, 0)
    m = sgd.apply(best, g[1], slots, 1)
    m = sgd.apply(m, g[2], slots, 2)
    m = sgd.apply(best, g[3], slots, 3)
    a, _ = _run(w0 - g[0], g[1:], psclient.Adam(0.01))
    np.testing.assert_array_equal(got["m"], m)
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["big"], big)
    assert (infos["a"][0].version, infos["a"][0].iterations) == (4, 3)
    assert (infos["m"][0].version, infos["m"][0].iterations) == (6, 4)
