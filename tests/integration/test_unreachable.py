"""A shard that is down: the client says so (address, connection refused) within seconds and in its error;
a push that got no answer says its outcome is unknown."""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import psclient
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def closed_address() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a port held bound (nobody else takes it) but not listening: refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


async def test_a_shard_that_is_down_is_named_as_refused_in_a_warning_and_the_error(
    closed_address: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="psclient")
    async with psclient.AsyncPSClient([closed_address], worker_id="w0", timeout=4.0) as client:
        with pytest.raises((psclient.DeadlineExceededError, psclient.UnavailableError)) as info:
            await client.pull()
    message = str(info.value)
    assert f"shard {closed_address} unreachable" in message, message
    assert "connection refused" in message, message
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(closed_address in w and "connection refused" in w for w in warnings), warnings


def test_a_short_call_to_a_shard_that_is_down_still_says_refused(closed_address: str) -> None:
    # Shorter than the first warning: the error alone says what happened.
    with (
        psclient.PSClient([closed_address], worker_id="w0", timeout=1.0) as client,
        pytest.raises((psclient.DeadlineExceededError, psclient.UnavailableError)) as info,
    ):
        client.pull()
    assert "connection refused" in str(info.value) and closed_address in str(info.value)


async def test_a_replicated_shard_that_is_down_says_refused_after_its_retries(closed_address: str) -> None:
    # PRIMARY|BACKUP: calls fail fast (no wait_for_ready) and are retried until the deadline.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        backup = f"127.0.0.1:{other.getsockname()[1]}"
        async with psclient.AsyncPSClient([f"{closed_address}|{backup}"], timeout=2.0) as client:
            with pytest.raises(psclient.UnavailableError) as info:
                await client.status()
    assert "connection refused" in str(info.value) and "unreachable" in str(info.value)


@pytest.mark.parametrize("data_port_min_bytes", [0, 1 << 30], ids=["data_port", "grpc"])
def test_a_push_that_got_no_answer_says_its_outcome_is_unknown_and_is_applied_at_most_once(
    make_cluster: Callable[..., LocalCluster], data_port_min_bytes: int
) -> None:
    cluster = make_cluster(num_shards=1)
    pid = cluster.procs[0].pid
    with psclient.PSClient(
        cluster.addresses, worker_id="w0", timeout=1.0, data_port_min_bytes=data_port_min_bytes
    ) as client:
        client.create("v", np.zeros(2, np.float32), optimizer=psclient.SGD(1.0))
        client.push({"v": np.ones(2, np.float32)})  # connections open: the next push reaches the shard
        os.kill(pid, signal.SIGSTOP)  # a shard that stalls, with the push in its socket
        try:
            with pytest.raises(psclient.DeadlineExceededError) as pushed:
                client.push({"v": np.ones(2, np.float32)})
            with pytest.raises(psclient.DeadlineExceededError) as pulled:
                client.pull(["v"])
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "may or may not have been applied" in str(pushed.value), pushed.value
        assert "may or may not" not in str(pulled.value), pulled.value  # a read changes nothing
        for err in (pushed.value, pulled.value):  # not a bare "Deadline Exceeded": where to look
            assert "accepts connections but sent no answer" in str(err) and "its log" in str(err), err
        value = client.pull(["v"])["v"]
    assert value[0] in (-1.0, -2.0), value  # the second push applied once, or not at all
