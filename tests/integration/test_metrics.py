"""Prometheus metrics of a shard: the endpoint is scraped and its counters move after pushes and pulls."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S
from prometheus_client.parser import text_string_to_metric_families

import psclient
from psserver.config import ServerConfig
from psserver.server import serve, start
from trainer.cluster import LocalCluster


def scrape(host_port: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of one scrape."""
    with urllib.request.urlopen(f"http://{host_port}/metrics", timeout=TIMEOUT_S) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert hits, f"no sample {name}{labels}"
    return sum(hits)


async def test_counters_move_after_pushes_and_pulls() -> None:
    shard = await start(ServerConfig(shard=0, port=0, metrics_port=0))
    try:
        assert shard.metrics is not None and shard.metrics.port
        endpoint = f"127.0.0.1:{shard.metrics.port}"
        before = await asyncio.to_thread(scrape, endpoint)
        assert value(before, "psserver_variables", shard="0") == 0
        assert value(before, "psserver_pulls_total", shard="0") == 0
        async with psclient.AsyncPSClient([shard.address], worker_id="w0", timeout=TIMEOUT_S) as c:
            await c.create("w", np.zeros((16, 8), np.float32), optimizer=psclient.SGD(0.1))
            await c.pull()
            for _ in range(3):
                await c.push({"w": np.ones((16, 8), np.float32)})
            await c.push_pull({"w": np.ones((16, 8), np.float32)})
        after = await asyncio.to_thread(scrape, endpoint)
    finally:
        await shard.stop(0)
    assert value(after, "psserver_pushes_total", shard="0", outcome="applied") == 4
    assert value(after, "psserver_pulls_total", shard="0") == 1
    assert value(after, "psserver_push_bytes_total") == 4 * 16 * 8 * 4
    assert value(after, "psserver_pull_bytes_total") == 2 * 16 * 8 * 4  # one pull + one push_pull
    assert value(after, "psserver_variable_version", variable="w") == 4
    assert value(after, "psserver_variable_bytes", variable="w") == 16 * 8 * 4
    assert value(after, "psserver_stored_bytes") == 16 * 8 * 4
    assert value(after, "psserver_rpc_latency_seconds_count", rpc="Push") == 4
    assert value(after, "psserver_rpc_latency_seconds_count", rpc="Pull") == 1
    # w0 pulled, then pushed three times without reading: staleness 0, 1, 2, then push_pull at 3.
    assert value(after, "psserver_push_staleness_count") == 4
    assert value(after, "psserver_push_staleness_sum") == 0 + 1 + 2 + 3
    assert math.isnan(value(after, "psserver_checkpoint_age_seconds"))
    assert value(after, "psserver_dropped_stale_gradients_total") == 0


async def test_dynamic_table_rows_admissions_and_evictions_are_exported() -> None:
    shard = await start(ServerConfig(shard=0, port=0, metrics_port=0))
    try:
        async with psclient.AsyncPSClient([shard.address], worker_id="w0", timeout=TIMEOUT_S) as c:
            await c.create_embedding("d", None, 2, capacity=4, min_count=2)
            for _ in range(2):  # ids 0..5 admitted on their second push: the 4 smallest fit, 2 dropped
                await c.push({"d": psclient.Rows(np.arange(6), np.ones((6, 2), np.float32))})
            await c.push({"d": psclient.Rows([7], np.ones((1, 2), np.float32))})  # seen once: dropped
            await c.lookup("d", [7, 8])
        samples = await asyncio.to_thread(scrape, f"127.0.0.1:{shard.metrics.port}")
    finally:
        await shard.stop(0)
    labels = {"shard": "0", "table": "d"}
    assert value(samples, "psserver_table_rows", **labels) == 4
    assert value(samples, "psserver_table_capacity_rows", **labels) == 4
    assert value(samples, "psserver_table_admitted_rows_total", **labels) == 4
    assert value(samples, "psserver_table_dropped_row_updates_total", **labels) == 6 + 2 + 1
    assert value(samples, "psserver_table_evicted_rows_total", **labels) == 0
    assert value(samples, "psserver_table_expired_rows_total", **labels) == 0
    assert value(samples, "psserver_table_initializer_reads_total", **labels) == 2


async def test_errors_are_counted_by_code_and_checkpoint_age_reported() -> None:
    shard = await start(ServerConfig(shard=0, port=0, metrics_port=0))
    try:
        async with psclient.AsyncPSClient([shard.address], worker_id="w0", timeout=TIMEOUT_S) as c:
            await c.create("v", np.zeros(4, np.float32))
            with pytest.raises(psclient.InvalidArgumentError):
                await c.push({"v": np.full(4, np.nan, np.float32)})
        shard.metrics.checkpoint_saved()
        samples = await asyncio.to_thread(scrape, f"127.0.0.1:{shard.metrics.port}")
    finally:
        await shard.stop(0)
    assert value(samples, "psserver_rpc_errors_total", rpc="Push", code="INVALID_ARGUMENT") == 1
    assert value(samples, "psserver_pushes_total") == 0
    assert 0 <= value(samples, "psserver_checkpoint_age_seconds") < 3600
    assert value(samples, "psserver_checkpoints_total") == 1


async def test_sync_barrier_wait_recorded_and_stall_names_awaited_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ServerConfig(
        shard=0, port=0, mode="sync", replicas_to_aggregate=2, total_replicas=2, barrier_timeout_s=20.0
    )
    shard = await start(config)
    try:
        async with (
            psclient.AsyncPSClient([shard.address], worker_id="w0", timeout=TIMEOUT_S) as w0,
            psclient.AsyncPSClient([shard.address], worker_id="w1", timeout=TIMEOUT_S) as w1,
        ):
            await w0.create("v", np.zeros(4, np.float32))
            await w1.pull()  # the shard has now seen w1
            g = np.ones(4, np.float32)
            pending = asyncio.create_task(w0.push({"v": g}, step=0))
            for _ in range(1000):  # bounded (10 s): until w0's push waits in the barrier
                if shard.metrics.waits:
                    break
                await asyncio.sleep(0.01)
            assert shard.metrics.waits
            registry = shard.metrics.registry
            assert registry.get_sample_value("psserver_waiting_requests", {"shard": "0"}) == 1
            assert registry.get_sample_value("psserver_oldest_wait_seconds", {"shard": "0"}) > 0
            report = shard.metrics.stall_report(older_than_s=-1.0)
            assert report is not None
            assert "push of w0 for step 0" in report and "awaiting w1" in report
            with caplog.at_level(logging.WARNING, logger="psserver.metrics"):
                watcher = asyncio.create_task(shard.metrics.watch_stalls(interval_s=0.05, older_than_s=0.0))
                for _ in range(1000):
                    if any("awaiting w1" in r.getMessage() for r in caplog.records):
                        break
                    await asyncio.sleep(0.01)
                watcher.cancel()
            assert any("awaiting w1" in r.getMessage() for r in caplog.records)
            await w1.push({"v": g}, step=0)
            await asyncio.wait_for(pending, TIMEOUT_S)
        assert shard.metrics.stall_report(older_than_s=-1.0) is None
        assert shard.metrics.registry.get_sample_value("psserver_oldest_wait_seconds", {"shard": "0"}) == 0
        samples = shard.metrics.registry
        count = samples.get_sample_value("psserver_barrier_wait_seconds_count", {"shard": "0", "op": "push"})
        assert count == 2
    finally:
        await shard.stop(0)


def test_metrics_port_flag_on_a_process_shard(tmp_path: Path) -> None:
    with LocalCluster(num_shards=1, server_args=["--metrics-port", "0"], workdir=tmp_path) as cluster:
        metrics_file = tmp_path / "ps0.addr.metrics"
        assert metrics_file.exists(), "the shard writes HOST:PORT of its metrics next to the ready file"
        with psclient.PSClient(cluster.addresses, worker_id="w9", timeout=TIMEOUT_S) as c:
            c.create("x", np.zeros(3, np.float32))
            c.push({"x": np.ones(3, np.float32)})
        samples = scrape(metrics_file.read_text().strip())
        assert value(samples, "psserver_pushes_total", shard="0", outcome="applied") == 1
        log_text = cluster.log_tail(0, lines=50)
    assert "metrics on http://127.0.0.1:" in log_text
    assert "psserver[shard=0 " in log_text


async def test_checkpoint_dirty_and_interval(tmp_path: Path) -> None:
    shard = await start(ServerConfig(shard=0, port=0, checkpoint_dir=str(tmp_path), checkpoint_every_s=3600))
    try:
        registry = shard.metrics.registry

        def sample(name: str) -> float | None:
            return registry.get_sample_value(name, {"shard": "0"})

        assert sample("psserver_checkpoint_interval_seconds") == 3600
        assert sample("psserver_checkpoint_dirty") == 0  # empty and unchanged: nothing to save yet
        await shard.checkpointer.save()
        assert sample("psserver_checkpoint_dirty") == 0
        async with psclient.AsyncPSClient([shard.address], worker_id="w0", timeout=TIMEOUT_S) as c:
            await c.create("v", np.zeros(4, np.float32))
            assert sample("psserver_checkpoint_dirty") == 1
            await shard.checkpointer.save()
            assert sample("psserver_checkpoint_dirty") == 0
            assert 0 <= sample("psserver_checkpoint_age_seconds") < 3600
            await c.push({"v": np.ones(4, np.float32)})
            assert sample("psserver_checkpoint_dirty") == 1
    finally:
        await shard.stop(0)
    plain = await start(ServerConfig(shard=0, port=0))  # no --checkpoint-dir: nothing to watch
    try:
        registry = plain.metrics.registry
        assert registry.get_sample_value("psserver_checkpoint_dirty", {"shard": "0"}) is None
        assert registry.get_sample_value("psserver_role", {"shard": "0", "role": "primary"}) == 1
    finally:
        await plain.stop(0)


async def test_replication_lag_role_and_backup_link() -> None:
    primary = await start(ServerConfig(shard=0, port=0))
    backup = await start(ServerConfig(shard=0, port=0, backup_of=primary.address))
    try:
        p, b = primary.metrics.registry, backup.metrics.registry

        def sample(registry: object, name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"shard": "0", **labels})  # type: ignore[attr-defined]

        for _ in range(1000):  # bounded (10 s): until the backup has attached and caught up
            if sample(p, "psserver_replication_backup_attached") == 1 and backup.backup.caught_up:
                break
            await asyncio.sleep(0.01)
        assert sample(p, "psserver_replication_backup_attached") == 1
        assert sample(b, "psserver_role", role="backup") == 1
        assert sample(b, "psserver_role", role="primary") == 0
        assert sample(p, "psserver_replication_ack_seconds_count") == 0
        async with psclient.AsyncPSClient([primary.address], worker_id="w0", timeout=TIMEOUT_S) as c:
            await c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
            for _ in range(3):
                await c.push({"v": np.ones(4, np.float32)})
        # Every update was acknowledged before its call returned: one create and three pushes, timed.
        assert sample(p, "psserver_replication_ack_seconds_count") == 4
        assert sample(p, "psserver_replication_ack_seconds_sum") > 0
        assert sample(p, "psserver_replication_unacked_updates") == 0
        assert sample(b, "psserver_replication_updates_applied_total") == 3
        assert sample(p, "psserver_replication_updates_applied_total") is None  # not a backup
        await primary.stop(0)
        for _ in range(1000):  # bounded (10 s): the backup sees its primary's stream end
            if sample(b, "psserver_role", role="orphaned") == 1:
                break
            await asyncio.sleep(0.01)
        assert sample(b, "psserver_role", role="orphaned") == 1
        assert sample(b, "psserver_role", role="backup") == 0
    finally:
        await primary.stop(0)
        await backup.stop(0)


async def test_a_blocked_event_loop_is_logged_with_where_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A shard's event loop blocked past 2 s: a WARNING naming the blocking code, then the stall counted."""
    ready = tmp_path / "ps0.addr"
    metrics_file = Path(f"{ready}.metrics")
    stop = asyncio.Event()
    config = ServerConfig(shard=0, port=0, metrics_port=0, ready_file=str(ready))
    with caplog.at_level(logging.WARNING, logger="pscore.loopwatch"):
        served = asyncio.create_task(serve(config, stop=stop))
        try:
            for _ in range(200):
                if await asyncio.to_thread(metrics_file.exists):
                    break
                await asyncio.sleep(0.05)
            metrics = (await asyncio.to_thread(metrics_file.read_text)).strip()
            _hold_the_loop(2.6)  # what a blocking call in a handler does to every call
            for _ in range(100):
                if any("turns again" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
            samples = await asyncio.to_thread(scrape, metrics)
        finally:
            stop.set()
            await asyncio.wait_for(served, TIMEOUT_S)
    stuck = [r.getMessage() for r in caplog.records if "has not turned" in r.getMessage()]
    assert len(stuck) == 1 and "_hold_the_loop" in stuck[0], caplog.text
    assert value(samples, "psserver_event_loop_stalls_total") == 1
    assert 2.0 < value(samples, "psserver_event_loop_blocked_seconds_total") < 4.0


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)
