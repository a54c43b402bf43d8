"""Ring schedule math: segments, chunks, and a pure-numpy simulation of the pipelined ring."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from psclient.collective._schedule import (
    chunk_range,
    even_segments,
    num_chunks,
    recv_segment,
    segments_from_sizes,
    send_segment,
)


@given(total=st.integers(0, 10_000), world=st.integers(1, 8))
def test_even_segments_cover_in_order_and_differ_by_at_most_one(total: int, world: int) -> None:
    segs = even_segments(total, world)
    assert len(segs) == world
    assert segs[0][0] == 0 and segs[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segs))
    sizes = [b - a for a, b in segs]
    assert max(sizes) - min(sizes) <= 1


@given(a=st.integers(0, 1000), n=st.integers(0, 1000), chunks=st.integers(1, 50))
def test_chunks_partition_a_segment(a: int, n: int, chunks: int) -> None:
    ranges = [chunk_range((a, a + n), chunks, c) for c in range(chunks)]
    assert ranges[0][0] == a and ranges[-1][1] == a + n
    assert all(x[1] == y[0] for x, y in itertools.pairwise(ranges))


@pytest.mark.parametrize(
    ("sizes", "itemsize", "chunk_bytes", "expected"),
    [([0, 0], 4, 1024, 1), ([256, 255], 4, 1024, 1), ([257, 0], 4, 1024, 2), ([10**6], 8, 1 << 20, 8)],
)
def test_num_chunks_bounds_the_payload(
    sizes: list[int], itemsize: int, chunk_bytes: int, expected: int
) -> None:
    segs = segments_from_sizes(sizes)
    k = num_chunks(segs, itemsize, chunk_bytes)
    assert k == expected
    for seg in segs:
        assert all((b - a) * itemsize <= chunk_bytes for a, b in (chunk_range(seg, k, c) for c in range(k)))


@pytest.mark.parametrize("world", range(1, 9))
def test_what_a_rank_receives_is_what_its_predecessor_sends(world: int) -> None:
    for rank in range(world):
        prev = (rank - 1) % world
        for step in range(2 * world):
            assert recv_segment(rank, step, world) == send_segment(prev, step, world)
            # Received at step t is sent at step t + 1 (pipelining: forward at once).
            assert send_segment(rank, step + 1, world) == recv_segment(rank, step, world)


def _simulate_allreduce(inputs: list[np.ndarray], chunks: int, ufunc: np.ufunc) -> list[np.ndarray]:
    """Runs the ring schedule synchronously, step by step, chunk by chunk."""
    n = len(inputs)
    bufs = [x.copy() for x in inputs]
    segs = even_segments(inputs[0].size, n)
    for step in range(2 * (n - 1)):
        sent = [
            [
                bufs[r][slice(*chunk_range(segs[send_segment(r, step, n)], chunks, c))].copy()
                for c in range(chunks)
            ]
            for r in range(n)
        ]
        for r in range(n):
            for c in range(chunks):
                dst = bufs[r][slice(*chunk_range(segs[recv_segment(r, step, n)], chunks, c))]
                src = sent[(r - 1) % n][c]
                if step < n - 1:
                    ufunc(dst, src, out=dst)
                else:
                    dst[...] = src
    return bufs


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("size", [0, 1, 7, 1001])
@pytest.mark.parametrize("chunks", [1, 3])
def test_simulated_ring_equals_numpy(world: int, size: int, chunks: int) -> None:
    rng = np.random.default_rng(world * 1000 + size)
    inputs = [rng.integers(-100, 100, size).astype(np.int64) for _ in range(world)]
    for ufunc, ref in ((np.add, np.sum), (np.maximum, np.max), (np.minimum, np.min)):
        expected = ref(np.stack(inputs), axis=0) if size else np.zeros(0, np.int64)
        for out in _simulate_allreduce(inputs, chunks, ufunc):
            np.testing.assert_array_equal(out, expected)
