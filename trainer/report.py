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
    print(
        f"test accuracy {result['test_accuracy']:.4f} after {result['epochs']} epochs "
        f"({result['mode']} mode): {result['steps_per_second']:.1f} steps/s",
        flush=True,
    )
    if path:
        write_json(path, result)
        print(f"results written to {path}", flush=True)
