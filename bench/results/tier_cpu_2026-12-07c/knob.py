"""``bench_tier_push.py`` with one module constant set: ``knob.py MODULE NAME VALUE``, then the bench's args.

Usage: python knob.py psserver.rows.tiering _VICTIM_QUEUE 32 --variants memory,tiered-log --time-parts --out X
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import bench_tier_push

module, name, value = sys.argv[1:4]
setattr(importlib.import_module(module), name, int(value))
bench_tier_push.main(sys.argv[4:])
