"""What ``pstrain`` reports at the end of a run: the result line and the ``--result-json`` file."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Writes ``payload`` to ``path`` atomically (nothing when ``path`` is empty)."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)


def print_result(result: dict[str, Any], path: str | None) -> None:
    """Prints the result line (wide_deep: with the test AUC, then payload, RSS and table lines)."""
    auc = ""
    if "test_auc" in result:  # wide_deep
        auc = f", test AUC {result['test_auc']:.4f} (the ground truth's: {result['best_auc']:.4f})"
    print(
        f"test accuracy {result['test_accuracy']:.4f}{auc} after {result['epochs']} epochs "
        f"({result['mode']} mode): {result['steps_per_second']:.1f} steps/s",
        flush=True,
    )
    if "bytes_per_step" in result:
        print(
            f"payload {result['bytes_per_step'] / 1024:.1f} KiB per worker-step; worker peak RSS "
            f"{', '.join(f'{r:.0f}' for r in result['worker_peak_rss_mib'])} MiB; shard RSS "
            f"{', '.join(f'{r:.0f}' for r in result['shard_rss_mib'])} MiB",
            flush=True,
        )
        for name, t in result["tables"].items():
            print(
                f"table {name}: rows per shard {t['rows_per_shard']}, {t['admitted']} admitted, "
                f"{t['evicted']} evicted, {t['dropped_updates']} updates dropped",
                flush=True,
            )
    if path:
        write_json(path, result)
        print(f"results written to {path}", flush=True)
