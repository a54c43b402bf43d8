"""pscore.transport.Conn over a real socket pair: reads of every size get the stream's bytes in order,
whether they arrive in one write or byte by byte, with bytes read ahead or not."""

from __future__ import annotations

import asyncio
import random
import socket

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
