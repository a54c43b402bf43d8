"""The shard's raw-TCP data port: pulls, pushes and lookups without gRPC, an adapter over ``ShardService``.

A client gets the port and a one-time nonce from the ``DataPort`` call (so the
auth token guards the port too), connects (TLS when the shard serves TLS, with
its certificate), and sends requests one at a time as ``pscore.bulk`` frames.

- A pull is ``ShardService.pull_snapshot``, as for ``Pull``; the values
  are sent straight from the stored arrays (copy-on-write, so a snapshot stays
  put while it is sent).
- A push's gradients are received straight into a buffer of a small pool
  (reused once nothing refers to it, so a steady stream of pushes does not
  fault in fresh pages), then go through ``ShardService.push``, as
  ``Push``: validation, the mode (idempotence, sync barrier, ssp clock),
  replication and the returned values are exactly those of the gRPC calls. The
  shard applies a push once all of it has arrived (a push is all or nothing).
  A push or push_pull that waits for nothing (async mode, no backup, small
  variables: the common case) is served by ``ShardService.push_now``, the same
  checks, update and values with no await (none of the mode's and the store's
  coroutines).
- Failures are answered with the status, message and reason the gRPC call
  would have ended with (``ShardService.failure``); bytes that are not
  frames end the connection (the shard goes on serving).
- A lookup is ``ShardService.lookup_rows``, as ``Lookup``; its ids travel in
  the head, the rows are sent straight from the copy it read.
- Metrics count these requests as ``Push``, ``Pull`` and ``Lookup`` RPCs.
- A BATCH frame carries several small requests of one client process (its
  concurrent callers met, ``psclient._bulk``): each is served as if it had
  come alone and answered once, in BATCHED frames. In sync and ssp modes, or
  with a backup, all at once (a task each: a push waiting at a sync barrier
  holds back none of the others), those served at once answered together and
  the others as they end; in async mode one after the other, answered in one
  frame. A bad entry gets its own ERROR answer; the others are served as usual.

Shutdown (``stop``): the port stops accepting; connections waiting for a
request are closed, and a request in progress is answered (up to the grace
period) before its connection closes. Clients retry on the restarted shard.

Memory: besides the state, the pool keeps up to ``POOL_BUFFERS`` idle buffers,
each the size of the push it last held (rounded up to 1 MiB); a buffer is
allocated per push in flight beyond that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import sys
import time
from typing import Any, Final

import grpc
import numpy as np

from pscore import bulk, codec, transport
from pscore.errors import PSError, UnavailableError, status_number
from psproto.v1 import ps_pb2
from psserver.metrics import ShardMetrics
from psserver.service import ShardService, deadline_of

log = logging.getLogger(__name__)

POOL_BUFFERS: Final[int] = 2  # idle receive buffers kept for reuse
_ROUND: Final[int] = 1 << 20  # buffer sizes are rounded up to this
_NONCES: Final[int] = 4096  # unused nonces kept (one per connection a client is opening)
_NONCE_TTL_S: Final[float] = 120.0


class BufferPool:
    """Receive buffers for pushes: a buffer is reused once no gradient array refers to it any more.

    Not thread-safe: used from the shard's event loop.
    """

    def __init__(self, keep: int = POOL_BUFFERS) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` (a free pooled one if any fits)."""
        best = None
        for buf in self._free:
            # References: the pool's list, this loop variable and getrefcount's argument.
            if (
                buf.nbytes >= nbytes
                and sys.getrefcount(buf) <= 3
                and (best is None or buf.nbytes < best.nbytes)
            ):
                best = buf
        if best is not None:
            return best
        buf = np.empty(-(-max(nbytes, 1) // _ROUND) * _ROUND, np.uint8)
        self._free.append(buf)
        if len(self._free) > self.keep:  # forget the smallest idle one (a busy one lives on with its users)
            idle = [b for b in self._free if b is not buf and sys.getrefcount(b) <= 3]
            drop = min(idle, key=lambda b: b.nbytes) if idle else buf
            self._free = [b for b in self._free if b is not drop]  # by identity: arrays do not compare
        return buf

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps."""
        return sum(b.nbytes for b in self._free)


class DataPortServer:
    """The data port of one shard (see the module doc).

    Args:
        service: the shard's operations (its push, pull and lookup).
        metrics: the shard's metrics (requests counted as ``Push`` / ``Pull``), or None.
        host: the host the gRPC server binds.
        port: the port to bind (0: an ephemeral one).
        tls: the accepting side's TLS context (``pscore.transport.server_context``), or None.
    """

    def __init__(
        self,
        service: ShardService,
        metrics: ShardMetrics | None,
        *,
        host: str,
        port: int = 0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._service = service
        self._metrics = metrics
        self._shard = service.shard
        self._port = transport.DataPort(
            host,
            port,
            magic=bulk.MAGIC,
            on_connection=self._serve,
            tls=tls,
            max_nonces=_NONCES,
            nonce_ttl_s=_NONCE_TTL_S,
            name=f"shard {service.shard} data port",
        )
        self.pool = BufferPool()
        self._idle: set[asyncio.Task[None]] = set()  # serving tasks waiting for a request
        self._busy: set[asyncio.Task[None]] = set()  # serving tasks answering one
        self._links: set[bulk.BulkConnection] = set()
        self._descriptions = bulk.Descriptions(ps_pb2.PushResponse, "values")  # push_pull's values' entries
        self._quiet: asyncio.Event | None = None  # made by stop(): set once no request is in progress
        self.stopping = False

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port.port

    async def start(self) -> None:
        """Binds the port and starts accepting. Raises: OSError."""
        await self._port.start()

    def issue_nonce(self) -> bytes:
        """A one-time nonce for one connection (``DataPort`` call)."""
        return self._port.issue_nonce()

    async def stop(self, grace_s: float) -> None:
        """Stops accepting; answers requests in progress (for ``grace_s`` at most), then closes all."""
        self.stopping = True
        self._port.stop_accepting()
        for task in list(self._idle):
            task.cancel()
        quiet = self._quiet = asyncio.Event()
        if not self._busy:
            quiet.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await quiet.wait()
        await self._port.close()
        for link in list(self._links):
            link.reset()

    async def _serve(self, conn: transport.Conn, _who: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        link = bulk.BulkConnection(conn, f"shard {self._shard} data port client")
        self._links.add(link)
        try:
            while link.open and not self.stopping:
                received: list[Any] = []  # the payload's buffer, a push's tensors and the payload's bytes
                self._idle.add(task)
                try:
                    frame, _ = await link.recv(functools.partial(self._receive_into, received=received))
                except bulk.Closed:
                    return
                except PSError as err:  # garbage, or a broken connection: drop it, serve the others
                    log.warning("shard %d: data port connection dropped: %s", self._shard, err.details)
                    return
                finally:
                    self._idle.discard(task)
                self._busy.add(task)
                try:
                    if frame.kind == bulk.BATCH:
                        await self._answer_batch(link, frame, received[0], received[2])
                        continue
                    reply, payload = await self._reply(frame, received[0], received[1])
                    try:
                        await link.send(reply, payload)
                    except PSError as err:  # the client went away; its retry (a push: idempotent) is answered
                        log.info("shard %d: data port answer not delivered: %s", self._shard, err.details)
                        continue
                    if self._metrics is not None and payload and frame.kind != bulk.LOOKUP:
                        self._metrics.pull_bytes.value += sum(map(len, payload))  # Tally.inc, inline
                finally:
                    self._busy.discard(task)
                    if self._quiet is not None and not self._busy:  # stopping: the last one ended
                        self._quiet.set()
                    del received
        except asyncio.CancelledError:
            if not self.stopping:
                raise
        finally:
            link.reset()
            self._links.discard(link)

    def _receive_into(self, frame: bulk.Frame, nbytes: int, received: list[Any]) -> list[memoryview]:
        """Where a request's payload goes: a push's gradients into a pooled buffer (appended to ``received``
        with the tensors' layout and the payload's bytes). Raises: CodecError."""
        kind = frame.kind
        if kind not in bulk.REQUESTS and kind != bulk.BATCH:
            raise codec.CodecError(f"a request cannot be a frame of kind {kind}")
        layout = bulk.tensor_layout(frame.head.grads) if kind == bulk.PUSH else []  # frame.tensors()
        described = 0
        for t in layout:  # a loop, not sum() over a generator: no call per tensor
            described += t[3]
        if kind != bulk.BATCH and described != nbytes:  # a batch: checked entry by entry (``_reply``)
            raise codec.CodecError(f"the head describes other tensors than the {nbytes} payload bytes")
        buf = self.pool.take(nbytes) if nbytes else None
        received += (buf, layout, nbytes)
        return [memoryview(buf)[:nbytes]] if buf is not None else []

    async def _answer_batch(
        self, link: bulk.BulkConnection, frame: bulk.Frame, buf: np.ndarray | None, nbytes: int
    ) -> None:
        """Serves a BATCH frame's requests, each as if it had come alone, and answers each once. Where a
        request may wait for another one (sync and ssp modes) or for a backup, they are served at the same
        time (a task each: one waiting on a barrier holds back none of the others): those served at once
        are answered in one BATCHED frame, the others in BATCHED frames as they end; else (async mode, no
        backup: ``ShardService.serves_alone``) one after the other, all answered in one frame. A bad entry
        is answered by its own ERROR; entries that do not fill the frame (of ``nbytes`` of payload) drop
        the connection."""
        view = memoryview(buf if buf is not None else b"")[:nbytes]  # the pooled buffer may be longer
        try:
            items = bulk.read_entries(view, frame.head.count, bulk.REQUESTS)
        except codec.CodecError as err:  # not a frame: the stream is out of step
            log.warning("shard %d: data port connection dropped: bad batch frame: %s", self._shard, err)
            link.reset()
            return
        done: list[tuple[int, bulk.Frame, list[memoryview]]] = []
        wake: list[asyncio.Future[None]] = []
        if self._service.serves_alone():  # the common case: one after the other, no task each
            for index, item, payload in items:
                if isinstance(item, codec.CodecError):
                    done.append((index, self._refusal(item), []))
                    continue
                done.append((index, *await self._reply(item, payload, None)))
            await self._send_answers(link, done)
            return
        loop = asyncio.get_running_loop()
        tasks = []
        for index, item, payload in items:
            if isinstance(item, codec.CodecError):
                done.append((index, self._refusal(item), []))
                continue
            tasks.append(loop.create_task(self._entry(index, item, payload, done, wake)))
        try:
            answered = 0
            while True:
                if len(done) == answered and answered < len(items):  # none ended since the last answer
                    woken = loop.create_future()
                    wake.append(woken)
                    await woken
                ready, answered = done[answered:], len(done)
                if not await self._send_answers(link, ready) or answered == len(items):
                    return
        finally:
            for t in tasks:
                t.cancel()

    async def _send_answers(
        self, link: bulk.BulkConnection, ready: list[tuple[int, bulk.Frame, list[memoryview]]]
    ) -> bool:
        """Sends answers to a batch's requests in one BATCHED frame; False: the client went away (its
        retries get new answers)."""
        try:
            await link.send(
                bulk.Frame(bulk.BATCHED, ps_pb2.DataPortBatch(count=len(ready))), bulk.entries(ready)
            )
        except PSError as err:
            log.info("shard %d: data port answers not delivered: %s", self._shard, err.details)
            return False
        if self._metrics is not None:
            sent = sum(len(p) for _, f, payload in ready if f.kind != bulk.LOOKED_UP for p in payload)
            if sent:
                self._metrics.pull_bytes.inc(sent)
        return True

    async def _entry(
        self,
        index: int,
        frame: bulk.Frame,
        payload: memoryview,
        done: list[tuple[int, bulk.Frame, list[memoryview]]],
        wake: list[asyncio.Future[None]],
    ) -> None:
        """One request of a batch: its answer to ``done``, and ``_answer_batch`` woken."""
        done.append((index, *await self._reply(frame, payload, None)))
        if wake:
            woken = wake.pop()
            if not woken.done():
                woken.set_result(None)

    def _refusal(self, err: codec.CodecError) -> bulk.Frame:
        """The ERROR answer to a malformed request of a batch (as ``_reply`` answers a bad request)."""
        code, message, reason = self._service.failure(err)
        return bulk.Frame(
            bulk.ERROR, ps_pb2.DataPortError(code=status_number(code), message=message, reason=reason)
        )

    async def _reply(
        self,
        frame: bulk.Frame,
        buf: np.ndarray | memoryview | None = None,
        layout: bulk.Layout | None = None,
    ) -> tuple[bulk.Frame, list[memoryview]]:
        """Serves one request: its answer frame and payload (an ERROR frame for a failure). ``buf``: the
        request's payload; ``layout``: a push's tensors (``_receive_into`` checked them against it), or
        None: a batch's entry, checked here."""
        started = time.perf_counter()
        head = frame.head
        kind, rpc = frame.kind, bulk.REQUESTS[frame.kind]
        reply: bulk.Frame
        payload: list[memoryview] = []
        code = grpc.StatusCode.OK
        response = None
        try:
            if layout is None:
                layout = bulk.tensor_layout(head.grads) if kind == bulk.PUSH else []
                nbytes = len(buf) if buf is not None else 0
                for t in layout:
                    nbytes -= t[3]
                if nbytes:
                    raise codec.CodecError(
                        f"the head describes other tensors than the {len(buf) if buf is not None else 0} "
                        "payload bytes"
                    )
            if self.stopping:
                raise UnavailableError("the shard is shutting down; retry on its restart")
            if kind == bulk.PUSH:
                grads, nbytes = _gradients(layout, buf)
                if self._metrics is not None:
                    self._metrics.push_received(head, nbytes)
                done = self._service.push_now(head, grads)  # the common case: no await
                if done is None:
                    left = head.timeout_s  # deadline_of(None, head.timeout_s), inline
                    done = await self._service.push(
                        head, grads, time.monotonic() + left if left > 0 else None
                    )
                response, snapshot = done
                if snapshot is not None:  # push_pull: the values, straight from the stored arrays
                    versions = response.versions
                    descriptions = self._descriptions
                    encoded = [b""]  # the head as sent: its fields, then the values' encoded descriptions
                    for name, value, version in snapshot:
                        versions.append(version)
                        encoded.append(descriptions[name, value.dtype, value.shape])
                        payload.append(memoryview(value.reshape(-1)).cast("B"))
                    encoded[0] = response.SerializeToString()
                    reply = bulk.Frame(bulk.PUSHED, b"".join(encoded))
                else:
                    reply = bulk.Frame(bulk.PUSHED, response)
            elif kind == bulk.LOOKUP:
                rows = await self._service.lookup_rows(head, None)
                described = rows.header.values
                for c in rows.chunks:  # _described, and the payload, by a loop: no call per lookup
                    described.add(name=c.name, dtype=c.dtype, shape=c.shape)
                    payload.append(c.data)
                reply = bulk.Frame(bulk.LOOKED_UP, rows.header)
            else:
                if self._metrics is not None:
                    self._metrics.saw_worker(head.worker_id)
                snapshot = await self._service.pull_snapshot(head, deadline_of(None, head.timeout_s))
                chunks = [codec.WireChunk.of(name, value) for name, value, _ in snapshot]
                answer = ps_pb2.PullResponse(versions=[v for _, _, v in snapshot], values=_described(chunks))
                payload = [c.data for c in chunks]
                reply = bulk.Frame(bulk.PULLED, answer)
        except (PSError, codec.CodecError) as err:
            code, message, reason = self._service.failure(err)
            reply = bulk.Frame(
                bulk.ERROR, ps_pb2.DataPortError(code=status_number(code), message=message, reason=reason)
            )
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            log.exception("shard %d: data port %s failed", self._shard, rpc)
            reply = bulk.Frame(
                bulk.ERROR,
                ps_pb2.DataPortError(
                    code=status_number(code), message=f"shard {self._shard}: internal error"
                ),
            )
        finally:
            if self._metrics is not None:
                seconds = time.perf_counter() - started
                if kind == bulk.PUSH:
                    self._metrics.push_done(head, response, code, seconds, rpc)
                elif kind == bulk.PULL:
                    self._metrics.pull_done(head, code, seconds, rpc)
                else:  # as the Lookup call is counted
                    self._metrics.rpc_done(rpc, seconds, code)
        return reply, payload


def _gradients(layout: bulk.Layout, buf: np.ndarray | memoryview | None) -> tuple[dict[str, np.ndarray], int]:
    """The push's gradients as ``ShardService.push_one`` assembles those of ``Push``: by name, each a
    read-only view of the buffer (the tensors of ``layout``, in order, from its start), and their bytes.
    Raises: CodecError (a tensor named twice)."""
    view = memoryview(buf).toreadonly() if buf is not None else memoryview(b"")
    grads: dict[str, np.ndarray] = {}
    start = 0
    for name, dtype, shape, size in layout:
        if name in grads:  # as the Assembler says it
            raise codec.CodecError(f"tensor {name!r}: received more elements than its shape {shape} holds")
        grads[name] = np.frombuffer(view[start : start + size], dtype).reshape(shape)
        start += size
    return grads, start


def _described(chunks: list[codec.WireChunk]) -> list[ps_pb2.TensorChunk]:
    """The head entries announcing whole-tensor ``chunks`` (their bytes follow as the payload)."""
    return [ps_pb2.TensorChunk(name=c.name, dtype=c.dtype, shape=c.shape) for c in chunks]
