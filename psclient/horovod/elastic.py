"""Horovod's elastic training (``horovod.tensorflow.elastic``) on the ring: ``hvd.elastic``.

Under ``psrun --min-np M --max-np N`` (see ``trainer.elastic``) the training function runs in
``hvd.elastic.run``: when a rank is lost (its process dies, or a collective fails), the other ranks
get :class:`~psclient.elastic.HorovodInternalError` at once (psrun tells them; no ring deadline
to wait for), restore the state of the last ``state.commit()``, form a smaller ring with new
ranks (``hvd.rank()``/``hvd.size()`` change), sync the state from the new rank 0 and call the
function again. A rank that psrun starts later joins at the next commit. Example (Horovod's)::

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, steps):
                step(...)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(state)

Outside a psrun elastic job, ``run`` syncs the state once and runs the function (a failure ends
the job, as without elastic).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from psclient.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run_fn
from psclient.horovod import _state
from psclient.horovod._ops import broadcast_object
from psclient.horovod._state import rank, worker

R = TypeVar("R")


def _is_ring_failure(err: BaseException) -> bool:
    # A collective in a tf.function reaches the caller as a TensorFlow error wrapping ours, so the
    # ring's own state decides (never the message text).
    return isinstance(err, HorovodInternalError) or _state.ring_broken()


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorator: runs ``func(state, ...)`` elastically (Horovod's ``hvd.elastic.run``).

    Syncs ``state`` from rank 0, then runs ``func``; when the ring breaks, restores the last commit,
    re-forms the ring with the ranks that are left (and new ones), runs the state's reset callbacks,
    syncs and runs ``func`` again. ``func`` must not start with a collective that new ranks would not
    run (as in Horovod).

    Raises:
        RendezvousError: psrun ended the job (e.g. fewer than ``--min-np`` ranks are left).
        HorovodInternalError: the ring broke outside a psrun elastic job.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        reset = _state.reset if _state.elastic_session() is not None else None
        return run_fn(func, reset, _is_ring_failure)(state, *args, **kwargs)

    return wrapper


def _hosts_updated() -> bool:
    session = _state.elastic_session()
    return session is not None and session.hosts_updated()


def _variables(model: Any, optimizer: Any) -> list[Any]:
    return list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])


class TensorFlowKerasState(ObjectState):
    """The state of a Keras model and its optimizer, plus any attributes (``epoch=0``, ``batch=0``).

    ``commit()`` copies the model's and the optimizer's variables to host memory, ``restore()``
    assigns them back, ``sync()`` broadcasts rank 0's (one ring broadcast) and the attributes.

    The model must be built (Horovod's requirement: run a step, or ``model.build(shape)``). An
    optimizer that has not applied a step yet is built here (``optimizer.build``), so its slots are
    part of the state from the start.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: accepted for Horovod's signature (TF1 sessions), unused.
        **kwargs: attributes to keep with the weights.

    Raises:
        ValueError: the model is not built, or there is no optimizer.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True) or not model.variables:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if self.optimizer is None:
            raise ValueError("give the optimizer, or compile the model with it")
        if not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        self.backend = backend
        self._save_model()
        super().__init__(broadcast_object, rank, _hosts_updated, **kwargs)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        worker().broadcast_variables(_variables(self.model, self.optimizer), root=0)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in _variables(self.model, self.optimizer)]

    def _load_model(self) -> None:
        variables = _variables(self.model, self.optimizer)
        if len(variables) != len(self._saved_values):
            raise ValueError(
                f"the model and optimizer hold {len(variables)} variables, the commit "
                f"{len(self._saved_values)}"
            )
        for var, value in zip(variables, self._saved_values, strict=True):
            var.assign(value)


class TensorFlowState(ObjectState):
    """The state of a list of TensorFlow variables, plus any attributes (Horovod's ``TensorFlowState``).

    Args:
        variables: the variables to keep (TF2: required; there are no global variables).
        session: accepted for Horovod's signature (TF1), unused.
        **kwargs: attributes to keep with them.

    Raises:
        ValueError: no variables given.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if not variables:
            raise ValueError("give the variables to keep (TensorFlow 2 has no global variables)")
        self.variables = list(variables)
        self.session = session
        self._save_model()
        super().__init__(broadcast_object, rank, _hosts_updated, **kwargs)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables, self._values, strict=True):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        worker().broadcast_variables(self.variables, root=0)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        self._values = [np.array(v.numpy(), copy=True) for v in self.variables]


__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
]
