"""UpdateOptimizer (``set_learning_rate`` / ``update_optimizer``) against real shard processes.

The next push after a change uses the new hyper-parameters exactly, the slots
are kept, the change survives a checkpoint restore and reaches a backup, and bad
changes are typed errors that leave every variable as it was.
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


def _grad(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _replay(
    w0: np.ndarray, grads: list[np.ndarray], opts: list[specs.Optimizer]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """What a shard computes: each push with the optimizer in force at it, on one set of slots."""
    slots = server.from_config(opts[0]).init_slots(w0)
    value = w0
    for step, (grad, opt) in enumerate(zip(grads, opts, strict=True)):
        value = server.from_config(opt).apply(value, grad, slots, step)
    return value, slots


def test_the_next_push_uses_the_new_learning_rate_exactly(client: psclient.PSClient, var_name: str) -> None:
    shape = (3, 4)
    w0 = _grad(0, shape)
    sgd, adam = f"{var_name}sgd", f"{var_name}adam"
    client.create(sgd, w0, optimizer=psclient.SGD(0.1, momentum=0.9))
    client.create(adam, w0, optimizer=psclient.Adam(0.01))
    grads = [_grad(i + 1, shape) for i in range(4)]
    for g in grads[:2]:
        client.push({sgd: g, adam: g})
    assert client.set_learning_rate(0.5, [sgd, adam]) == sorted([sgd, adam])
    for g in grads[2:]:
        client.push({sgd: g, adam: g})
    got = client.pull([sgd, adam])
    sgd_expected, _ = _replay(w0, grads, [psclient.SGD(0.1, momentum=0.9)] * 2 + [psclient.SGD(0.5, 0.9)] * 2)
    adam_expected, _ = _replay(w0, grads, [psclient.Adam(0.01)] * 2 + [psclient.Adam(0.5)] * 2)
    np.testing.assert_array_equal(got[sgd], sgd_expected)  # bit for bit: slots and step count kept
    np.testing.assert_array_equal(got[adam], adam_expected)
    infos = client.list_variables([adam])[adam]
    assert specs.optimizer_from_proto(infos[0].spec.optimizer) == psclient.Adam(0.5)
    assert infos[0].version == 4


def test_update_optimizer_sets_other_hyper_parameters(client: psclient.PSClient, var_name: str) -> None:
    w0 = _grad(0, (5,))
    client.create(var_name, w0, optimizer=psclient.Nadam(0.01))
    g = _grad(1, (5,))
    client.push({var_name: g})
    assert client.update_optimizer({"beta_1": 0.5, "learning_rate": 0.1}, [var_name]) == [var_name]
    client.push({var_name: g})
    expected, _ = _replay(w0, [g, g], [psclient.Nadam(0.01), psclient.Nadam(0.1, beta_1=0.5)])
    np.testing.assert_array_equal(client.pull([var_name])[var_name], expected)


def test_ema_momentum_changes_in_place_and_use_ema_needs_a_replacement(
    client: psclient.PSClient, var_name: str
) -> None:
    ema, plain = f"{var_name}ema", f"{var_name}plain"
    w0 = _grad(0, (5,))
    client.create(ema, w0, optimizer=psclient.SGD(0.1, use_ema=True))
    client.create(plain, w0, optimizer=psclient.SGD(0.1))
    g = _grad(1, (5,))
    client.push({ema: g, plain: g})
    assert client.update_optimizer({"ema_momentum": 0.5}, [ema]) == [ema]  # the average slot is kept
    client.push({ema: g, plain: g})
    opts = [psclient.SGD(0.1, use_ema=True), psclient.SGD(0.1, use_ema=True, ema_momentum=0.5)]
    _, slots = _replay(w0, [g, g], opts)
    np.testing.assert_array_equal(client.pull([ema], ema=True)[ema], slots["average"])
    with pytest.raises(psclient.InvalidArgumentError, match="would change its slots"):
        client.update_optimizer({"use_ema": 1.0}, [plain])  # adds the average slot
    client.replace_optimizer(psclient.SGD(0.1, use_ema=True), [plain])  # fresh: the average is the value
    np.testing.assert_array_equal(client.pull([plain], ema=True)[plain], client.pull([plain])[plain])


def test_bad_changes_are_typed_errors_and_change_nothing(client: psclient.PSClient, var_name: str) -> None:
    plain, scheduled = f"{var_name}plain", f"{var_name}sched"
    client.create(plain, np.zeros(3, np.float32), optimizer=psclient.SGD(0.1))
    schedule = specs.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    client.create(scheduled, np.zeros(3, np.float32), optimizer=psclient.Adam(schedule))
    with pytest.raises(psclient.NotFoundError, match="no_such_variable"):
        client.set_learning_rate(0.5, [plain, "no_such_variable"])
    with pytest.raises(psclient.InvalidArgumentError, match="learning rate is a schedule"):
        client.set_learning_rate(0.5, [plain, scheduled])
    with pytest.raises(psclient.InvalidArgumentError, match="`learning_rate` must be >= 0"):
        client.set_learning_rate(-1.0, [plain])
    with pytest.raises(psclient.InvalidArgumentError, match="would change its slots"):
        client.update_optimizer({"momentum": 0.9}, [plain])  # SGD momentum from 0 adds a slot
    with pytest.raises(psclient.InvalidArgumentError, match="has no parameter 'beta_1'"):
        client.update_optimizer({"beta_1": 0.9}, [plain])
    infos = client.list_variables([plain, scheduled])
    assert specs.optimizer_from_proto(infos[plain][0].spec.optimizer) == psclient.SGD(0.1)
    assert specs.optimizer_from_proto(infos[scheduled][0].spec.optimizer) == psclient.Adam(schedule)
    # names=None: every variable with a constant rate; a schedule is left alone
    changed = client.set_learning_rate(0.25)
    assert plain in changed and scheduled not in changed
    infos = client.list_variables([plain, scheduled])
    assert specs.optimizer_from_proto(infos[plain][0].spec.optimizer) == psclient.SGD(0.25)
    assert specs.optimizer_from_proto(infos[scheduled][0].spec.optimizer) == psclient.Adam(schedule)


async def test_the_async_client_sets_the_rate(async_client: psclient.AsyncPSClient, var_name: str) -> None:
    await async_client.create(var_name, np.ones(4, np.float32), optimizer=psclient.SGD(0.1))
    assert await async_client.set_learning_rate(2.0, [var_name]) == [var_name]
    await async_client.push({var_name: np.ones(4, np.float32)})
    np.testing.assert_array_equal(
        (await async_client.pull([var_name]))[var_name], np.full(4, -1.0, np.float32)
    )


def test_a_partitioned_variable_changes_on_every_shard(make_cluster) -> None:
    cluster = make_cluster(2)
    with psclient.PSClient(cluster.addresses, "w", timeout=TIMEOUT_S, partition_bytes=1024) as c:
        w0 = np.ones(1000, np.float32)
        c.create("big", w0, optimizer=psclient.SGD(0.1))
        assert len(c.list_variables(["big"])["big"]) == 2
        assert c.set_learning_rate(0.5, ["big"]) == ["big"]
        c.push({"big": np.ones(1000, np.float32)})
        np.testing.assert_array_equal(c.pull(["big"])["big"], np.full(1000, 0.5, np.float32))


def test_the_change_survives_a_checkpoint_restore(tmp_path) -> None:
    with LocalCluster(1, ["--checkpoint-dir", str(tmp_path)]) as cluster:
        with psclient.PSClient(cluster.addresses, "w", timeout=TIMEOUT_S) as c:
            c.create("v", np.ones(3, np.float32), optimizer=psclient.Adam(0.01))
            c.push({"v": np.ones(3, np.float32)})
            c.set_learning_rate(0.5, ["v"])
            c.save_checkpoint()
        port = int(cluster.addresses[0].rpartition(":")[2])
        cluster.kill_shard(0)
        cluster.start_shard(0, port=port)
        with psclient.PSClient(cluster.addresses, "w2", timeout=TIMEOUT_S) as c:
            info = c.list_variables(["v"])["v"][0]
            assert specs.optimizer_from_proto(info.spec.optimizer) == psclient.Adam(0.5)
            c.push({"v": np.ones(3, np.float32)})
            expected, _ = _replay(
                np.ones(3, np.float32),
                [np.ones(3, np.float32)] * 2,
                [psclient.Adam(0.01), psclient.Adam(0.5)],
            )
            np.testing.assert_array_equal(c.pull(["v"])["v"], expected)


def test_the_backup_follows_the_change_bit_for_bit() -> None:
    shape = (64,)
    w0 = _grad(0, shape)
    grads = [_grad(i + 1, shape) for i in range(6)]
    with LocalCluster(1) as primary, backups_of(primary, ["--serve-alone"]) as backup:
        addresses = [f"{primary.addresses[0]}|{backup.addresses[0]}"]
        with psclient.PSClient(addresses, "w", timeout=TIMEOUT_S) as c:
            c.create("v", w0, optimizer=psclient.Adam(0.01))
            for g in grads[:3]:
                c.push({"v": g})
            c.set_learning_rate(0.2, ["v"])
            for g in grads[3:5]:
                c.push({"v": g})
            primary.kill_shard(0)  # the backup takes over: its Adam must already use the new rate
            c.push({"v": grads[5]})
            got = c.pull(["v"])["v"]
            info = c.list_variables(["v"])["v"][0]
    expected, _ = _replay(w0, grads, [psclient.Adam(0.01)] * 3 + [psclient.Adam(0.2)] * 3)
    np.testing.assert_array_equal(got, expected)
    assert specs.optimizer_from_proto(info.spec.optimizer) == psclient.Adam(0.2)
