"""One variant of ``bench_tier_push.py``'s measured steps: user and system CPU a step, minor and major
faults a step (``getrusage``), and with ``--profile`` the Python and C calls a step (cProfile; numpy's
operators and indexing are not calls it sees) and the ``--top`` functions by own time.

Usage: python prof.py tiered-log [--profile] [--top 40]   (under flock /tmp/bench.lock)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import bench_tier_push as bench

ap = argparse.ArgumentParser()
ap.add_argument("variant")
ap.add_argument("--steps", type=int, default=800)
ap.add_argument("--profile", action="store_true")
ap.add_argument("--top", type=int, default=40)
cli = ap.parse_args()
args = argparse.Namespace(
    rows=1_000_000,
    dim=32,
    batch=16384,
    steps=cli.steps,
    table_memory="40MiB",
    time_parts=False,
    profile_parts=0,
)
prof = cProfile.Profile() if cli.profile else None
usage: dict[str, Any] = {}


class _Steps:
    """Stands in for the bench's ``contextlib.nullcontext`` around its measured steps."""

    def __init__(self, *_: object) -> None:
        pass

    def __enter__(self) -> None:
        usage["before"] = resource.getrusage(resource.RUSAGE_SELF)
        if prof is not None:
            prof.enable()

    def __exit__(self, *_: object) -> None:
        if prof is not None:
            prof.disable()
        usage["after"] = resource.getrusage(resource.RUSAGE_SELF)


bench.contextlib = type("_Contextlib", (), {"nullcontext": _Steps})  # type: ignore[assignment]
with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    cell = asyncio.run(bench._measure(cli.variant, args, Path(tmp)))
r0, r1, s = usage["before"], usage["after"], cli.steps
user, system = 1e3 * (r1.ru_utime - r0.ru_utime) / s, 1e3 * (r1.ru_stime - r0.ru_stime) / s
minor, major = (r1.ru_minflt - r0.ru_minflt) / s, (r1.ru_majflt - r0.ru_majflt) / s
print(
    f"{cli.variant}: CPU {cell['cpu_ms_per_step']} ms a step; user {user:.3f}, system {system:.3f} ms; "
    f"minor faults {minor:.1f}, major {major:.2f} a step"
)
if prof is not None:
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    calls = sum(v[1] for v in stats.values())
    c_calls = sum(v[1] for k, v in stats.items() if k[0] == "~")
    print(f"calls a step: {calls / s:.0f} (C functions and methods: {c_calls / s:.0f})")
    for (path, line, fn), (_, n, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[: cli.top]:
        print(
            f"{1e6 * own / s:8.1f} own {1e6 * cum / s:8.1f} cum {n / s:7.2f} a step  "
            f"{Path(path).name}:{line}:{fn}"
        )
