"""Retries of idempotent RPCs: exponential backoff with full jitter, bounded by one overall deadline.

Every psclient RPC is safe to repeat: pulls and listings read, creates are
idempotent for an equal spec, a push carries ``(worker_id, session, seq)`` chosen
once before the first attempt, so a shard applies a retried push once, an
assign sets the same values again and an optimizer change (or replacement) makes
the same change again. A call
that fails with ``UNAVAILABLE`` (the shard is down, restarting or shutting
down, or the connection broke mid-call; a broken stream may also surface as
INTERNAL/UNKNOWN with a transport message from gRPC core, see
``BROKEN_CONNECTION_MESSAGES``) is therefore retried until its deadline: a
worker rides through a shard restart with no code of its own.

The deadline covers all attempts together: each attempt gets the time that is
left (``attempt_timeout``), and the sleep between attempts never runs past it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

# CANCELLED: an RpcError with it comes from the other side (a shard whose server stops, or restarts
# in-process as its peer's backup, cancels the calls it holds); this client's own cancellations raise
# asyncio.CancelledError instead. Every call retried is idempotent (pushes by their ledger key).
RETRYABLE_CODES: frozenset[grpc.StatusCode] = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
)
# A connection that breaks under a streaming call can surface as INTERNAL or UNKNOWN with one of
# these messages from gRPC core (not from our server): retried like UNAVAILABLE.
BROKEN_CONNECTION_CODES: frozenset[grpc.StatusCode] = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)
BROKEN_CONNECTION_MESSAGES: tuple[str, ...] = (
    "Internal error from Core",
    "Stream removed",
    "Socket closed",
    "Connection reset",
    "Broken pipe",
    "RST_STREAM",
)

# Seconds left for the attempt in progress; read by the client when it builds the call's kwargs.
ATTEMPT_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "psclient_attempt_timeout", default=None
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How failed calls are retried.

    Attributes:
        initial_backoff_s: upper bound of the first sleep.
        max_backoff_s: upper bound of any sleep.
        multiplier: growth of the bound per attempt.
        enabled: False turns retries off (every error surfaces at once).
    """

    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < initial_backoff_s ({self.initial_backoff_s}) "
                f"<= max_backoff_s ({self.max_backoff_s})"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """The sleep before retry number ``attempt`` (0-based): uniform in [0, bound] ("full jitter").

        >>> RetryPolicy(0.1, 1.0).backoff(10, random.Random(0)) <= 1.0
        True
        """
        bound = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** min(attempt, 64))
        return (rng or random).uniform(0.0, bound)


def attempt_timeout(default: float) -> float:
    """The deadline (seconds) to give the RPC being started: what is left of the retried call's deadline."""
    left = ATTEMPT_TIMEOUT.get()
    return default if left is None else left


def is_retryable(err: grpc.RpcError) -> bool:
    """True for errors a repeat of the same (idempotent) call may fix: UNAVAILABLE, a call the shard
    cancelled, a broken connection."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    if code in RETRYABLE_CODES:
        return True
    if code in BROKEN_CONNECTION_CODES:
        details = (err.details() if callable(getattr(err, "details", None)) else "") or ""
        return any(m in details for m in BROKEN_CONNECTION_MESSAGES)
    return False


async def call_with_retry(
    fn: Callable[[], Awaitable[T]],
    *,
    timeout: float,
    policy: RetryPolicy,
    what: str = "call",
    on_retry: Callable[[grpc.RpcError], None] | None = None,
) -> T:
    """Runs ``fn()`` (which must start a fresh RPC each time) until it succeeds or the deadline passes.

    Args:
        fn: starts one attempt; it reads its deadline from ``attempt_timeout``.
        timeout: the deadline of all attempts together, seconds.
        policy: backoff settings.
        what: names the call in log messages.
        on_retry: called with each error that will be retried (before the backoff sleep).

    Raises:
        grpc.RpcError: a non-retryable error, or the last retryable one once the
            deadline leaves no time for another attempt.
    """
    deadline = time.monotonic() + timeout
    token = ATTEMPT_TIMEOUT.set(max(timeout, 0.001))
    try:
        return await fn()
    except grpc.RpcError as err:
        failed = err
    finally:
        ATTEMPT_TIMEOUT.reset(token)
    return await retry_after(failed, fn, deadline=deadline, policy=policy, what=what, on_retry=on_retry)


async def retry_after(
    err: grpc.RpcError,
    fn: Callable[[], Awaitable[T]],
    *,
    deadline: float,
    policy: RetryPolicy,
    what: str = "call",
    on_retry: Callable[[grpc.RpcError], None] | None = None,
) -> T:
    """``call_with_retry`` once its first attempt failed with ``err``: the retries, until ``deadline``
    (``time.monotonic()``). A caller that makes the first attempt itself (no frame of this module on the
    path of a call that succeeds at once) hands its error here.

    Raises:
        grpc.RpcError: ``err`` or a later error (see ``call_with_retry``).
    """
    attempt = 0
    while True:
        if not policy.enabled or not is_retryable(err):
            raise err
        sleep = policy.backoff(attempt)
        left = deadline - time.monotonic()
        if left <= sleep + 0.01:
            raise err
        code = err.code().name
        log.info("%s failed (%s: %s); retry %d in %.2fs", what, code, err.details(), attempt + 1, sleep)
        attempt += 1
        if on_retry is not None:
            on_retry(err)
        await asyncio.sleep(sleep)
        token = ATTEMPT_TIMEOUT.set(max(deadline - time.monotonic(), 0.001))
        try:
            return await fn()
        except grpc.RpcError as failed:
            err = failed
        finally:
            ATTEMPT_TIMEOUT.reset(token)
