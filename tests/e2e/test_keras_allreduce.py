"""psclient.keras all-reduce glue: ranks start from rank 0's weights, stay identical, match one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

keras = pytest.importorskip("keras")

import _allreduce_worker as w  # noqa: E402

import psclient  # noqa: E402
import psclient.keras as psk  # noqa: E402
from trainer.cluster import reserve_ports  # noqa: E402

WORKER = Path(__file__).with_name("_allreduce_worker.py")
RUN_TIMEOUT_S = 300


def _run_ranks(tmp_path: Path, mode: str, world: int = 2) -> list[dict[str, np.ndarray]]:
    addresses = ",".join(reserve_ports(world))
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
    with psk.AllReduceWorker([reserve_ports(1)[0]], 0) as worker:
        opt = psk.AllReduceOptimizer(keras.optimizers.Adam(0.005, beta_1=0.8), worker)
        assert isinstance(opt, keras.optimizers.Adam) and isinstance(opt, psk.AllReduceOptimizer)
        assert type(opt).__name__ == "Adam" and opt.get_config()["beta_1"] == 0.8
        assert float(opt.learning_rate) == pytest.approx(0.005)
        with pytest.raises(TypeError):
            psk.AllReduceOptimizer(opt, worker)
        with pytest.raises(TypeError):
            psk.AllReduceOptimizer("adam", worker)
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
        psk.AllReduceWorker([reserve_ports(1)[0]], 0) as worker,
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
