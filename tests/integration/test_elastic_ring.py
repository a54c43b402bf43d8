"""ElasticRing on real rings (a thread per rank, loopback): join, mismatched collectives, generations."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _support import free_addresses

from psclient.collective import Ring
from psclient.elastic import ElasticRing, HorovodInternalError, broadcast_object
from pscore.errors import FailedPreconditionError, InvalidArgumentError

_RUN_S = 60.0


def _ranks(world: int, body: Callable[[int, ElasticRing], Any], **ring_kw: Any) -> list[Any]:
    """Runs ``body(rank, ring)`` on ``world`` ranks in threads; returns each result or raised exception."""
    addrs = free_addresses(world)
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        ring = ElasticRing(Ring(addrs, rank, timeout=20.0), **ring_kw)
        try:
            out[rank] = body(rank, ring)
        except Exception as err:
            out[rank] = err
        finally:
            ring.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=_RUN_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_join_lets_ranks_with_more_data_go_on_with_zeros_from_the_joined_ranks() -> None:
    steps = {0: 4, 1: 1, 2: 2}

    def body(rank: int, ring: ElasticRing) -> tuple[list[Any], int]:
        seen = []
        for _ in range(steps[rank]):
            mean, count = ring.allreduce_many([np.full(2, 6.0, np.float32), np.array([1], np.int64)], "sum")
            seen.append(
                (mean.tolist(), int(count[0]), float(ring.allreduce(np.array([-1.0 - rank]), "max")[0]))
            )
            ring.barrier()
        return seen, ring.join()

    results = _ranks(3, body)
    assert not any(isinstance(r, Exception) for r in results), results
    seen0 = results[0][0]
    # step 1: all three; step 2: ranks 0 and 2; steps 3-4: rank 0 alone (the others add zeros; max skips them)
    assert seen0 == [
        ([18.0, 18.0], 3, -1.0),
        ([12.0, 12.0], 2, -1.0),
        ([6.0, 6.0], 1, -1.0),
        ([6.0, 6.0], 1, -1.0),
    ]
    assert [r[1] for r in results] == [0, 0, 0]  # rank 0 joined last, and every rank is told so
    assert results[1][0] == seen0[:1] and results[2][0] == seen0[:2]


def test_average_with_joined_ranks_divides_by_every_rank_as_horovod() -> None:
    def body(rank: int, ring: ElasticRing) -> Any:
        if rank == 1:
            return ring.join()
        mean = ring.allreduce(np.array([4.0]), "mean")
        ring.join()
        return mean.tolist()

    assert _ranks(2, body)[0] == [2.0]


def test_broadcast_while_a_rank_has_joined_fails_for_the_caller_only() -> None:
    def body(rank: int, ring: ElasticRing) -> Any:
        if rank == 1:
            return ring.join()
        with pytest.raises(FailedPreconditionError, match=r"broadcast while rank\(s\) \[1\] have joined"):
            ring.broadcast(np.zeros(2), root=0)
        total = ring.allreduce(np.array([1.0]), "sum")  # the joined rank still serves all-reduces
        return total.tolist(), ring.join()

    assert _ranks(2, body) == [([1.0], 0), 0]


def test_ranks_calling_different_collectives_get_a_clear_error_and_the_ring_goes_on() -> None:
    def body(rank: int, ring: ElasticRing) -> Any:
        with pytest.raises(InvalidArgumentError, match="called different collectives"):
            ring.allreduce(np.zeros(3 + rank), "sum")  # different shapes
        with pytest.raises(InvalidArgumentError, match="called different collectives"):
            ring.barrier() if rank == 0 else ring.allgather(np.zeros(1))
        return broadcast_object(ring, {"from": rank}, 1)

    assert _ranks(2, body) == [{"from": 1}, {"from": 1}]


def test_interrupt_fails_a_waiting_collective_at_once_and_replace_goes_on_with_a_new_ring() -> None:
    addrs = free_addresses(2)
    ring = ElasticRing(Ring(addrs, 0, timeout=30.0), generation=1, elastic=True)
    try:
        threading.Timer(0.5, ring.interrupt, (1, "rank 1 (worker 1) exited with status -9", [1])).start()
        t0 = time.monotonic()
        with pytest.raises(HorovodInternalError, match="status -9") as info:
            ring.allreduce(np.ones(2), "sum")  # rank 1 never comes: only the interrupt ends this
        assert time.monotonic() - t0 < 20  # not the ring's 30 s deadline
        assert info.value.generation == 1 and info.value.lost_ranks == (1,)
        assert ring.broken
        with pytest.raises(HorovodInternalError):
            ring.allreduce(np.ones(2), "sum")  # the generation stays broken
        ring.interrupt(0, "an old generation")  # ignored
        ring.replace(Ring(free_addresses(1), 0, timeout=10.0), generation=2)
        assert not ring.broken and (ring.generation, ring.world, ring.rank) == (2, 1, 0)
        assert ring.allreduce(np.ones(2), "sum").tolist() == [1.0, 1.0]
    finally:
        ring.close()


def test_a_ring_error_in_elastic_mode_breaks_the_generation_and_names_the_peer() -> None:
    reports: list[tuple[int, str]] = []

    def body(rank: int, ring: ElasticRing) -> Any:
        ring.allreduce(np.ones(1), "sum")
        if rank == 1:
            return None  # leaves: its ring closes
        time.sleep(0.5)
        ring.allreduce(np.ones(1), "sum", timeout=5.0)

    results = _ranks(2, body, generation=3, elastic=True, on_break=lambda g, why: reports.append((g, why)))
    error = results[0]
    assert isinstance(error, HorovodInternalError), error
    assert error.generation == 3 and error.lost_ranks == (1,), error
    assert reports and reports[0][0] == 3


def test_without_the_control_round_collectives_pass_through_and_join_is_a_barrier() -> None:
    def body(rank: int, ring: ElasticRing) -> Any:
        total = ring.allreduce(np.array([rank + 1.0]), "sum").tolist()
        return total, ring.join()

    results = _ranks(2, body, negotiate=False)
    assert [r[0] for r in results] == [[3.0], [3.0]]
    assert results[0][1] == results[1][1] in (0, 1)  # every rank names the same last rank
