"""pscore.transport.Conn over a real socket pair: reads of every size get the stream's bytes in order,
whether they arrive in one write or byte by byte, with bytes read ahead or not."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest

from pscore.transport import READ_AHEAD_BYTES, Conn

# Sizes of the reads, small ones (read ahead) and large ones (straight into the caller's buffer) mixed.
READS = [
    16,
    1,
    300,
    3 * READ_AHEAD_BYTES,
    7,
    READ_AHEAD_BYTES // 2,
    READ_AHEAD_BYTES // 2 - 1,
    24,
    100_000,
    5,
]


async def _read_all(conn: Conn) -> bytes:
    out = bytearray()
    for size in READS:
        view = memoryview(bytearray(size))
        await conn.recv_exactly(view)
        out += view
    return bytes(out)


@pytest.mark.parametrize("pieces", ["one_write", "random_pieces", "bytewise_start"])
async def test_reads_of_every_size_get_the_bytes_in_order(pieces: str) -> None:
    rng = random.Random(7)
    data = rng.randbytes(sum(READS))
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    conn = Conn(reader)

    async def write() -> None:
        loop = asyncio.get_running_loop()
        writer.setblocking(False)
        if pieces == "one_write":
            await loop.sock_sendall(writer, data)
            return
        pos = 0
        while pos < len(data):
            n = 1 if pieces == "bytewise_start" and pos < 400 else rng.randint(1, 200_000)
            await loop.sock_sendall(writer, data[pos : pos + n])
            pos += n
            await asyncio.sleep(0)  # let the reader take what arrived

    try:
        async with asyncio.timeout(30):
            got, _ = await asyncio.gather(_read_all(conn), write())
    finally:
        conn.close()
        writer.close()
    assert got == data


async def test_a_peer_that_closes_mid_read_is_a_connection_error() -> None:
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    conn = Conn(reader)
    writer.sendall(b"abc")
    writer.close()
    try:
        head = memoryview(bytearray(2))
        await conn.recv_exactly(head)  # reads ahead "abc"
        assert bytes(head) == b"ab"
        with pytest.raises(ConnectionError):
            async with asyncio.timeout(10):
                await conn.recv_exactly(memoryview(bytearray(4)))  # "c", then the end
    finally:
        conn.close()


def _views(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_send_views_and_recv_views_move_many_views_in_order_through_waits(loop_kind: str) -> None:
    """A frame's payload goes out by ``send_views`` and in by ``recv_views`` (scatter/gather system calls,
    one wait each): more views than one call takes, empty ones, sizes far beyond the socket's buffers
    (both sides wait), and bytes read ahead before the views."""
    rng = random.Random(11)
    sizes = [rng.choice([0, 1, 7, 4096, 70_000]) for _ in range(700)] + [6 << 20, 3, 2 << 20]
    data = rng.randbytes(sum(sizes))
    prefix = b"0123456789"

    async def run() -> list[memoryview]:
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        sender, receiver = Conn(a), Conn(b)
        parts, pos = [], 0
        for n in sizes:
            parts.append(memoryview(data)[pos : pos + n])
            pos += n
        views = _views(sizes)

        async def receive() -> None:
            head = memoryview(bytearray(4))
            await receiver.recv_exactly(head)  # reads ahead the rest of the prefix and what follows
            assert bytes(head) == prefix[:4]
            rest = memoryview(bytearray(len(prefix) - 4))
            await receiver.recv_exactly(rest)
            assert bytes(rest) == prefix[4:]
            await receiver.recv_views(views)

        try:
            async with asyncio.timeout(60):
                await asyncio.gather(receive(), sender.send_views([prefix, *parts]))
        finally:
            sender.close()
            receiver.close()
        return views

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        views = uvloop.run(run())
    else:
        views = asyncio.run(run())
    assert b"".join(bytes(v) for v in views) == data


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_small_reads_that_wait_are_woken_by_one_reader_kept_between_waits(loop_kind: str) -> None:
    """A small read that waits is woken by the loop's reader callback, registered on the first wait and
    kept between waits (uvloop): request-answer rounds each wait and get their bytes; a wait cancelled leaves
    nothing behind, and bytes that come while nobody reads (the callback then stops watching) are read
    by the next call; close removes the callback."""

    async def run() -> None:
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        near, far = Conn(a), Conn(b)
        try:
            async with asyncio.timeout(30):
                for i in range(20):  # rounds: each read waits for the other side's answer
                    ask = memoryview(bytearray(4))
                    reading = asyncio.ensure_future(far.recv_exactly(ask))
                    await asyncio.sleep(0)  # it waits: nothing sent yet
                    assert not reading.done()
                    await near.send_views([i.to_bytes(4, "little")])
                    await reading
                    await far.send_views([bytes(ask)])
                    answer = memoryview(bytearray(4))
                    await near.recv_exactly(answer)
                    assert int.from_bytes(answer, "little") == i
                if loop_kind == "uvloop":  # kept between waits (asyncio's selector loop polls again before
                    # the woken task reads: there the callback finds no wait and stops, as it should)
                    assert far._reader_fd >= 0
                # A wait cancelled: the next read gets the bytes sent after it.
                cancelled = asyncio.ensure_future(far.recv_exactly(memoryview(bytearray(3))))
                await asyncio.sleep(0)
                cancelled.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await cancelled
                assert far._reader_fd == -1
                await near.send_views([b"xyz"])
                got = memoryview(bytearray(3))
                await far.recv_exactly(got)
                assert bytes(got) == b"xyz"
                # Bytes that come while nobody reads: the callback fires once, stops watching, and the
                # next read takes them.
                ask = memoryview(bytearray(2))
                reading = asyncio.ensure_future(far.recv_exactly(ask))
                await asyncio.sleep(0)
                await near.send_views([b"ab"])
                await reading
                await near.send_views([b"cd"])
                for _ in range(20):  # loop turns: the callback finds no wait
                    if far._reader_fd == -1:
                        break
                    await asyncio.sleep(0)
                assert far._reader_fd == -1
                await far.recv_exactly(ask)
                assert bytes(ask) == b"cd"
                reading = asyncio.ensure_future(far.recv_exactly(ask))
                await asyncio.sleep(0)
                assert far._reader_fd >= 0
                reading.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await reading
        finally:
            near.close()
            far.close()
        assert far._reader_fd == -1

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(run())
    else:
        asyncio.run(run())


async def test_a_cancelled_recv_views_writes_nothing_more_into_its_views() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    receiver = Conn(b)
    views = _views([4, 100_000])
    try:
        a.sendall(b"abcdef")  # the first view and part of the second, then nothing
        task = asyncio.ensure_future(receiver.recv_views(views))
        for _ in range(50):  # bounded: until the task waits for the rest
            await asyncio.sleep(0.01)
            if bytes(views[1][:2]) == b"ef":
                break
        assert bytes(views[0]) == b"abcd" and bytes(views[1][:2]) == b"ef"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        a.sendall(b"x" * 1000)
        await asyncio.sleep(0.05)
        assert bytes(views[1][2:1002]) == bytes(1000)  # the loop no longer reads into it
    finally:
        receiver.close()
        a.close()


@pytest.mark.parametrize("kind", ["socketpair", "tcp"])
async def test_a_peer_that_closes_mid_recv_views_is_a_connection_error(kind: str) -> None:
    """Also over TCP with a payload far beyond what arrived: a reader waiting for its next mark
    (SO_RCVLOWAT) still learns at once that its peer closed."""
    if kind == "tcp":
        a, b = _tcp_pair()
        sizes, sent = [1 << 20], b"x" * 10_000
    else:
        a, b = socket.socketpair()
        b.setblocking(False)
        sizes, sent = [2, 10], b"xyz"
    receiver = Conn(b)
    try:
        task = asyncio.ensure_future(receiver.recv_views(_views(sizes)))
        a.sendall(sent)
        await asyncio.sleep(0.05)
        assert not task.done()
        a.close()
        with pytest.raises(ConnectionError):
            async with asyncio.timeout(10):
                await task
    finally:
        receiver.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on loopback (SO_RCVLOWAT is TCP's: a socketpair's poll ignores it)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    b.setblocking(False)
    return a, b


async def test_a_payload_that_trickles_in_wakes_the_reader_per_mark_not_per_packet() -> None:
    """A payload's rest arriving in small pieces (a slow link's packets) is read in a few wake-ups of
    the loop (SO_RCVLOWAT), and the next small read after it still wakes at its first bytes."""
    a, b = _tcp_pair()
    receiver = Conn(b)
    size, piece = 1 << 20, 4096
    data = random.Random(5).randbytes(size)
    wakeups = 0
    move = receiver._move

    def counted(*args: object) -> bool:
        nonlocal wakeups
        wakeups += 1
        return move(*args)  # type: ignore[arg-type]

    receiver._move = counted  # type: ignore[method-assign]

    def trickle() -> None:
        for pos in range(0, size, piece):
            a.sendall(data[pos : pos + piece])
            if pos % (16 * piece) == 0:
                time.sleep(0.001)

    view = memoryview(bytearray(size))
    try:
        async with asyncio.timeout(60):
            sender = asyncio.get_running_loop().run_in_executor(None, trickle)
            await receiver.recv_views([view])
            await sender
        assert bytes(view) == data
        # 1 MiB in 4 KiB pieces: 256 wake-ups at worst without the mark, about 8 with it (128 KiB each)
        assert wakeups <= 40, wakeups
        a.sendall(b"next")  # four bytes alone: the mark is back to one byte
        head = memoryview(bytearray(4))
        async with asyncio.timeout(10):
            await receiver.recv_exactly(head)
        assert bytes(head) == b"next"
    finally:
        receiver.close()
        a.close()
