"""Pieces shared by the parameter-server and all-reduce Keras glue."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
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


# An exchange of a stateless step (JAX) that waits for the step's new non-trainable state: called with
# ``state_of(variable) -> its new value``, it returns ``[(trainable variable, new value)]`` and
# ``[(state variable, new value)]`` for the step's wrapper to put into the state the step returns.
Deferred = Callable[[Callable[[Any], Any]], tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]]


class DeferredExchanges:
    """A worker whose step exchanges may wait for the step's new non-trainable state (``defer_state``).

    Keras's JAX step is stateless: the optimizer's ``stateless_apply`` sees the shared state (BatchNorm
    statistics) as it was before the forward pass and hands back only its own variables. The JAX
    adapter wraps the train step in ``defer_state``; the worker's optimizer step appends what it must
    exchange with the new state to the list it yields, and the wrapper calls each once the step returned
    its state. Elsewhere (``_deferred`` None) the optimizer's step reads and assigns the state itself.
    """

    _deferred: list[Deferred] | None = None

    @contextlib.contextmanager
    def defer_state(self) -> Iterator[list[Deferred]]:
        """A stateless step (JAX) in which the exchanges that need the step's new state wait for it (see the
        class docs); yields the list the step's exchanges are appended to."""
        self._deferred = []
        try:
            yield self._deferred
        finally:
            self._deferred = None


class StepTimer(keras.callbacks.Callback):
    """Counts ``fit``'s training steps and times those after each ``fit``'s first call of its step
    function (which traces the graph).

    With ``compile(steps_per_execution=n)`` Keras calls the batch hooks once per ``n`` steps; the
    steps are counted from their batch indices (an epoch's short last execution exactly when Keras
    knows the steps per epoch). Subclasses that override ``on_train_batch_begin``,
    ``on_train_batch_end`` or ``on_train_end`` call ``super()``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.train_seconds = 0.0
        self._untimed = 0  # steps of each fit's first execution
        self._begin: int | None = None
        self._t0: float | None = None
        self._timing = False

    @property
    def steps_per_second(self) -> float:
        """Steps per second after each fit's first execution (0.0 until some are timed)."""
        timed = self.steps - self._untimed
        return timed / self.train_seconds if timed > 0 and self.train_seconds > 0 else 0.0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._timing = False

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._begin = batch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        begin, self._begin = self._begin, None
        per_epoch = (self.params or {}).get("steps")  # a short last execution ends at the epoch's end
        end = min(batch, per_epoch - 1) if per_epoch else batch
        done = end - begin + 1 if begin is not None and end >= begin else 1
        self.steps += done
        if not self._timing:  # the first execution of this fit
            self._timing = True
            self._untimed += done
            self._t0 = time.perf_counter()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None
