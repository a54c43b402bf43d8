"""Parameter-server training for ``model.fit`` and ``GradientTape`` loops (Keras 3 glue).

An existing ``model.fit`` script becomes parameter-server trained by three changes,
in the spirit of Horovod's ``DistributedOptimizer``::

    import psclient.keras as psk

    worker = psk.PSWorker(["ps0:50051", "ps1:50051"], worker_index=0, num_workers=2)  # or from TF_CONFIG
    model.compile(optimizer=psk.DistributedOptimizer(keras.optimizers.Adam(1e-3), worker),  # 1
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(ds, epochs=5, callbacks=[worker.callback()])                               # 2

and for a custom ``GradientTape`` loop::

    worker.attach(model, optimizer=keras.optimizers.Adam(1e-3))
    for x, y in ds:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        worker.apply_gradients(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    worker.finish()

How it works:

- Variables live on the shards, named by their Keras path (``"cnn/conv1/kernel"``);
  build the same model, with the same layer names, on every worker. The chief
  (worker 0) creates them from its model with the Keras optimizer's
  configuration as the server-side optimizer; the other workers wait for them
  and attach (idempotently: a restarted worker attaches again). Every worker
  then starts from the shards' values.
- Each step pushes the gradients and receives new values. The exchange runs
  outside the graph, in a ``tf.numpy_function`` inside Keras's compiled train
  step (so ``fit`` keeps ``tf.function``; XLA ``jit_compile`` must be off).
- ``async`` and ``ssp`` modes overlap communication with compute: step ``k``'s
  fused ``push_pull`` is in flight while step ``k + 1`` computes, on the values
  returned by step ``k - 1``'s ``push_pull`` (one step of extra staleness,
  ``overlap=False`` turns it off). ``sync`` mode pushes with the global step
  (the push is the barrier), then pulls the step's result; a worker whose
  gradient was dropped as stale resyncs to the shards' current step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from psclient._sync_client import PSClient
from psclient.config import ps_addresses_from_tf_config
from psclient.errors import NotFoundError
from psclient.keras._common import StepTimer, check_no_jit, variable_name
from psclient.optimizers import Optimizer, optimizer_from_config

log = logging.getLogger(__name__)

MODES = ("async", "sync", "ssp")
_ATTACH_POLL_S = 0.2


def server_optimizer(optimizer: keras.optimizers.Optimizer | Optimizer) -> Optimizer:
    """The server-side optimizer spec matching a Keras 3 optimizer's configuration.

    Raises:
        ValueError: an optimizer or setting the shards do not implement (schedules, clipping, ...).
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.server_optimizer
    return optimizer_from_config(type(optimizer).__name__, optimizer.get_config())


class PSWorker:
    """One training worker's session with the parameter server.

    Args:
        addresses: ``HOST:PORT`` of every shard; default: the ``ps`` list of ``TF_CONFIG``.
        worker_index: this worker's index; worker 0 (the chief) creates the variables.
        num_workers: number of workers (informational; the shards' flags set M).
        mode: the shards' mode: ``"async"``, ``"sync"`` or ``"ssp"``.
        overlap: async/ssp: overlap step k's push_pull with step k+1's compute.
        worker_id: the id the shards know this worker by (default ``worker<index>``).
        client: an existing ``PSClient`` to use (its addresses win).
        attach_timeout: seconds a non-chief worker waits for the chief to create the variables.
        **client_options: ``PSClient`` arguments (``timeout``, ``auth_token``, TLS paths, ...).

    Raises:
        ValueError: an unknown mode, or no addresses and no TF_CONFIG.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str | None = None,
        *,
        worker_index: int = 0,
        num_workers: int = 1,
        mode: str = "async",
        overlap: bool = True,
        worker_id: str | None = None,
        client: PSClient | None = None,
        attach_timeout: float = 120.0,
        **client_options: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not 0 <= worker_index < max(1, num_workers):
            raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}")
        self.mode = mode
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.overlap = overlap and mode != "sync"
        self.attach_timeout = attach_timeout
        if client is None:
            if addresses is None:
                addresses = list(ps_addresses_from_tf_config())
            client = PSClient(addresses, worker_id=worker_id or f"worker{worker_index}", **client_options)
            self._owns_client = True
        else:
            self._owns_client = False
        self.client = client
        self.step = 0  # sync: the global step; async/ssp: this worker's clock (steps pushed)
        self.stale_steps = 0  # sync: gradients the shards dropped as stale
        self.steps_done = 0
        self._names: list[str] | None = None
        self._variables: list[Any] = []
        self._optimizer: Optimizer | None = None
        self._inflight: concurrent.futures.Future[dict[str, np.ndarray]] | None = None

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    @property
    def attached(self) -> bool:
        return self._names is not None

    # -- setup ----------------------------------------------------------------

    def attach(self, model_or_variables: Any, optimizer: Any = None) -> None:
        """Creates (chief) or finds (others) the variables on the shards, then loads their values.

        Args:
            model_or_variables: a built Keras model (its trainable variables) or a list of variables.
            optimizer: a Keras optimizer, a ``DistributedOptimizer`` or a psclient optimizer spec;
                default: the model's compiled optimizer.

        Raises:
            ValueError: the model is not built, variable names repeat, or the optimizer is unsupported.
            DeadlineExceededError: a non-chief worker waited ``attach_timeout`` for the chief.
            PSError: a shard failed, or the variables exist with a different spec.
        """
        if isinstance(model_or_variables, keras.Model):
            model = model_or_variables
            if not model.built:
                raise ValueError("build the model before attaching it (call it on a batch, or model.build)")
            variables = list(model.trainable_variables)
            optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        else:
            variables = list(model_or_variables)
        if optimizer is None:
            raise ValueError("attach needs an optimizer (the server-side optimizer is built from its config)")
        spec = server_optimizer(optimizer)
        names = [variable_name(v) for v in variables]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"variable names repeat: {dup}; give the layers unique names")
        values = {n: np.asarray(v.numpy()) for n, v in zip(names, variables, strict=True)}
        if not self.is_chief:
            self._wait_for_variables(names)
        created = self.client.create_many(values, optimizer=spec)  # idempotent; checks the spec
        self._names, self._variables, self._optimizer = names, variables, spec
        log.info(
            "worker %d attached %d variables (%d created here, %s)",
            self.worker_index,
            len(names),
            sum(created.values()),
            type(spec).__name__,
        )
        self.refresh()

    def _wait_for_variables(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.attach_timeout
        while True:
            try:
                self.client.pull_with_versions(names)
                return
            except NotFoundError as err:
                if time.monotonic() > deadline:
                    from psclient.errors import DeadlineExceededError

                    raise DeadlineExceededError(
                        f"worker {self.worker_index}: the chief (worker 0) did not create the variables "
                        f"within {self.attach_timeout:.0f}s: {err}"
                    ) from err
                time.sleep(_ATTACH_POLL_S)

    def refresh(self) -> None:
        """Loads the shards' current values into the variables (and, in sync mode, the global step)."""
        names = self._require()
        self._drain()
        values, versions = self.client.pull_with_versions(names)
        for name, var in zip(names, self._variables, strict=True):
            var.assign(values[name])
        if self.mode == "sync":
            self.step = max(versions.values(), default=0)

    def finish(self) -> None:
        """End of training: waits for the in-flight push, tells the shards this worker is done (sync and
        ssp barriers stop waiting for it), and loads the final values."""
        if self.attached:
            self._drain()
            if self.mode != "async":
                self.client.leave()
            self.refresh()

    def close(self) -> None:
        """Drains the in-flight exchange, closes the client (if this worker made it). Idempotent."""
        try:
            self._drain()
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> PSWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require(self) -> list[str]:
        if self._names is None:
            raise RuntimeError(
                "the worker is not attached to the parameter server: pass worker.callback() to "
                "model.fit, or call worker.attach(model) before training"
            )
        return self._names

    def _drain(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is not None:
            self._wait(fut)

    def _wait(self, fut: concurrent.futures.Future[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        try:
            return fut.result(self.client.wait_timeout)
        except TimeoutError:
            fut.cancel()
            raise

    # -- one step -------------------------------------------------------------

    def exchange(self, names: Sequence[str], grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Pushes one step's gradients and returns the values to train on next (eager; numpy in and out).

        Raises:
            PSError: a shard failed, rejected the gradients, or a barrier timed out.
        """
        self._require()
        gmap = {n: np.asarray(g) for n, g in zip(names, grads, strict=True)}
        self.steps_done += 1
        if self.mode == "sync":
            step = self.step
            applied = self.client.push(gmap, step=step)
            values, versions = self.client.pull_with_versions(list(names))
            if not applied:
                self.stale_steps += 1
                log.info("worker %d: gradient for step %d dropped as stale", self.worker_index, step)
            self.step = max(max(versions.values(), default=0), step + (1 if applied else 0))
            return [values[n] for n in names]
        # Straight onto the client's loop: no helper thread blocks on the call.
        fut = self.client.push_pull_future(gmap, step=self.step)
        self.step += 1
        if not self.overlap:
            values = self._wait(fut)
        else:
            prev, self._inflight = self._inflight, fut
            if prev is None:  # first step: nothing earlier to take values from
                values = self._wait(fut)
            else:
                values = self._wait(prev)
                if set(values) != set(names):  # variables without gradients this step
                    values = {**values, **self._wait(fut)}
                    self._inflight = None
        return [values[n] for n in names]

    def apply_gradients(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> None:
        """Exchanges gradients with the shards and assigns the new values; eager or inside ``tf.function``.

        Args:
            grads: gradients, parallel to ``variables`` (None entries are skipped).
            variables: the attached variables (default: all of them, in attach order).

        Raises:
            PSError: see ``exchange`` (wrapped by TensorFlow inside a graph).
        """
        names = self._require()
        if variables is None:
            variables = self._variables
        pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        if not pairs:
            return
        var_names = [variable_name(v) for _, v in pairs]
        unknown = sorted(set(var_names) - set(names))
        if unknown:
            raise ValueError(f"variables {unknown} were not attached to the parameter server")
        tensors = [tf.convert_to_tensor(g) for g, _ in pairs]
        if tf.executing_eagerly():
            new = self.exchange(var_names, [t.numpy() for t in tensors])
            for (_, var), value in zip(pairs, new, strict=True):
                var.assign(value)
            return
        dtypes = [tf.as_dtype(v.dtype) for _, v in pairs]
        new = tf.numpy_function(
            _exchange_fn(self, var_names), tensors, Tout=dtypes, stateful=True, name="ps_exchange"
        )
        for (_, var), value in zip(pairs, new, strict=True):
            value.set_shape(var.shape)
            var.assign(value)

    # -- Keras -----------------------------------------------------------------

    def callback(self) -> PSCallback:
        """The ``fit`` callback: attach at train begin, load the final values at train end."""
        return PSCallback(self)


def _exchange_fn(worker: PSWorker, names: list[str]) -> Callable[..., list[np.ndarray]]:
    def fn(*grads: np.ndarray) -> list[np.ndarray]:
        return worker.exchange(names, grads)

    return fn


def load_from_ps(model_or_variables: Any, client: PSClient) -> None:
    """Assigns the shards' current values to a model's variables (for an evaluator or a final export).

    Raises:
        NotFoundError: a variable is not on the shards (different model or layer names).
        PSError: a shard failed.
    """
    if isinstance(model_or_variables, keras.Model):
        variables = list(model_or_variables.trainable_variables)
    else:
        variables = list(model_or_variables)
    names = [variable_name(v) for v in variables]
    values = client.pull(names)
    for name, var in zip(names, variables, strict=True):
        var.assign(values[name])


class DistributedOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer whose updates happen on the parameter server.

    The wrapped optimizer's configuration becomes the server-side optimizer
    (same update rule and defaults); no optimizer state lives on the worker.
    Use with ``model.compile(optimizer=...)`` and ``PSCallback``.

    Args:
        optimizer: a Keras ``SGD``, ``Adam``, ``Adagrad`` or ``RMSprop`` (constant learning rate).
        worker: the ``PSWorker`` to train on.

    Raises:
        ValueError: an optimizer or setting the shards do not implement.
    """

    def __init__(
        self, optimizer: keras.optimizers.Optimizer, worker: PSWorker, name: str | None = None
    ) -> None:
        spec = server_optimizer(optimizer)
        super().__init__(
            learning_rate=float(spec.params().get("learning_rate", 0.0)), name=name or "ps_optimizer"
        )
        self.inner = optimizer
        self.worker = worker
        self.server_optimizer = spec

    def _backend_apply_gradients(self, grads: list[Any], trainable_variables: list[Any]) -> None:
        self.worker.apply_gradients(grads, trainable_variables)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["inner"] = keras.optimizers.serialize(self.inner)
        return config


class PSCallback(StepTimer):
    """Attaches the model to the parameter server when ``fit`` begins; loads the final values when it ends.

    Also records throughput: ``steps_per_second`` (steps after the first, which traces the graph).
    """

    def __init__(self, worker: PSWorker) -> None:
        super().__init__()
        self.worker = worker

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        check_no_jit(model, "parameter-server training")
        if not isinstance(model.optimizer, DistributedOptimizer):
            raise ValueError(
                "compile the model with psclient.keras.DistributedOptimizer(keras_optimizer, worker)"
            )
        if self.worker.attached:
            self.worker.refresh()
        else:
            self.worker.attach(model, model.optimizer)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_end(logs)
        self.worker.finish()


__all__ = [
    "MODES", "DistributedOptimizer", "PSCallback", "PSWorker", "load_from_ps", "server_optimizer",
]  # fmt: skip
