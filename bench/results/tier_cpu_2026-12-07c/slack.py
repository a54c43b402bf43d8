"""``bench_tier_push.py`` with ``psserver.rows.tiering._SPILL_MIN_ROWS`` (a spill's least rows beyond its
need) set to ``argv[1]``; the rest of argv goes to the bench.

Usage: python slack.py 8192 --variants memory,tiered-log --out runs/slack_8192_1   (under flock)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import bench_tier_push

import psserver.rows.tiering

psserver.rows.tiering._SPILL_MIN_ROWS = int(sys.argv[1])
bench_tier_push.main(sys.argv[2:])
