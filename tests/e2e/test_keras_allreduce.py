"""psclient.keras all-reduce glue: ranks start from rank 0's weights, stay identical, match one process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

keras = pytest.importorskip("keras")

import _allreduce_worker as w  # noqa: E402
from _support import RUN_TIMEOUT_S, free_addresses  # noqa: E402

import psclient  # noqa: E402
import psclient.keras as psk  # noqa: E402

SCENARIOS = list(w.scenarios())

WORKER = Path(__file__).with_name("_allreduce_worker.py")


def _run_ranks(tmp_path: Path, mode: str, world: int = 2) -> list[dict[str, np.ndarray]]:
    addresses = ",".join(free_addresses(world))
    outs = [tmp_path / f"rank{r}.npz" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), addresses, str(r), mode, str(outs[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=RUN_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    results = []
    for out in outs:
        with np.load(out) as f:
            results.append({k: f[k] for k in f.files})
    return results


def _reference_weights(world: int) -> list[np.ndarray]:
    """One process, rank 0's start, global batches = the ranks' batches side by side (mean of means)."""
    model = w.build(seed=100)
    model.compile(optimizer=w.optimizer(), loss="mse", jit_compile=False)
    parts = [w.data(r, world) for r in range(world)]
    xs, ys = [], []
    for k in range(w.STEPS_PER_EPOCH):
        sl = slice(k * w.BATCH, (k + 1) * w.BATCH)
        xs += [p[0][sl] for p in parts]
        ys += [p[1][sl] for p in parts]
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=world * w.BATCH, epochs=w.EPOCHS,
              shuffle=False, verbose=0)  # fmt: skip
    return model.get_weights()


@pytest.mark.parametrize("mode", ["fit", "tape"])
def test_ranks_stay_identical_and_match_one_process_on_the_global_batch(tmp_path: Path, mode: str) -> None:
    ranks = _run_ranks(tmp_path, mode)
    n = len([k for k in ranks[0] if k.startswith("arr_")])
    for r in ranks:
        assert bool(r["in_sync"])
        assert int(r["steps"]) == w.EPOCHS * w.STEPS_PER_EPOCH
    for i in range(n):  # bit-identical replicas
        np.testing.assert_array_equal(ranks[0][f"arr_{i}"], ranks[1][f"arr_{i}"])
    reference = _reference_weights(world=2)
    for i, ref in enumerate(reference):
        np.testing.assert_allclose(ranks[0][f"arr_{i}"], ref, rtol=1e-4, atol=1e-5)


def test_optimizer_keeps_its_class_and_config() -> None:
    with psk.AllReduceWorker([free_addresses(1)[0]], 0) as worker:
        opt = psk.AllReduceOptimizer(keras.optimizers.Adam(0.005, beta_1=0.8), worker)
        assert isinstance(opt, keras.optimizers.Adam) and isinstance(opt, psk.AllReduceOptimizer)
        assert type(opt).__name__ == "Adam" and opt.get_config()["beta_1"] == 0.8
        assert float(opt.learning_rate) == pytest.approx(0.005)
        with pytest.raises(TypeError):
            psk.AllReduceOptimizer(opt, worker)
        with pytest.raises(TypeError):
            psk.AllReduceOptimizer(42, worker)
        by_name = psk.AllReduceOptimizer("adam", worker)  # issue 9: a name, as compile accepts
        assert type(by_name).__name__ == "Adam" and isinstance(by_name, psk.AllReduceOptimizer)
        # one rank: the average is the gradient itself
        g = [np.arange(6, dtype=np.float32).reshape(2, 3), None]
        out = worker.allreduce_gradients(g)
        np.testing.assert_array_equal(out[0].numpy(), g[0])
        assert out[1] is None


def test_callback_refuses_a_plain_optimizer() -> None:
    model = w.build(seed=0)
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    x, y = np.zeros((4, 4), np.float32), np.zeros((4, 2), np.float32)
    with (
        psk.AllReduceWorker([free_addresses(1)[0]], 0) as worker,
        pytest.raises(ValueError, match="AllReduceOptimizer"),
    ):
        model.fit(x, y, verbose=0, callbacks=[worker.callback()])


def test_ring_from_tf_config() -> None:
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})}
    assert psk.ring_from_tf_config(env) == (["c:1", "w0:1", "w1:1"], 2)
    env = {
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}
        )
    }
    assert psk.ring_from_tf_config(env) == (["a:1", "b:1"], 0)
    for bad in (
        {},
        {"TF_CONFIG": "{"},
        {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})},
    ):
        with pytest.raises(ValueError):
            psk.ring_from_tf_config(bad)


def test_public_names() -> None:
    names = ("PSWorker", "DistributedOptimizer", "PSCallback", "load_from_ps", "server_optimizer",
             "variable_name", "MODES", "AllReduceWorker", "AllReduceOptimizer",
             "AllReduceCallback")  # fmt: skip
    for name in names:
        assert hasattr(psk, name), name
    assert psk.PSError is psclient.PSError


# -- issue 9: what the wrapped optimizer and the model do must keep working on 2 ranks ---------------------


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], Path]:
    """Every scenario of _allreduce_worker.py on 2 ranks, each on its own ring (one pair of processes)."""
    out = tmp_path_factory.mktemp("scenarios")
    world = 2
    addresses = ",".join(free_addresses(world * len(SCENARIOS)))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), addresses, str(r), "scenarios", ",".join(SCENARIOS), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=RUN_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    results = {}
    for name in SCENARIOS:
        results[name] = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]
    return results, out


def _ranks(scenarios: tuple[dict[str, list[dict]], Path], name: str) -> list[dict]:
    ranks = scenarios[0][name]
    for rank, r in enumerate(ranks):
        assert r["error"] is None, f"{name}, rank {rank}: {r['error']}"
        assert r["in_sync"], f"{name}, rank {rank}: replicas differ"
    return ranks


def _loss_goes_down(name: str, ranks: list[dict]) -> None:
    for rank, r in enumerate(ranks):
        first, last = r["losses"][0], r["losses"][-1]
        assert math.isfinite(last) and last < 0.95 * first, f"{name}, rank {rank}: losses {r['losses']}"


@pytest.mark.parametrize("name", ["batchnorm_fit", "batchnorm_tape", "custom_train_step", "lazy"])
def test_batchnorm_statistics_are_averaged_so_replicas_stay_identical(scenarios: Any, name: str) -> None:
    ranks = _ranks(scenarios, name)
    _loss_goes_down(name, ranks)
    if "moving_mean" in ranks[0]:
        assert ranks[0]["moving_mean"] == ranks[1]["moving_mean"]
        assert any(abs(m) > 1e-3 for m in ranks[0]["moving_mean"])  # the statistics did move


def test_a_train_step_with_two_optimizers_keeps_replicas_identical(scenarios: Any) -> None:
    """A GAN's shape (examples/gan.py): each optimizer all-reduces its own part's gradients every step."""
    ranks = _ranks(scenarios, "two_optimizers")
    _loss_goes_down("two_optimizers", ranks)
    for r in ranks:
        assert r["iterations"] == [w.S_EPOCHS * w.S_STEPS] * 2, r  # each optimizer applied every step
        assert r["steps"] >= 2 * w.S_EPOCHS * w.S_STEPS, r  # an all-reduce for each


def test_lazily_built_model_is_broadcast_after_the_first_step(scenarios: Any) -> None:
    _ranks(scenarios, "lazy")  # a Sequential without Input, different seeds per rank; the callback checks


def test_broadcast_keeps_a_scalar_variable_scalar_and_a_second_fit_works(scenarios: Any) -> None:
    for r in _ranks(scenarios, "scalar_variable"):
        assert r["shape"] == [] and r["value"] == 1.0  # rank 0's keras.Variable(1.0), still 0-d
        assert r["iterations"] == (w.S_EPOCHS + 1) * w.S_STEPS


@pytest.mark.parametrize(
    "name",
    ["schedule", "loss_scale_inner", "mixed_float16", "weight_decay", "clipnorm", "global_clipnorm",
     "accumulation", "ema", "name"],
)  # fmt: skip
def test_optimizer_settings_train_and_keep_replicas_identical(scenarios: Any, name: str) -> None:
    _loss_goes_down(name, _ranks(scenarios, name))


def test_mixed_float16_is_a_loss_scale_optimizer_that_serializes_as_keras(scenarios: Any) -> None:
    config = _ranks(scenarios, "mixed_float16")[0]["serialized"]
    assert (config["module"], config["class_name"]) == ("keras.optimizers", "LossScaleOptimizer")
    inner = config["config"]["inner_optimizer"]
    assert (inner["module"], inner["class_name"]) == ("keras.optimizers", "Adam")


def test_loss_scale_skips_the_same_steps_on_every_rank(scenarios: Any) -> None:
    """LossScaleOptimizer(AllReduceOptimizer(...)); rank 1's first batch of each epoch overflows."""
    ranks = _ranks(scenarios, "loss_scale_outer")
    skipped = w.S_EPOCHS
    for r in ranks:
        assert r["iterations"] == w.S_EPOCHS * w.S_STEPS - skipped
        assert r["scale"] == 2.0**15 / 2**skipped
    _loss_goes_down("loss_scale_outer", ranks[:1])


def test_transfer_learning_freeze_fit_unfreeze_recompile_fit(scenarios: Any) -> None:
    ranks = _ranks(scenarios, "transfer")
    assert ranks[0]["frozen_after_first"] == ranks[1]["frozen_after_first"]
    assert len(ranks[0]["losses"]) == 2 * w.S_EPOCHS


def test_frozen_layer_stays_identical_and_frozen(scenarios: Any) -> None:
    ranks = _ranks(scenarios, "frozen_layer")
    _loss_goes_down("frozen_layer", ranks)
    assert ranks[0]["frozen"] == ranks[1]["frozen"] == ranks[0]["initial"]  # rank 0's, unchanged
    assert ranks[1]["initial"] != ranks[0]["initial"]  # the ranks did start apart


def test_saved_model_loads_with_the_plain_optimizer_class(scenarios: Any) -> None:
    ranks = _ranks(scenarios, "save_load")
    out = scenarios[1]
    custom = w.custom_optimizer()
    for name, cls in (("adam", keras.optimizers.Adam), ("custom", custom)):
        for r in ranks:
            got, plain = r[f"{name}_serialized"], r[f"{name}_plain_serialized"]
            for key in ("module", "class_name", "registered_name"):
                assert got[key] == plain[key], (name, key)
        model = keras.models.load_model(out / f"{name}.keras")
        assert type(model.optimizer) is cls
        assert not isinstance(model.optimizer, psk.AllReduceOptimizer)
        with np.load(out / f"{name}.npz") as saved:
            for i, v in enumerate(model.get_weights()):
                np.testing.assert_array_equal(v, saved[f"arr_{i}"])


def test_optimizer_wraps_a_loss_scale_optimizer_and_a_schedule() -> None:
    with psk.AllReduceWorker([free_addresses(1)[0]], 0) as worker:
        schedule = keras.optimizers.schedules.CosineDecay(1e-3, 1000)
        opt = psk.AllReduceOptimizer(keras.optimizers.Adam(schedule), worker)
        assert (
            opt.get_config()["learning_rate"] == keras.optimizers.Adam(schedule).get_config()["learning_rate"]
        )
        lso = psk.AllReduceOptimizer(
            keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0), worker
        )
        assert isinstance(lso, keras.mixed_precision.LossScaleOptimizer)
        assert isinstance(lso.inner_optimizer, keras.optimizers.SGD)
        assert not isinstance(lso.inner_optimizer, psk.AllReduceOptimizer)
        assert lso.get_config()["initial_scale"] == 8.0
        with pytest.raises(TypeError):
            psk.AllReduceOptimizer(keras.mixed_precision.LossScaleOptimizer(opt), worker)
        with pytest.raises(TypeError):
            opt.attach([1, 2])
        # one rank: attached variables keep their values (the mean of one)
        v = keras.Variable(np.arange(3, dtype=np.float32))
        var = keras.Variable(np.ones((2, 2), np.float32))
        opt.attach([v])
        opt.apply([np.full((2, 2), 0.5, np.float32)], [var])
        np.testing.assert_array_equal(v.numpy(), np.arange(3, dtype=np.float32))
        assert worker.steps_done == 1  # gradients and statistics in one fused all-reduce
