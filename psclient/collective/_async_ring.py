"""AsyncRing: ring all-reduce, broadcast, all-gather and barrier on one event loop, over a RingTransport."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc
import numpy as np

from psclient.collective import _fusion
from psclient.collective._config import RingConfig
from psclient.collective._frame import FrameHeader, encode
from psclient.collective._link import GrpcTransport, Link
from psclient.collective._schedule import (
    chunk_range,
    even_segments,
    num_chunks,
    recv_segment,
    segments_from_sizes,
    send_segment,
)
from psclient.collective._service import (
    DATA_PORT_METHOD,
    EXCHANGE_METHOD,
    CollectiveService,
    Mailboxes,
)
from psclient.collective._tcp import DataLink, DataListener, TcpTransport, tcp_error
from psclient.collective._transport import RingTransport
from pscore import security, transport
from pscore.codec import CodecError, as_wire_array, wire_dtype
from pscore.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    PSError,
    UnavailableError,
    error_class,
    status_from_number,
    status_number,
)
from pscore.memory import tune_malloc
from psproto.v1 import collective_pb2 as _pb

logger = logging.getLogger(__name__)

REDUCE_OPS: Final[dict[str, tuple[int, np.ufunc]]] = {
    "sum": (_pb.REDUCE_OP_SUM, np.add),
    "mean": (_pb.REDUCE_OP_MEAN, np.add),
    "min": (_pb.REDUCE_OP_MIN, np.minimum),
    "max": (_pb.REDUCE_OP_MAX, np.maximum),
}
ALLREDUCE_DTYPES: Final[frozenset[np.dtype]] = frozenset(
    np.dtype(d) for d in ("<f2", "<f4", "<f8", "<i4", "<i8")
)
_KIND_NAMES: Final[dict[int, str]] = {
    _pb.COLLECTIVE_KIND_ALLREDUCE: "allreduce",
    _pb.COLLECTIVE_KIND_BROADCAST: "broadcast",
    _pb.COLLECTIVE_KIND_ALLGATHER: "allgather",
    _pb.COLLECTIVE_KIND_BARRIER: "barrier",
}
_ABORT_TEXT_BYTES: Final[int] = 1000  # fits any frame buffer (chunk_bytes >= 1024)
_CLOSE_GRACE_S: Final[float] = 1.0
_LINK_LIFETIME_S: Final[float] = 3600.0
_MALLOC_MMAP_THRESHOLD: Final[int] = 32 << 20  # glibc's upper limit on 64-bit
_MALLOC_TRIM_THRESHOLD: Final[int] = 256 << 20

# process(step, chunk, payload): applies a received frame's payload to the buffer and returns the slice
# to forward, or None; payload None means it was received straight into the slice (a copy step).
Process = Callable[[int, int, "bytes | memoryview | None"], "np.ndarray | None"]
# direct(step, chunk): the slice that a copy step's payload may be received straight into, or None.
Direct = Callable[[int, int], "np.ndarray | None"]


@dataclass(slots=True)
class _Op:
    """One collective operation in flight: what every frame of it must say, and where it stands."""

    method: str
    kind: int
    seq: int
    deadline: float
    dtype: int
    total: int
    op: int
    chunks: int
    receiving: tuple[int, int] | None = None
    sending: tuple[int, int] | str | None = None
    sent: int = 0
    writing: bool = False

    @property
    def name(self) -> str:
        return f"{self.method} #{self.seq}"


class AsyncRing:
    """One rank of a ring of workers: collectives as coroutines on the caller's event loop.

    Each rank serves the ``psproto.v1.Collective`` service on ``addresses[rank]``
    and streams to ``addresses[(rank + 1) % world]``. Every rank must call the
    same collectives in the same order with equal shapes and dtypes (all-gather:
    equal trailing dimensions). Operations are serialized in call order.

    Create it inside a running event loop and ``await ring.start()`` (or use
    ``async with``). Not thread-safe: use it from its loop only;
    :class:`psclient.collective.Ring` is the synchronous wrapper.

    Example::

        async with AsyncRing(["127.0.0.1:7001", "127.0.0.1:7002"], rank=0) as ring:
            total = await ring.allreduce(np.ones(4, np.float32))

    Args:
        addresses: ``HOST:PORT`` of every rank, in rank order (fixed ports).
        rank: this worker's index into ``addresses``.
        timeout: default deadline of each operation, in seconds.
        chunk_bytes: largest frame payload; big tensors are pipelined in chunks of this size.
        fusion_threshold_bytes: largest fused buffer of :meth:`allreduce_many`.
        compression: ``"fp16"`` sends float32 all-reduce data as float16.
        auth_token: a shared secret every stream must carry (``authorization: Bearer``), or None.
        tls_ca: PEM CA the next rank's certificate must chain to (default: system roots).
        tls_cert, tls_key: PEM certificate and key of this rank: TLS on every stream (server
            certificate, and client certificate towards the next rank).
        tls_client_ca: PEM CA that must have signed the previous rank's client certificate (mTLS).
        max_message_bytes: gRPC message size limit of the server and channel.
        grpc_options: extra gRPC channel and server arguments.
        tune_malloc: apply :func:`pscore.memory.tune_malloc` at start (default True).
        transport: ``"tcp"`` (default: frames on a raw TCP connection per link, negotiated through the
            ``DataPort`` call; TLS with the TLS settings) or ``"grpc"`` (frames on the ``Exchange`` stream).

    Raises:
        ValueError: invalid settings.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        rank: int,
        timeout: float = 60.0,
        **options: Any,
    ) -> None:
        self._cfg = RingConfig(addresses=tuple(addresses), rank=rank, timeout=timeout, **options)
        self._seq = 0
        self._boxes = Mailboxes()
        self._lock: asyncio.Lock | None = None
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._transport: RingTransport | None = None
        self._data: DataListener | None = None  # the data port (transport "tcp")
        self._closed = False
        self._metadata = security.auth_metadata(self._cfg.auth_token) or None

    @property
    def config(self) -> RingConfig:
        """The validated settings."""
        return self._cfg

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self._cfg.rank

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self._cfg.world

    async def start(self) -> AsyncRing:
        """Starts serving on ``addresses[rank]`` and opens the channel to the next rank.

        Raises:
            UnavailableError: the address cannot be bound.
            ValueError: a TLS file cannot be read.
        """
        cfg = self._cfg
        self._lock = asyncio.Lock()
        if cfg.tune_malloc:
            # Keep 2 MiB message buffers in the heap, but let 64 MiB tensors have their own mmap:
            # measured faster for the ring than no mmap at all (bench/bench_allreduce.py, 64 MiB).
            tune_malloc(mmap_threshold=_MALLOC_MMAP_THRESHOLD, trim_threshold=_MALLOC_TRIM_THRESHOLD)
        limits = [
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            *(tuple(o) for o in cfg.grpc_options),
        ]
        # Read every TLS file before binding anything: a bad path fails cleanly.
        server_creds = channel_creds = None
        if cfg.tls:
            assert cfg.tls_cert is not None and cfg.tls_key is not None
            server_creds = security.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
            channel_creds = security.channel_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        interceptors: list[grpc.aio.ServerInterceptor] = [security.MalformedRequestInterceptor()]
        if cfg.auth_token is not None:  # first: an unauthenticated stream reaches nothing else
            interceptors.insert(0, security.TokenAuthInterceptor(cfg.auth_token))
        server = grpc.aio.server(options=[*limits, ("grpc.so_reuseport", 0)], interceptors=interceptors)
        service = CollectiveService(
            self._boxes,
            rank=cfg.rank,
            prev_rank=cfg.prev_rank,
            prev_address=cfg.addresses[cfg.prev_rank],
        )
        address = cfg.addresses[cfg.rank]
        if cfg.transport == "tcp":
            server_tls = None
            if cfg.tls:  # the data connections are TLS too, with the same certificates
                assert cfg.tls_cert is not None and cfg.tls_key is not None
                server_tls = transport.server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
            data = DataListener(
                address.rpartition(":")[0],
                rank=cfg.rank,
                prev_rank=cfg.prev_rank,
                prev_address=cfg.addresses[cfg.prev_rank],
                max_payload=cfg.chunk_bytes + 64,
                tls=server_tls,
            )
            try:
                await data.start()
            except OSError as err:
                raise UnavailableError(
                    f"rank {cfg.rank}: cannot bind a data port on {address}: {err}", address=address
                ) from None
            self._data = data
            service = CollectiveService(
                self._boxes,
                rank=cfg.rank,
                prev_rank=cfg.prev_rank,
                prev_address=cfg.addresses[cfg.prev_rank],
                world=cfg.world,
                data_plane=data,
            )
        server.add_generic_rpc_handlers([service.handler()])
        try:
            security.add_port(server, address, server_creds)
        except (OSError, RuntimeError) as err:
            if self._data is not None:
                await self._data.close()
            raise UnavailableError(
                f"rank {cfg.rank}: cannot bind {address}: {err}", address=address
            ) from None
        await server.start()
        self._server = server
        link: Link | None = None
        data_link: DataLink | None = None
        target = cfg.addresses[cfg.next_rank]
        if cfg.world > 1:
            if channel_creds is not None:
                self._channel = grpc.aio.secure_channel(target, channel_creds, options=limits)
            else:
                self._channel = grpc.aio.insecure_channel(target, options=limits)
            if self._data is None:
                close = FrameHeader(0, 0, _pb.COLLECTIVE_KIND_CLOSE, 0, 0, 0, 0, 0, cfg.rank, cfg.world)
                link = Link(
                    self._channel.stream_unary(EXCHANGE_METHOD),
                    self._metadata,
                    max(_LINK_LIFETIME_S, 2 * cfg.timeout + 10.0),
                    encode(close, b""),
                )
            else:
                data_link = DataLink(
                    self._channel.unary_unary(
                        DATA_PORT_METHOD,
                        request_serializer=_pb.DataPortRequest.SerializeToString,
                        response_deserializer=_pb.DataPortReply.FromString,
                    ),
                    self._metadata,
                    target.rpartition(":")[0],
                    rank=cfg.rank,
                    world=cfg.world,
                    next_rank=cfg.next_rank,
                    next_address=target,
                    tls=transport.client_context(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls else None,
                )
        if self._data is not None:
            self._transport = TcpTransport(self._data, data_link)
        else:
            self._transport = GrpcTransport(self._boxes, link, next_rank=cfg.next_rank, next_address=target)
        logger.info("ring rank %d/%d serving Collective on %s", cfg.rank, cfg.world, address)
        return self

    async def close(self) -> None:
        """Stops serving and closes the channel (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._transport is not None:
            await self._transport.close(_CLOSE_GRACE_S)
        elif self._data is not None:
            await self._data.close()
        if self._channel is not None:
            await self._channel.close()
        if self._server is not None:
            # A grace period lets the previous rank finish the stream of the last operation.
            await self._server.stop(_CLOSE_GRACE_S)
        self._boxes.fail_open(UnavailableError(f"rank {self.rank}: the ring is closed"))

    async def __aenter__(self) -> AsyncRing:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ public collectives

    async def allreduce(
        self, x: Any, op: str = "sum", *, out: np.ndarray | None = None, timeout: float | None = None
    ) -> np.ndarray:
        """Reduces ``x`` element-wise over all ranks; every rank gets the result.

        Args:
            x: array-like of float16, float32, float64, int32 or int64, any shape.
            op: ``"sum"``, ``"mean"`` (integers: truncated toward zero), ``"min"`` or ``"max"``.
            out: optional C-contiguous array of ``x``'s shape and dtype to write the result into
                (may be ``x`` itself: in place, no allocation).
            timeout: deadline of this operation in seconds (default: the ring's).

        Returns:
            The result, same shape and dtype as ``x`` (``out`` when given).

        Raises:
            InvalidArgumentError: unsupported dtype or op, bad ``out``, or ranks that disagree.
            DeadlineExceededError: a peer did not answer within the deadline (names it).
            UnavailableError: a peer died or closed (names it).
        """
        deadline = self._deadline(timeout)
        arr = self._reduce_input(x, op)
        result = self._result_buffer(arr, out)
        if self._cfg.compression == "fp16" and arr.dtype == np.float32:
            work = arr.astype(np.float16).reshape(-1)
            await self._locked(self._allreduce_flat(work, op, deadline))
            result.reshape(-1)[...] = work
            return result
        if result is not arr:
            np.copyto(result, arr)
        await self._locked(self._allreduce_flat(result.reshape(-1), op, deadline))
        return result

    async def allreduce_many(
        self,
        tensors: Sequence[Any] | Mapping[str, Any],
        op: str = "sum",
        *,
        timeout: float | None = None,
    ) -> list[np.ndarray] | dict[str, np.ndarray]:
        """All-reduces many tensors, fusing small ones into buffers of ``fusion_threshold_bytes``.

        Args:
            tensors: a list of arrays, or a dict of them (reduced in sorted key order; every
                rank must pass the same keys, shapes and dtypes).
            op: as in :meth:`allreduce`.
            timeout: deadline of the whole call (default: the ring's).

        Returns:
            The results, in the same structure as ``tensors``.

        Raises:
            InvalidArgumentError, DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        deadline = self._deadline(timeout)
        keys = sorted(tensors) if isinstance(tensors, Mapping) else None
        items = [tensors[k] for k in keys] if keys is not None else list(tensors)  # type: ignore[index]
        arrays = [self._reduce_input(t, op) for t in items]
        shapes = [a.shape for a in arrays]
        fp16 = self._cfg.compression == "fp16"
        wire = [a.astype(np.float16) if fp16 and a.dtype == np.float32 else a for a in arrays]
        results: list[np.ndarray | None] = [None] * len(arrays)
        async with self._lock_or_fail():
            for bucket in _fusion.plan_buckets(wire, self._cfg.fusion_threshold_bytes):
                buf = _fusion.pack(wire, bucket)
                await self._allreduce_flat(buf, op, deadline)
                _fusion.unpack(buf, bucket, shapes, results)
        out = [r.astype(a.dtype) if r.dtype != a.dtype else r for r, a in zip(results, arrays, strict=True)]  # type: ignore[union-attr]
        return dict(zip(keys, out, strict=True)) if keys is not None else out

    async def broadcast(self, x: Any, root: int = 0, *, timeout: float | None = None) -> np.ndarray:
        """Every rank gets ``root``'s ``x``; the others pass an array of the same shape and dtype.

        Raises:
            InvalidArgumentError: bad root or dtype, or ranks that disagree on shape or dtype.
            DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        deadline = self._deadline(timeout)
        if not 0 <= root < self.world:
            raise InvalidArgumentError(
                f"broadcast root {root} is not in [0, {self.world})", method="broadcast"
            )
        arr = self._wire_input(x, "broadcast")
        buf = np.array(arr, copy=True, order="C") if self.rank == root else np.empty_like(arr, order="C")
        await self._locked(self._broadcast_flat(buf.reshape(-1), root, deadline))
        return buf

    async def allgather(self, x: Any, *, timeout: float | None = None) -> np.ndarray:
        """Concatenates every rank's ``x`` along axis 0, in rank order.

        Ranks may contribute different lengths along axis 0; the other dimensions
        and the dtype must agree. A scalar counts as shape ``(1,)``.

        Raises:
            InvalidArgumentError: unsupported dtype or ranks that disagree on trailing shape or dtype.
            DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        deadline = self._deadline(timeout)
        arr = self._wire_input(x, "allgather")
        if arr.ndim == 0:
            arr = arr.reshape(1)
        async with self._lock_or_fail():
            return await self._allgather(arr, deadline)

    async def barrier(self, *, timeout: float | None = None) -> None:
        """Returns once every rank has entered the barrier.

        Raises:
            DeadlineExceededError, UnavailableError: as in :meth:`allreduce`.
        """
        deadline = self._deadline(timeout)
        async with self._lock_or_fail():
            if self.world == 1:
                self._next_seq()
                return
            buf = np.empty(0, np.int32)
            op = self._new_op("barrier", _pb.COLLECTIVE_KIND_BARRIER, buf, 0, 1, deadline)
            await self._ring_pass(op, buf, even_segments(0, self.world), steps=self.world - 1, reduce_steps=0)

    # ------------------------------------------------------------------ input handling

    def _deadline(self, timeout: float | None) -> float:
        t = self._cfg.timeout if timeout is None else timeout
        if not t > 0:
            raise InvalidArgumentError(f"timeout must be positive, got {t}")
        return asyncio.get_running_loop().time() + t

    def _wire_input(self, x: Any, method: str) -> np.ndarray:
        try:
            arr = as_wire_array(x)
            wire_dtype(arr.dtype)
        except (CodecError, TypeError, ValueError) as err:
            raise InvalidArgumentError(f"rank {self.rank}: {err}", method=method) from None
        return arr

    def _reduce_input(self, x: Any, op: str) -> np.ndarray:
        if op not in REDUCE_OPS:
            raise InvalidArgumentError(
                f"unknown reduce op {op!r}; use one of {sorted(REDUCE_OPS)}", method="allreduce"
            )
        arr = self._wire_input(x, "allreduce")
        if arr.dtype not in ALLREDUCE_DTYPES:
            raise InvalidArgumentError(
                f"allreduce does not support dtype {arr.dtype.name}; "
                "use float16, float32, float64, int32 or int64",
                method="allreduce",
            )
        return arr

    @staticmethod
    def _result_buffer(arr: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return np.empty_like(arr, order="C")
        if (
            out.shape != arr.shape
            or out.dtype != arr.dtype
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise InvalidArgumentError(
                f"out must be a writeable C-contiguous {arr.dtype.name} array of shape {arr.shape}",
                method="allreduce",
            )
        return out

    def _lock_or_fail(self) -> asyncio.Lock:
        if self._lock is None or self._closed:
            raise UnavailableError(f"rank {self.rank}: the ring is not started or already closed")
        return self._lock

    async def _locked(self, coro: Any) -> Any:
        try:
            lock = self._lock_or_fail()
        except PSError:
            coro.close()
            raise
        async with lock:
            return await coro

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _new_op(self, method: str, kind: int, buf: np.ndarray, op: int, chunks: int, deadline: float) -> _Op:
        return _Op(
            method=method,
            kind=kind,
            seq=self._next_seq(),
            deadline=deadline,
            dtype=wire_dtype(buf.dtype),
            total=buf.size,
            op=op,
            chunks=chunks,
        )

    # ------------------------------------------------------------------ algorithms

    async def _allreduce_flat(self, buf: np.ndarray, op_name: str, deadline: float) -> None:
        """Ring all-reduce of the flat ``buf`` in place (reduce-scatter, then all-gather)."""
        n, r = self.world, self.rank
        op_code, ufunc = REDUCE_OPS[op_name]
        if n == 1 or buf.size == 0:
            self._next_seq()  # keep sequence numbers equal on every rank
            return
        segs = even_segments(buf.size, n)
        k = num_chunks(segs, buf.itemsize, self._cfg.chunk_bytes)
        op = self._new_op("allreduce", _pb.COLLECTIVE_KIND_ALLREDUCE, buf, op_code, k, deadline)
        mean = op_name == "mean"
        integer = buf.dtype.kind in "iu"
        dtype = buf.dtype

        def process(step: int, chunk: int, msg: bytes | memoryview | None) -> np.ndarray | None:
            a, b = chunk_range(segs[recv_segment(r, step, n)], k, chunk)
            dst = buf[a:b]
            if msg is None:
                pass  # received in place
            elif step < n - 1:
                src = np.frombuffer(msg, dtype, b - a)
                with np.errstate(over="ignore", invalid="ignore"):  # inf/nan as numpy gives them
                    ufunc(dst, src, out=dst)
                if mean and step == n - 2:  # this rank now owns the full sum of this segment
                    np.divide(dst, n, out=dst, casting="unsafe" if integer else "same_kind")
            else:
                dst[...] = np.frombuffer(msg, dtype, b - a)
            return dst if step + 1 < 2 * (n - 1) else None

        await self._ring_pass(op, buf, segs, steps=2 * (n - 1), reduce_steps=n - 1, process=process)

    async def _allgather(self, arr: np.ndarray, deadline: float) -> np.ndarray:
        n, r = self.world, self.rank
        if n == 1:
            self._next_seq()
            self._next_seq()
            return arr.copy()
        # 1) Everyone's length along axis 0, dtype and trailing shape.
        tail = arr.shape[1:]
        meta = np.zeros(4 * n, np.int64)
        meta[4 * r : 4 * r + 4] = (
            arr.shape[0],
            wire_dtype(arr.dtype),
            arr.ndim,
            zlib.crc32(repr(tail).encode()),
        )
        op = self._new_op("allgather", _pb.COLLECTIVE_KIND_ALLGATHER, meta, 0, 1, deadline)
        await self._gather_pass(op, meta, even_segments(meta.size, n))
        rows = meta.reshape(n, 4)
        for j in range(n):
            if tuple(rows[j, 1:]) != tuple(rows[r, 1:]):
                raise InvalidArgumentError(
                    f"allgather #{op.seq}: rank {j} contributes dtype/ndim/trailing shape that differ "
                    f"from rank {r}'s {arr.dtype.name} {arr.shape} (only axis 0 may differ)",
                    method="allgather",
                )
        # 2) The data.
        row = int(np.prod(tail, dtype=np.int64))
        segs = segments_from_sizes([int(d) * row for d in rows[:, 0]])
        out = np.empty(segs[-1][1], arr.dtype)
        a, b = segs[r]
        out[a:b] = arr.reshape(-1)
        k = num_chunks(segs, out.itemsize, self._cfg.chunk_bytes)
        op = self._new_op("allgather", _pb.COLLECTIVE_KIND_ALLGATHER, out, 0, k, deadline)
        await self._gather_pass(op, out, segs)
        return out.reshape(-1, *tail)

    async def _gather_pass(self, op: _Op, buf: np.ndarray, segs: list[tuple[int, int]]) -> None:
        await self._ring_pass(op, buf, segs, steps=self.world - 1, reduce_steps=0)

    async def _ring_pass(
        self,
        op: _Op,
        buf: np.ndarray,
        segs: list[tuple[int, int]],
        *,
        steps: int,
        reduce_steps: int,
        process: Process | None = None,
    ) -> None:
        """Runs ``steps`` ring steps over ``buf``; default processing copies (all-gather steps)."""
        n, r, k, dtype = self.world, self.rank, op.chunks, buf.dtype
        if process is None:

            def process(step: int, chunk: int, msg: bytes | memoryview | None) -> np.ndarray | None:
                a, b = chunk_range(segs[recv_segment(r, step, n)], k, chunk)
                dst = buf[a:b]
                if msg is not None:
                    dst[...] = np.frombuffer(msg, dtype, b - a)
                return dst if step + 1 < steps else None

        def direct(step: int, chunk: int) -> np.ndarray | None:
            if step < reduce_steps:
                return None
            return buf[slice(*chunk_range(segs[recv_segment(r, step, n)], k, chunk))]

        first = segs[send_segment(r, 0, n)]
        initial = [(0, c, buf[slice(*chunk_range(first, k, c))]) for c in range(k)]
        plan = [
            (t, c, self._payload_bytes(segs, recv_segment(r, t, n), k, c, buf.itemsize))
            for t in range(steps)
            for c in range(k)
        ]
        await self._execute(op, initial, plan, process, sends=True, direct=direct)

    async def _broadcast_flat(self, buf: np.ndarray, root: int, deadline: float) -> None:
        n, r = self.world, self.rank
        if n == 1:
            self._next_seq()
            return
        segs = [(0, buf.size)]
        k = num_chunks(segs, buf.itemsize, self._cfg.chunk_bytes)
        op = self._new_op("broadcast", _pb.COLLECTIVE_KIND_BROADCAST, buf, root, k, deadline)
        dist = (r - root) % n
        dtype = buf.dtype

        def process(step: int, chunk: int, msg: bytes | memoryview | None) -> np.ndarray | None:
            a, b = chunk_range(segs[0], k, chunk)
            dst = buf[a:b]
            if msg is not None:
                dst[...] = np.frombuffer(msg, dtype, b - a)
            return dst if dist < n - 1 else None

        def direct(step: int, chunk: int) -> np.ndarray | None:
            return buf[slice(*chunk_range(segs[0], k, chunk))]

        if dist == 0:
            initial = [(0, c, buf[slice(*chunk_range(segs[0], k, c))]) for c in range(k)]
            plan: list[tuple[int, int, int]] = []
        else:
            initial = []
            plan = [(dist - 1, c, self._payload_bytes(segs, 0, k, c, buf.itemsize)) for c in range(k)]
        await self._execute(op, initial, plan, process, sends=dist < n - 1, direct=direct)

    @staticmethod
    def _payload_bytes(segs: list[tuple[int, int]], seg: int, k: int, c: int, itemsize: int) -> int:
        a, b = chunk_range(segs[seg], k, c)
        return (b - a) * itemsize

    # ------------------------------------------------------------------ the data path

    async def _execute(
        self,
        op: _Op,
        initial: list[tuple[int, int, np.ndarray]],
        plan: list[tuple[int, int, int]],
        process: Process,
        *,
        sends: bool,
        direct: Direct | None = None,
    ) -> None:
        """Streams ``initial`` (and whatever ``process`` forwards) to the next rank while receiving ``plan``.

        ``plan`` lists the expected frames (step, chunk, payload bytes) from the previous rank in order.
        A frame of a copy step (``direct`` gives its slice) whose header is exactly the expected one
        is received straight into that slice where the transport can (transport "tcp").
        """
        t = self._transport
        assert t is not None
        prev = self._cfg.prev_rank
        sendq: asyncio.Queue[tuple[int, int, np.ndarray] | None] = asyncio.Queue()
        for item in initial:
            sendq.put_nowait(item)

        async def receiver() -> None:
            for step, chunk, nbytes in plan:
                op.receiving = (step, chunk)
                want = FrameHeader(
                    op.seq, op.total, op.kind, op.dtype, op.op, step, chunk, op.chunks, prev, self.world
                )
                dst = direct(step, chunk) if direct is not None and nbytes else None

                def into(
                    h: FrameHeader, size: int, dst: np.ndarray | None = dst, want: FrameHeader = want
                ) -> list[memoryview] | None:
                    if dst is None or h != want or size != dst.nbytes:
                        return None
                    return [memoryview(dst).cast("B")]

                try:
                    header, payload = await t.recv(into)
                except PSError as err:
                    self._check(op, err, step, chunk, nbytes)  # raises it, naming the operation
                # payload None: it went straight into dst
                if payload is not None:
                    self._check(op, (header, payload), step, chunk, nbytes)
                fwd = process(step, chunk, payload)
                if fwd is not None:
                    sendq.put_nowait((step + 1, chunk, fwd))
            op.receiving = None
            sendq.put_nowait(None)

        async def sender() -> None:
            where = f"{op.name} on rank {self.rank}"
            header = FrameHeader(
                op.seq, op.total, op.kind, op.dtype, op.op, 0, 0, op.chunks, self.rank, self.world
            )
            op.sending = "the data connection"
            op.writing = True
            try:
                await t.connect(op.deadline)
            except PSError as err:
                raise tcp_error(err, f"{where}: opening the data connection", op.method) from None
            op.writing = False
            op.sending = None  # connected: what it waits for now is a frame to send
            while (item := await sendq.get()) is not None:
                step, chunk, view = item
                op.sending = (step, chunk)
                op.writing = True
                try:
                    await t.send(header._replace(step=step, chunk=chunk), (memoryview(view).cast("B"),))
                except PSError as err:
                    raise tcp_error(err, f"{where}: sending {self._where(op.sending)}", op.method) from None
                op.writing = False
                op.sent += 1
            op.sending = None

        lost = t.begin(op.seq, op.deadline, sends=sends)
        tasks = [asyncio.create_task(receiver(), name=f"{op.name} receive")]
        if sends:
            tasks.append(asyncio.create_task(sender(), name=f"{op.name} send"))
        try:
            async with asyncio.timeout_at(op.deadline):
                pending: set[asyncio.Future[Any]] = {*tasks, lost} if lost is not None else set(tasks)
                while any(task in pending for task in tasks):
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if task is lost:
                            # The next rank ended the stream mid-operation (auth, abort, shutdown,
                            # death): fail now rather than at the deadline.
                            err = task.result()
                            raise tcp_error(err, f"{op.name} on rank {self.rank}", op.method)
                        if (exc := task.exception()) is not None:
                            raise self._translate(op, exc, sender=task is not tasks[0]) from exc
        except TimeoutError:
            error: PSError = self._deadline_error(op)
            await self._abort(op, tasks, error)
            raise error from None
        except PSError as error:
            await self._abort(op, tasks, error)
            raise
        except BaseException:
            await self._abort(op, tasks, None)
            raise
        finally:
            t.end(op.seq)

    def _check(
        self, op: _Op, item: PSError | tuple[FrameHeader, memoryview], step: int, chunk: int, nbytes: int
    ) -> None:
        """Validates a received frame (header and payload) against what this rank expects.

        Raises:
            PSError: the frame is an abort, or an error was delivered instead of a frame.
            InvalidArgumentError: the previous rank runs a different operation or shape.
        """
        if isinstance(item, PSError):
            raise type(item)(
                f"{op.name} on rank {self.rank}: waiting for {self._where((step, chunk))}: {item.details}",
                method=op.method,
                address=item.address,
            )
        h, msg = item
        prev = self._cfg.prev_rank
        if h.kind == _pb.COLLECTIVE_KIND_ABORT:
            text = bytes(msg).decode("utf-8", "replace")
            code = status_from_number(h.op)
            raise error_class(code)(
                f"{op.name} on rank {self.rank}: rank {h.rank} aborted it: {text}",
                method=op.method,
                address=self._cfg.addresses[prev],
            )
        got = (
            h.kind,
            h.dtype,
            h.op,
            h.total,
            h.chunks,
            h.world,
            h.rank,
            h.step,
            h.chunk,
            len(msg),
        )
        want = (op.kind, op.dtype, op.op, op.total, op.chunks, self.world, prev, step, chunk, nbytes)
        if got != want:
            names = ("kind", "dtype", "op", "total", "chunks", "world", "rank", "step", "chunk", "bytes")
            diff = ", ".join(
                f"{k}={g} (expected {w})" for k, g, w in zip(names, got, want, strict=True) if g != w
            )
            raise InvalidArgumentError(
                f"{op.name} on rank {self.rank}: rank {h.rank} sent "
                f"{_KIND_NAMES.get(h.kind, h.kind)} #{h.seq} with {diff}; every rank must call the same "
                "collectives in the same order with equal shapes, dtypes and ops",
                method=op.method,
                address=self._cfg.addresses[prev],
            )

    def _translate(self, op: _Op, exc: BaseException, *, sender: bool) -> PSError:
        if isinstance(exc, PSError):
            return exc
        nxt = self._cfg.next_rank
        addr = self._cfg.addresses[nxt]
        if isinstance(exc, grpc.aio.AioRpcError):
            return error_class(exc.code())(
                f"{op.name} on rank {self.rank}: sending {self._where(op.sending)} to rank {nxt} failed: "
                f"{exc.code().name}: {exc.details()}",
                method=op.method,
                address=addr,
            )
        if sender:
            return UnavailableError(
                f"{op.name} on rank {self.rank}: sending to rank {nxt} failed: {type(exc).__name__}: {exc}",
                method=op.method,
                address=addr,
            )
        return InternalError(
            f"{op.name} on rank {self.rank}: processing a frame failed: {type(exc).__name__}: {exc}",
            method=op.method,
        )

    @staticmethod
    def _where(pos: tuple[int, int] | str | None) -> str:
        if isinstance(pos, tuple):
            return f"step {pos[0]} chunk {pos[1]}"
        return pos or "the stream"

    def _deadline_error(self, op: _Op) -> DeadlineExceededError:
        cfg = self._cfg
        why = "the peer is dead, stuck, or not calling the same collective"
        if op.sending is not None and op.sent == 0:
            peer, what = cfg.next_rank, f"waiting for rank {cfg.next_rank} to accept the stream"
            if (
                self._channel is not None
                and self._channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE
            ):  # grpc logs the handshake's own reason
                why = (
                    "connecting to it fails: nothing listens there, or the TLS settings disagree "
                    "(plaintext vs TLS, tls_ca, or a certificate that its tls_client_ca refuses)"
                )
        elif op.receiving is not None:
            peer, what = cfg.prev_rank, f"waiting for {self._where(op.receiving)} from rank {cfg.prev_rank}"
        else:
            peer, what = (
                cfg.next_rank,
                f"waiting for rank {cfg.next_rank} to accept {self._where(op.sending)}",
            )
        return DeadlineExceededError(
            f"{op.name} on rank {self.rank}: deadline exceeded {what} ({cfg.addresses[peer]}); {why}",
            method=op.method,
            address=cfg.addresses[peer],
        )

    async def _abort(self, op: _Op, tasks: list[asyncio.Task[None]], error: PSError | None) -> None:
        """Stops both directions; tells the next rank why (best effort) so the whole ring fails fast."""
        writing = op.writing  # a cancelled write leaves the link unusable for the abort frame
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert self._transport is not None
        header = None
        text = b""
        if error is not None and not writing and len(tasks) > 1:
            code = status_number(error.code)
            header = FrameHeader(
                op.seq,
                op.total,
                _pb.COLLECTIVE_KIND_ABORT,
                op.dtype,
                code,
                0,
                0,
                op.chunks,
                self.rank,
                self.world,
            )
            text = str(error).encode()[:_ABORT_TEXT_BYTES]
        # Frames of the failed operation may be in flight: the next one starts on fresh links.
        await self._transport.abort(header, text)
