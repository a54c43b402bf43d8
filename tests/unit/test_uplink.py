"""A client's large uploads take turns on its uplink (``psclient._bulk.Uplink``); small ones never wait."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest

from psclient import _bulk
from pscore import transport

BIG = _bulk.STAGGER_MIN_BYTES


async def test_large_uploads_go_one_at_a_time_in_the_order_they_asked() -> None:
    uplink = _bulk.Uplink()
    events: list[str] = []

    async def upload(name: str, hold_s: float) -> None:
        async with uplink.turn(BIG):
            events.append(f"{name} starts")
            await asyncio.sleep(hold_s)
            events.append(f"{name} ends")

    await asyncio.gather(upload("a", 0.05), upload("b", 0.0), upload("c", 0.0))
    assert events == ["a starts", "a ends", "b starts", "b ends", "c starts", "c ends"]


async def test_small_uploads_do_not_wait_for_a_turn() -> None:
    uplink = _bulk.Uplink()
    big_done = asyncio.Event()
    order: list[str] = []

    async def big() -> None:
        async with uplink.turn(BIG):
            await asyncio.wait_for(big_done.wait(), 5)
            order.append("big")

    async def small() -> None:
        async with uplink.turn(BIG - 1):
            order.append("small")
        big_done.set()

    await asyncio.gather(big(), small())
    assert order == ["small", "big"]


async def test_a_turn_stuck_behind_an_upload_that_does_not_end_goes_out_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_bulk, "STAGGER_WAIT_S", 0.05)
    uplink = _bulk.Uplink()
    stuck = asyncio.Event()
    went: list[str] = []

    async def stuck_upload() -> None:
        async with uplink.turn(BIG):
            await asyncio.wait_for(stuck.wait(), 5)

    async def next_upload() -> None:
        async with uplink.turn(BIG):
            went.append("next")
        stuck.set()

    await asyncio.gather(stuck_upload(), next_upload())
    assert went == ["next"]
    async with uplink.turn(BIG):  # the turn that went out beside it released nothing it did not hold
        pass


async def test_an_upload_that_fails_gives_its_turn_back() -> None:
    uplink = _bulk.Uplink()
    with pytest.raises(OSError, match="broke"):
        async with uplink.turn(BIG):
            raise OSError("the connection broke")
    async with asyncio.timeout(1):
        async with uplink.turn(BIG):
            pass


@contextlib.asynccontextmanager
async def _dialed() -> AsyncIterator[tuple[transport.Conn, transport.Conn]]:
    """A data connection dialed to a ``DataPort`` on loopback, and the port's end of it."""
    accepted: list[transport.Conn] = []
    arrived = asyncio.Event()

    def on_connection(conn: transport.Conn, who: int) -> None:
        accepted.append(conn)
        arrived.set()

    port = transport.DataPort("127.0.0.1", magic=b"TESTMAGC", on_connection=on_connection)
    await port.start()
    try:
        conn = await transport.dial("127.0.0.1", port.port, magic=b"TESTMAGC", nonce=port.issue_nonce())
        try:
            async with asyncio.timeout(5):
                await arrived.wait()
            yield conn, accepted[0]
        finally:
            conn.close()
    finally:
        await port.close()
        for c in accepted:
            c.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="the system has no TCP_NOTSENT_LOWAT")
async def test_a_connection_limits_its_unsent_bytes_on_demand_and_knows_its_delivery_rate() -> None:
    async with _dialed() as (conn, peer):

        def lowat() -> int:
            return conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)

        assert lowat() == 0  # none until asked for
        conn.limit_unsent(_bulk.NOTSENT_LOWAT)
        assert lowat() == _bulk.NOTSENT_LOWAT
        conn.limit_unsent(0)
        assert lowat() == 0
        async with asyncio.timeout(5):
            payload = bytes(1 << 20)
            await conn.sendall(payload)
            await peer.recv_exactly(memoryview(bytearray(len(payload))))
        assert conn.delivery_rate() > 0  # acknowledged bytes: the kernel measured a rate


async def test_a_connection_waits_until_its_bytes_reached_the_peer_or_its_deadline() -> None:
    """``Conn.delivered``: the send queue (unsent and unacknowledged) drained to a bound, not only the bytes
    handed to the kernel; a peer that does not read holds it until the deadline."""
    async with _dialed() as (conn, peer), asyncio.timeout(10):
        assert conn.queued() == 0
        payload = bytes(16 << 20)  # more than the peer's receive buffer: it stays queued here
        sending = asyncio.ensure_future(conn.sendall(payload))
        await asyncio.sleep(0.05)
        assert conn.queued() > 1 << 20
        loop = asyncio.get_running_loop()
        start = loop.time()
        await conn.delivered(8 << 10, time.monotonic() + 0.2)  # the peer reads nothing: the deadline
        assert loop.time() - start >= 0.15 and conn.queued() > 1 << 20
        received = asyncio.ensure_future(peer.recv_exactly(memoryview(bytearray(len(payload)))))
        await sending
        await conn.delivered(8 << 10, time.monotonic() + 9)  # the peer read it: returns before
        assert conn.queued() <= 8 << 10
        await received


async def test_a_delivery_wait_asks_again_after_half_the_time_the_rest_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Conn.delivered`` sleeps half of what the rest takes at the measured rate between asks (at most
    250 ms, at least 3 ms): a few asks an upload, not one every 20 ms."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(round(seconds, 4))

    async with _dialed() as (conn, _peer), asyncio.timeout(10):
        left = iter([1_000_000, 400_000, 20_000, 2_000, 0])  # unacknowledged beyond the 8 KiB allowed
        monkeypatch.setattr(conn, "queued", lambda: next(left) + (8 << 10))
        monkeypatch.setattr(conn, "delivery_rate", lambda: 1_000_000)  # 8 Mbit/s
        monkeypatch.setattr(transport.asyncio, "sleep", sleep)
        await conn.delivered(8 << 10, time.monotonic() + 60)
        monkeypatch.undo()
    assert slept == [0.25, 0.2, 0.01, 0.003]


def test_a_large_request_leaves_unsent_what_its_link_carries_in_two_milliseconds_or_256_kib() -> None:
    assert _bulk.unsent_limit(0) == _bulk.NOTSENT_LOWAT  # no rate measured yet
    assert _bulk.unsent_limit(25_000_000) == _bulk.NOTSENT_LOWAT  # 200 Mbit/s: 50 KB in 2 ms
    assert _bulk.unsent_limit(1_250_000_000) == 2_500_000  # 10 Gbit/s
    assert _bulk.unsent_limit(4_000_000_000) > 4 << 20  # loopback: more than the kernel queues a socket


def test_workers_start_their_turns_at_their_own_shard() -> None:
    assert [_bulk.first_turn(f"worker{i}") % 4 for i in range(4)] == [0, 1, 2, 3]  # psclient.keras's names
    assert _bulk.first_turn("w7") == 7
    assert _bulk.first_turn("evaluator") == _bulk.first_turn("evaluator")  # no number: a stable hash


def test_every_client_of_a_process_takes_its_turns_on_one_uplink() -> None:
    import psclient

    a = psclient.AsyncPSClient(["127.0.0.1:1"], worker_id="w0")
    b = psclient.AsyncPSClient(["127.0.0.1:1", "127.0.0.1:2"], worker_id="w1")
    alone = psclient.AsyncPSClient(["127.0.0.1:1"], worker_id="w2", stagger_uploads=False)
    links = [*a._shards, *b._shards]
    assert {id(link._uplink) for link in links} == {id(_bulk.process_uplink())}
    assert alone._shards[0]._uplink is None


def test_one_uplink_keeps_the_turns_of_each_event_loop_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients on two loops (threads) of one process: neither waits for the other's turn, and a lock
    made on one loop is never used on the other (asyncio refuses that)."""
    import threading

    monkeypatch.setattr(_bulk, "STAGGER_WAIT_S", 30.0)  # a turn that waited for the other loop would time out
    uplink = _bulk.Uplink()
    holding = [threading.Event(), threading.Event()]
    errors: list[BaseException] = []

    async def hold(i: int) -> None:
        async with asyncio.timeout(5), uplink.turn(BIG):  # the other loop holds its own turn meanwhile
            holding[i].set()
            await asyncio.to_thread(holding[1 - i].wait, 5)
        async with asyncio.timeout(5), uplink.turn(BIG):  # and this loop's turn was given back
            pass

    def run(i: int) -> None:
        try:
            asyncio.run(hold(i))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors == [] and all(e.is_set() for e in holding)


async def test_a_waiting_upload_that_is_cancelled_passes_the_turn_on_to_the_next() -> None:
    uplink = _bulk.Uplink()
    turns = uplink.turns()
    order: list[str] = []
    assert await turns.take(BIG)  # held

    async def upload(name: str) -> None:
        async with uplink.turn(BIG):
            order.append(name)

    cancelled = asyncio.ensure_future(upload("cancelled"))
    after = asyncio.ensure_future(upload("after"))
    await asyncio.sleep(0.01)  # both wait, in this order
    cancelled.cancel()
    await asyncio.sleep(0.01)
    turns.release()  # skips the cancelled one
    async with asyncio.timeout(5):
        await after
    assert order == ["after"]
    assert cancelled.cancelled()
    assert not turns.busy and not turns.waiting  # free again, nobody queued


async def test_a_turn_taken_inline_and_one_taken_by_take_exclude_each_other() -> None:
    """A data link takes a free turn by setting ``busy`` itself (no call); others then wait for it."""
    uplink = _bulk.Uplink()
    turns = uplink.turns()
    assert not turns.busy and not turns.waiting
    turns.busy = True  # as DataLink.request takes a free turn
    waiter = asyncio.ensure_future(turns.take(BIG))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    turns.release()
    async with asyncio.timeout(5):
        assert await waiter
    assert turns.busy
    turns.release()
    assert not turns.busy


async def test_a_turn_waits_as_long_as_its_caller_says() -> None:
    """``take(nbytes, wait_s)``: a sync push's part waits for the parts before it to its shard for as long
    as its request may (``DataLink.request`` gives its deadline), not ``STAGGER_WAIT_S``; a short wait
    ends with the upload going out beside the others (False), and nothing stays queued."""
    turns = _bulk.Uplink().turns()
    assert await turns.take(BIG)  # held
    assert not await turns.take(BIG, 0.01)  # gave up waiting: sent beside the holder
    patient = asyncio.ensure_future(turns.take(BIG, 10 * _bulk.STAGGER_WAIT_S))
    await asyncio.sleep(0.01)
    assert not patient.done() and sum(not f.done() for f in turns.waiting) == 1  # the one that gave up: done
    turns.release()
    async with asyncio.timeout(5):
        assert await patient  # handed the turn, however long the holder took
    turns.release()
    assert not turns.busy and not turns.waiting


class _Windows:
    """Stands in for ``_bulk._turn_window``: each window of a turn's wait passes at once, after the turns do
    what the test scripts for it (``None``: they stand still)."""

    def __init__(self, steps: list[Callable[[], object] | None]) -> None:
        self.steps = steps
        self.passed = 0

    async def __call__(self, handed: asyncio.Future[None], seconds: float) -> None:
        step = self.steps[self.passed] if self.passed < len(self.steps) else None
        self.passed += 1
        if step is not None:
            step()
        await asyncio.sleep(0)


def _undelivered(turns: _bulk.Turns, count: int) -> None:
    """``count`` uploads past their turn, being delivered (as ``Turns.deliver`` counts them)."""
    turns.delivering = count


async def test_a_turn_waits_while_the_turns_move_and_goes_out_once_they_stand_still(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``until`` (a large upload's ``DataLink.request``), a waiting upload waits as long as turns pass
    or delivery slots free up, however long that is: a worker's queue of turns holds its rounds in flight
    (64 parts at n = k = 32, 8 Mbit/s: 8 s). It goes out beside the others once they stood still for a
    whole window (``STAGGER_WAIT_S``)."""
    turns = _bulk.Turns()
    assert await turns.take(BIG)  # the holder
    _undelivered(turns, 3)
    windows = _Windows([turns._delivered, turns._delivered, turns._delivered, None])
    monkeypatch.setattr(_bulk, "_turn_window", windows)
    async with asyncio.timeout(5):
        assert not await turns.take(BIG, 2.0, time.monotonic() + 60)  # sent beside the holder
    assert windows.passed == 4  # three windows with a delivery in each, then one with nothing
    assert turns.busy and not any(not f.done() for f in turns.waiting)  # the holder's turn; nobody queued
    turns.release()
    assert not turns.busy


async def test_a_turn_handed_over_after_many_windows_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    turns = _bulk.Turns()
    assert await turns.take(BIG)
    _undelivered(turns, 2)
    windows = _Windows([turns._delivered, turns._delivered, turns.release])  # the holder ends its turn
    monkeypatch.setattr(_bulk, "_turn_window", windows)
    async with asyncio.timeout(5):
        assert await turns.take(BIG, 2.0, time.monotonic() + 60)
    assert windows.passed == 3 and turns.busy
    turns.release()
    assert not turns.busy and not turns.waiting


@pytest.mark.parametrize("until", [None, "passed"])
async def test_a_turn_without_until_or_past_it_waits_one_window_however_the_turns_move(
    monkeypatch: pytest.MonkeyPatch, until: str | None
) -> None:
    """Without ``until`` (a sync push's part: ``wait_s`` is its deadline) a wait lasts one window, as
    before; past ``until`` (half the request's time left) an upload goes out beside the others even while
    the turns move."""
    turns = _bulk.Turns()
    assert await turns.take(BIG)
    _undelivered(turns, 3)
    at = None if until is None else time.monotonic() + 0.01

    def delivered() -> None:
        if at is not None:
            time.sleep(0.02)  # the window outlasts ``until``
        turns._delivered()

    windows = _Windows([delivered, delivered])
    monkeypatch.setattr(_bulk, "_turn_window", windows)
    async with asyncio.timeout(5):
        assert not await turns.take(BIG, 2.0, at)
    assert windows.passed == 1
    turns.release()
    assert not turns.busy


class _Delivery:
    """A connection's delivery as ``Turns.deliver`` waits for it: ``delivered`` returns once ``done`` is
    set, or at its deadline."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def delivered(self, nbytes: int, deadline: float) -> None:
        assert nbytes == _bulk.UPLOAD_DELIVERED_BYTES
        with contextlib.suppress(TimeoutError):  # as ``Conn.delivered``: returns at the deadline
            await asyncio.wait_for(self.done.wait(), max(deadline - time.monotonic(), 0.0))


async def test_uploads_on_a_slow_link_pass_the_turn_on_while_at_most_three_are_undelivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Turns.deliver``: an upload handed to the kernel passes the turn on at once while fewer than
    ``UPLOADS_UNDELIVERED - 1`` others are being delivered; the next holds the turn until one of them is
    delivered, and the uploads after it wait for the turn meanwhile (the rule with three slots; the
    client keeps five)."""
    assert _bulk.UPLOADS_UNDELIVERED == 5
    monkeypatch.setattr(_bulk, "UPLOADS_UNDELIVERED", 3)
    turns = _bulk.Turns()
    deliveries = {name: _Delivery() for name in "abcde"}
    events: list[str] = []

    async def upload(name: str) -> None:
        assert await turns.take(BIG, 5)
        events.append(f"{name} has the turn")
        await turns.deliver(deliveries[name], time.monotonic() + 5)  # type: ignore[arg-type]
        events.append(f"{name} delivered")

    async with asyncio.timeout(5):
        tasks = [asyncio.ensure_future(upload(name)) for name in "abcde"]
        for _ in range(20):
            await asyncio.sleep(0)
        assert events == ["a has the turn", "b has the turn", "c has the turn"]  # c holds it: two undelivered
        assert turns.delivering == 2 and len(turns.waiting) == 2
        deliveries["b"].done.set()  # one of the two: c takes its slot and passes the turn on to d
        for _ in range(20):
            await asyncio.sleep(0)
        assert events[3:] == ["b delivered", "d has the turn"]
        assert turns.delivering == 2 and len(turns.waiting) == 1
        for name in "acde":
            deliveries[name].done.set()
        await asyncio.gather(*tasks)
    assert sorted(events) == sorted(
        [f"{n} has the turn" for n in "abcde"] + [f"{n} delivered" for n in "abcde"]
    )
    assert turns.delivering == 0 and not turns.busy and not turns.waiting and not turns.slots


@pytest.mark.parametrize("bound", ["deadline", "stagger wait"])
async def test_a_holder_waiting_for_a_delivery_slot_gives_up_and_passes_the_turn_on(
    monkeypatch: pytest.MonkeyPatch, bound: str
) -> None:
    """Two uploads whose deliveries stall (a connection in TCP's backoff) hold the slots: the next holder
    waits for one until its deadline or ``STAGGER_WAIT_S``, whichever comes first, then passes the turn
    on, takes no slot and returns (its request then reads its answer in the time it has left)."""
    wait_s, deadline_s = (5.0, 0.1) if bound == "deadline" else (0.1, 60.0)
    monkeypatch.setattr(_bulk, "STAGGER_WAIT_S", wait_s)
    monkeypatch.setattr(_bulk, "UPLOADS_UNDELIVERED", 3)  # two stalled deliveries hold every slot
    turns = _bulk.Turns()
    stuck = _Delivery()  # never delivered
    assert await turns.take(BIG, 5)
    first = asyncio.ensure_future(turns.deliver(stuck, time.monotonic() + 60))  # type: ignore[arg-type]
    assert await turns.take(BIG, 5)
    second = asyncio.ensure_future(turns.deliver(stuck, time.monotonic() + 60))  # type: ignore[arg-type]
    assert await turns.take(BIG, 5)  # two undelivered: this holder waits for a slot
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(5):
        await turns.deliver(stuck, time.monotonic() + deadline_s)  # type: ignore[arg-type]
    assert 0.05 <= loop.time() - start < 2.0
    assert not turns.busy and turns.delivering == 2  # the turn passed on, no slot taken
    assert all(slot.done() for slot in turns.slots)  # nobody waits for one
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    assert turns.delivering == 0


async def test_a_delivery_that_stalls_is_waited_for_no_longer_than_a_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upload's own delivery is waited for ``STAGGER_WAIT_S`` at most, not until its request's deadline:
    its request then reads its answer, and its slot is free again."""
    monkeypatch.setattr(_bulk, "STAGGER_WAIT_S", 0.1)
    turns = _bulk.Turns()
    assert await turns.take(BIG, 5)
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(5):
        await turns.deliver(_Delivery(), time.monotonic() + 60)  # type: ignore[arg-type]  # never delivered
    assert 0.05 <= loop.time() - start < 2.0
    assert turns.delivering == 0 and not turns.busy


async def test_a_connection_says_how_long_its_undelivered_bytes_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Conn.delivery_wait``: what decides whether an upload waits for its delivery
    (``_bulk.UPLOAD_WAIT_WORTH_S``): 0 with nothing beyond the bound unacknowledged, or no rate
    measured yet."""
    async with _dialed() as (conn, peer), asyncio.timeout(10):
        assert conn.delivery_wait(0) == 0.0
        payload = bytes(16 << 20)  # more than the peer's receive buffer: it stays queued here
        sending = asyncio.ensure_future(conn.sendall(payload))
        await asyncio.sleep(0.05)
        queued = conn.queued()
        assert queued > 1 << 20
        monkeypatch.setattr(conn, "delivery_rate", lambda: 0)  # not measured yet
        assert conn.delivery_wait(8 << 10) == 0.0
        monkeypatch.setattr(conn, "delivery_rate", lambda: queued)  # about a second's worth
        assert 0.5 < conn.delivery_wait(8 << 10) <= 1.0
        assert conn.delivery_wait(queued) == 0.0
        received = asyncio.ensure_future(peer.recv_exactly(memoryview(bytearray(len(payload)))))
        await sending
        await received
