"""Ring: the synchronous ring collective for training loops (an AsyncRing on a private event-loop thread)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, Final, TypeVar

import numpy as np

from psclient.collective._async_ring import AsyncRing
from psclient.collective._config import RingConfig
from pscore.errors import DeadlineExceededError, UnavailableError

try:
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
    _uvloop = None

logger = logging.getLogger(__name__)

T = TypeVar("T")
_GRACE_S: Final[float] = 10.0  # the coroutine enforces the deadline; this only guards the thread hop


class Ring:
    """One rank of a ring all-reduce group, with a synchronous API.

    Each rank serves the ``psproto.v1.Collective`` gRPC service on
    ``addresses[rank]`` and streams to the next rank. A private uvloop event loop
    in a daemon thread hosts the server and the channel; methods block the caller
    until the operation completes or its deadline passes, and never longer.

    Every rank must call the same collectives in the same order with equal shapes
    and dtypes. Methods may be called from any thread; calls are serialized.

    Example::

        with Ring(["10.0.0.1:7000", "10.0.0.2:7000"], rank=0, timeout=30) as ring:
            grads = ring.allreduce_many(grads, op="mean")

    Args:
        addresses: ``HOST:PORT`` of every rank, in rank order (fixed, non-zero ports).
        rank: this worker's index into ``addresses``.
        timeout: deadline of each operation in seconds; a dead or stuck peer raises within it.
        **options: keyword-only settings of :class:`RingConfig`: ``chunk_bytes`` (pipelining
            granularity, default 2 MiB), ``fusion_threshold_bytes`` (default 64 MiB),
            ``compression`` (``"none"`` or ``"fp16"``: float32 all-reduce data travels as float16),
            ``auth_token`` (shared secret, or None), ``tls_cert``/``tls_key`` (this rank's PEM
            certificate and key: TLS on every stream), ``tls_ca`` (PEM CA of the peers'
            certificates), ``tls_client_ca`` (require client certificates it signed: mutual TLS),
            ``max_message_bytes`` (default 64 MiB), ``grpc_options`` (extra channel/server
            arguments), ``tune_malloc`` (default True: :func:`pscore.memory.tune_malloc`,
            so message buffers are reused instead of page-faulted in) and ``transport``
            (``"tcp"``, the default, or ``"grpc"``: frames on a raw TCP connection per link,
            negotiated through the authenticated ``DataPort`` call; about half the CPU per byte;
            TLS with the TLS settings; every rank must use the same transport).

    Raises:
        ValueError: invalid settings.
        UnavailableError: ``addresses[rank]`` cannot be bound.
    """

    def __init__(self, addresses: Sequence[str], rank: int, timeout: float = 60.0, **options: Any) -> None:
        RingConfig(addresses=tuple(addresses), rank=rank, timeout=timeout, **options)  # validate early
        self._timeout = timeout
        self._loop = _uvloop.new_event_loop() if _uvloop is not None else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"psclient-ring-{rank}", daemon=True)
        self._thread.start()
        self._closed = False

        async def start() -> AsyncRing:
            return await AsyncRing(addresses, rank, timeout, **options).start()

        try:
            self._ring = self._submit(start(), 30.0)
        except BaseException:
            self._stop_loop()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def _submit(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Ring methods must not be called from the ring's own event-loop thread")
        limit = (self._timeout if timeout is None else timeout) + _GRACE_S
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DeadlineExceededError(f"ring operation did not finish within {limit:.1f} s") from None

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError("the ring is closed")

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self._ring.rank

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self._ring.world

    @property
    def config(self) -> RingConfig:
        """The validated settings."""
        return self._ring.config

    def allreduce(
        self, x: Any, op: str = "sum", *, out: np.ndarray | None = None, timeout: float | None = None
    ) -> np.ndarray:
        """Reduces ``x`` element-wise over all ranks; see :meth:`AsyncRing.allreduce`.

        Returns:
            The result, same shape and dtype as ``x`` (``out`` when given; ``out=x`` works in place).

        Raises:
            InvalidArgumentError: unsupported dtype or op, or ranks that disagree.
            DeadlineExceededError: a peer did not answer within the deadline (names it).
            UnavailableError: a peer died or the ring is closed (names it).
        """
        self._check_open()
        return self._submit(self._ring.allreduce(x, op, out=out, timeout=timeout), timeout)

    def allreduce_many(
        self, tensors: Sequence[Any] | Mapping[str, Any], op: str = "sum", *, timeout: float | None = None
    ) -> list[np.ndarray] | dict[str, np.ndarray]:
        """All-reduces a list or dict of tensors with tensor fusion; see :meth:`AsyncRing.allreduce_many`.

        Raises:
            InvalidArgumentError, DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        self._check_open()
        return self._submit(self._ring.allreduce_many(tensors, op, timeout=timeout), timeout)

    def broadcast(self, x: Any, root: int = 0, *, timeout: float | None = None) -> np.ndarray:
        """Returns ``root``'s ``x`` on every rank (others pass a same-shaped array).

        Raises:
            InvalidArgumentError, DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        self._check_open()
        return self._submit(self._ring.broadcast(x, root, timeout=timeout), timeout)

    def allgather(self, x: Any, *, timeout: float | None = None) -> np.ndarray:
        """Concatenates every rank's ``x`` along axis 0 in rank order (lengths along axis 0 may differ).

        Raises:
            InvalidArgumentError, DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        self._check_open()
        return self._submit(self._ring.allgather(x, timeout=timeout), timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Blocks until every rank has entered the barrier.

        Raises:
            DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        self._check_open()
        self._submit(self._ring.barrier(timeout=timeout), timeout)

    def close(self) -> None:
        """Stops serving and stops the event-loop thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(self._ring.close(), 10.0)
        finally:
            self._stop_loop()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
