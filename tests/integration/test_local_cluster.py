"""``trainer.cluster.LocalCluster`` as a context manager: a cluster already started is not started again."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(60)


def test_a_started_cluster_entered_by_with_keeps_its_shards_and_stops_them() -> None:
    # ``with LocalCluster(...).start() as cluster:`` started every shard twice: the first processes ran on,
    # owned by nobody, after the block (a harness left 19 pairs of idle shards on the machine that way).
    cluster = LocalCluster(num_shards=1).start()
    first = cluster.procs[0]
    assert first is not None
    try:
        with cluster as entered:
            assert entered is cluster
            assert cluster.procs[0] is first  # the shard that start() made, not a second one
        assert first.poll() is not None  # stopped with the block
    finally:
        if first.poll() is None:  # the failure above: do not leave it running
            with contextlib.suppress(ProcessLookupError):
                os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=10)
        cluster.stop()
