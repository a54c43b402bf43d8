"""A client that pushes in a loop against a replicated shard and records every call; run inside a host.

python _partition_client.py ADDRESSES SECONDS TIMEOUT DATA_PORT_MIN_BYTES RESULT_JSON

Creates ``v`` (SGD, learning rate 1: after k applied pushes of ones, ``v == -k``), then pushes ones for
SECONDS, one call at a time. Prints ``started`` once the variable exists, then writes RESULT_JSON: every
call's start and end (``time.monotonic()``: the same clock in every namespace of the machine), its outcome
(``"ok"`` or the error's type and message), and the value the client read last. (A file, not stdout: the
record runs to megabytes, and an unbuffered write to a full pipe can return short, which Python's text
layer does not retry.)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import psclient


def main(addresses: str, seconds: float, timeout: float, data_port_min_bytes: int, result: Path) -> None:
    calls: list[dict[str, object]] = []
    with psclient.PSClient(
        [addresses], worker_id="partition-client", timeout=timeout, data_port_min_bytes=data_port_min_bytes
    ) as c:
        c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        print("started", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                c.push({"v": np.ones(4, np.float32)})
                outcome = "ok"
            except psclient.PSError as err:
                outcome = f"{type(err).__name__}: {err}"
            calls.append({"start": t0, "end": time.monotonic(), "outcome": outcome})
        value = float(c.pull(["v"])["v"][0])
    result.write_text(json.dumps({"calls": calls, "value": value}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
