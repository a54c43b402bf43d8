"""``pscore.memory.tune_malloc(arenas=...)``: threads that each free a large buffer while the others live
keep one peak between them in one arena, one each in glibc's default arenas (a shard's update threads and
its disk tier's compaction thread, whose freed buffers the shard's memory held several times over)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_CHILD = r"""
import sys, threading
import numpy as np
from pscore.memory import tune_malloc

arenas = None if sys.argv[1] == "default" else int(sys.argv[1])
assert tune_malloc(arenas=arenas)


def rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


done = threading.Event()
start = rss_anon_kib()
for _ in range(4):  # each thread lives on (its arena with it) while the next one allocates
    freed = threading.Event()

    def work() -> None:
        buf = np.ones(16 << 20, np.uint8)  # touched: resident
        del buf  # back to its arena, which keeps it (no trimming)
        freed.set()
        done.wait(60)

    threading.Thread(target=work, daemon=True).start()
    assert freed.wait(60)
print((rss_anon_kib() - start) >> 10)
done.set()
"""


def _grown_mib(arenas: str) -> int:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PS_MALLOC_TUNING": "1"}
    env.pop("MALLOC_ARENA_MAX", None)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, arenas],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc, /proc")
def test_one_arena_keeps_one_peak_for_all_threads() -> None:
    one = _grown_mib("1")
    default = _grown_mib("default")
    assert default >= 3 * 16, (
        f"glibc's default arenas kept {default} MiB: one 16 MiB peak per thread expected"
    )
    assert one <= 2 * 16, f"one arena kept {one} MiB for four threads' 16 MiB buffers freed in turn"
