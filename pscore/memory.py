"""glibc malloc tuning for processes that move big tensors: large buffers are reused, not faulted in anew.

Shards and workers allocate the same large buffers over and over: gRPC's
message buffers, assembled gradients, new values (copy-on-write), pulled
arrays. glibc serves allocations over 32 MiB (and, at first, over 128 KiB)
with a fresh ``mmap``, gives freed heap memory back to the kernel, and the
next buffer then page-faults on every 4 KiB page (2-3 us each on the machine
of bench/results/ps.md), so copying into it runs at ~1-2 GB/s instead of
~5-7 GB/s. ``tune_malloc`` keeps such memory in the heap (no mmap for large
chunks, no trimming of freed memory), so those buffers stay warm. The cost:
freed memory stays with the process for reuse, so its resident size stays
at its peak.

Threads: glibc gives each new thread an arena of its own (up to 8 a core), and
with trimming off each arena keeps its own peak: a buffer a worker thread
freed is not reused by the event loop's thread, nor by the next thread. A
shard (``psserver``) runs its large pushes' computations in a thread pool and a
disk tier's compaction in a thread of its own, so its memory held the peaks of
several arenas at once (``tune_malloc(arenas=1)``: one arena for all threads).

``psserver`` applies it at start (one arena). A worker opts in with
``pscore.memory.tune_malloc()`` (early, once). ``PS_MALLOC_TUNING=0`` in the
environment turns it off everywhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: ~2 GiB of free heap is kept for reuse
TOP_PAD_BYTES = 64 << 20  # grow the heap in steps of 64 MiB


def tune_malloc(
    *,
    mmap_threshold: int | None = None,
    trim_threshold: int = TRIM_THRESHOLD_BYTES,
    arenas: int | None = None,
) -> bool:
    """Applies the settings above to this process's glibc malloc; False where that is not possible.

    Call it once, early (before large allocations). Does nothing unless the C
    library is glibc, or when ``PS_MALLOC_TUNING=0``.

    Args:
        mmap_threshold: None (the default): no mmap for large chunks at all. A size: chunks
            above it still get their own mmap (glibc caps it at 32 MiB). The ring collective
            uses ``32 << 20``: measured faster for its 64 MiB all-reduces than no mmap at all.
        trim_threshold: bytes of free heap kept for reuse instead of given back.
        arenas: the most malloc arenas the process's threads share (None: glibc's default, 8 a core).
            Threads made before the call keep the arenas they have.
    """
    if os.environ.get("PS_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_ok = (
        mallopt(_M_MMAP_MAX, 0) == 1
        if mmap_threshold is None
        else mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    )
    ok = (
        mmap_ok
        and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
        and mallopt(_M_TOP_PAD, TOP_PAD_BYTES) == 1
        and (arenas is None or mallopt(_M_ARENA_MAX, arenas) == 1)
    )
    log.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok
