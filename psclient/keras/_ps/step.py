"""A ``PSWorker``'s step: the exchange of one step's gradients and shared state for the shards' new values
(sync barrier, async overlap, rows of Embedding tables and of ``prefetch_rows``), and ``apply_gradients``,
which stages it in the backend's step."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from psclient.keras import _backend
from psclient.keras._ps.optimizer import DistributedOptimizer
from psclient.keras._ps.setup import STATE_OPTIMIZER
from pscore.embedding import Rows

if TYPE_CHECKING:
    from psclient.keras._ps.worker import PSWorker

log = logging.getLogger(__name__)

# No rows of a psclient.keras.Embedding (what comes back for its table; what a step's backward pass gave none)
_NO_ROWS = Rows(np.zeros(0, np.int64), np.zeros((0, 0), np.float32))


def _nbytes(arrays: Iterable[Any]) -> int:
    """Payload bytes of dense arrays and ``Rows`` (ids and values), all together: one call a step, not
    one per variable (the step's host function runs every step)."""
    total = 0
    for x in arrays:
        if isinstance(x, Rows):
            total += np.asarray(x.ids).nbytes + np.asarray(x.values).nbytes
        else:
            total += x.nbytes if isinstance(x, np.ndarray) else np.asarray(x).nbytes
    return int(total)


class WorkerStep:
    """``PSWorker``'s step: a step's exchange with the shards (push the gradients and state changes, take
    the new values), eager or staged in a compiled step by the backend's adapter. A mixin of
    ``PSWorker``, whose ``__init__`` makes the state it uses."""

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
        self.bytes_pushed += _nbytes(gmap.values())
        self.bytes_pulled += _nbytes(values.values())
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
            values = self.client.push_pull(
                gmap, step=step, every_shard=True, return_rows=local_tables, parts=self.sync_parts
            )
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
        if not self.overlap:  # the step waits for its own answer: the client's blocking call, no future
            values = self._push_pull_now(gmap, local_tables)
            self.step += 1
            return values
        # Straight onto the client's loop: no helper thread blocks on the call.
        fut = self._push_pull(gmap, local_tables)
        self.step += 1
        prev, self._inflight = self._inflight, fut
        if prev is None:  # first step: nothing earlier to take values from. Its own answer (the next
            return self._wait(fut)  # step takes it again, done): from then on one exchange is in flight
        values = self._wait(prev)
        wanted = {n for n in gmap if n not in self._remote}
        if not wanted <= set(values):  # variables the previous step did not push
            values = {**values, **self._wait(fut)}
            self._inflight = None
        return values

    def _wanted_rows(self) -> list[tuple[str, Any, tuple[Any, np.ndarray]]]:
        """``(table, layer, (key, distinct ids))`` of the rows ``prefetch_rows`` asked for (the next
        batches' ids of the ``psclient.keras.Embedding`` layers), to read with this step's push."""
        return [
            (name, layer, asked)
            for name, layer in self._remote.items()
            if (asked := layer.wanted_rows()) is not None
        ]

    def _push_pull_now(self, gmap: dict[str, Any], local_tables: list[str]) -> dict[str, Any]:
        """This step's push_pull, waited for (no overlap); the rows ``prefetch_rows`` asked for are read
        with it and handed to their layers (``rows_read``). The client's blocking calls hand the answer
        back with one lock: no ``concurrent.futures.Future`` (a condition variable and its callbacks)."""
        wants = self._wanted_rows()
        if not wants:
            return self.client.push_pull(gmap, step=self.step, return_rows=local_tables)
        lookup = {name: ids for name, _, (_, ids) in wants}  # tf.unique's: distinct already
        values, rows = self.client.push_pull_lookup(
            gmap, lookup, step=self.step, return_rows=local_tables, distinct=True
        )
        for name, layer, (key, _) in wants:
            layer.rows_read(key, rows[name])
        return values

    def _push_pull(self, gmap: dict[str, Any], local_tables: list[str]) -> concurrent.futures.Future[Any]:
        """Starts this step's push_pull; the rows ``prefetch_rows`` asked for (the next batches' ids of
        the ``psclient.keras.Embedding`` layers) are read with it, once it is applied.

        One future for the step and its layers: its values (``push_pull``), or ``(values, rows)``
        (``push_pull_lookup``) whose rows each layer takes by its table's name (``rows_coming``). No
        futures chained behind it: each would take a lock and wake its waiters again on the loop's
        thread, every step.
        """
        wants = self._wanted_rows()
        if not wants:
            return self.client.push_pull_future(gmap, step=self.step, return_rows=local_tables)
        lookup = {name: ids for name, _, (_, ids) in wants}  # tf.unique's: distinct already
        both = self.client.push_pull_lookup_future(
            gmap, lookup, step=self.step, return_rows=local_tables, distinct=True
        )
        for name, layer, (key, _) in wants:
            layer.rows_coming(key, both, name)
        return both

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
                        " a second optimizer, a layer unfrozen during fit; attach them with their optimizer"
                        " before fit or the loop's first step: worker.attach(part, optimizer))"
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
        # every row travels; its new value out), "remote" (a psclient.keras.Embedding's batch rows: ids and
        # rows in, none out), "host" (a psclient.keras.Embedding's rows that the backward pass handed to the
        # host, JAX and PyTorch: its anchor's gradient in, to order the two; none out).
        kinds: list[str] = []
        inputs: list[Any] = []
        outputs: list[_backend.OutputSpec] = []
        for (g, var), name in zip(pairs, var_names, strict=True):
            dtype = keras.backend.standardize_dtype(var.dtype)
            rows = backend.row_gradient(g) if name in self._tables else None
            if name in self._remote and backend.host_row_gradients:
                kinds.append("host")
                inputs.append(g)
            elif rows is not None and name in self._remote:  # a psclient.keras.Embedding's batch rows
                kinds.append("remote")  # none come back: the layer's next lookup reads them
                inputs += list(rows)
            elif rows is not None:  # a keras Embedding's gradient: only the batch's rows
                kinds.append("rows")
                inputs += list(rows)
                outputs += [((None,), "int64"), ((None, var.shape[1]), dtype)]
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
                assigned = [
                    var for (_, var), k in zip(pairs, kinds, strict=True) if k not in ("host", "remote")
                ]
                return [(var, next(new)) for var in assigned], [(var, next(new)) for var in state_vars]

            self._deferred.append(exchange)  # type: ignore[union-attr]  # checked above
            return
        inputs += [v.value for v in state_vars]
        new = backend.host_call(fn, inputs, outputs, "ps_exchange")
        out = iter(new)
        for (_, var), kind in zip(pairs, kinds, strict=True):
            if kind in ("host", "remote"):  # nothing comes back: the layer's next lookup reads the rows
                continue
            if kind == "rows":  # the rows that came back: written into the worker's copy of the table
                ids, rows = next(out), next(out)
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


def _exchange_fn(worker: PSWorker, names: list[str], kinds: list[str]) -> Callable[..., list[np.ndarray]]:
    """The host function of a step: the inputs are each gradient (a table's batch rows as ids and rows, a
    table's dense gradient whole), then the shared state; the outputs the new values in the same order
    (the ids and new rows of a table's batch rows; a table whose gradient was dense, whole; nothing for a
    ``psclient.keras.Embedding``'s rows, "remote" or "host")."""

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        grads: list[Any] = []
        k = 0
        for kind, name in zip(kinds, names, strict=True):
            if kind == "host":  # the rows the backward pass handed over (none: an empty push of the table)
                grads.append(worker._remote[name].take_rows() or _NO_ROWS)
                k += 1
            elif kind in ("rows", "remote"):
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
            if kind in ("host", "remote"):
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
