"""Runs ``bench_tier_push.py``'s steps in the tree ``TREE`` for ``memory`` and ``tiered-log``, then reads
every id's row from each and compares them (sha256 of the rows): bit-exact or not. ``ROWS`` (200000),
``STEPS`` (300) and ``MEM`` (8MiB) from the environment.

Usage: TREE=/tmp/wt_h44proto python exact.py
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = os.environ["TREE"]
sys.path.insert(0, ROOT + "/bench")
sys.path.insert(0, ROOT)
import bench_tier_push as bench  # noqa: E402
import numpy as np  # noqa: E402

from psserver import store as store_module  # noqa: E402
from psserver.rows.piece import DynamicRows  # noqa: E402

ROWS, STEPS = int(os.environ.get("ROWS", "200000")), int(os.environ.get("STEPS", "300"))
ARGS = argparse.Namespace(
    rows=ROWS, dim=32, batch=16384, steps=STEPS, table_memory=os.environ.get("MEM", "8MiB"),
    time_parts=False, profile_parts=0,
)  # fmt: skip
digests: list[str] = []
_proto_stats = DynamicRows.proto_stats
_get = store_module.Store.get


def _digest(self: Any) -> Any:
    """The bench calls ``proto_stats`` after its steps: every id's row read there first."""
    ids = np.arange(ROWS, dtype=np.int64)
    rows = [self.read(self.check_holder, ids[i : i + 50_000]) for i in range(0, ROWS, 50_000)]
    digests.append(hashlib.sha256(np.concatenate(rows).tobytes()).hexdigest()[:16])
    return _proto_stats(self)


def _get_var(self: Any, name: str) -> Any:
    var = _get(self, name)
    if var.dyn is not None:
        var.dyn.check_holder = var
    return var


store_module.Store.get = _get_var  # type: ignore[method-assign]
DynamicRows.proto_stats = _digest  # type: ignore[method-assign]
with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    for variant in ("memory", "tiered-log"):
        cell = asyncio.run(bench._measure(variant, ARGS, Path(tmp)))
        print(variant, cell["cpu_ms_per_step"], "filled", cell["filled"], "spilled", cell["spilled"])
print(digests, "BIT-EXACT" if len(set(digests)) == 1 else "DIFFER")
