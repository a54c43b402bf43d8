"""psclient._retry: backoff bounds, what is retried, and the one deadline over all attempts."""

from __future__ import annotations

import random

import grpc
import pytest

from psclient import _retry


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code = code
        self._details = details or code.name

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


FAST = _retry.RetryPolicy(initial_backoff_s=0.001, max_backoff_s=0.01)


def test_backoff_full_jitter_is_bounded_and_grows() -> None:
    policy = _retry.RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0)
    rng = random.Random(1)
    for attempt in range(100):
        bound = min(1.0, 0.1 * 2**attempt)
        assert 0.0 <= policy.backoff(attempt, rng) <= bound


@pytest.mark.parametrize("bad", [{"initial_backoff_s": 0}, {"initial_backoff_s": 2, "max_backoff_s": 1},
                                 {"multiplier": 0.5}])  # fmt: skip
def test_policy_rejects_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        _retry.RetryPolicy(**bad)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
async def test_unavailable_is_retried_until_success_with_shrinking_attempt_timeout(
    code: grpc.StatusCode,
) -> None:
    # CANCELLED as an RpcError: the shard cancelled the call (its server stopping, or restarting in-process as
    # its peer's backup); the client's own cancellations are asyncio.CancelledError, never retried.
    seen: list[float] = []

    async def fn() -> str:
        seen.append(_retry.attempt_timeout(99.0))
        if len(seen) < 4:
            raise _Err(code)
        return "ok"

    assert await _retry.call_with_retry(fn, timeout=5.0, policy=FAST) == "ok"
    assert len(seen) == 4
    assert all(0 < t <= 5.0 for t in seen)
    assert seen == sorted(seen, reverse=True)
    assert _retry.attempt_timeout(99.0) == 99.0  # reset outside the call


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
             grpc.StatusCode.DEADLINE_EXCEEDED],
)  # fmt: skip
async def test_other_codes_are_not_retried(code: grpc.StatusCode) -> None:
    calls = 0

    async def fn() -> None:
        nonlocal calls
        calls += 1
        raise _Err(code)

    with pytest.raises(_Err):
        await _retry.call_with_retry(fn, timeout=5.0, policy=FAST)
    assert calls == 1


async def test_gives_up_at_the_deadline() -> None:
    calls = 0

    async def fn() -> None:
        nonlocal calls
        calls += 1
        raise _Err(grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(_Err):
        await _retry.call_with_retry(fn, timeout=0.3, policy=FAST)
    assert 1 < calls < 10_000


async def test_disabled_policy_raises_at_once() -> None:
    calls = 0

    async def fn() -> None:
        nonlocal calls
        calls += 1
        raise _Err(grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(_Err):
        await _retry.call_with_retry(fn, timeout=5.0, policy=_retry.RetryPolicy(enabled=False))
    assert calls == 1


def test_broken_connection_errors_are_retryable_but_server_internal_errors_are_not() -> None:
    assert _retry.is_retryable(_Err(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert _retry.is_retryable(_Err(grpc.StatusCode.UNKNOWN, "Stream removed"))
    assert not _retry.is_retryable(_Err(grpc.StatusCode.INTERNAL, "shard 0: checkpoint failed: disk full"))
    assert not _retry.is_retryable(_Err(grpc.StatusCode.UNKNOWN, "Exception calling application"))
