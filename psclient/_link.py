"""ShardLink: what one client holds for one shard, and the one place that sends it requests.

A shard has one address, or two (``PRIMARY|BACKUP``: ``psserver --backup-of``).
Its link holds, per replica, a gRPC channel (the control plane, and the wire a
request falls back to), the data connections (``psclient._bulk.DataLink``) and
a reachability watch (``psclient._reach``), and which replica is in use.

- ``call`` runs one RPC: retried on UNAVAILABLE with backoff within one
  deadline (``psclient._retry``), failed over to the other replica, and its
  error turned into a ``PSError`` that says what happened (a silent shard, the
  replica that went quiet, a push whose outcome is unknown).
- ``request`` sends a pull, a push (or push_pull) or a lookup over the wire
  ``psclient._wire.choose`` picks, and speaks that wire: one frame each way on
  the data port, one message each way on the shard's PushSession stream (small
  pushes over gRPC) or in a unary call, or a stream of chunks. The
  answer's tensors go to a ``Sink`` as they arrive, whatever the wire; a wire
  that turns out unusable hands the request to the next one.

Not thread-safe: used from the client's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import grpc

from psclient import _bulk, _reach, _retry, _session, _stall, _wire
from psclient import _requests as rq
from psclient._wire import Op, Wire
from psclient.config import ClientConfig
from pscore import bulk, codec, rpc, transport
from pscore.errors import error_class, from_rpc_error
from psproto.v1 import ps_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

# Channels to a replicated shard (PRIMARY|BACKUP): an HTTP/2 ping every second, calls in flight or not;
# unanswered for 2 s (gRPC's core answers pings, not the shard's busy event loop), the link is silent and
# the channel's calls fail (UNAVAILABLE) and fail over. A shard with one address has nowhere to fail over
# to: its channel keeps gRPC's slower keepalive (30 s / 10 s), and its calls wait for it (wait_for_ready)
# until their deadline.
KEEPALIVE_TIME_S = 1.0
KEEPALIVE_TIMEOUT_S = 2.0
_SINGLE_KEEPALIVE_TIME_S = 30.0
_SINGLE_KEEPALIVE_TIMEOUT_S = 10.0

# The gRPC methods of each op, per wire (the data port's frames are named as the unary call, in errors).
_METHODS: dict[tuple[Op, Wire], str] = {
    (Op.PULL, Wire.DATA_PORT): "Pull",
    (Op.PULL, Wire.UNARY): "Pull",
    (Op.PULL, Wire.STREAM): "PullStream",
    (Op.PUSH, Wire.DATA_PORT): "Push",
    (Op.PUSH, Wire.SESSION): "PushSession",
    (Op.PUSH, Wire.UNARY): "Push",
    (Op.PUSH, Wire.STREAM): "PushStream",
    (Op.LOOKUP, Wire.DATA_PORT): "Lookup",
    (Op.LOOKUP, Wire.UNARY): "Lookup",
}
_PUSH_METHODS = frozenset({"Push", "PushSession", "PushStream"})
_UNREACHABLE_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})
_SILENT_SHARD = (
    "shard {address} accepts connections but sent no answer in {waited:.0f} s (gRPC channel {state}; its "
    "log says why: a shard whose event loop is blocked logs where; `kill -USR1` on its process writes every "
    "thread's stack there)"
)
# A push that failed for want of an answer may have reached the shard: say so, and what holds.
_OUTCOME_UNKNOWN = (
    "the push may or may not have been applied (never twice: the shard's push ledger applies each push at "
    "most once); pull to see the values"
)
_DATA_PORT_REQUEST = ps_pb2.ShardDataPortRequest()
_EMPTY_PUSH = ps_pb2.PushRequest()


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__
class Sink:
    """Where the tensors of a request's answer go, over any wire.

    Args:
        add: takes one received tensor (a ``TensorChunk`` with its bytes, or a ``codec.WireChunk``).
        place: for a tensor announced on the data port, the buffer its bytes go straight into, or
            None: it is received into a buffer of its own and given to ``add``.
        restart: an attempt begins again (a retry): forget what an earlier attempt received.
    """

    add: Callable[[Any], None]
    place: Callable[[ps_pb2.TensorChunk], memoryview | None] | None = None
    restart: Callable[[], None] = lambda: None


@dataclass
class Answer:
    """What the answer to a request says besides its tensors (those went to the ``Sink``)."""

    applied: bool = True  # a push: whether the shard applied it (False: a duplicate or a stale step)
    checkpoint_step: int = 0  # a push in sync mode: the step of the cluster's next periodic checkpoint
    versions: dict[str, int] = field(default_factory=dict)  # a pull: each tensor's version

    def read(self, op: Op, head: Any) -> None:
        """Takes in one message of the answer (a stream's answer has several)."""
        if op is Op.PUSH:
            self.applied = self.applied and bool(head.applied)
            self.checkpoint_step = max(self.checkpoint_step, head.checkpoint_step)
        elif op is Op.PULL:
            self.versions.update(rq.versions_of(head.values, head.versions))


class Credentials:
    """A client's TLS settings, read from its files once and shared by its links.

    Args:
        config: ``tls_ca``, ``tls_cert`` and ``tls_key`` are read (PEM file paths).
    """

    def __init__(self, config: ClientConfig) -> None:
        self._config = config
        self._channel: grpc.ChannelCredentials | None = None
        self._data: ssl.SSLContext | None = None

    @property
    def secure(self) -> bool:
        return bool(self._config.tls_ca or self._config.tls_cert)

    def channel(self) -> grpc.ChannelCredentials | None:
        """The gRPC channels' credentials (None: plain text)."""
        cfg = self._config
        if self._channel is None and self.secure:
            self._channel = grpc.ssl_channel_credentials(
                root_certificates=_read(cfg.tls_ca),
                private_key=_read(cfg.tls_key),
                certificate_chain=_read(cfg.tls_cert),
            )
        return self._channel

    def data(self) -> ssl.SSLContext | None:
        """The data connections' TLS context (None: plain TCP)."""
        cfg = self._config
        if self._data is None and self.secure:
            self._data = transport.client_context(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        return self._data


class ShardLink:
    """One shard's replicas, as one client reaches them (see the module docstring).

    Args:
        shard: the shard's index.
        config: the client's settings (timeouts, retry policy, wires, auth token).
        credentials: the client's TLS settings.
        uplink: the client's turns for large uploads (``_bulk.Uplink``), or None.
    """

    def __init__(
        self, shard: int, config: ClientConfig, credentials: Credentials, uplink: _bulk.Uplink | None
    ) -> None:
        self.shard = shard
        self.address = config.addresses[shard]  # as given: ``PRIMARY|BACKUP`` for a replicated shard
        self.replicas = self.address.split("|")
        self.current = 0  # the replica in use (the primary, as far as this client knows)
        self._config = config
        self._credentials = credentials
        self._uplink = uplink
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[rpc.Stub] = []
        self._data: dict[int, _bulk.DataLink] = {}  # replica -> its data port (shared: ``_bulk.shared_link``)
        self._data_ports: dict[int, Callable[[float], Any]] = {}  # replica -> this client's DataPort call
        self._session: _session.PushSession | None = None  # small pushes over gRPC, to the replica in use
        self._closing: set[asyncio.Future[None]] = set()  # sessions of replicas failed over from
        self._watches: dict[int, _reach.Watch] = {}  # replica -> its reachability
        self._last_failure: dict[int, str] = {}  # replica -> its last failed attempt
        # Replicated shards: per replica, its calls waiting and whether its process still answers.
        self._liveness: list[_stall.Liveness] = []
        self._closed = False
        self._descriptions = bulk.Descriptions(ps_pb2.PushRequest, "grads")  # pushed tensors' head entries

    # -- gRPC ----------------------------------------------------------------

    def stub(self) -> rpc.Stub:
        """The stub of the replica in use (its channel is made on first use).

        Raises:
            RuntimeError: the client is closed.
        """
        if self._closed:
            raise RuntimeError("the client is closed")
        if not self._stubs:
            creds = self._credentials.channel()
            options = _channel_options(self._config, replicated=len(self.replicas) > 1)
            self._channels = [
                grpc.aio.insecure_channel(a, options=options)
                if creds is None
                else grpc.aio.secure_channel(a, creds, options=options)
                for a in self.replicas
            ]
            self._stubs = [rpc.Stub(ch) for ch in self._channels]
        return self._stubs[self.current]

    def channel(self) -> grpc.aio.Channel:
        """The channel of the replica in use (for other services on it: health)."""
        self.stub()
        return self._channels[self.current]

    def metadata(self) -> tuple[tuple[str, str], ...]:
        token = self._config.auth_token
        return (("authorization", f"Bearer {token}"),) if token else ()

    def kw(self, *, wait_for_ready: bool | None = None) -> dict[str, Any]:
        """The keyword arguments of one attempt of a call on ``stub()``: deadline, metadata, and
        ``wait_for_ready`` (by default: one address waits while it restarts, replicas fail fast so
        that the call fails over)."""
        return {
            "timeout": _retry.attempt_timeout(self._config.timeout),
            "metadata": self.metadata(),
            "wait_for_ready": len(self.replicas) == 1 if wait_for_ready is None else wait_for_ready,
        }

    async def call(
        self, method: str, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None
    ) -> T:
        """Runs one RPC, converting gRPC errors to ``PSError``.

        ``fn(*args)`` starts a fresh attempt each time it is called (it reads its deadline from
        ``_retry.attempt_timeout``): UNAVAILABLE (shard down or restarting, connection broken) is
        retried with backoff, on the other replica if there is one, until ``timeout`` (default
        ``config.timeout``) has passed. The first attempt is made here, with no partial and no frame
        of ``_retry`` 's: the path of a request answered at once (a pull, a push over the data port).

        Raises:
            PSError: the call failed (its message says what the client saw of the shard).
        """
        watch = self._watches.get(self.current) or self._watch()
        watch.enter()  # a shard that does not answer is reported within seconds (see psclient._reach)
        started = time.monotonic()
        limit = self._config.timeout if timeout is None else timeout
        # A replicated shard: a stopped process is told from a slow one, and failed over from.
        replicated = len(self.replicas) > 1
        try:
            # The first attempt here, the retries (rare) in ``_retry``: as ``_retry.call_with_retry``.
            token = _retry.ATTEMPT_TIMEOUT.set(max(limit, 0.001))
            try:
                if replicated:
                    return await self._unless_stalled(fn, *args)
                return await fn(*args)
            except grpc.RpcError as err:
                failed = err
            finally:
                _retry.ATTEMPT_TIMEOUT.reset(token)
            attempt = (
                functools.partial(self._unless_stalled, fn, *args)
                if replicated
                else functools.partial(fn, *args)
            )
            return await self._retries(method, attempt, failed, started, limit)
        finally:
            watch.leave()

    async def _retries(
        self, method: str, fn: Callable[[], Awaitable[T]], failed: grpc.RpcError, started: float, limit: float
    ) -> T:
        """``call`` once its first attempt (begun at ``started``) failed with ``failed``: the retries and
        failover within ``limit`` seconds of ``started``, and the ``PSError`` if they fail too."""
        try:
            return await _retry.retry_after(
                failed,
                fn,
                deadline=started + limit,
                policy=self._config.retry,
                what=f"{method} on {self.address}",
                on_retry=self._failover,
            )
        except grpc.RpcError as err:
            raise await self._error(method, err, time.monotonic() - started) from err

    async def unary(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """``call`` of the unary RPC ``method`` with ``request`` (the same message at every attempt)."""
        return await self.call(
            method, lambda: getattr(self.stub(), method)(request, **self.kw()), timeout=timeout
        )

    async def unary_stream(
        self, method: str, messages: Callable[[], Iterable[Any]], *, timeout: float | None = None
    ) -> Any:
        """``call`` of the client-streaming RPC ``method``: each attempt sends ``messages()`` afresh."""
        return await self.call(
            method, lambda: getattr(self.stub(), method)(stream_of(messages()), **self.kw()), timeout=timeout
        )

    async def _unless_stalled(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """One attempt of a call to a replicated shard, failed (``_stall.StalledError``) if its replica's
        process stops answering while it waits (``psclient._stall``)."""
        if not self._liveness:
            self._liveness = [
                _stall.Liveness(address, functools.partial(self._status, r))
                for r, address in enumerate(self.replicas)
            ]
        liveness = self._liveness[self.current]
        task = liveness.enter()
        try:
            return await fn(*args)
        except asyncio.CancelledError:
            waited = liveness.leave(task)
            if waited is None:
                raise
            raise _stall.StalledError(liveness.address, waited) from None
        finally:
            liveness.leave(task)  # a second leave does nothing

    async def _status(self, replica: int, timeout: float) -> Any:
        self.stub()
        return await self._stubs[replica].GetStatus(
            ps_pb2.GetStatusRequest(), timeout=timeout, metadata=self.metadata(), wait_for_ready=False
        )

    def _failover(self, err: grpc.RpcError) -> None:
        """After a retryable error: the next attempt goes to the next replica (``PRIMARY|BACKUP``), unless
        that one's process was found stopped moments ago (``psclient._stall``): then this one again."""
        if len(self.replicas) == 1:
            return
        self._last_failure[self.current] = _failure(err)
        old = self.replicas[self.current]
        following = (self.current + 1) % len(self.replicas)
        if self._liveness and self._liveness[following].recently_stalled():
            return
        self.current = following
        session, self._session = self._session, None
        if session is not None:  # its stream is bound to the old replica
            closing = asyncio.ensure_future(session.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        log.info(
            "shard %d: %s answered %s; trying %s",
            self.shard,
            old,
            err.code().name,
            self.replicas[self.current],
        )

    async def _error(self, method: str, err: grpc.RpcError, waited: float) -> Exception:
        """The ``PSError`` of a failed call: for a shard that could not be reached, what the client saw."""
        address = self.address
        replicas = self._replica_story(err, waited)
        if err.code() in _UNREACHABLE_CODES:
            why = await self._watch().describe(waited)
            if why is None and _no_answer(err):
                why = _SILENT_SHARD.format(address=address, waited=waited, state=self.channel_state())
            unknown = _OUTCOME_UNKNOWN if method in _PUSH_METHODS and _no_answer(err) else None
            if why is not None or replicas or unknown:  # say what happened, not just "Deadline Exceeded"
                said = "; ".join(p for p in (why, err.details(), replicas, unknown) if p)
                return error_class(err.code())(said, method=method, address=address)
        return from_rpc_error(err, method=method, address=address)

    def _replica_story(self, err: grpc.RpcError, waited: float) -> str:
        """For a replicated shard, which replica went silent or refused and what the other last said
        (a standby backup names its primary), or "" for a shard with one address."""
        if len(self.replicas) == 1:
            return ""
        self._last_failure[self.current] = _failure(err)
        asked = self.replicas[self.current]
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            story = f"shard {self.shard}: {asked}, the replica asked last, gave no answer in {waited:.1f} s"
        else:
            story = f"shard {self.shard}: {asked}, the replica asked last, answered {err.code().name}"
        for r, address in enumerate(self.replicas):
            if r != self.current:
                last = self._last_failure.get(r)
                story += f"; {address}: " + (f"its last failure: {last}" if last else "not tried yet")
        return story

    def _watch(self) -> _reach.Watch:
        """The reachability watch of the replica in use."""
        replica = self.current
        watch = self._watches.get(replica)
        if watch is None:
            watch = self._watches[replica] = _reach.Watch(
                self.replicas[replica], functools.partial(self._connected, replica)
            )
        return watch

    def _connected(self, replica: int) -> bool:
        if not self._channels:
            return False
        return self._channels[replica].get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY

    def channel_state(self) -> str:
        """The state of the replica in use's gRPC channel (``READY``, ``CONNECTING``...)."""
        if not self._channels:
            return "closed"
        return self._channels[self.current].get_state(try_to_connect=False).name

    # -- pulls, pushes and lookups --------------------------------------------

    def data_link(self) -> _bulk.DataLink | None:
        """The data port of the replica in use; None: use gRPC (turned off, or the data port could
        not be reached lately)."""
        if not self._config.data_port:
            return None
        if self._closed:
            raise RuntimeError("the client is closed")
        link = self._data.get(self.current)
        if link is None:
            link = self._new_data_link()
        return link if time.monotonic() >= link.off_until else None  # ``link.usable``, inline

    def _new_data_link(self) -> _bulk.DataLink:
        """The data link of the replica in use, made on its first use."""
        self.stub()  # the channels exist
        replica = self.current
        stub = self._stubs[replica]
        wait = len(self.replicas) == 1

        def data_port(timeout: float) -> Any:
            return stub.DataPort(
                _DATA_PORT_REQUEST, timeout=timeout, metadata=self.metadata(), wait_for_ready=wait
            )

        cfg = self._config
        link = self._data[replica] = _bulk.shared_link(
            self.replicas[replica],
            (cfg.auth_token, cfg.tls_ca, cfg.tls_cert, cfg.tls_key),
            data_port,
            self._credentials.data(),
        )
        self._data_ports[replica] = data_port
        return link

    @property
    def data_links(self) -> dict[int, _bulk.DataLink]:
        """The data links made so far, by replica."""
        return dict(self._data)

    def wire(self, op: Op, nbytes: int, *, after: Wire | None = None) -> Wire:
        """The wire of an ``op`` request of ``nbytes`` (``psclient._wire.choose``); ``after``: the wire
        that refused it."""

        def available(wire: Wire) -> bool:
            if wire is Wire.DATA_PORT:
                return self.data_link() is not None
            return self.session().supported

        return _wire.choose(op, nbytes, self._config, available, after=after)

    def session(self) -> _session.PushSession:
        """The PushSession stream to the replica in use (opened on its first push)."""
        if self._session is None:
            wait = len(self.replicas) == 1  # replicas: fail fast, fail over
            self._session = _session.PushSession(
                lambda: self.stub().PushSession(
                    timeout=_session.STREAM_DEADLINE_S, metadata=self.metadata(), wait_for_ready=wait
                )
            )
        return self._session

    async def request(
        self,
        op: Op,
        header: Any,
        tensors: Sequence[tuple[str, Any]] = (),
        sink: Sink | rq.Gather | None = None,
        *,
        nbytes: int | None = None,
    ) -> Answer:
        """One pull, push or lookup to this shard, retried and failed over, over the wire it takes.

        Args:
            op: what the request is; ``header`` is its ``PullRequest``, ``PushRequest`` or
                ``LookupRequest`` (without tensors).
            tensors: a push's gradients, ``(wire name, wire array)``.
            sink: where the answer's tensors go (default: nowhere); an ``rq.Gather`` of the whole answer is
                one as it is (its ``add``, ``place`` and ``restart()``).
            nbytes: the request's size for the choice of wire and for frame sharing (default: the
                tensors' bytes; a pull gives the bytes it reads, a lookup the bytes of the rows it reads:
                a small one shares a frame with the link's other small requests, ``_bulk.DataLink``; a
                lookup that gives none goes alone).

        Raises:
            PSError: the request failed (retries and failover are done).
        """
        if nbytes is None:
            size = 0
            for _, t in tensors:
                size += t.nbytes
        else:
            size = nbytes
        into = sink or _DISCARD
        cfg = self._config
        link = self._data.get(self.current)
        if (
            cfg.data_port
            and (op is Op.LOOKUP or size >= cfg.data_port_min_bytes)  # ``_wire.takes_data_port``, inline
            and (
                (link is not None and not self._closed and time.monotonic() >= link.off_until)
                or self.data_link() is not None  # ``data_link``: its common case above, without its call
            )
        ):
            wire = Wire.DATA_PORT  # the common case, as ``wire`` picks it (without its closure and calls)
        else:
            wire = self.wire(op, size)
        while True:
            if wire is Wire.DATA_PORT:  # one frame each way
                fn, args = self._over_data_port, (op, header, tensors, into, size)
            else:
                fn, args = self._attempt, (op, wire, header, tensors, into)
            try:
                return await self.call(_METHODS[op, wire], fn, *args)
            except _bulk.Unusable:
                if wire is not Wire.DATA_PORT:
                    raise
                # logged by the data link; the next wire
            except _session.SessionUnsupported:
                if wire is not Wire.SESSION:
                    raise
                log.info("shard %s has no PushSession; using unary Push", self.address)
            wire = self.wire(op, size, after=wire)

    async def _attempt(
        self, op: Op, wire: Wire, header: Any, tensors: Sequence[tuple[str, Any]], sink: Sink | rq.Gather
    ) -> Answer:
        """One attempt of ``request`` over ``wire``."""
        sink.restart()
        answer = Answer()
        stub = self.stub()
        if wire is Wire.STREAM:
            if op is Op.PULL:
                responses = stub.PullStream(header, **self.kw())
            else:
                messages = _push_messages(header, tensors, self._config.chunk_bytes)
                responses = stub.PushStream(stream_of(messages), **self.kw())
            async for response in responses:  # each message's tensors as it comes
                _take(op, response, sink, answer)
            return answer
        message = header
        if tensors:
            message = codec.WireMessage(header, "grads", [codec.WireChunk.of(n, t) for n, t in tensors])
        if wire is Wire.SESSION:
            # The stream's deadline is not this push's: the shard bounds its waits by this one.
            left = header.timeout_s = _retry.attempt_timeout(self._config.timeout)
            response = await self.session().push(message, left)
        else:
            response = await getattr(stub, _METHODS[op, wire])(message, **self.kw())
        _take(op, response, sink, answer)
        return answer

    async def _over_data_port(
        self,
        op: Op,
        header: Any,
        tensors: Sequence[tuple[str, Any]],
        sink: Sink | rq.Gather,
        size: int,
    ) -> Answer:
        """One attempt of ``request`` over the data port: the tensors straight from their arrays to the
        socket, and the answer's straight into ``sink``'s buffers (``size``: the request's, as ``request``
        measured it; a small one may share a frame with others, ``_bulk.DataLink.request``). Its deadline:
        ``_retry.ATTEMPT_TIMEOUT`` 's.

        Raises:
            _bulk.Unusable: the data port cannot be used (the data link said why); RequestError,
                grpc.RpcError.
        """
        link = self._data.get(self.current)  # ``data_link`` 's common case, without its call
        if link is None or self._closed or time.monotonic() < link.off_until:
            link = self.data_link()
            if link is None:
                raise _bulk.Unusable
        left = _retry.ATTEMPT_TIMEOUT.get()
        timeout = self._config.timeout if left is None else left
        head: Any = header
        payload = []
        if op is Op.PUSH:  # the head as sent: the header's fields, this attempt's timeout, the gradients'
            # descriptions (``bulk.Descriptions``), encoded one after the other; the header is left as it is
            encoded = [header.SerializeToString(), _TIMEOUT_FIELD.pack(_TIMEOUT_TAG, timeout)]
            descriptions = self._descriptions
            for n, t in tensors:  # bulk.describe and bulk.payload_of, inline (wire arrays: little-endian)
                encoded.append(descriptions[n, t.dtype, t.shape])
                payload.append(memoryview(t.reshape(-1)).cast("B"))
            head = b"".join(encoded)
            kind = bulk.PUSH
        else:
            kind = bulk.PULL if op is Op.PULL else bulk.LOOKUP
            if op is Op.PULL:  # the shard bounds its waits (a barrier, the staleness bound) by this
                head.timeout_s = timeout
        spare: list[codec.WireChunk] = []
        if op is Op.PUSH and not (header.return_values or header.lookup_ids):
            into = None  # a plain push: its answer carries no tensors (none to place, none kept)
        else:
            into = functools.partial(_receive, sink.place, spare)
        # Small requests may share a frame: a pull, a push (a push_pull's values are as big as its
        # gradients), a lookup whose rows' bytes its caller gave (``nbytes``; 0: not known). A push that reads
        # rows too (``lookup_ids``) and a lookup of rows of unknown size go alone, and so does a sync push's
        # part (``parts``), whatever its size: it takes its turn among its push's parts to the shard (_bulk).
        try:
            if size <= _bulk.BATCH_MAX_BYTES and (
                (op is Op.PUSH and not header.lookup_ids and not header.parts)
                or op is Op.PULL
                or (op is Op.LOOKUP and size > 0)
            ):
                reply = await link.request(bulk.Frame(kind, head), payload, into, timeout, small=size)
            else:
                reply = await link.request(
                    bulk.Frame(kind, head),
                    payload,
                    into,
                    timeout,
                    uplink=self._uplink if op is Op.PUSH else None,
                )
        except BaseException:
            # What this attempt received is forgotten as it fails, not as the next one begins: the first
            # attempt (nearly every request) then makes no call for it. ``request`` tries the data port
            # before any other wire, so no attempt over another one came before.
            if into is not None:
                sink.restart()
            raise
        for chunk in spare:
            sink.add(chunk)
        head = reply.head
        if op is Op.PUSH:  # ``Answer.read``'s, inline
            if head.applied and head.checkpoint_step <= 0:
                return _APPLIED
            return Answer(bool(head.applied), max(0, head.checkpoint_step))
        if op is Op.LOOKUP:  # nothing besides its rows to read
            return Answer()
        answer = Answer()
        answer.read(op, head)
        return answer

    async def close(self) -> None:
        """Closes the push session, the data connections and the channels (idempotent)."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        links, self._data = self._data, {}
        for replica, link in links.items():
            link.release(self._data_ports.pop(replica))
        channels, self._channels, self._stubs = self._channels, [], []
        await asyncio.gather(*(ch.close() for ch in channels), *self._closing, return_exceptions=True)


_DISCARD = Sink(lambda chunk: None)  # a request whose answer carries no tensors the caller keeps
# A data-port push's timeout, encoded after its header's fields (of a field given twice, the last one counts):
# ``PushRequest.timeout_s``, a 32-bit float (wire type 5) whose tag is one byte.
_TIMEOUT_TAG: Final[int] = ps_pb2.PushRequest.DESCRIPTOR.fields_by_name["timeout_s"].number << 3 | 5
_TIMEOUT_FIELD: Final = struct.Struct("<Bf")
# The answer of most pushes (applied, no checkpoint announced): one, read and never changed by ``_push``.
_APPLIED = Answer()


def _take(op: Op, response: Any, sink: Sink | rq.Gather, answer: Answer) -> None:
    """One gRPC answer message: its tensors to ``sink``, the rest to ``answer``."""
    for chunk in response.values:
        sink.add(chunk)
    answer.read(op, response)


def _push_messages(
    header: ps_pb2.PushRequest, tensors: Sequence[tuple[str, Any]], chunk_bytes: int
) -> Iterable[codec.WireMessage]:
    """A PushStream's messages: the gradients in chunks, the header's fields in the first message only."""
    first = header
    for batch in codec.wire_batches(list(tensors), chunk_bytes):
        yield codec.WireMessage(first, "grads", batch)
        first = _EMPTY_PUSH


async def stream_of(items: Iterable[T]) -> AsyncIterator[T]:
    """The request messages of a client-streaming call, as the async iterator gRPC takes."""
    for item in items:
        yield item


def _receive(
    place: Callable[[Any], memoryview | None] | None,
    spare: list[codec.WireChunk],
    frame: bulk.Frame,
    nbytes: int,
) -> list[memoryview]:
    """Where an answer's tensors are received: ``place(chunk)``'s view in the result, else a buffer of
    their own (appended to ``spare`` as chunks: rows of a table, or no ``place``).

    Raises:
        CodecError: a tensor that was not asked for, or a malformed description.
    """
    views = []
    field = bulk.TENSOR_FIELDS.get(frame.kind)  # ``frame.tensors()``, inline
    for chunk in getattr(frame.head, field) if field is not None else ():
        view = place(chunk) if place is not None and "\x00" not in chunk.name else None
        if view is None:  # its own buffer, of the size its description gives (``tensor_layout``'s checks)
            ((name, _, shape, size),) = bulk.tensor_layout((chunk,))
            view = memoryview(bytearray(size))
            spare.append(codec.WireChunk(name, chunk.dtype, shape, 0, view))
        elif chunk.offset or chunk.data:  # placed: its dtype and shape are the piece's (``place``)
            raise codec.CodecError(f"tensor {chunk.name!r}: on the data port a tensor travels whole")
        views.append(view)
    return views


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _failure(err: grpc.RpcError) -> str:
    """One failed attempt in a few words: ``no answer (...)`` for a deadline, else the status and details."""
    code = err.code()
    details = (err.details() or "").split("\n")[0][:200]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer ({details})"
    return f"{code.name}: {details}"


def _no_answer(err: grpc.RpcError) -> bool:
    """The client gave up waiting (its deadline), as opposed to a shard that answered with an error."""
    details = err.details() or ""  # gRPC's: "Deadline Exceeded", "Stream removed (Deadline Exceeded)"
    return err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (
        "Deadline Exceeded" in details or details.startswith("no answer")
    )


def _channel_options(config: ClientConfig, *, replicated: bool) -> list[tuple[str, Any]]:
    ping, wait = (
        (KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S)
        if replicated
        else (_SINGLE_KEEPALIVE_TIME_S, _SINGLE_KEEPALIVE_TIMEOUT_S)
    )
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # A silent link (a partition: no reset, no answer) fails the channel's calls within
        # KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S, so they fail over to the other replica instead of
        # waiting for their deadline (the shards allow pings this often).
        ("grpc.keepalive_time_ms", int(ping * 1000)),
        ("grpc.keepalive_timeout_ms", int(wait * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.enable_retries", 0),  # psclient retries itself (_retry), with one deadline for all attempts
        # Reconnect to a restarted shard quickly (gRPC's default backoff grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
