"""Logistic regression trained through PSClient (numpy, no TensorFlow): the fault-injection tests' workload.

One worker, sequential pull / compute / push steps: with no update lost, the
trained parameters are the same bit for bit from run to run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from _support import CALL_TIMEOUT_S as TIMEOUT_S

import psclient

STEPS = 240
BATCH = 64


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = 32
    w_true = rng.standard_normal(d)
    x = rng.standard_normal((6000, d)).astype(np.float32)
    y = ((x @ w_true + 0.5 * rng.standard_normal(6000)) > 0).astype(np.float32)
    return x[:5000], y[:5000], x[5000:], y[5000:]


def accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    logits = x @ params["lr/w"] + params["lr/b"][0]
    return float(np.mean((logits > 0) == (y > 0.5)))


def train(
    addresses: list[str], worker: str, on_step: dict[int, Callable[[], object]] | None = None
) -> tuple[float, dict[str, np.ndarray]]:
    """Trains ``STEPS`` steps (``on_step[k]()`` runs before step ``k``); returns test accuracy, parameters."""
    x, y, xt, yt = data()
    rng = np.random.default_rng(1)
    with psclient.PSClient(addresses, worker, timeout=TIMEOUT_S) as c:
        c.create_many(
            {"lr/w": np.zeros(x.shape[1], np.float32), "lr/b": np.zeros(1, np.float32)},
            optimizer=psclient.Adam(learning_rate=0.05),
        )
        for step in range(STEPS):
            if on_step and step in on_step:
                on_step[step]()
            idx = rng.integers(0, len(x), BATCH)
            p = c.pull()
            logits = x[idx] @ p["lr/w"] + p["lr/b"][0]
            err = (1 / (1 + np.exp(-logits)) - y[idx]).astype(np.float32)
            c.push({"lr/w": x[idx].T @ err / BATCH, "lr/b": np.array([err.mean()], np.float32)})
        params = c.pull()
        return accuracy(params, xt, yt), params
