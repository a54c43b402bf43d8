"""``PSWorker``: one training worker's session with the parameter server (its setup and its step are the
mixins of ``setup`` and ``step``)."""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from psclient._sync_client import PSClient
from psclient.config import ps_addresses_from_tf_config
from psclient.keras import _backend
from psclient.keras._common import DeferredExchanges, variable_name
from psclient.keras._ps.callbacks import PSCallback
from psclient.keras._ps.optimizer import DistributedOptimizer
from psclient.keras._ps.setup import WorkerSetup
from psclient.keras._ps.step import WorkerStep
from pscore.embedding import Regularizer
from pscore.errors import PSError
from pscore.optimizers import Optimizer
from pscore.tf_config import read_tf_config

log = logging.getLogger(__name__)

MODES = ("async", "sync", "ssp")


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


class PSWorker(WorkerSetup, WorkerStep, DeferredExchanges):
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
        sync_parts: sync mode: each step's gradients go to each shard as this many pushes
            (``PSClient.push_pull``'s ``parts``), so that a shard applies and answers the first part
            while the later ones still arrive: on links, the answers' download overlaps the next
            parts' upload (worth it where a step moves much more than a link carries in a few
            milliseconds, with the model's variables cut small enough to fill the parts:
            ``partition_bytes``). Every worker must give the same; dense variables only (a model
            with embedding tables is refused at ``attach``). Default 1: one push per shard a step.
        **client_options: ``PSClient`` arguments (``timeout``, ``auth_token``, TLS paths, ...).

    Not thread-safe: one worker per training loop.

    Raises:
        ValueError: an unknown mode, a bad index or ``sync_parts``, or no addresses and no TF_CONFIG.
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
        sync_parts: int = 1,
        **client_options: Any,
    ) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if table_regularization not in ("lazy", "exact"):
            raise ValueError(f"table_regularization must be 'lazy' or 'exact', got {table_regularization!r}")
        if isinstance(sync_parts, bool) or not isinstance(sync_parts, int) or sync_parts < 1:
            raise ValueError(f"sync_parts must be an int >= 1, got {sync_parts!r}")
        self.table_regularization = table_regularization
        self.sync_parts = sync_parts
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
        self._inflight: concurrent.futures.Future[Any] | None = None  # values, or (values, rows)
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

    def _wait(self, fut: concurrent.futures.Future[Any]) -> dict[str, np.ndarray]:
        """The values of an exchange (``WorkerStep._push_pull``'s future: values, or ``(values, rows)``)."""
        try:
            got = fut.result(self.client.wait_timeout)
        except TimeoutError:
            fut.cancel()
            raise
        return got[0] if isinstance(got, tuple) else got  # type: ignore[no-any-return]

    # -- Keras -----------------------------------------------------------------

    def callback(self) -> PSCallback:
        """The ``fit`` callback: attach at train begin, load the final values at train end."""
        return PSCallback(self)
