"""Stable names for a Keras model's variables on the shards: the same for every copy of the model.

Keras names variables by their ``path`` (``"sequential_1/dense_3/kernel"``),
whose layer and model names carry counters that depend on what else the
process built before (a second copy of a model, a ``from_config`` copy or an
evaluator that builds the model twice gets other names). On the shards a model's
variable is named instead by

    ``<model>/<index>/<layer>/<variable>``

- ``<model>``: the model's name, with Keras's automatic counter dropped
  (``sequential_1`` -> ``sequential``; a name you give, ``name="encoder"``, is kept);
- ``<index>``: the variable's position in ``model.variables`` (3 digits), which is
  the same for every copy of the same architecture;
- ``<layer>/<variable>``: the last two parts of its Keras path, counters dropped,
  for readability (``batch_normalization/moving_mean``).

So ``"sequential/004/batch_normalization/moving_mean"``. Two different models
trained on the same shards need different model names (``name=`` when building it).

>>> strip_counter("dense_12")
'dense'
>>> strip_counter("head")
'head'
"""

from __future__ import annotations

import re
from typing import Any

import keras

_COUNTER = re.compile(r"_\d+$")


def strip_counter(name: str) -> str:
    """A Keras name without the ``_N`` counter Keras appends to make names unique."""
    return _COUNTER.sub("", name)


def is_shared_state(variable: Any) -> bool:
    """Whether a non-trainable variable is model state the shards keep (moving statistics, frozen
    weights): floating-point, and not a random generator's state (each worker keeps its own)."""
    if "seed_generator" in str(getattr(variable, "path", "")):
        return False
    try:
        return bool(keras.backend.is_float_dtype(variable.dtype))
    except (TypeError, ValueError):
        return False


def model_variable_names(model: keras.Model) -> list[tuple[Any, str]]:
    """``(variable, stable name)`` for each of a built model's variables that live on the shards.

    Trainable variables and floating-point non-trainable state; random generators'
    states stay on the worker.

    Raises:
        ValueError: the model is not built (has no variables yet).
    """
    if not model.built and not model.variables:  # (a model without call() builds only its parts)
        raise ValueError(
            f"model {model.name!r} is not built: call it on a batch, or model.build(input_shape), first"
        )
    prefix = strip_counter(model.name)
    out = []
    for i, var in enumerate(model.variables):
        if not var.trainable and not is_shared_state(var):
            continue
        parts = str(getattr(var, "path", var.name)).removesuffix(":0").split("/")
        tail = "/".join(strip_counter(p) for p in parts[-2:])
        out.append((var, f"{prefix}/{i:03d}/{tail}"))
    return out
