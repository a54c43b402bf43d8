"""Pieces shared by the parameter-server and all-reduce Keras glue."""

from __future__ import annotations

from typing import Any

import keras


def variable_name(variable: Any) -> str:
    """The name a Keras (or tf) variable has on the shards and in the ring: its Keras ``path``."""
    path = getattr(variable, "path", None) or variable.name
    return str(path).removesuffix(":0")


def model_variables(model_or_variables: Any, *, trainable_only: bool = True) -> list[Any]:
    """A model's (trainable, or all) variables, or the given sequence of variables as a list.

    Raises:
        ValueError: a model that is not built yet.
    """
    if isinstance(model_or_variables, keras.Model):
        if not model_or_variables.built:
            raise ValueError("build the model first (call it on a batch, or model.build)")
        if trainable_only:
            return list(model_or_variables.trainable_variables)
        return list(model_or_variables.variables)
    return list(model_or_variables)


def check_no_jit(model: keras.Model, what: str) -> None:
    """Refuses a model compiled with XLA: the glue runs host code (``tf.numpy_function``) in the step.

    Raises:
        ValueError: ``model.jit_compile`` is on.
    """
    if getattr(model, "jit_compile", False):
        raise ValueError(f"{what} needs model.compile(..., jit_compile=False)")
