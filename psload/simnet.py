"""The simulation's network: calls between simulated processes, with delays, cuts, breaks and resets.

Every call (a shard's ``Replicate`` stream, a ``GetStatus``, a client's push or
pull) is a ``Call``: two one-way ``_Pipe`` s, each delivering its messages in
order (a TCP connection's guarantee) after a delay drawn from the seed, so
messages of different calls overtake each other. A pipe whose link is cut
holds its messages (TCP retransmits); if the cut heals they go on in order,
and if it lasts ``BREAK_S`` the call breaks on both sides (the data port's
``TCP_USER_TIMEOUT``, gRPC's keepalive timeout). A killed process's calls
break at once for its peers (a reset), unless the link back is cut too.

The shard code talks to the network through ``SimChannel``, which stands in
for a ``grpc.aio.Channel`` under ``pscore.rpc.Stub``: the backup's
``Replicate`` stream and ``peer_status``'s ``GetStatus`` run over it with
their real serializers, so the replication protocol's bytes cross it as
they cross gRPC.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from pscore.errors import PSError

if TYPE_CHECKING:
    from psload.simloop import VirtualLoop

BREAK_S = 3.0  # a call whose messages a cut link has held this long breaks on both sides
CONNECT_REFUSED_S = 0.002  # a call to a process that is down fails this fast (a reset)
_END = object()  # a stream's last message
_CANCEL = object()  # the caller gave up (cancel, deadline)


class SimRpcError(grpc.RpcError):
    """A failed simulated call, as gRPC raises it (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Host:
    """What the network needs of a simulated process: its name, loop, liveness, handlers.

    ``handle(method, call)`` runs on the host's loop, answering ``call``.
    """

    def __init__(self, name: str, loop: VirtualLoop) -> None:
        self.name = name
        self.loop = loop
        self.alive = True
        self.calls: set[Call] = set()
        self.handler: Callable[[str, Call], Awaitable[None]] | None = None


@dataclass(order=True)
class _Event:
    when: float
    order: int
    run: Callable[[], None] = field(compare=False)


class Network:
    """Links between hosts: their state (cut one way or both) and the calls that cross them.

    Args:
        world: the simulation's world clock.
        rng: the seed's random numbers (delays).
        delay_s: (low, high) of a message's usual delay; ``spike`` of the messages take up to
            ``spike_s`` more (so calls overtake each other).
    """

    def __init__(
        self,
        world: Callable[[], float],
        rng: random.Random,
        *,
        delay_s: tuple[float, float] = (0.0002, 0.003),
        spike: float = 0.02,
        spike_s: float = 0.3,
    ) -> None:
        self.world = world
        self.rng = rng
        self.delay_s = delay_s
        self.spike = spike
        self.spike_s = spike_s
        self.hosts: dict[str, Host] = {}
        self.cut: set[tuple[str, str]] = set()
        self._events: list[_Event] = []
        self._order = itertools.count()
        self._pipes: dict[tuple[str, str], set[_Pipe]] = {}

    # -- the world's event queue --------------------------------------------------------------

    def at(self, when: float, run: Callable[[], None]) -> None:
        """Runs ``run`` (outside every loop) at world time ``when``."""
        heapq.heappush(self._events, _Event(when, next(self._order), run))

    def next_event(self) -> float | None:
        return self._events[0].when if self._events else None

    def fire_due(self) -> bool:
        """Runs the events due at the current world time; returns whether any ran."""
        now = self.world()
        fired = False
        while self._events and self._events[0].when <= now:
            heapq.heappop(self._events).run()
            fired = True
        return fired

    def delay(self) -> float:
        low, high = self.delay_s
        d = self.rng.uniform(low, high)
        if self.rng.random() < self.spike:
            d += self.rng.uniform(0.0, self.spike_s)
        return d

    # -- links ----------------------------------------------------------------------------------

    def set_cut(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Cuts each (src, dst) link, one way."""
        for pair in pairs:
            self.cut.add(pair)

    def heal(self, pairs: Iterable[tuple[str, str]] | None = None) -> None:
        """Heals the links named (all without names); what they held goes on, in order."""
        healed = set(self.cut) if pairs is None else set(pairs) & self.cut
        self.cut -= healed
        for pair in sorted(healed):
            for pipe in sorted(self._pipes.get(pair, ()), key=lambda p: p.order):
                pipe.flush()

    def is_cut(self, src: str, dst: str) -> bool:
        return (src, dst) in self.cut

    def _register(self, pipe: _Pipe) -> None:
        self._pipes.setdefault((pipe.src, pipe.dst), set()).add(pipe)

    def _unregister(self, pipe: _Pipe) -> None:
        pipes = self._pipes.get((pipe.src, pipe.dst))
        if pipes is not None:
            pipes.discard(pipe)

    # -- calls ----------------------------------------------------------------------------------

    def call(self, caller: Host, target: str, method: str, metadata: Sequence[tuple[str, str]] = ()) -> Call:
        """Opens a call from ``caller`` to the host named ``target`` (its handler answers it)."""
        call = Call(self, caller, target, method, metadata)
        caller.calls.add(call)
        call.c2s.send(("open", None))
        return call

    def kill(self, host: Host) -> None:
        """``host`` died: its calls reset (the peers learn it after a delay, or a break past a cut)."""
        host.alive = False
        for call in sorted(host.calls, key=lambda c: c.order):
            call.reset(host.name, "the peer process died (connection reset)")
        host.calls.clear()


class _Pipe:
    """One direction of a call: messages delivered in order, after delays, held across a cut."""

    def __init__(self, net: Network, call: Call, src: str, dst: str, deliver: Callable[[Any], None]) -> None:
        self.net = net
        self.call = call
        self.src, self.dst = src, dst
        self.deliver = deliver
        self.order = call.order
        self.last = 0.0  # world time of the last delivery scheduled (FIFO)
        self.sent = 0  # messages sent: each one's number keeps them in order across a cut
        self.held: list[tuple[int, Any]] = []  # (number, message), in order
        self.expected = 1  # the number of the next message to deliver
        self.early: dict[int, Any] = {}  # arrived ahead of one held or still on its way (TCP reorders them)
        self.held_since = 0.0  # world time of the oldest message held
        net._register(self)

    def send(self, message: Any) -> None:
        if self.call.broken:
            return
        self.sent += 1
        item = (self.sent, message)
        if self.held or self.net.is_cut(self.src, self.dst):
            self._hold(item)
            return
        self._schedule(item)

    def _schedule(self, item: tuple[int, Any]) -> None:
        when = max(self.net.world() + self.net.delay(), self.last)
        self.last = when
        self.net.at(when, lambda: self._arrive(item))

    def _arrive(self, item: tuple[int, Any]) -> None:
        if self.call.broken:
            return
        if self.held or self.net.is_cut(self.src, self.dst):  # cut while in flight: retransmitted later
            self._hold(item)
            return
        self.early[item[0]] = item[1]
        while self.expected in self.early:
            self.deliver(self.early.pop(self.expected))
            self.expected += 1

    def _hold(self, item: tuple[int, Any]) -> None:
        if not self.held:
            since = self.held_since = self.net.world()
            self.net.at(since + BREAK_S, lambda: self._break_if_held(since))
        bisect.insort(self.held, item, key=lambda held: held[0])  # one in flight goes before those held

    def _break_if_held(self, since: float) -> None:
        if self.held and not self.call.broken and self.held_since == since:
            self.call.fail(f"no answer across a cut link for {BREAK_S:g}s (the connection timed out)")

    def flush(self) -> None:
        held, self.held = self.held, []
        for item in held:
            self._schedule(item)

    def close(self) -> None:
        self.held.clear()
        self.net._unregister(self)


class Call:
    """One call between two hosts: the caller's side (``responses``) and the target's (``requests``)."""

    _orders = itertools.count()

    def __init__(
        self, net: Network, caller: Host, target: str, method: str, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.net = net
        self.metadata = tuple(metadata)
        self.caller = caller
        self.target = target
        self.method = method
        self.order = next(Call._orders)
        self.broken = False
        self.cancelled = False  # the caller gave up (its word may still be on its way)
        self.responses: asyncio.Queue[Any] = asyncio.Queue()  # on the caller's loop (created lazily there)
        self.requests: asyncio.Queue[Any] | None = None  # on the target's loop
        self.task: asyncio.Task[None] | None = None  # the target's handler
        self.c2s = _Pipe(net, self, caller.name, target, self._at_target)
        self.s2c = _Pipe(net, self, target, caller.name, self._at_caller)

    # -- the target's side ---------------------------------------------------------------------------

    def _at_target(self, message: Any) -> None:
        host = self.net.hosts.get(self.target)
        if host is None or not host.alive or host.handler is None:  # nobody listens: refused
            self.reset(self.target, f"{self.target} is down (connection refused)")
            return
        kind, payload = message
        if kind == "open":
            host.calls.add(self)
            handler = host.handler
            self.requests = asyncio.Queue()

            def start() -> None:
                if not self.broken:  # a call that broke before its handler ran (its host was paused) is gone
                    self.task = host.loop.create_task(handler(self.method, self))

            host.loop.call_soon(start)
        elif kind == "cancel":
            host.loop.call_soon(self._cancel_handler)
            self._close()
        else:
            host.loop.call_soon(self._put_request, payload)

    def _put_request(self, payload: Any) -> None:
        if self.requests is not None:
            self.requests.put_nowait(payload)

    def _cancel_handler(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.requests is not None:
            self.requests.put_nowait(_CANCEL)

    async def first_request(self) -> Any:
        """The target's view of a unary call's request (None: the caller gave up before it came)."""
        assert self.requests is not None
        item = await self.requests.get()
        return None if item is _END or item is _CANCEL else item

    async def request_stream(self) -> AsyncIterator[Any]:
        """The target's view of the caller's messages (ends when the caller ends its stream)."""
        assert self.requests is not None
        while True:
            item = await self.requests.get()
            if item is _END or item is _CANCEL:
                return
            yield item

    def answer(self, message: Any) -> None:
        """The target sends ``message`` (a response, or a stream's next message)."""
        self.s2c.send(("message", message))

    def finish(self, error: BaseException | None = None) -> None:
        """The target ends the call: with its last message sent, or with ``error`` (a PSError's code)."""
        if error is None:
            self.s2c.send(("end", None))
            return
        code = error.code if isinstance(error, PSError) else grpc.StatusCode.UNKNOWN
        self.s2c.send(("error", (code, str(error))))

    # -- the caller's side -----------------------------------------------------------------------------

    def _at_caller(self, message: Any) -> None:
        if not self.caller.alive:
            return
        kind, payload = message
        if kind == "message":
            item: Any = payload
        elif kind == "end":
            item = _END
        else:
            item = SimRpcError(*payload)
        self.caller.loop.call_soon(self.responses.put_nowait, item)

    def send(self, message: Any) -> None:
        """The caller sends ``message`` on a streaming call."""
        self.c2s.send(("message", message))

    def end_requests(self) -> None:
        self.c2s.send(("message", _END))

    def cancel(self) -> None:
        """The caller gives up: the target's handler is cancelled when the word reaches it (across a cut
        only once it heals, or when the call breaks: as an HTTP/2 RST_STREAM, retransmitted by TCP)."""
        if not self.broken and not self.cancelled:
            self.cancelled = True
            self.c2s.send(("cancel", None))

    async def next(self) -> Any:
        """The caller's next message; raises SimRpcError; StopAsyncIteration at the end."""
        item = await self.responses.get()
        if isinstance(item, SimRpcError):
            self.responses.put_nowait(item)  # every later read fails the same way
            raise item
        if item is _END:
            self.responses.put_nowait(item)
            raise StopAsyncIteration
        return item

    # -- breaks ---------------------------------------------------------------------------------------

    def reset(self, dead: str, why: str) -> None:
        """``dead``'s end is gone: the other side learns it after a delay (a break, past a cut)."""
        if self.broken:
            return
        self.broken = True
        other_is_caller = dead != self.caller.name
        src, dst = (dead, self.caller.name) if other_is_caller else (dead, self.target)
        after = BREAK_S if self.net.is_cut(src, dst) else CONNECT_REFUSED_S + self.net.delay()
        self.net.at(self.net.world() + after, lambda: self._tell(why, caller=other_is_caller))
        self._close()

    def fail(self, why: str) -> None:
        """The connection timed out: both sides learn it now."""
        if self.broken:
            return
        self.broken = True
        self._tell(why, caller=True)
        self._tell(why, caller=False)
        self._close()

    def _tell(self, why: str, *, caller: bool) -> None:
        if caller:
            if self.caller.alive:
                error = SimRpcError(grpc.StatusCode.UNAVAILABLE, f"{self.target}: {why}")
                self.caller.loop.call_soon(self.responses.put_nowait, error)
            return
        host = self.net.hosts.get(self.target)
        if host is not None and host.alive:  # its handler, once its host runs again (it may be paused)
            host.loop.call_soon(self._cancel_handler)

    def _close(self) -> None:
        self.c2s.close()
        self.s2c.close()
        self.caller.calls.discard(self)
        host = self.net.hosts.get(self.target)
        if host is not None:
            host.calls.discard(self)


class _StreamCall:
    """A streaming call as ``grpc.aio`` gives it to the caller: async-iterable, ``cancel()``."""

    def __init__(
        self,
        call: Call,
        requests: AsyncIterator[Any] | None,
        serialize: Callable[[Any], bytes],
        parse: Callable[[bytes], Any],
    ) -> None:
        self._call = call
        self._parse = parse
        self._sender: asyncio.Task[None] | None = None
        if requests is not None:
            self._sender = asyncio.get_running_loop().create_task(self._send(requests, serialize))

    async def _send(self, requests: AsyncIterator[Any], serialize: Callable[[Any], bytes]) -> None:
        async for request in requests:
            self._call.send(serialize(request))
        self._call.end_requests()

    def __aiter__(self) -> _StreamCall:
        return self

    async def __anext__(self) -> Any:
        raw = await self._call.next()
        return self._parse(raw)

    def cancel(self) -> bool:
        if self._sender is not None:
            self._sender.cancel()
        self._call.cancel()
        return True


class SimChannel:
    """Stands in for a ``grpc.aio.Channel`` from ``host`` to ``target`` (``pscore.rpc.Stub`` over it)."""

    def __init__(self, net: Network, host: Host, target: str) -> None:
        self._net = net
        self._host = host
        self._target = target

    async def __aenter__(self) -> SimChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def stream_stream(
        self,
        path: str,
        *,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
    ) -> Callable[..., _StreamCall]:
        method = path.rpartition("/")[2]

        def open_stream(
            requests: AsyncIterator[Any], *, metadata: Sequence[tuple[str, str]] = (), **_: Any
        ) -> _StreamCall:
            call = self._net.call(self._host, self._target, method, metadata)
            return _StreamCall(call, requests, request_serializer, response_deserializer)

        return open_stream

    def unary_unary(
        self,
        path: str,
        *,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
    ) -> Callable[..., Awaitable[Any]]:
        method = path.rpartition("/")[2]

        async def unary(request: Any, *, timeout: float | None = None, **_: Any) -> Any:
            call = self._net.call(self._host, self._target, method)
            call.send(request_serializer(request))
            call.end_requests()
            try:
                async with asyncio.timeout(timeout):
                    return response_deserializer(await call.next())
            except TimeoutError:
                call.cancel()
                raise SimRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self._target}: no answer") from None

        return unary

    def unary_stream(self, path: str, **_: Any) -> Callable[..., Any]:
        return self._unsupported(path)

    def stream_unary(self, path: str, **_: Any) -> Callable[..., Any]:
        return self._unsupported(path)

    @staticmethod
    def _unsupported(path: str) -> Callable[..., Any]:
        def fail(*_: Any, **__: Any) -> Any:
            raise NotImplementedError(f"{path} is not simulated")

        return fail
