"""Ring collectives end to end: ranks as real processes, and AsyncRing ranks sharing one event loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _rings import async_rings
from _support import free_addresses, pythonpath

from psclient.collective import AsyncRing, Ring
from pscore.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    PSError,
    UnavailableError,
)

WORKER = Path(__file__).with_name("_collective_worker.py")
REPO = Path(__file__).resolve().parents[2]
EVENT_TIMEOUT_S = 60.0  # bound on any wait for a worker's line (the machine is slow and shared)


class Worker:
    """One rank process; reads its JSON lines with a bounded wait."""

    def __init__(
        self, scenario: str, rank: int, addrs: list[str], timeout: float, transport: str = "grpc"
    ) -> None:
        env = {**os.environ, "PYTHONPATH": pythonpath(REPO), "GRPC_VERBOSITY": "ERROR"}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(rank), ",".join(addrs), str(timeout), transport],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.rank = rank

    def next_event(self, timeout: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        """The next JSON line (bounded by ``timeout``); fails the test on EOF or timeout."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = ""
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.readline()
            if chunk:
                buf += chunk
                if buf.endswith("\n"):
                    return json.loads(buf)
            elif self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                pytest.fail(f"rank {self.rank} exited {self.proc.returncode} without output: {err[-2000:]}")
            else:
                time.sleep(0.02)
        pytest.fail(f"rank {self.rank} gave no event within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@contextmanager
def ring_processes(
    scenario: str,
    world: int,
    *,
    timeout: float,
    start: Callable[[int], bool] = lambda r: True,
    transport: str = "grpc",
) -> Iterator[tuple[list[str], list[Worker]]]:
    """Starts the ranks where ``start(rank)`` is true; waits until they serve (retries port clashes)."""
    workers: list[Worker] = []
    try:
        for _attempt in range(3):
            addrs = free_addresses(world)
            workers = [Worker(scenario, r, addrs, timeout, transport) for r in range(world) if start(r)]
            events = [w.next_event() for w in workers]
            if all(e["event"] == "ready" for e in events):
                yield addrs, workers
                return
            for w in workers:
                w.stop()
        pytest.fail("could not bind ring addresses in 3 attempts")
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_every_op_dtype_and_awkward_size_equals_numpy_with_three_processes(transport: str) -> None:
    with ring_processes("matrix", 3, timeout=30.0, transport=transport) as (_, workers):
        results = [w.next_event(timeout=120.0) for w in workers]
    for r, res in enumerate(results):
        assert res["event"] == "done" and "error" not in res, f"rank {r}: {res}"
        assert res["failures"] == [], f"rank {r}: {res['failures']}"


def test_world_size_one() -> None:
    (addr,) = free_addresses(1)
    with Ring([addr], 0, timeout=5.0) as ring:
        x = np.arange(7, dtype=np.int32)
        for op in ("sum", "mean", "min", "max"):
            np.testing.assert_array_equal(ring.allreduce(x, op), x)
        np.testing.assert_array_equal(ring.broadcast(x), x)
        np.testing.assert_array_equal(ring.allgather(x), x)
        (many,) = ring.allreduce_many([x])
        np.testing.assert_array_equal(many, x)
        ring.barrier()
    with pytest.raises(UnavailableError, match="closed"):
        ring.allreduce(x)


def test_sync_rings_in_threads_of_one_process() -> None:
    """Each Ring runs its own event-loop thread, so two ranks can even share a process."""
    addrs = free_addresses(2)
    results: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with Ring(addrs, rank, timeout=10.0) as ring:
                results[rank] = [
                    ring.allreduce(np.full((2, 3), rank + 1.0), op="mean"),
                    ring.allgather(np.array([rank])),
                    ring.broadcast(np.array([rank * 7]), root=1),
                ]
                ring.barrier()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and sorted(results) == [0, 1], errors
    for mean, gathered, bcast in results.values():
        np.testing.assert_array_equal(mean, np.full((2, 3), 1.5))
        np.testing.assert_array_equal(gathered, [0, 1])
        np.testing.assert_array_equal(bcast, [7])


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_killed_peer_gives_typed_error_naming_a_rank_not_a_hang(transport: str) -> None:
    timeout = 3.0
    with ring_processes("until_error", 3, timeout=timeout, transport=transport) as (addrs, workers):
        for w in workers:
            assert w.next_event()["event"] == "progress"
        os.kill(workers[1].proc.pid, signal.SIGKILL)
        survivors = [workers[0], workers[2]]
        results = [w.next_event(timeout=timeout + 30.0) for w in survivors]
    for w, res in zip(survivors, results, strict=True):
        assert res["event"] == "done", res
        assert res["error"] in ("UnavailableError", "DeadlineExceededError"), res
        assert "allreduce #" in res["message"] and "rank " in res["message"], res
        assert any(a in res["message"] for a in addrs), res
        assert f"on rank {w.rank}" in res["message"], res


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_rank_that_never_joins_gives_deadline_error_naming_it(transport: str) -> None:
    with ring_processes("until_error", 3, timeout=2.0, start=lambda r: r != 2, transport=transport) as (
        addrs,
        workers,
    ):
        results = [w.next_event(timeout=40.0) for w in workers]
    for res in results:
        assert res["event"] == "done" and res["error"] in ("DeadlineExceededError", "UnavailableError"), res
        assert "allreduce #0" in res["message"], res
    # Rank 1 sends to rank 2 and names it. Rank 0 receives from rank 2 and names it, unless
    # rank 1 gave up first and closed, which rank 0 then sees and reports.
    assert "rank 2" in results[1]["message"] and addrs[2] in results[1]["message"], results[1]
    assert any(f"rank {p} " in results[0]["message"] and addrs[p] in results[0]["message"] for p in (1, 2))


# --------------------------------------------------------------------------- AsyncRing, one loop


async def test_fp16_compression_of_float32() -> None:
    async with asyncio.timeout(30), async_rings(3, compression="fp16") as rings:
        xs = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) for r in range(3)]
        outs = await asyncio.gather(*(ring.allreduce(x) for ring, x in zip(rings, xs, strict=True)))
        many = await asyncio.gather(
            *(ring.allreduce_many([x, x.astype(np.float64)]) for ring, x in zip(rings, xs, strict=True))
        )
    for out in outs:
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, np.sum(xs, axis=0), rtol=1e-2, atol=1e-2)
    for m in many:
        assert [a.dtype for a in m] == [np.float32, np.float64]
        np.testing.assert_allclose(m[1], np.sum(xs, axis=0, dtype=np.float64), rtol=1e-6)


@pytest.mark.parametrize(
    ("world", "transport"), [(2, "grpc"), (5, "grpc"), (8, "grpc"), (2, "tcp"), (5, "tcp")]
)
async def test_world_sizes_up_to_eight_with_awkward_sizes(world: int, transport: str) -> None:
    rng = np.random.default_rng(world)
    async with asyncio.timeout(60), async_rings(world, chunk_bytes=4096, transport=transport) as rings:
        for size in (0, 1, world - 1, 3 * world + 1, 10_007):
            xs = [rng.integers(-50, 50, size).astype(np.int64) for _ in range(world)]
            for op, ref in (("sum", np.sum), ("min", np.min), ("max", np.max)):
                outs = await asyncio.gather(
                    *(ring.allreduce(x, op) for ring, x in zip(rings, xs, strict=True))
                )
                for out in outs:
                    np.testing.assert_array_equal(out, ref(np.stack(xs), axis=0) if size else xs[0])
            gathered = await asyncio.gather(*(ring.allgather(x) for ring, x in zip(rings, xs, strict=True)))
            bcast = await asyncio.gather(
                *(ring.broadcast(x, root=world - 1) for ring, x in zip(rings, xs, strict=True))
            )
            for g, b in zip(gathered, bcast, strict=True):
                np.testing.assert_array_equal(g, np.concatenate(xs))
                np.testing.assert_array_equal(b, xs[-1])
        await asyncio.gather(*(ring.barrier() for ring in rings))


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_small_chunks_pipeline_many_frames(transport: str) -> None:
    # ~800 chunks a rank, four ranks on one event loop: the rings' default 5 s deadline was once too short
    # on a loaded machine (a CI run's rank 2 timed out "waiting for rank 3 to accept the stream").
    async with (
        asyncio.timeout(30),
        async_rings(4, timeout=20.0, chunk_bytes=1024, transport=transport) as rings,
    ):
        xs = [np.arange(100_001, dtype=np.float64) * (r + 1) for r in range(4)]
        outs = await asyncio.gather(*(ring.allreduce(x, "max") for ring, x in zip(rings, xs, strict=True)))
    for out in outs:
        np.testing.assert_array_equal(out, xs[3])


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_mismatched_shapes_fail_with_invalid_argument_then_the_ring_recovers(transport: str) -> None:
    async with asyncio.timeout(30), async_rings(3, timeout=3.0, transport=transport) as rings:
        results = await asyncio.gather(
            *(ring.allreduce(np.ones(10 + (r == 1), np.float32)) for r, ring in enumerate(rings)),
            return_exceptions=True,
        )
        assert all(isinstance(e, PSError) for e in results), results
        assert any(isinstance(e, InvalidArgumentError) and "total=" in str(e) for e in results), results
        # The ring recovers: the next operation starts on fresh streams and succeeds.
        outs = await asyncio.gather(
            *(ring.allreduce(np.full(5, r, np.int64)) for r, ring in enumerate(rings))
        )
    for out in outs:
        np.testing.assert_array_equal(out, np.full(5, 3))


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_stuck_peer_gives_deadline_exceeded_naming_it(transport: str) -> None:
    async with asyncio.timeout(30), async_rings(3, transport=transport) as rings:
        results = await asyncio.gather(
            *(ring.allreduce(np.ones(4, np.float32), timeout=1.0) for ring in rings[:2]),
            return_exceptions=True,
        )
    assert all(isinstance(e, DeadlineExceededError) for e in results), results
    assert "rank 2" in str(results[0]) and "allreduce #0" in str(results[0])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ring: ring.allreduce(np.ones(3, np.bool_)), "dtype"),
        (lambda ring: ring.allreduce(np.ones(3), op="prod"), "reduce op"),
        (lambda ring: ring.allreduce(np.ones(3), out=np.ones(4)), "out"),
        (lambda ring: ring.broadcast(np.ones(3), root=5), "root"),
        (lambda ring: ring.allgather(np.array(["a"])), "dtype"),
    ],
)
async def test_bad_arguments_are_invalid_argument(call: Callable[[AsyncRing], Any], match: str) -> None:
    async with asyncio.timeout(30), async_rings(1) as (ring,):
        with pytest.raises(InvalidArgumentError, match=match):
            await call(ring)
