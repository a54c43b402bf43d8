"""Says what a call waits for when its shard cannot be reached, instead of sitting silent until its deadline.

A call to a shard that is down waits (``wait_for_ready``) or retries until its
deadline: it rides through a restart. While calls wait, a ``Watch`` of the
shard's address checks it: after ``WARN_AFTER_S`` it tries a TCP connection
every ``PROBE_EVERY_S`` and logs a WARNING (once, then every ``WARN_EVERY_S``)
naming the address, what happened (connection refused, no answer) and the
attempts so far. A call that then fails is reported with the same words
(``describe``).

The hot path costs no timer while calls follow each other: the first call to
wait arms one, which when it fires re-arms itself for the calls waiting then,
or stops; nothing is probed while the channel is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WARN_AFTER_S = 2.0  # a call waiting this long for an unconnected shard starts the checks
PROBE_EVERY_S = 2.0
WARN_EVERY_S = 10.0
PROBE_TIMEOUT_S = 1.0


async def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Tries a TCP connection to ``HOST:PORT``; returns None if it opens, else what went wrong.

    >>> asyncio.run(probe("127.0.0.1:notaport"))
    'bad address 127.0.0.1:notaport'
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return f"bad address {address}"
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, int(port))
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"unreachable: no answer within {timeout:g} s"
    except socket.gaierror as err:
        return f"cannot resolve {host}: {err.strerror}"
    except OSError as err:
        return f"unreachable: {err.strerror or err}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


class Watch:
    """Checks one address while calls to it wait; shared by those calls (``enter`` / ``leave``).

    Args:
        address: ``HOST:PORT``.
        connected: whether the gRPC channel to it is connected now (then nothing is probed).
    """

    def __init__(self, address: str, connected: Callable[[], bool]) -> None:
        self.address = address
        self._connected = connected
        self._waiting = 0
        self._busy_since = 0.0  # when calls last started waiting (time.monotonic())
        self._timer: asyncio.TimerHandle | None = None  # armed when calls start waiting; fires to ``_start``
        self._task: asyncio.Task[None] | None = None
        self.since: float | None = None  # when the first failed check was made (monotonic)
        self.attempts = 0  # failed connection attempts since then
        self.reason: str | None = None  # what the last one said

    def enter(self) -> None:
        """A call to the address starts."""
        self._waiting += 1
        if self._waiting == 1:
            # time.monotonic(), not the loop's clock: asyncio.get_running_loop() is a getpid() system call
            # in Python 3.11 (its fork check), on every call
            self._busy_since = time.monotonic()
            if self._timer is None:  # a timer left from an earlier wait re-arms itself (``_start``)
                self._timer = asyncio.get_running_loop().call_later(WARN_AFTER_S, self._start)

    def leave(self) -> None:
        """A call to the address ended (the checks stop with the last one; the timer, if armed, is left to
        fire: a call that follows soon after costs no timer)."""
        self._waiting -= 1
        if self._waiting:
            return
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.since, self.attempts, self.reason = None, 0, None

    def _start(self) -> None:
        """The checks start once calls have waited ``WARN_AFTER_S`` without a pause."""
        self._timer = None
        if not self._waiting or self._task is not None:
            return
        left = self._busy_since + WARN_AFTER_S - time.monotonic()
        if left > 0:  # the calls waiting now began after a pause
            self._timer = asyncio.get_running_loop().call_later(left, self._start)
            return
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        warned = -WARN_EVERY_S
        while True:
            await self.check()
            now = time.monotonic()
            if self.reason is not None and now - warned >= WARN_EVERY_S:
                warned = now
                log.warning(
                    "waiting for shard %s: %s; %d connection attempt(s) in %.0f s; "
                    "retrying until the call's deadline",
                    self.address, self.reason, self.attempts, now - (self.since or now),
                )  # fmt: skip
            await asyncio.sleep(PROBE_EVERY_S)

    async def check(self) -> str | None:
        """Checks the address now (unless the channel is connected); returns what went wrong, or None."""
        if self._connected():
            self.reason = None
            return None
        reason = await probe(self.address)
        if reason is None:  # the port answers: what the call waits for is not the connection
            self.since, self.attempts, self.reason = None, 0, None
            return None
        self.since = self.since or time.monotonic()
        self.attempts += 1
        self.reason = reason
        return reason

    async def describe(self, waited_s: float) -> str | None:
        """Why a call that waited ``waited_s`` seconds could not reach the address, or None if it could.

        Checks once more when no check has failed yet (a call shorter than ``WARN_AFTER_S``).
        """
        if self.reason is None and await self.check() is None:
            return None
        return (
            f"shard {self.address} unreachable for {waited_s:.0f} s "
            f"({self.reason}, {self.attempts} connection attempt(s))"
        )
