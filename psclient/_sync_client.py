"""PSClient: the blocking parameter-server client that TensorFlow workers call."""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from psclient._async_client import AsyncPSClient, Tensors
from psclient._loop import BackgroundLoop
from psclient._requests import PushedValues
from psclient._tables import DynamicOptions
from psclient.config import ClientConfig
from pscore.embedding import Initializer, Regularizer
from pscore.optimizers import Optimizer
from psproto.v1 import ps_pb2


async def _next(batches: AsyncIterator[Any]) -> Any:
    return await anext(batches)


class PSClient:
    """Blocking client of a sharded parameter server.

    Example:
        ```python
        with psclient.PSClient(["127.0.0.1:50051", "127.0.0.1:50052"], worker_id="w0") as c:
            c.create("dense/kernel", np.zeros((784, 10), np.float32), optimizer=psclient.Adam(1e-3))
            c.push({"dense/kernel": grad})
            params = c.pull()
        ```

    It drives an ``AsyncPSClient`` on a private event loop in a daemon thread,
    so requests to different shards still go out concurrently. Thread-safe:
    methods may be called from several threads at once. Never call it from
    inside a ``tf.function`` graph.

    Args: as ``AsyncPSClient``.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
        worker_id: str | None = None,
        auth_token: str | None = None,
        timeout: float = 30.0,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        **options: Any,
    ) -> None:
        self._async = AsyncPSClient(
            addresses, worker_id, auth_token, timeout, tls_ca, tls_cert, tls_key, **options
        )
        self._loop = BackgroundLoop("psclient")
        self._closed = False
        self._wait_s = self.wait_timeout  # the config is frozen: read once, not per call

    @property
    def config(self) -> ClientConfig:
        return self._async.config

    @property
    def worker_id(self) -> str:
        return self._async.worker_id

    @property
    def num_shards(self) -> int:
        return self._async.num_shards

    @property
    def session(self) -> int:
        """This client's random 64-bit session id (sent with every push; see ``AsyncPSClient``)."""
        return self._async.session

    def _run(self, coro: Any) -> Any:
        # The per-call gRPC deadlines bound the work; this outer bound only guards
        # against a bug that would otherwise hang the caller forever.
        return self._loop.run(coro, self._wait_s)

    def create(self, name: str, value: Any, optimizer: Optimizer | None = None) -> bool:
        """Creates one variable; see ``AsyncPSClient.create_many``."""
        return bool(self._run(self._async.create(name, value, optimizer)))

    def create_many(
        self,
        values: Tensors,
        optimizer: Optimizer | None = None,
        optimizers: Mapping[str, Optimizer] | None = None,
    ) -> dict[str, bool]:
        """Creates variables, placement balanced over the batch; see ``AsyncPSClient.create_many``."""
        return dict(self._run(self._async.create_many(values, optimizer, optimizers)))

    def list_variables(self, names: Iterable[str] = ()) -> dict[str, list[ps_pb2.VariableInfo]]:
        """See ``AsyncPSClient.list_variables``."""
        return dict(self._run(self._async.list_variables(list(names))))

    def pull(
        self, names: Iterable[str] | None = None, *, step: int = 0, ema: bool = False
    ) -> dict[str, np.ndarray]:
        """Reads current values (``ema=True``: the moving averages); see ``AsyncPSClient.pull``."""
        coro = self._async.pull(None if names is None else list(names), step=step, ema=ema)
        return dict(self._loop.run(coro, self._wait_s))  # ``_run``, inline on the hot methods

    def pull_with_versions(
        self, names: Iterable[str] | None = None, *, step: int = 0, ema: bool = False
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """See ``AsyncPSClient.pull_with_versions``."""
        values, versions = self._run(
            self._async.pull_with_versions(None if names is None else list(names), step=step, ema=ema)
        )
        return dict(values), dict(versions)

    def push(self, grads: Tensors, *, step: int = 0, every_shard: bool = False) -> bool:
        """Applies gradients; see ``AsyncPSClient.push``."""
        return bool(self._loop.run(self._async.push(grads, step=step, every_shard=every_shard), self._wait_s))

    def push_pull(
        self,
        grads: Tensors,
        *,
        step: int = 0,
        every_shard: bool = False,
        return_rows: bool | Iterable[str] = True,
        parts: int = 1,
    ) -> PushedValues:
        """Pushes gradients and returns the updated values (``return_rows``: which tables' rows) and
        ``.applied`` (``parts``: a sync push in parts); see ``AsyncPSClient.push_pull``."""
        coro = self._async.push_pull(
            grads, step=step, every_shard=every_shard, return_rows=return_rows, parts=parts
        )
        return self._loop.run(coro, self._wait_s)

    def create_embedding(
        self,
        name: str,
        num_rows: int | None,
        dim: int,
        *,
        dtype: Any = np.float32,
        optimizer: Optimizer | None = None,
        initializer: Initializer = "uniform",
        key_type: str = "int64",
        capacity: int | None = None,
        min_count: int = 1,
        eviction: str = "lru",
        ttl_steps: int | None = None,
        ttl_seconds: float | None = None,
        regularizer: Regularizer | None = None,
    ) -> bool:
        """Creates an embedding table spread by row (``num_rows=None``: a dynamic hash table); see
        ``AsyncPSClient.create_embedding``."""
        options = DynamicOptions(
            key_type=key_type, capacity=capacity, min_count=min_count, eviction=eviction,
            ttl_steps=ttl_steps, ttl_seconds=ttl_seconds,
        )  # fmt: skip
        coro = self._async._create_embedding(
            name, num_rows, dim, dtype=dtype, optimizer=optimizer, initializer=initializer, options=options,
            regularizer=regularizer,
        )  # fmt: skip
        return bool(self._run(coro))

    def lookup(self, name: str, ids: Any, *, step: int = 0, distinct: bool = False) -> np.ndarray:
        """Reads rows of a table, shape ``ids.shape + (dim,)``; see ``AsyncPSClient.lookup``."""
        return np.asarray(
            self._loop.run(self._async.lookup(name, ids, step=step, distinct=distinct), self._wait_s)
        )

    def export(self, name: str, *, batch_rows: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterates over every row of a table in batches, ``(ids, rows)``; see ``AsyncPSClient.export``.

        Each batch is read when the iteration asks for it (memory O(batch)).
        """
        batches = self._async.export(name, batch_rows=batch_rows)
        try:
            while True:
                try:
                    yield self._run(_next(batches))
                except StopAsyncIteration:
                    return
        finally:
            self._run(batches.aclose())

    def status(self) -> list[ps_pb2.GetStatusResponse]:
        """Every shard's status (mode, step, counters, role); see ``AsyncPSClient.status``."""
        return list(self._run(self._async.status()))

    def push_pull_future(
        self,
        grads: Tensors,
        *,
        step: int = 0,
        every_shard: bool = False,
        return_rows: bool | Iterable[str] = True,
        parts: int = 1,
    ) -> concurrent.futures.Future[PushedValues]:
        """Starts a ``push_pull`` and returns at once; ``.result(timeout)`` gives the updated values.

        For callers that overlap the exchange with other work (the Keras glue):
        no helper thread sits blocked on the call. Cancelling the future cancels
        the request. Errors are raised by ``.result()``, as by ``push_pull``;
        ``every_shard``, ``return_rows`` and ``parts`` as there.

        Raises:
            RuntimeError: the client is closed.
        """
        coro = self._async.push_pull(
            grads, step=step, every_shard=every_shard, return_rows=return_rows, parts=parts
        )
        return self._loop.submit(coro)

    def push_pull_lookup(
        self,
        grads: Tensors,
        lookup: Mapping[str, Any],
        *,
        step: int = 0,
        return_rows: bool | Iterable[str] = True,
        distinct: bool = False,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``push_pull``, and the rows of other ids read once the push is applied, in the same round trip:
        ``(values, rows)``; see ``AsyncPSClient.push_pull_lookup``."""
        coro = self._async.push_pull_lookup(
            grads, lookup, step=step, return_rows=return_rows, distinct=distinct
        )
        values, rows = self._run(coro)
        return values, rows

    def push_pull_lookup_future(
        self,
        grads: Tensors,
        lookup: Mapping[str, Any],
        *,
        step: int = 0,
        return_rows: bool | Iterable[str] = True,
        distinct: bool = False,
    ) -> concurrent.futures.Future[tuple[dict[str, Any], dict[str, np.ndarray]]]:
        """Starts a ``push_pull_lookup`` and returns at once; ``.result(timeout)`` gives ``(values, rows)``.

        As ``push_pull_future`` (cancelling cancels the request; errors come from ``.result()``).

        Raises:
            RuntimeError: the client is closed.
        """
        return self._loop.submit(
            self._async.push_pull_lookup(grads, lookup, step=step, return_rows=return_rows, distinct=distinct)
        )

    def lookup_future(
        self, name: str, ids: Any, *, step: int = 0, distinct: bool = False
    ) -> concurrent.futures.Future[np.ndarray]:
        """Starts a ``lookup`` and returns at once; ``.result(timeout)`` gives the rows.

        For callers that read rows ahead of their use (``psclient.keras.prefetch_rows``).
        Cancelling the future cancels the request; errors are raised by ``.result()``.

        Raises:
            RuntimeError: the client is closed.
        """
        return self._loop.submit(self._async.lookup(name, ids, step=step, distinct=distinct))

    @property
    def wait_timeout(self) -> float:
        """The outer bound, in seconds, the blocking methods wait for one call (a hang guard)."""
        return self.config.timeout * 4 + 60

    def leave(self) -> None:
        """Tells every shard this worker is done; see ``AsyncPSClient.leave``."""
        self._run(self._async.leave())

    def set_learning_rate(self, learning_rate: float, names: Iterable[str] | None = None) -> list[str]:
        """Sets the learning rate of variables, keeping their slots; see ``AsyncPSClient.set_learning_rate``.

        Raises:
            NotFoundError: a named variable does not exist.
            InvalidArgumentError: a rate that is not > 0, or a variable whose learning rate is a schedule.
        """
        return list(
            self._run(self._async.set_learning_rate(learning_rate, None if names is None else list(names)))
        )

    def update_optimizer(self, params: Mapping[str, float], names: Iterable[str] | None = None) -> list[str]:
        """Sets optimizer hyper-parameters of existing variables; see ``AsyncPSClient.update_optimizer``.

        Raises:
            NotFoundError: a named variable does not exist.
            InvalidArgumentError: an invalid parameter, or a change of the slots.
        """
        return list(self._run(self._async.update_optimizer(params, None if names is None else list(names))))

    def replace_optimizer(self, optimizer: Optimizer, names: Iterable[str]) -> list[str]:
        """Replaces the optimizer of variables (any class, fresh slots, step count 0).

        See ``AsyncPSClient.replace_optimizer``.

        Returns:
            The names of the variables changed, sorted.

        Raises:
            NotFoundError: a named variable does not exist.
            InvalidArgumentError: not a psclient optimizer, or one that needs the
                whole variable for a partitioned variable.
            PSError: a shard failed.
        """
        return list(self._run(self._async.replace_optimizer(optimizer, list(names))))

    def assign(self, values: Mapping[str, np.ndarray]) -> None:
        """Sets variables to the given values, keeping their optimizer slots; see ``AsyncPSClient.assign``.

        Raises:
            NotFoundError: an unknown variable.
            InvalidArgumentError: a shape or dtype mismatch, or non-finite values
                (unless the shards allow them).
            PSError: a shard failed.
        """
        self._run(self._async.assign(values))

    def save_checkpoint(
        self, *, consistent: bool = False, timeout: float | None = None
    ) -> list[ps_pb2.SaveCheckpointResponse]:
        """Makes every shard write a checkpoint now (``consistent``: at one cut of the whole cluster);
        see ``AsyncPSClient.save_checkpoint``."""
        return list(self._run(self._async.save_checkpoint(consistent=consistent, timeout=timeout)))

    def close(self) -> None:
        """Closes the channels and the private loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._async.close())
        finally:
            self._loop.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: do not leak the loop thread
        if not getattr(self, "_closed", True):
            self._loop.close()
