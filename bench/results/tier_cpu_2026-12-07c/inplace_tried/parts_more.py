"""``bench_tier_push.py --time-parts`` in the tree ``TREE`` with two more parts: the remembered reads'
``_forget`` (a write's) and the log's ``_reserve_index``.

Usage: TREE=/tmp/wt_h44proto PYTHONPATH=$TREE python parts_more.py --variants memory,tiered-log --time-parts
"""

from __future__ import annotations

import os
import sys
from typing import Any

ROOT = os.environ["TREE"]
sys.path.insert(0, ROOT + "/bench")
sys.path.insert(0, ROOT)
import bench_tier_push as bench  # noqa: E402

_timed = bench._timed_methods


def _more() -> list[tuple[str, type, str]]:
    from psserver.logtier import LogTier
    from psserver.tier import ColdTier

    extra: list[tuple[str, Any, str]] = [
        ("tier: _forget", ColdTier, "_forget"),
        ("log: _reserve_index", LogTier, "_reserve_index"),
    ]
    return _timed() + extra


bench._timed_methods = _more
bench.main(sys.argv[1:])
