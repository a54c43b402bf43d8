"""Parameter-server training for ``model.fit`` and ``GradientTape`` loops (Keras 3 glue).

An existing ``model.fit`` script becomes parameter-server trained by three changes,
in the spirit of Horovod's ``DistributedOptimizer``::

    import psclient.keras as psk

    worker = psk.PSWorker(["ps0:50051", "ps1:50051"])        # index and count from TF_CONFIG, or
    # worker = psk.PSWorker([...], worker_index=1, num_workers=2)
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

- All of a model's state lives on the shards, under names relative to the model
  (``psclient.keras.model_variable_names``: the same for every copy of the model
  in any process). Trainable variables are updated by the server-side optimizer
  built from the Keras optimizer's configuration. Non-trainable floating-point
  state (BatchNorm moving statistics, the weights of frozen layers) is shared too:
  each step, the change a worker's forward pass made to it (``new - old``) is
  added to the shard's value (in sync mode, the mean of the step's changes), and
  the worker continues from the shard's value. Frozen weights never change, so
  they cost nothing after the first pull. Random generators' states stay local.
- The chief (worker 0) creates the variables; the other workers wait for them and
  attach (idempotently: a restarted worker attaches again). Every worker then
  starts from the shards' values. Variables an optimizer sees first in the train
  step (a GAN's two optimizers, a layer unfrozen before a second ``fit``) are
  attached when it first applies them.
- Each step pushes the gradients and receives new values. The exchange is host
  code inside Keras's compiled train step, staged by the backend's adapter
  (``psclient.keras._backend``): a ``tf.numpy_function`` on TensorFlow (``fit``
  keeps ``tf.function``; XLA ``jit_compile`` must be off), an ordered
  ``io_callback`` in the jitted stateless step on JAX (``fit`` stays compiled),
  a direct call in PyTorch's eager step. This module imports no TensorFlow.
- ``async`` and ``ssp`` modes can overlap communication with compute
  (``overlap=True``): step ``k``'s fused ``push_pull`` is in flight while step
  ``k + 1`` computes, on the values returned by step ``k - 1``'s ``push_pull``
  (one step of extra staleness; off by default). ``sync`` mode pushes with the global step
  (the push is the barrier), then pulls the step's result; a worker whose
  gradient was dropped as stale resyncs to the shards' current step.
- Worker side (as Keras does them): ``global_clipnorm`` (it needs all of a step's
  gradients), ``gradient_accumulation_steps`` (one push per k steps), loss scaling
  (``LossScaleOptimizer`` / ``mixed_float16``). Shard side: the update rule,
  learning-rate schedules (evaluated from each variable's update count),
  ``weight_decay``, ``clipnorm`` and ``clipvalue``. A learning rate set by a
  callback (``LearningRateScheduler``, ``ReduceLROnPlateau``) is sent to the shards
  before the next step.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import keras
import numpy as np

from psclient._sync_client import PSClient
from psclient.config import ps_addresses_from_tf_config
from psclient.keras import _backend
from psclient.keras._common import DeferredExchanges, StepTimer, variable_name
from psclient.keras._naming import model_variable_names
from pscore.embedding import Regularizer, Rows
from pscore.errors import DeadlineExceededError, InvalidArgumentError, PSError
from pscore.optimizers import SGD, Optimizer, optimizer_from_config
from pscore.tf_config import read_tf_config

log = logging.getLogger(__name__)

MODES = ("async", "sync", "ssp")
_ATTACH_POLL_S = 0.2
# Non-trainable state: a push carries the worker's change to the value, applied by SGD with rate 1
# (w - 1 * (-delta) = w + delta; in sync mode the mean of the step's changes).
STATE_OPTIMIZER = SGD(learning_rate=1.0)
# Keras optimizer settings the worker applies itself (they are not per-variable rules).
_WORKER_SIDE_KEYS = ("global_clipnorm", "gradient_accumulation_steps")
# No rows of a psclient.keras.Embedding (what comes back for its table; what a step's backward pass gave none)
_NO_ROWS = Rows(np.zeros(0, np.int64), np.zeros((0, 0), np.float32))


def _keras_optimizer(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, str | dict):
        return keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer or its name, got {type(optimizer)!r}")
    return optimizer


def _unwrap_loss_scale(optimizer: Any) -> Any:
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def server_optimizer(optimizer: Any) -> Optimizer:
    """The server-side optimizer spec matching a Keras 3 optimizer (or its name, e.g. ``"adam"``).

    Settings the worker applies itself (``global_clipnorm``, ``gradient_accumulation_steps``,
    loss scaling) are not part of the spec.

    Raises:
        ValueError: an optimizer or setting the shards do not implement.
        TypeError: not an optimizer.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.server_optimizer
    inner = _keras_optimizer(_unwrap_loss_scale(optimizer))
    config = {k: v for k, v in inner.get_config().items() if k not in _WORKER_SIDE_KEYS}
    return optimizer_from_config(type(inner).__name__, config)


def _is_table(spec: Any) -> bool:
    """Whether a stored spec is a piece of an embedding table (fixed, or dynamic: a hash table)."""
    return bool(spec.HasField("table") or spec.HasField("dynamic"))


def _embedding_tables(model: keras.Model) -> list[Any]:
    """The tables of a model's trainable ``keras.layers.Embedding`` layers (gradients: IndexedSlices)."""
    return [
        layer.embeddings
        for layer in _flatten(model)
        if isinstance(layer, keras.layers.Embedding)
        and layer.trainable
        and getattr(layer, "embeddings", None) is not None
        and len(layer.embeddings.shape) == 2
    ]


def _remote_tables(model: keras.Model) -> dict[int, Any]:
    """id(anchor) -> layer, for a model's ``psclient.keras.Embedding`` layers (rows only on the shards)."""
    return {
        id(layer.anchor): layer
        for layer in _flatten(model)
        if getattr(layer, "_ps_remote_table", False) and getattr(layer, "anchor", None) is not None
    }


def _nbytes(x: Any) -> int:
    """Payload bytes of a dense array or of ``Rows`` (ids and values)."""
    if isinstance(x, Rows):
        return int(np.asarray(x.ids).nbytes + np.asarray(x.values).nbytes)
    return int(np.asarray(x).nbytes)


def _flatten(model: keras.Model) -> list[Any]:
    """A model's layers, nested ones included."""
    return list(model._flatten_layers()) if hasattr(model, "_flatten_layers") else list(model.layers)


def _row_optimizer(optimizer: Any) -> Optimizer | None:
    """The server-side spec of ``optimizer`` when the shards can apply it to a table row by row, else None."""
    if optimizer is None:
        return None
    try:
        spec = server_optimizer(optimizer)
    except (TypeError, ValueError):
        return None
    return None if spec.needs_whole_variable or spec.gradient_accumulation_steps else spec


def _shard_regularizer(regularizer: Any, *, every_row: bool) -> Regularizer | None:
    """The shards' form of a Keras ``L1``, ``L2`` or ``L1L2`` regularizer; None for none or another kind."""
    if regularizer is None:
        return None
    regularizer = keras.regularizers.get(regularizer)
    if type(regularizer) not in (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2):
        return None
    l1 = float(getattr(regularizer, "l1", 0.0) or 0.0)
    l2 = float(getattr(regularizer, "l2", 0.0) or 0.0)
    return Regularizer(l1=l1, l2=l2, every_row=every_row)


def _is_built(model: keras.Model) -> bool:
    """Whether a model and its layers are built (Keras builds a subclassed model, or a ``Sequential``
    without ``Input``, on its first call: in ``fit``, when the train step is first traced). A model
    without ``call`` (its own ``train_step`` calls its parts) is never marked built: its parts are."""
    own = model.built or type(model).call is keras.Model.call
    return bool(own and model.variables) and all(
        layer.built for layer in _flatten(model) if layer is not model
    )


def _has_value(variable: Any) -> bool:
    """Whether a variable has a value to read (eager): not one made by a ``tf.function`` trace that
    TensorFlow has not initialized yet."""
    return bool(np.shape(keras.ops.convert_to_numpy(variable)) == tuple(variable.shape))


def _same_but_rate(stored: Any, spec: Optimizer) -> bool:
    """Whether a stored ``OptimizerSpec`` equals ``spec`` except for a constant learning rate."""
    mine = spec.to_proto()
    if stored.HasField("learning_rate_schedule") or mine.HasField("learning_rate_schedule"):
        return bool(stored == mine)
    a, b = dict(stored.params), dict(mine.params)
    a.pop("learning_rate", None)
    b.pop("learning_rate", None)
    return stored.name == mine.name and a == b


def _worker_from_tf_config(worker_index: int | None, num_workers: int | None) -> tuple[int, int]:
    """This worker's index and the number of workers: given, else from TF_CONFIG, else 0 of 1."""
    try:
        cfg = read_tf_config()
    except ValueError:
        cfg = None
    if cfg is not None and cfg.task_type in ("chief", "worker"):
        rank, count = cfg.worker_rank(), len(cfg.workers)
        if worker_index is not None and worker_index != rank:
            log.warning(
                "worker_index=%d given; TF_CONFIG says %d (using %d)", worker_index, rank, worker_index
            )
        return (rank if worker_index is None else worker_index), (
            count if num_workers is None else num_workers
        )
    count = 1 if num_workers is None else num_workers
    if worker_index is None:
        if count > 1:
            raise ValueError(
                f"num_workers={count} but no worker_index and no TF_CONFIG worker task: give each worker "
                "its own worker_index (0 is the chief), or set TF_CONFIG"
            )
        worker_index = 0
    return worker_index, count


class PSWorker(DeferredExchanges):
    """One training worker's session with the parameter server.

    Args:
        addresses: ``HOST:PORT`` of every shard; default: the ``ps`` list of ``TF_CONFIG``.
        worker_index: this worker's index; worker 0 (the chief) creates the variables.
            Default: this task's rank in ``TF_CONFIG`` (chief, then workers), else 0.
        num_workers: number of workers (default: from ``TF_CONFIG``, else 1).
        mode: the shards' mode: ``"async"``, ``"sync"`` or ``"ssp"``; default: asked from the shards
            (a mode given that differs from theirs is refused when attaching).
        overlap: async/ssp: overlap step k's push_pull with step k+1's compute, which then trains on
            values one step staler (off by default: with a high learning rate the extra staleness can
            make async training diverge; see the README).
        worker_id: the id the shards know this worker by (default ``worker<index>``); unique per worker.
        client: an existing ``PSClient`` to use (its addresses win).
        attach_timeout: seconds a non-chief worker waits for the chief to create the variables.
        table_regularization: where an ``Embedding``'s L1/L2 ``embeddings_regularizer`` applies, on
            the shards that hold the rows (the table never travels whole): ``"lazy"`` (default) to
            the rows each step touches, as embedding systems do; ``"exact"`` to every row on every
            update, as local Keras does (each shard then updates its whole piece per push).
        **client_options: ``PSClient`` arguments (``timeout``, ``auth_token``, TLS paths, ...).

    Not thread-safe: one worker per training loop.

    Raises:
        ValueError: an unknown mode, a bad index, or no addresses and no TF_CONFIG.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str | None = None,
        *,
        worker_index: int | None = None,
        num_workers: int | None = None,
        mode: str | None = None,
        overlap: bool = False,
        worker_id: str | None = None,
        client: PSClient | None = None,
        attach_timeout: float = 120.0,
        table_regularization: str = "lazy",
        **client_options: Any,
    ) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if table_regularization not in ("lazy", "exact"):
            raise ValueError(f"table_regularization must be 'lazy' or 'exact', got {table_regularization!r}")
        self.table_regularization = table_regularization
        worker_index, num_workers = _worker_from_tf_config(worker_index, num_workers)
        if not 0 <= worker_index < max(1, num_workers):
            raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}")
        self._given_mode = mode
        self.mode = mode or "async"  # until the shards are asked (attach)
        self._overlap = overlap
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.overlap = overlap and self.mode != "sync"
        self.attach_timeout = attach_timeout
        if client is None:
            if addresses is None:
                addresses = list(ps_addresses_from_tf_config())
            client = PSClient(addresses, worker_id=worker_id or f"worker{worker_index}", **client_options)
            self._owns_client = True
        else:
            self._owns_client = False
        self.client = client
        self._backend = _backend.adapter()  # how this Keras backend runs host code in a step
        self.step = 0  # sync: the global step; async/ssp: this worker's clock (steps pushed)
        self.stale_steps = 0  # sync: gradients the shards dropped as stale
        self.steps_done = 0
        # Payload of the exchanges (gradients and state changes out; values and rows back), in bytes.
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self._model_names: dict[int, str] = {}  # id(variable) -> stable name, for attached models
        self._vars: dict[str, Any] = {}  # every attached variable by name
        self._specs: dict[str, Optimizer] = {}  # its server-side optimizer
        self._state: list[tuple[str, Any]] = []  # non-trainable shared state, in attach order
        self._table_candidates: set[str] = set()  # Embedding layers' tables: rows spread over the shards
        self._regularizers: dict[int, Regularizer] = {}  # id(table variable) -> its (shard-side) regularizer
        self._dense_warned: set[str] = set()  # tables whose gradient came dense (warned once)
        self._regularizers_by_name: dict[str, Regularizer] = {}
        self._tables: set[str] = set()  # those that are tables on the shards: pushed and pulled by row
        self._remote: dict[str, Any] = {}  # psclient.keras.Embedding layers by table name: no local copy
        self._base: dict[str, np.ndarray] = {}  # state: the value last loaded from the shards
        self._optimizers: dict[int, DistributedOptimizer] = {}  # those that applied gradients
        self._sent_lr: dict[int, float] = {}
        self._inflight: concurrent.futures.Future[dict[str, np.ndarray]] | None = None
        self._attached = False
        self._pending: tuple[keras.Model, Any] | None = None  # attached once its first step builds it
        self._left = False  # told the shards it is done (sync/ssp); a push counts it in again
        self._fit_running = False  # between the fit callback's train begin and end
        self._fit_ended = False  # after a fit, until the next
        self._restored = False  # model.set_weights during the fit (EarlyStopping restoring the best)
        self._closed = False
        atexit.register(self.close)  # a script that never closes the worker still leaves the barriers

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    @property
    def attached(self) -> bool:
        """Whether ``attach`` was called (by the ``fit`` callback or the training script)."""
        return self._attached

    @property
    def optimizers(self) -> list[DistributedOptimizer]:
        """The ``DistributedOptimizer`` instances that applied gradients through this worker."""
        return list(self._optimizers.values())

    def name_of(self, variable: Any) -> str:
        """The variable's name on the shards (stable names for attached models' variables)."""
        return self._model_names.get(id(variable)) or variable_name(variable)

    # -- setup ----------------------------------------------------------------

    def attach(self, model_or_variables: Any, optimizer: Any = None) -> None:
        """Creates (chief) or finds (others) the variables on the shards, then loads their values.

        A model's trainable variables get the server-side optimizer; its non-trainable
        floating-point state (BatchNorm statistics, frozen layers) is shared as described in
        the module docs. Attaching again (a second ``fit``, after unfreezing a layer) is
        idempotent for what did not change.

        A model that is not built yet (a subclassed model, a ``Sequential`` without ``Input``:
        Keras builds them when ``fit`` first traces the train step) is attached when its first
        step applies gradients: inside that trace, before the step runs, so the first step
        already computes on the shards' values.

        Args:
            model_or_variables: a Keras model, or a list of (trainable) variables.
            optimizer: a Keras optimizer (or its name), a ``DistributedOptimizer`` or a psclient
                optimizer spec; default: the model's compiled ``DistributedOptimizer``. Without one,
                only the model's state is attached now, and the trainable variables when a
                ``DistributedOptimizer`` first applies them.

        Raises:
            ValueError: variable names repeat, or the optimizer is unsupported.
            DeadlineExceededError: a non-chief worker waited ``attach_timeout`` for the chief.
            PSError: a shard failed, or the variables exist with a different spec.
        """
        if not self._attached:
            self._check_mode()
        if isinstance(model_or_variables, keras.Model):
            self._move_regularizers(model_or_variables, optimizer)
        if isinstance(model_or_variables, keras.Model) and not _is_built(model_or_variables):
            self._pending = (model_or_variables, optimizer)
            self._watch_set_weights(model_or_variables)
            self._backend.prepare_unbuilt(self, model_or_variables)
            log.info(
                "worker %d: model %r is not built yet; it is built and attached when fit traces its first "
                "step (a GradientTape loop: when it first applies gradients)",
                self.worker_index,
                model_or_variables.name,
            )
            return
        self._pending = None
        if isinstance(model_or_variables, keras.Model):
            model = model_or_variables
            named = model_variable_names(model)
            self._watch_set_weights(model)
            embeddings = {id(v) for v in _embedding_tables(model)}
            self._table_candidates.update(n for v, n in named if id(v) in embeddings)
            self._regularizers_by_name.update(
                {n: self._regularizers[id(v)] for v, n in named if id(v) in self._regularizers}
            )
            self._model_names.update({id(v): n for v, n in named})
            remote = _remote_tables(model)
            if remote and isinstance(
                getattr(model, "optimizer", None), keras.mixed_precision.LossScaleOptimizer
            ):
                raise ValueError(
                    "psclient.keras.Embedding does not support loss scaling (LossScaleOptimizer, "
                    "mixed_float16): its row gradients bypass the optimizer's unscaling; use float32 or "
                    "keras.layers.Embedding"
                )
            self._remote.update({n: remote[id(v)] for v, n in named if id(v) in remote})
            own = [v for v, _ in named if id(v) in remote and remote[id(v)].server_optimizer is not None]
            trainable = [v for v, _ in named if v.trainable and all(v is not o for o in own)]
            state = [v for v, _ in named if not v.trainable]
            if optimizer is None:
                compiled = _unwrap_loss_scale(getattr(model, "optimizer", None))
                optimizer = compiled if isinstance(compiled, DistributedOptimizer) else None
        else:
            trainable, state = list(model_or_variables), []
        groups: list[tuple[list[Any], Optimizer]] = [(state, STATE_OPTIMIZER)]
        if optimizer is not None:
            groups.append((trainable, server_optimizer(optimizer)))
        if isinstance(model_or_variables, keras.Model):
            groups += [([v], remote[id(v)].server_optimizer) for v in own]
        self._register(groups, check=True)
        self._attached = True
        if self._vars:
            self.refresh()

    def _move_regularizers(self, model: keras.Model, optimizer: Any) -> None:
        """Moves the L1/L2 ``embeddings_regularizer`` of the model's ``Embedding`` layers to the shards.

        In the loss, a table's regularizer gives every row a gradient every step, and the whole
        table would travel with each push. The shards apply it to the rows instead (see
        ``table_regularization``), so the layer's variable stops carrying it; for a layer not built
        yet, as soon as its ``build`` makes the variable (before the train step computes the loss).
        Other regularizers, or an optimizer the shards cannot apply by row, keep it in the loss.
        """
        spec = _row_optimizer(optimizer if optimizer is not None else getattr(model, "optimizer", None))
        if spec is None:
            return
        for layer in _flatten(model):
            if not isinstance(layer, keras.layers.Embedding) or not layer.trainable:
                continue
            reg = _shard_regularizer(
                layer.embeddings_regularizer, every_row=self.table_regularization == "exact"
            )
            if reg is None:
                continue
            if layer.built:
                self._take_regularizer(layer, reg)
            elif not getattr(layer, "_psclient_regularizer_moved", False):
                layer.build = self._build_then_take(layer, reg)
                layer._psclient_regularizer_moved = True

    def _build_then_take(self, layer: keras.layers.Embedding, reg: Regularizer) -> Callable[..., None]:
        """The layer's ``build``, then ``_take_regularizer`` (Keras reads build's signature: kept)."""
        original = layer.build

        @functools.wraps(original)
        def build(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            self._take_regularizer(layer, reg)

        return build

    def _take_regularizer(self, layer: keras.layers.Embedding, reg: Regularizer) -> None:
        variable = getattr(layer, "_embeddings", None)
        if variable is None or len(variable.shape) != 2:
            return
        variable.regularizer = None
        self._regularizers[id(variable)] = reg

    def _watch_set_weights(self, model: keras.Model) -> None:
        """Notices ``model.set_weights`` (``EarlyStopping(restore_best_weights=True)`` restores the best
        weights with it when ``fit`` ends) so that the shards get those weights too."""
        if getattr(model, "_psclient_watched", False):
            return
        original = model.set_weights

        def set_weights(weights: Any) -> None:
            original(weights)
            self._weights_set(model)

        model.set_weights = set_weights
        model._psclient_watched = True

    def begin_fit(self, model: keras.Model, optimizer: Any = None) -> None:
        """``fit`` begins (the callback): attaches the model (see ``attach``)."""
        self.attach(model, optimizer)
        self._fit_running, self._fit_ended, self._restored = True, False, False

    def end_fit(self, model: keras.Model) -> None:
        """``fit`` ends (the callback): the shards take weights a callback restored before this one
        (``EarlyStopping(restore_best_weights=True)``, chief only), then the worker loads the shards'
        values; it stays expected by sync/ssp barriers (``finish(leave=False)``)."""
        self._fit_running = False
        if self._restored and self.is_chief:
            self.assign_from(model)
        self.finish(leave=False)
        self._fit_ended = True

    def _weights_set(self, model: keras.Model) -> None:
        if self._fit_running:  # a callback before ours, at the end of fit: we push them in on_train_end
            self._restored = True
        elif self._fit_ended and self.is_chief:  # after our on_train_end: push them now
            self.assign_from(model)

    def assign_from(self, model_or_variables: Any) -> None:
        """Sets the shards' values to this worker's (the chief's best weights after early stopping).

        Optimizer slots on the shards are kept, as Keras keeps them when weights are restored.

        Raises:
            PSError: a shard failed.
        """
        self._drain()
        variables = (
            [v for v, _ in model_variable_names(model_or_variables)]
            if isinstance(model_or_variables, keras.Model)
            else list(model_or_variables)
        )
        values = {}
        with self._backend.eager():
            for var in variables:
                name = self.name_of(var)
                if name in self._vars and name not in self._remote:
                    values[name] = np.array(keras.ops.convert_to_numpy(var))
        self.client.assign(values)
        for name, value in values.items():
            if name in self._base:
                self._base[name] = value
        log.info(
            "worker %d: the shards now hold this worker's weights (%d variables)",
            self.worker_index,
            len(values),
        )

    def _check_mode(self) -> None:
        """Takes the mode from the shards; refuses a given mode that differs (it would train wrongly)."""
        modes = sorted({s.mode for s in self.client.status()})
        if len(modes) != 1:
            raise ValueError(f"the shards run in different modes ({', '.join(modes)}); restart them alike")
        if self._given_mode is not None and modes[0] != self._given_mode:
            raise ValueError(
                f"this worker was started for {self._given_mode!r} mode but the shards run in {modes[0]!r} "
                f"mode: start the shards with --mode {self._given_mode}, or the worker with mode={modes[0]!r}"
            )
        self.mode = modes[0]
        self.overlap = self._overlap and self.mode != "sync"

    def _register(self, groups: list[tuple[list[Any], Optimizer]], *, check: bool = False) -> list[str]:
        """Creates or finds variables with their specs; returns the names it (re)attached.

        Args:
            groups: variables, each group with its server-side optimizer.
            check: compare with the shards also what this worker attached before (a new ``fit``,
                a new optimizer: a callback may have changed the shards' learning rate).
        """
        todo: list[tuple[str, Any, Optimizer]] = []
        for variables, spec in groups:
            for var in variables:
                name = self.name_of(var)
                if check or self._specs.get(name) != spec or self._vars.get(name) is not var:
                    todo.append((name, var, spec))
        names = [n for n, _, _ in todo]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"variable names repeat: {dup}; give the layers unique names")
        if not todo:
            return []
        with self._backend.eager():  # also when first seen while tracing the train step
            values = {n: np.asarray(keras.ops.convert_to_numpy(v)) for n, v, _ in todo}
        unset = [n for n, v, _ in todo if values[n].shape != tuple(v.shape)]
        if unset:  # made inside a tf.function that has not run yet: no value to create or set
            raise ValueError(
                f"variables {unset[:3]} were created inside a tf.function and have no values yet: build the "
                "model before training (call it on a batch, or model.build(input_shape))"
            )
        created = self._reconcile({n: s for n, _, s in todo}, values)
        for name, var, spec in todo:
            self._vars[name], self._specs[name] = var, spec
            if spec is STATE_OPTIMIZER:
                if all(n != name for n, _ in self._state):
                    self._state.append((name, var))
            else:
                self._state = [(n, v) for n, v in self._state if n != name]
                self._base.pop(name, None)
        log.info(
            "worker %d attached %d variables (%d created here; %d shared non-trainable)",
            self.worker_index,
            len(todo),
            created,
            sum(1 for _, _, s in todo if s is STATE_OPTIMIZER),
        )
        return names

    def _reconcile(self, wanted: dict[str, Optimizer], values: dict[str, np.ndarray]) -> int:
        """Makes the shards hold ``wanted`` variables with these optimizers; returns how many it created.

        The chief creates what is missing and, where a variable exists with another optimizer
        (a recompiled model, a layer frozen or unfrozen), gives it the new one: a learning rate
        that differs alone is set (a callback may have changed it; slots kept), any other change
        replaces the optimizer with fresh slots, as compiling with a new Keras optimizer does.
        The other workers wait until the shards hold the variables with their optimizers (up to
        the learning rate).

        Raises:
            DeadlineExceededError: a non-chief worker waited ``attach_timeout`` for the chief.
        """
        names = list(wanted)
        deadline = time.monotonic() + self.attach_timeout
        while True:
            listed = self.client.list_variables(names)
            missing = [n for n in names if n not in listed]
            stored = {n: listed[n][0].spec.optimizer for n in names if n in listed}
            differ = [n for n in stored if stored[n] != wanted[n].to_proto()]
            self._tables.update(n for n in stored if _is_table(listed[n][0].spec))
            if self.is_chief:
                break
            pending = missing + [n for n in differ if not _same_but_rate(stored[n], wanted[n])]
            if not pending:
                return 0
            if time.monotonic() > deadline:
                got = ", ".join(
                    f"{n}: {stored[n].name}" if n in stored else f"{n}: missing" for n in pending[:5]
                )
                raise DeadlineExceededError(
                    f"worker {self.worker_index}: the chief (worker 0) did not create or update "
                    f"{len(pending)} variable(s) within {self.attach_timeout:.0f}s ({got}); "
                    "is worker 0 running the same model and optimizer?"
                )
            time.sleep(_ATTACH_POLL_S)
        created = 0
        for n in [n for n in missing if n in self._remote]:
            created += self._create_remote_table(n, wanted[n])
        for n in [n for n in missing if n in self._table_candidates and wanted[n] is not STATE_OPTIMIZER]:
            created += self._create_table(n, values[n], wanted[n])
        missing = [n for n in missing if n not in self._tables]
        for spec in {id(wanted[n]): wanted[n] for n in missing}.values():
            batch = {n: values[n] for n in missing if wanted[n] is spec}
            created += sum(self.client.create_many(batch, optimizer=spec).values())
        rates: dict[float, list[str]] = {}
        replaced: dict[Optimizer, list[str]] = {}
        for n in differ:
            if _same_but_rate(stored[n], wanted[n]):
                rates.setdefault(float(wanted[n].params()["learning_rate"]), []).append(n)
            else:
                replaced.setdefault(wanted[n], []).append(n)
        for rate, group in rates.items():
            self.client.set_learning_rate(rate, group)
        for spec, group in replaced.items():
            log.info(
                "worker %d: %d variable(s) get a new optimizer (%s)", self.worker_index, len(group), spec.name
            )
            self.client.replace_optimizer(spec, group)
        return created

    def _create_table(self, name: str, value: np.ndarray, spec: Optimizer) -> int:
        """Creates an Embedding's table as rows spread over the shards (``create_embedding``), with this
        worker's initial values; returns 1 if created. An optimizer the shards cannot apply row by row
        (Adafactor, Lamb, clipnorm) keeps it a whole variable (its gradients are then sent whole)."""
        try:
            created = self.client.create_embedding(
                name, value.shape[0], value.shape[1], dtype=value.dtype, optimizer=spec,
                initializer=lambda ids, dim, dtype: value[np.asarray(ids)].astype(dtype, copy=False),
                regularizer=self._regularizers_by_name.get(name),
            )  # fmt: skip
        except InvalidArgumentError as err:
            log.info("worker %d: %s stays a whole variable on the shards: %s", self.worker_index, name, err)
            return 0
        self._tables.add(name)
        return int(created)

    def _create_remote_table(self, name: str, spec: Optimizer) -> int:
        """Creates a ``psclient.keras.Embedding``'s table on the shards (no local values); 1 if created."""
        layer = self._remote[name]
        reg = _shard_regularizer(
            layer.embeddings_regularizer,
            every_row=self.table_regularization == "exact" and layer.input_dim is not None,
        )
        if layer.embeddings_regularizer is not None and reg is None:
            raise ValueError(
                f"psclient.keras.Embedding {layer.name!r}: embeddings_regularizer "
                f"{layer.embeddings_regularizer!r} cannot run on the shards (L1, L2 and L1L2 can)"
            )
        try:
            created = self.client.create_embedding(
                name, optimizer=spec, regularizer=reg, **layer.table_options()
            )
        except InvalidArgumentError as err:
            raise ValueError(f"psclient.keras.Embedding {layer.name!r}: {err}") from None
        self._tables.add(name)
        return int(created)

    def refresh(self, names: Sequence[str] | None = None) -> None:
        """Loads the shards' current values into the variables (and, in sync mode, the global step)."""
        self._require()
        self._drain()
        wanted = [n for n in (list(self._vars) if names is None else names) if n not in self._remote]
        values = self.client.pull(wanted)
        with self._backend.eager():
            for name in wanted:
                self._vars[name].assign(values[name])
                if self._specs[name] is STATE_OPTIMIZER:
                    self._base[name] = np.array(values[name])
        if self.mode == "sync" and names is None:
            self.step = self._shards_step()

    def _shards_step(self) -> int:
        """Sync mode: the step the shards gather now (every shard completes every step): the smallest,
        so that a shard restored from an earlier checkpoint gets every step from its own on."""
        return min((s.step for s in self.client.status()), default=0)

    def sync_learning_rates(self) -> None:
        """Sends a learning rate changed on a ``DistributedOptimizer`` (by a callback) to the shards."""
        for key, opt in self._optimizers.items():
            if opt.has_schedule:
                continue
            if key not in self._sent_lr:  # what the shards hold: the rate it attached its variables with
                held = opt.server_optimizer.params().get("learning_rate")
                if isinstance(held, int | float):
                    self._sent_lr[key] = float(np.float32(held))  # as the Keras variable holds it
            lr = self._backend.read_rate(opt.learning_rate)
            if lr is None:  # not readable now, and so not changed since it was read (JAX's fit)
                continue
            if self._sent_lr.get(key) == lr:
                continue
            names = [
                n for n, s in self._specs.items() if s is opt.server_optimizer or s == opt.server_optimizer
            ]
            if key in self._sent_lr and names:
                self._drain()
                self.client.set_learning_rate(lr, names)
                log.info(
                    "worker %d: learning rate %g sent to %d variables", self.worker_index, lr, len(names)
                )
            self._sent_lr[key] = lr

    def finish(self, *, leave: bool = True) -> None:
        """End of training: waits for the in-flight push, tells the shards this worker is done (sync and
        ssp barriers stop waiting for it; ``leave=False`` keeps it expected), and loads the final values.

        The ``fit`` callback calls ``finish(leave=False)`` at the end of each ``fit``: a script may
        ``fit`` again (fine-tuning), and a worker that had left would let the others run the first
        steps of the next ``fit`` without it. It leaves when it is closed.
        """
        if self._vars:
            self._drain()
            if leave:
                self._leave()
            self.refresh()

    def _leave(self) -> None:
        if self.mode != "async" and self._attached and not self._left:
            self.client.leave()
            self._left = True

    def close(self) -> None:
        """Drains the in-flight exchange, tells sync/ssp shards this worker is done, and closes the
        client (if this worker made it). Idempotent; also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._drain()
            self._leave()
        except PSError as err:  # the shards are gone: nothing waits for this worker there anyway
            log.warning("worker %d: could not tell the shards it is done: %s", self.worker_index, err)
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> PSWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _attach_pending(self) -> bool:
        """Attaches a model that ``attach`` found unbuilt, once it is built; returns whether the worker
        holds no pending model now.

        Called before ``fit``'s step (a model built ahead of it) and when a step first applies
        gradients (a model that the step itself builds: a subclassed model whose ``train_step``
        calls its parts, ``Sequential`` parts without ``Input``). Eager here (the backend's ``eager``),
        so the variables get the shards' values before the step runs. Variables that the step
        being traced made have no values yet: TensorFlow initializes them when that trace ends
        and traces the step again, and the model is attached in that second trace.
        """
        if self._pending is None:
            return True
        model, optimizer = self._pending
        if not model.variables:
            return False  # the step builds it further on
        with self._backend.eager():
            if not self._backend.values_in_step(*model.variables) or not all(
                _has_value(v) for v in model.variables
            ):
                return False
            self.attach(model, optimizer)
        return self._pending is None

    def _require(self) -> None:
        if not self._attached:
            raise RuntimeError(
                "the worker is not attached to the parameter server: pass worker.callback() to "
                "model.fit, or call worker.attach(model) before training"
            )

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

    def exchange(
        self, names: Sequence[str], grads: Sequence[np.ndarray], state: Sequence[np.ndarray] = ()
    ) -> list[np.ndarray]:
        """Pushes one step's gradients and state changes; returns the values to train on next.

        Eager; numpy in and out.

        Args:
            names: the variables the gradients are for.
            grads: the gradients, parallel to ``names``.
            state: the current values of the shared non-trainable state, in attach order (or empty).

        Returns:
            The new values of ``names``, then of the state variables (when ``state`` was given).

        Raises:
            PSError: a shard failed, rejected the gradients, or a barrier timed out.
        """
        self._require()
        gmap = {
            n: g if isinstance(g, Rows) else np.asarray(g)
            for n, g in zip(names, grads, strict=True)
            if g is not _NO_ROWS
        }
        state_names = [n for n, _ in self._state] if len(state) else []
        for name, value in zip(state_names, state, strict=True):
            delta = np.subtract(value, self._base[name])
            if np.any(delta):
                gmap[name] = np.negative(delta)
        values = self._exchange(gmap)
        self.bytes_pushed += sum(_nbytes(g) for g in gmap.values())
        self.bytes_pulled += sum(_nbytes(v) for v in values.values())
        out = [_NO_ROWS if n in self._remote else values[n] for n in names]
        for name in state_names:
            if name in values:
                self._base[name] = np.array(values[name])
            out.append(self._base[name])
        return out

    def _exchange(self, gmap: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.steps_done += 1
        self._left = False
        # A remote table's rows do not come back (the layer's next lookup reads them): only those of a
        # table the worker holds a copy of.
        local_tables = [n for n in gmap if n in self._tables and n not in self._remote]
        if self.mode == "sync":
            # Every shard takes part in every step (empty pushes to the others), so one step count
            # holds for all shards whatever variables a step updates.
            # One round trip per shard: the push waits at the step's barrier, and its answer carries
            # the values after the step (a local table's pushed rows too).
            step = self.step
            values = self.client.push_pull(gmap, step=step, every_shard=True, return_rows=local_tables)
            if values.applied:
                self.step = step + 1
            else:
                self.stale_steps += 1
                shards = self._shards_step()
                # Behind (a straggler): on at the shards' step. Ahead of a shard restored from a
                # checkpoint (it refuses later steps): back to its step, so every shard applies the
                # same steps again (the others drop the repeats as stale).
                self.step = shards if shards < step else max(step + 1, shards)
                log.info(
                    "worker %d: gradient for step %d not applied on every shard; next step %d",
                    self.worker_index, step, self.step,
                )  # fmt: skip
            return values
        # Straight onto the client's loop: no helper thread blocks on the call.
        fut = self._push_pull(gmap, local_tables)
        self.step += 1
        if not self.overlap:
            return self._wait(fut)
        prev, self._inflight = self._inflight, fut
        if prev is None:  # first step: nothing earlier to take values from. Its own answer (the next
            return self._wait(fut)  # step takes it again, done): from then on one exchange is in flight
        values = self._wait(prev)
        wanted = {n for n in gmap if n not in self._remote}
        if not wanted <= set(values):  # variables the previous step did not push
            values = {**values, **self._wait(fut)}
            self._inflight = None
        return values

    def _push_pull(
        self, gmap: dict[str, Any], local_tables: list[str]
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """Starts this step's push_pull; the rows ``prefetch_rows`` asked for (the next batches' ids of
        the ``psclient.keras.Embedding`` layers) are read with it, once it is applied."""
        wants = [(name, layer, layer.wanted_rows()) for name, layer in self._remote.items()]
        wants = [(name, layer, asked) for name, layer, asked in wants if asked is not None]
        if not wants:
            return self.client.push_pull_future(gmap, step=self.step, return_rows=local_tables)
        lookup = {name: ids for name, _, (_, ids) in wants}  # tf.unique's: distinct already
        both = self.client.push_pull_lookup_future(
            gmap, lookup, step=self.step, return_rows=local_tables, distinct=True
        )
        values: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        parts = []  # (table, the future of its rows)
        for name, layer, (key, _) in wants:
            part: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
            parts.append((name, part))
            layer.rows_coming(key, part)

        def done(f: concurrent.futures.Future[Any]) -> None:
            if f.cancelled():
                outcomes: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
                for out in [values, *(p for _, p in parts)]:
                    out.cancel()
            elif (err := f.exception()) is not None:
                outcomes = [(out, None, err) for out in [values, *(p for _, p in parts)]]
            else:
                got, rows = f.result()
                outcomes = [(part, rows[name], None) for name, part in parts]
                outcomes.append((values, got, None))
            for out, result, error in outcomes:
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by its waiter
                    if error is not None:
                        out.set_exception(error)
                    else:
                        out.set_result(result)

        both.add_done_callback(done)
        values.add_done_callback(lambda f: both.cancel() if f.cancelled() else None)
        return values

    def apply_gradients(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any] | None = None,
        *,
        optimizer: DistributedOptimizer | None = None,
    ) -> None:
        """Exchanges gradients with the shards and assigns the new values; eager or inside a compiled step
        (``tf.function``, a jitted JAX step: the backend's adapter stages the exchange).

        The shared non-trainable state of the attached model goes with them.

        Args:
            grads: gradients, parallel to ``variables`` (None entries are skipped).
            variables: the attached variables (default: all trainable attached ones, in attach order).
            optimizer: the ``DistributedOptimizer`` applying them: variables not attached yet are
                attached with its server-side optimizer.

        Raises:
            ValueError: a variable that is not attached, and no optimizer to attach it with.
            PSError: see ``exchange`` (wrapped by TensorFlow inside a graph).
        """
        if not self._attach_pending():
            self._backend.pending_step(self._pending[0] if self._pending is not None else None)
            return
        self._require()
        if variables is None:
            variables = [v for n, v in self._vars.items() if self._specs[n] is not STATE_OPTIMIZER]
        pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        if not pairs:
            return
        var_names = [self.name_of(v) for _, v in pairs]
        unknown = [v for n, (_, v) in zip(var_names, pairs, strict=True) if n not in self._vars]
        if optimizer is not None:
            first = id(optimizer) not in self._optimizers  # a new optimizer: its rate, not the shards'
            self._optimizers.setdefault(id(optimizer), optimizer)
            spec = optimizer.server_optimizer
            own = {n: self._remote[n].server_optimizer for n in var_names if n in self._remote}
            specs = {n: own.get(n) or spec for n in var_names}
            changed = [
                (v, specs[n])
                for n, (_, v) in zip(var_names, pairs, strict=True)
                if first or self._specs.get(n) != specs[n]
            ]
            if changed and not self._backend.values_in_step(*(g for g, _ in pairs)):
                # A compiled step whose variables have no readable values (JAX's jitted step): the
                # variables the fit callback attached with this optimizer need nothing more.
                late = [self.name_of(v) for v, s in changed if self._specs.get(self.name_of(v)) != s]
                if late:
                    raise _backend.unsupported(
                        f"variables an optimizer first applies inside a compiled step ({', '.join(late[:3])}:"
                        " a second optimizer, a layer unfrozen during fit; attach them before fit)"
                    )
            elif changed:
                new = self._register([([v], s) for v, s in changed], check=first)
                self.refresh(new)
        elif unknown:
            raise ValueError(
                f"variables {sorted(self.name_of(v) for v in unknown)} were not attached to the "
                "parameter server: attach the model (worker.attach(model, optimizer)) first"
            )
        backend = self._backend
        if not backend.host_row_gradients and any(n in self._remote for n in var_names):
            # TensorFlow: the anchor's gradient is replaced by the layer's row gradients (IndexedSlices)
            swapped = [(self._remote[n].take_gradient(), v) if n in self._remote else (g, v)
                       for n, (g, v) in zip(var_names, pairs, strict=True)]  # fmt: skip
            keep = [g is not None for g, _ in swapped]
            pairs = [p for p, k in zip(swapped, keep, strict=True) if k]
            var_names = [n for n, k in zip(var_names, keep, strict=True) if k]
            if not pairs:
                return
        state_vars = [v for _, v in self._state]
        if state_vars and not backend.shared_state_in_step and self._deferred is None:
            raise _backend.unsupported(
                "non-trainable state shared through the parameter server in the optimizer's step (BatchNorm "
                f"statistics: {', '.join(n for n, _ in self._state[:3])})"
            )
        # What each gradient is on the wire: "dense" (a variable), "rows" (a table's gradient that holds the
        # batch's rows: ids and rows in, the ids and their new rows out), "table" (a table's dense gradient:
        # every row travels; its new value out), "host" (a psclient.keras.Embedding's rows that the backward
        # pass handed to the host, JAX and PyTorch: its anchor's gradient in, to order the two; none out).
        kinds: list[str] = []
        inputs: list[Any] = []
        outputs: list[_backend.OutputSpec] = []
        for (g, var), name in zip(pairs, var_names, strict=True):
            dtype = keras.backend.standardize_dtype(var.dtype)
            rows = backend.row_gradient(g) if name in self._tables else None
            if name in self._remote and backend.host_row_gradients:
                kinds.append("host")
                inputs.append(g)
            elif rows is not None:  # an Embedding's gradient: only the batch's rows
                kinds.append("rows")
                inputs += list(rows)
                width = None if name in self._remote else var.shape[1]  # a remote table: none come back
                outputs += [((None,), "int64"), ((None, width), dtype)]
            elif name in self._tables:
                self._warn_dense(name, g)
                kinds.append("table")
                inputs.append(g)
                outputs.append((tuple(var.shape), dtype))
            else:
                kinds.append("dense")
                inputs.append(g)
                outputs.append((tuple(var.shape), dtype))
        outputs += [(tuple(v.shape), keras.backend.standardize_dtype(v.dtype)) for v in state_vars]
        fn = _exchange_fn(self, var_names, kinds)
        if state_vars and not backend.shared_state_in_step:  # the step's wrapper exchanges, with its state

            def exchange(state_of: Callable[[Any], Any]) -> tuple[list[Any], list[Any]]:
                state = [state_of(v) for v in state_vars]
                new = iter(backend.host_call(fn, inputs + state, outputs, "ps_exchange"))
                assigned = [var for (_, var), kind in zip(pairs, kinds, strict=True) if kind != "host"]
                return [(var, next(new)) for var in assigned], [(var, next(new)) for var in state_vars]

            self._deferred.append(exchange)  # type: ignore[union-attr]  # checked above
            return
        inputs += [v.value for v in state_vars]
        new = backend.host_call(fn, inputs, outputs, "ps_exchange")
        out = iter(new)
        for (_, var), kind, name in zip(pairs, kinds, var_names, strict=True):
            if kind == "host":  # nothing comes back: the layer's next lookup reads the rows
                continue
            if kind == "rows":  # the rows that came back: written into the worker's copy of the table
                ids, rows = next(out), next(out)
                if name not in self._remote:  # none come back: no local copy
                    backend.scatter_rows(var, ids, rows)
            else:
                var.assign(next(out))
        for var in state_vars:
            var.assign(next(out))

    def _warn_dense(self, name: str, grad: Any) -> None:
        """Warns once per table whose gradient is dense over the whole table (every row travels)."""
        if name in self._dense_warned:
            return
        self._dense_warned.add(name)
        shape = tuple(grad.shape)
        known = all(isinstance(d, int) for d in shape)
        size = np.dtype(keras.backend.standardize_dtype(grad.dtype)).itemsize
        nbytes = int(np.prod(shape)) * size if known else None
        log.warning(
            "worker %d: the gradient of table %s is dense (every row, %s each way per step): something "
            "reads the whole table (a regularizer the shards cannot apply, a layer using `embeddings` "
            "directly); only the rows a batch looks up travel when the gradient is an Embedding's",
            self.worker_index,
            name,
            f"{nbytes / 2**20:.1f} MiB" if nbytes is not None else "the whole table",
        )

    # -- Keras -----------------------------------------------------------------

    def callback(self) -> PSCallback:
        """The ``fit`` callback: attach at train begin, load the final values at train end."""
        return PSCallback(self)


def _exchange_fn(worker: PSWorker, names: list[str], kinds: list[str]) -> Callable[..., list[np.ndarray]]:
    """The host function of a step: the inputs are each gradient (a table's batch rows as ids and rows, a
    table's dense gradient whole), then the shared state; the outputs the new values in the same order
    (the ids and new rows of a table's batch rows; a table whose gradient was dense, whole)."""

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        grads: list[Any] = []
        k = 0
        for kind, name in zip(kinds, names, strict=True):
            if kind == "host":  # the rows the backward pass handed over (none: an empty push of the table)
                grads.append(worker._remote[name].take_rows() or _NO_ROWS)
                k += 1
            elif kind == "rows":
                grads.append(Rows(arrays[k], arrays[k + 1]))
                k += 2
            elif kind == "table":
                grads.append(Rows(np.arange(len(arrays[k]), dtype=np.int64), arrays[k]))
                k += 1
            else:
                grads.append(arrays[k])
                k += 1
        values = worker.exchange(names, grads, arrays[k:])
        out: list[np.ndarray] = []
        for value, kind, grad in zip(values[: len(kinds)], kinds, grads, strict=True):
            if kind == "host":
                continue
            if kind == "table":  # every row was pushed, so every row came back
                whole = np.empty_like(grad.values)
                whole[np.asarray(value.ids, np.int64).reshape(-1)] = np.asarray(value.values)
                out.append(whole)
            elif isinstance(value, Rows):
                out += [np.asarray(value.ids, np.int64).reshape(-1), np.asarray(value.values)]
            else:
                out.append(value)
        out += [np.asarray(v) for v in values[len(kinds) :]]  # the shared state
        return out

    return fn


def load_from_ps(model_or_variables: Any, client: PSClient) -> None:
    """Assigns the shards' current values to a model's variables (for an evaluator or a final export).

    A model gets all of its shared state (trainable variables, BatchNorm statistics, frozen
    layers), found by the stable names of ``model_variable_names``: any copy of the model,
    built in any process, loads.

    Raises:
        NotFoundError: a variable is not on the shards (a different model, or another model name).
        PSError: a shard failed.
    """
    if isinstance(model_or_variables, keras.Model):
        remote = _remote_tables(model_or_variables)  # psclient.keras.Embedding: its rows stay on the shards
        named = [(v, n) for v, n in model_variable_names(model_or_variables) if id(v) not in remote]
    else:
        named = [(v, variable_name(v)) for v in model_or_variables]
    values = client.pull([n for _, n in named])
    for var, name in named:
        var.assign(values[name])


class DistributedOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer whose updates happen on the parameter server.

    ``DistributedOptimizer(keras.optimizers.Adam(1e-3), worker)`` is an ``Adam`` (a
    subclass made for it, with the same name and configuration, so a saved model
    loads as a plain ``Adam`` without psclient) whose updates are done by the shards
    with the same rule; it keeps no slots on the worker. A ``LossScaleOptimizer``
    stays outside: ``DistributedOptimizer(LossScaleOptimizer(Adam()), w)`` returns
    ``LossScaleOptimizer(DistributedOptimizer(Adam(), w))``. Use with
    ``model.compile(optimizer=...)`` and ``worker.callback()``.

    With ``use_ema=True`` the shards keep the moving average of each variable (an
    optimizer slot, updated after each update as Keras does, and written into the
    variable every ``ema_overwrite_frequency`` updates); the worker keeps none. At
    the end of ``fit`` (Keras's ``finalize_variable_values``) each worker reads the
    averages, writes them into the shards' variables (Keras overwrites the
    variables with their averages: a later ``fit``, an evaluator or a checkpoint
    sees them) and into its model, so the model ends as local Keras's does. The
    shards count updates per variable (Keras counts the optimizer's steps: the
    same while every step updates every variable). With ``gradient_accumulation_steps``
    (done by the worker) the shards move the average once per push, Keras on
    every step. ``keras.callbacks.SwapEMAWeights`` is not supported (it reads
    averages kept on the worker).

    Args:
        optimizer: a Keras optimizer, or its name (``"adam"``).
        worker: the ``PSWorker`` to train on.

    Raises:
        ValueError: an optimizer or setting the shards do not implement.
        TypeError: not a Keras optimizer, or ``worker`` is not a ``PSWorker``.
    """

    _classes: ClassVar[dict[type, type]] = {}

    def __new__(cls, optimizer: Any = None, worker: Any = None, **kwargs: Any) -> Any:
        if cls is not DistributedOptimizer:
            return super().__new__(cls)
        if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
            config = optimizer.get_config()
            return keras.mixed_precision.LossScaleOptimizer(
                DistributedOptimizer(optimizer.inner_optimizer, worker, **kwargs),
                initial_scale=config["initial_scale"],
                dynamic_growth_steps=config["dynamic_growth_steps"],
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a DistributedOptimizer")
        base = type(_keras_optimizer(optimizer))
        sub = cls._classes.get(base)
        if sub is None:
            sub = type(base.__name__, (DistributedOptimizer, base), {"__module__": base.__module__})
            cls._classes[base] = sub
        return super().__new__(sub)

    def __init__(self, optimizer: Any, worker: PSWorker, name: str | None = None) -> None:
        if not isinstance(worker, PSWorker):
            raise TypeError(f"worker must be a psclient.keras.PSWorker, got {type(worker)!r}")
        inner = _keras_optimizer(optimizer)
        spec = server_optimizer(inner)  # refuses what the shards cannot do, first
        config = inner.get_config()
        if isinstance(config.get("learning_rate"), dict):  # a schedule: the object, as from_config does
            config["learning_rate"] = keras.optimizers.schedules.deserialize(config["learning_rate"])
        if name is not None:
            config["name"] = name
        super().__init__(**config)
        self.server_optimizer = spec
        self.worker = worker

    @property
    def has_schedule(self) -> bool:
        """Whether the learning rate is a schedule (evaluated on the shards)."""
        return isinstance(self._learning_rate, keras.optimizers.schedules.LearningRateSchedule)

    def build(self, variables: Sequence[Any]) -> None:
        # No slots on the worker: the shards hold them (the wrapped class's build would add them), and
        # the moving averages too (the base class's build would add a copy of the weights).
        use_ema, self.use_ema = self.use_ema, False
        try:
            keras.optimizers.Optimizer.build(self, variables)
        finally:
            self.use_ema = use_ema

    def _update_model_variables_moving_average(self, trainable_variables: Any) -> None:
        return None  # on the shards (the ``average`` slot)

    def _overwrite_model_variables_with_average_value(self, trainable_variables: Any) -> None:
        return None  # ema_overwrite_frequency: the shards overwrite; the exchange brings the values

    def finalize_variable_values(self, var_list: Any) -> None:
        """The end of ``fit`` with ``use_ema``: the shards' moving averages become the variables' values,
        on the shards and in ``var_list`` (the model's trainable variables), as Keras does it locally.

        Raises:
            PSError: a shard failed.
        """
        worker = self.worker
        if not self.use_ema or not worker.attached:
            return
        worker._drain()  # the last step's push is applied first
        named = [(worker.name_of(v), v) for v in var_list]
        named = [
            (n, v)
            for n, v in named
            if n not in worker._remote and getattr(worker._specs.get(n), "use_ema", False)
        ]
        if not named:
            return
        averages = worker.client.pull([n for n, _ in named], ema=True)
        worker.client.assign(averages)
        with worker._backend.eager():
            for name, var in named:
                var.assign(averages[name])
        log.info(
            "worker %d: %d variables now hold their moving averages (use_ema)",
            worker.worker_index,
            len(named),
        )

    def _apply_weight_decay(self, variables: Any) -> None:
        return None  # on the shards

    def _backend_update_step(self, grads: Any, trainable_variables: Any, learning_rate: Any) -> None:
        self.worker.apply_gradients(grads, trainable_variables, optimizer=self)


class PSCallback(StepTimer):
    """Attaches the model to the parameter server when ``fit`` begins; loads the final values when it ends.

    Before each step it sends a learning rate changed by another callback to the shards (with
    ``compile(steps_per_execution=n)``: before each ``n`` steps, when Keras calls the callbacks).
    Also records throughput: ``steps`` and ``steps_per_second`` (steps after the first, which
    traces the graph).
    """

    def __init__(self, worker: PSWorker) -> None:
        super().__init__()
        self.worker = worker

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        model = self.model
        self.worker._backend.prepare_fit(self.worker, model, "parameter-server training")
        optimizer = _unwrap_loss_scale(model.optimizer)
        if not isinstance(optimizer, DistributedOptimizer):
            optimizer = None  # a custom train_step may apply its own DistributedOptimizers (a GAN)
        self.worker.begin_fit(model, optimizer)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_train_batch_begin(batch, logs)
        self.worker.sync_learning_rates()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        first = self.steps == 0
        super().on_train_batch_end(batch, logs)
        if first and not self.worker.optimizers:
            raise ValueError(
                "no psclient.keras.DistributedOptimizer applied gradients in the first step: compile the "
                "model with DistributedOptimizer(keras_optimizer, worker) (or use it in your train_step)"
            )

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_end(logs)
        self.worker.end_fit(self.model)


__all__ = [
    "MODES", "STATE_OPTIMIZER", "DistributedOptimizer", "PSCallback", "PSWorker", "load_from_ps",
    "server_optimizer",
]  # fmt: skip
