"""A data port takes a burst of connections while its event loop is busy (issue 24, 256 clients on a shard).

With a listen backlog of 64 and one accept per turn of a busy uvloop, 256 simulated workers connecting
to one shard at once lost their SYNs past the 64th; psclient gives a data port 3 s to answer
(``CONNECT_TIMEOUT_S``) and then sends that shard's pushes over gRPC for a minute, where they went at
a small fraction of the others' step rate.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time

import pytest

from pscore import transport

N = 200  # connections in the burst: over the old backlog of 64
MAGIC = b"BURST-T1"


async def _burst() -> tuple[int, int, int]:
    """Returns (connections established while the loop was blocked, served, loop turns to serve them)."""
    served = 0
    done = asyncio.Event()

    def on_connection(conn: transport.Conn, who: int) -> None:
        nonlocal served
        served += 1
        conn.close()
        if served == N:
            done.set()

    port = transport.DataPort("127.0.0.1", 0, magic=MAGIC, on_connection=on_connection, max_nonces=N)
    await port.start()
    socks: list[socket.socket] = []
    try:
        await asyncio.sleep(0)  # the accept task now waits for the first connection
        nonces = [port.issue_nonce() for _ in range(N)]
        # The loop is blocked from here to the hellos, as a busy shard's is: only the kernel answers.
        for _ in range(N):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port.port))
            socks.append(sock)
        pending = set(socks)
        deadline = time.monotonic() + 2.0  # past the first SYN retransmission (1 s)
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], 0.1)
            pending -= {s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
        established = N - len(pending)
        for sock, nonce in zip(socks, nonces, strict=True):
            if sock not in pending:
                sock.send(transport._HELLO.pack(MAGIC, nonce, 0))
        turns = 0
        while not done.is_set() and turns < 20 * N:
            await asyncio.sleep(0)
            turns += 1
        return established, served, turns
    finally:
        for sock in socks:
            sock.close()
        await port.close()


def test_a_burst_of_connections_is_established_and_accepted_in_a_few_loop_turns() -> None:
    uvloop = pytest.importorskip("uvloop")  # the shard's loop: one accept waits a whole turn there
    established, served, turns = uvloop.run(_burst())
    assert established == N, f"only {established} of {N} connections were established (listen backlog)"
    assert served == N
    assert turns < N // 4, f"{turns} loop turns to accept {N} waiting connections"
