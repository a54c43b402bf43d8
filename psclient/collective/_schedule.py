"""Ring schedule math: segments, chunks, and which segment a rank sends and receives at each step.

A flat buffer of ``total`` elements is cut into ``world`` contiguous segments
(sizes differ by at most one element), and every segment into the same number
of chunks so that each step of the ring moves exactly ``chunks`` frames per
link. At step ``t`` rank ``r`` sends segment ``(r - t) % world`` and receives
segment ``(r - t - 1) % world``; what a rank receives at step ``t`` is what it
sends at step ``t + 1``, so every received chunk is forwarded at once
(pipelining: a link never waits for a whole segment).

All-reduce is ``world - 1`` reduce steps (reduce-scatter: afterwards rank ``r``
holds the full result of segment ``(r + 1) % world``) then ``world - 1`` copy
steps (all-gather). All-gather alone is the copy steps with segment ``r`` being
rank ``r``'s contribution.

>>> even_segments(10, 3)
[(0, 4), (4, 7), (7, 10)]
>>> chunk_range((4, 7), 2, 1)
(5, 7)
>>> send_segment(rank=0, step=1, world=3), recv_segment(rank=0, step=1, world=3)
(2, 1)
"""

from __future__ import annotations

from collections.abc import Sequence


def even_segments(total: int, world: int) -> list[tuple[int, int]]:
    """Splits ``[0, total)`` into ``world`` contiguous ranges, the first ``total % world`` one longer."""
    if world < 1 or total < 0:
        raise ValueError(f"bad split of {total} elements into {world} segments")
    base, extra = divmod(total, world)
    out: list[tuple[int, int]] = []
    start = 0
    for j in range(world):
        stop = start + base + (1 if j < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def segments_from_sizes(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ranges of the given sizes, in order (all-gather of unequal contributions)."""
    out: list[tuple[int, int]] = []
    start = 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def num_chunks(segments: Sequence[tuple[int, int]], itemsize: int, chunk_bytes: int) -> int:
    """Chunks per segment so that no chunk exceeds ``chunk_bytes`` (at least one, even when empty)."""
    longest = max((b - a for a, b in segments), default=0) * itemsize
    return max(1, -(-longest // max(1, chunk_bytes)))


def chunk_range(segment: tuple[int, int], chunks: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``chunks`` near-equal contiguous pieces of ``segment`` (may be empty)."""
    a, b = segment
    n = b - a
    return a + n * index // chunks, a + n * (index + 1) // chunks


def send_segment(rank: int, step: int, world: int) -> int:
    """The segment rank ``rank`` sends to ``rank + 1`` at ring step ``step``."""
    return (rank - step) % world


def recv_segment(rank: int, step: int, world: int) -> int:
    """The segment rank ``rank`` receives from ``rank - 1`` at ring step ``step``."""
    return (rank - step - 1) % world
