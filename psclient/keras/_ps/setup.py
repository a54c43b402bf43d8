"""A ``PSWorker``'s setup: attach a model (create or find its variables on the shards with their
optimizers, load their values), the tables of its Embedding layers, learning rates set by callbacks,
the end of a ``fit``."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from psclient.keras._naming import model_variable_names
from psclient.keras._ps.optimizer import (
    DistributedOptimizer,
    _row_optimizer,
    _unwrap_loss_scale,
    server_optimizer,
)
from pscore.embedding import Regularizer
from pscore.errors import DeadlineExceededError, InvalidArgumentError
from pscore.optimizers import SGD, Optimizer

log = logging.getLogger(__name__)

_ATTACH_POLL_S = 0.2
# Non-trainable state: a push carries the worker's change to the value, applied by SGD with rate 1
# (w - 1 * (-delta) = w + delta; in sync mode the mean of the step's changes).
STATE_OPTIMIZER = SGD(learning_rate=1.0)


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


def _flatten(model: keras.Model) -> list[Any]:
    """A model's layers, nested ones included."""
    return list(model._flatten_layers()) if hasattr(model, "_flatten_layers") else list(model.layers)


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


class WorkerSetup:
    """``PSWorker``'s setup: attaching models and variables (create or find them on the shards, load
    their values), learning rates, and the end of a ``fit``. A mixin of ``PSWorker``, whose ``__init__``
    makes the state it uses."""

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
        if self.mode == "sync" and self.sync_parts > 1 and self._tables:
            raise ValueError(
                f"sync_parts={self.sync_parts} pushes dense variables only, and this model has embedding "
                f"tables ({', '.join(sorted(self._tables))}), pushed by row: use sync_parts=1"
            )
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
        so that a shard restored from an earlier checkpoint gets every step from its own on. A step in
        ``sync_parts`` parts is that many steps on the shards: a step begun there is joined at the next."""
        shard_step = min((s.step for s in self.client.status()), default=0)
        return -(-shard_step // self.sync_parts)

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
