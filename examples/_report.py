"""What every example ends with: an evaluator's check in the parameter-server modes, then worker 0's
one ``RESULT {json}`` line (what ``tests/e2e/test_examples.py`` reads)."""

import json
from collections.abc import Callable
from typing import Any

import keras

import psclient.keras as psk


def report(
    dist: psk.Distribution,
    result: dict[str, Any],
    fresh: Callable[[], keras.Model],
    score: Callable[[keras.Model], float],
    key: str = "loaded_accuracy",
) -> None:
    """Adds ``result[key]``: in a parameter-server mode, ``score`` of a fresh copy of the model (from
    ``fresh()``) loaded from the shards, as an evaluator process would; prints the result on worker 0;
    closes the worker."""
    if dist.mode in psk.MODES:
        model = fresh()
        psk.load_from_ps(model, dist.worker.client)
        result[key] = float(score(model))
        result["steps"], result["stale_steps"] = dist.worker.steps_done, dist.worker.stale_steps
    if dist.is_chief:
        print("RESULT " + json.dumps(result), flush=True)
    dist.close()
