"""``examples/``: each script, unchanged, trains under ``pstrain launch`` to within a few points of the same
script run locally (scripts in the style of published Keras examples, not shaped to pass). Every script runs
in a parameter-server mode and every mode runs some script (``EXAMPLES``); ``EXAMPLES_ALL_MODES=1`` runs
every script in every mode.

Each prints ``RESULT {json}`` from worker 0. In the parameter-server modes the result also holds the
accuracy of a fresh copy of the model loaded from the shards (``load_from_ps``): all of the model's state,
BatchNorm statistics and frozen layers included, is on the shards, so it evaluates like the worker.
The test sets are 360 digits images: one image is 0.28 points.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 400  # a run takes 15-40 s on 2 loaded cores
MARGIN = 0.03  # accuracy points below local that a distributed run may land
# custom_train_step's async run swings more: with Keras 3.15.1 local reaches 0.975 and a full-suite run on
# two loaded cores landed at 0.933 (staler gradients; 0.96-0.97 in a run of its own), 12 images of 360
# under MARGIN. An untrained or diverged model lands below 0.5.
MARGINS = {"custom_train_step.py": 0.05}
MODES = ("async", "sync", "allreduce")
# script -> the modes it is run in besides local. Every script runs in a parameter-server mode, every mode
# runs: async and sync share the glue (the callback, DistributedOptimizer, attach/finish); sync adds the
# step barrier, checked where it differs most: two optimizers per train step (gan.py) and a tf.function
# tape loop with BatchNorm state (gradient_tape.py). All-reduce runs the script whose part
# tests/e2e/test_keras_allreduce.py does not cover: an Embedding's sparse gradients (gan.py's two
# optimizers are its "two_optimizers" scenario). The recommender (a subclassed model built by its first
# batch, regularized tables) runs in async mode, the one people use with embedding tables; the same kind
# of model is checked in all three modes, weight for weight against local Keras, by
# tests/e2e/test_keras_lazy_models.py. EXAMPLES_ALL_MODES=1 runs every script in every mode (the README's
# table).
EXAMPLES = {
    "batchnorm_cnn.py": ("async",),
    "custom_train_step.py": ("async",),
    "gan.py": ("sync",),
    "gradient_tape.py": ("sync",),
    "recommender.py": ("async",),
    "text_classification.py": ("async", "allreduce"),
    "transfer_learning.py": ("async",),
    "wide_deep.py": ("sync",),  # dynamic tables; on JAX and PyTorch: tests/e2e/test_keras_backends.py
}
if os.environ.get("EXAMPLES_ALL_MODES") == "1":
    EXAMPLES = dict.fromkeys(EXAMPLES, MODES)
# Fewer epochs than the script's own 12, the same for the local run: settled within a point of 12
# (local 0.986, async 0.981-0.986 over five runs). The others keep theirs: the GAN scores ~0.05 (untrained)
# at 6 epochs in sync and all-reduce mode; text_classification needs its 10 for EarlyStopping to stop and
# restore the best weights; custom_train_step at 8 epochs (local 0.961, async 0.939-0.972) came within
# 3 images of the margin; the rest train for a few seconds of a run's 10-15.
EPOCHS = {"batchnorm_cnn.py": "6", "recommender.py": "3", "wide_deep.py": "2"}
# Smaller inputs than the script's own, the same for the local run.
ENV = {"recommender.py": {"RATINGS": "20000"}, "wide_deep.py": {"IMPRESSIONS": "12000"}}
# The recommender (keras-io's RecommenderNet: a subclassed model built by its first batch, Embedding tables
# with an L2 regularizer) reports its validation loss (binary cross-entropy; predicting the mean scores
# ~0.673, the trained model ~0.63): a run may land this much above local. At RATINGS=20000 and 3 epochs local
# is deterministic (0.6381); nine async runs of two workers landed 0.0024-0.0066 above it (2026-11-28, the
# code before and after that day's changes alike; 0.006 failed one full-suite run), while a run that loses
# updates or the regularizer lands near the mean's 0.673.
LOSS_MARGIN = 0.012
# What one step may move at most: twice the rows it touches. Per worker-step, a batch of 64 touches at most
# 64 rows of each of its four tables (two of 32 floats, two bias tables of 1), each row as an 8-byte id and
# its values, out and back: 2 x 64 x (8 + 128 + 8 + 128 + 8 + 4 + 8 + 4) bytes. Sending the tables whole
# (what an L2 regularizer in the loss does) would be ~0.9 MB.
RECOMMENDER_BYTES_PER_STEP = 2 * 2 * 64 * (8 + 128 + 8 + 128 + 8 + 4 + 8 + 4)
# The GAN's score (1.0: generated and real distributions equal) swings between epochs as the generator's
# balance between the two modes oscillates (0.61-0.96 after epoch 4 at its rate, locally; async runs
# 0.54-0.80); an untrained or mode-collapsed generator scores about 0.05.
GAN_MIN_SCORE = 0.3


def run_example(script: str, mode: str) -> dict[str, Any]:
    """Runs one example (locally, or under ``pstrain launch --mode``) and returns its RESULT line."""
    cmd = [sys.executable, str(ROOT / "examples" / script)]
    if mode != "local":
        cmd = [sys.executable, "-m", "trainer", "launch", "--mode", mode, "--timeout", str(RUN_TIMEOUT_S),
               "--", *cmd]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PSTRAIN_MODE", "EPOCHS")}
    if script in EPOCHS:
        env["EPOCHS"] = EPOCHS[script]
    env.update(ENV.get(script, {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split("RESULT ", 1)[1] for ln in proc.stdout.splitlines() if "RESULT " in ln]
    assert len(lines) == 1, proc.stdout[-3000:]  # worker 0 only
    result = json.loads(lines[0])
    print(f"\n{script} {mode}: {json.dumps(result)}")  # shown with -s: the README's table comes from these
    assert result["mode"] == mode
    return result


@pytest.fixture(scope="module")
def local_results() -> dict[str, float]:
    return {}


def _local(script: str, cache: dict[str, float], key: str = "test_accuracy") -> float:
    if script not in cache:
        cache[script] = float(run_example(script, "local")[key])
    return cache[script]


@pytest.mark.parametrize(("script", "mode"), [(s, m) for s, modes in EXAMPLES.items() for m in modes])
def test_example_matches_local(script: str, mode: str, local_results: dict[str, float]) -> None:
    if script == "gan.py":
        result = run_example(script, mode)
        assert result["score"] >= GAN_MIN_SCORE, result
        if mode == "sync":
            assert result["loaded_score"] == pytest.approx(result["score"], abs=1e-6), result
            assert result["stale_steps"] == 0, result  # two optimizers: two sync steps per train step
        return
    if script == "recommender.py":
        local = _local(script, local_results, "val_loss")
        result = run_example(script, mode)
        assert result["val_loss"] <= local + LOSS_MARGIN, (result, local)
        if mode in (
            "async",
            "sync",
        ):  # only the rows a step touches travel, though the tables are regularized
            assert 0 < result["bytes_per_step"] <= RECOMMENDER_BYTES_PER_STEP, result
            assert -result["loaded_neg_val_loss"] <= local + LOSS_MARGIN, (result, local)
        return
    local = _local(script, local_results)
    result = run_example(script, mode)
    margin = MARGINS.get(script, MARGIN)
    assert result["test_accuracy"] >= local - margin, (result, local)
    if "loaded_accuracy" in result:  # an evaluator that loads the model from the shards
        assert result["loaded_accuracy"] >= local - margin, (result, local)
    if mode == "sync":  # the shards hold the final model: the evaluator's copy is the same model
        assert result["loaded_accuracy"] == pytest.approx(result["test_accuracy"], abs=1e-6), result
        assert result["stale_steps"] == 0, result  # every worker's gradient counted in every step


def test_every_script_runs_in_a_parameter_server_mode_and_every_mode_runs() -> None:
    scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
    assert sorted(EXAMPLES) == scripts  # a new example gets a run here
    assert all(set(modes) & {"async", "sync"} for modes in EXAMPLES.values()), EXAMPLES
    assert {m for modes in EXAMPLES.values() for m in modes} == set(MODES), EXAMPLES
