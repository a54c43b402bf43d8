"""Simulates a tiered piece's rows in memory over ``bench_tier_push.py``'s batches (1M ids, the 112,748 rows
its 40 MiB hold): LRU filling every cold row a push has (today), against filling a cold row only on its
second cold push within W steps, the others updated where they lie (issue 44's unbuilt idea), and LRU at
lower capacities (a larger spill slack lowers the rows held between spills).

Usage: python sim.py   (from the repository root or anywhere; about a minute)
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_tier_push import _batches

ROWS, CAP, STEPS = 1_000_000, 112_748, 800
BATCHES = _batches(ROWS, STEPS)


def run(cap: int, window: int | None) -> tuple[float, float, float]:
    """Cold ids, fills and in-place updates a step. The piece starts as the bench's fill leaves it: the
    last ``cap`` ids in memory."""
    lru = collections.OrderedDict((i, None) for i in range(ROWS - cap, ROWS))
    ghost: dict[int, int] = {}
    miss = fill = inplace = 0
    for s in range(STEPS):
        for i in BATCHES[s].tolist():
            if i in lru:
                lru.move_to_end(i)
                continue
            miss += 1
            seen = ghost.get(i)
            if window is None or (seen is not None and seen >= s - window):
                fill += 1
                lru[i] = None
                ghost.pop(i, None)
                if len(lru) > cap:
                    lru.popitem(last=False)
            else:
                inplace += 1
                ghost[i] = s
    return miss / STEPS, fill / STEPS, inplace / STEPS


if __name__ == "__main__":
    print("policy | cold ids a step | fills a step | updated in place a step")
    print("LRU, fill every cold row (today) |", " | ".join(f"{x:.1f}" for x in run(CAP, None)))
    for w in (50, 200, 800):
        print(f"fill on a 2nd cold push within {w} steps |", " | ".join(f"{x:.1f}" for x in run(CAP, w)))
    for cap in (114_000, 110_000, 108_000):
        print(f"LRU at {cap:,} rows |", " | ".join(f"{x:.1f}" for x in run(cap, None)))
