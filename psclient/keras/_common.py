"""Pieces shared by the parameter-server and all-reduce Keras glue."""

from __future__ import annotations

import time
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


class StepTimer(keras.callbacks.Callback):
    """Counts ``fit``'s training steps and times those after the first (which traces the graph).

    Subclasses that override ``on_train_batch_end`` or ``on_train_end`` call ``super()``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.train_seconds = 0.0
        self._t0: float | None = None

    @property
    def steps_per_second(self) -> float:
        """Steps per second after the first step (0.0 until two steps are done)."""
        return (self.steps - 1) / self.train_seconds if self.steps > 1 and self.train_seconds > 0 else 0.0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.steps += 1
        if self.steps == 1:
            self._t0 = time.perf_counter()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None
