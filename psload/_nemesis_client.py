"""A process of the nemesis test (``psload.nemesis``), run inside a host: a client, the final reader or the
status monitor. It records every call in a ``psload.history.Recorder`` and writes it as JSON lines.

python -m psload._nemesis_client JSON_ARGS

``role`` (in the JSON):

- ``client``: creates the counters (idempotent), writes ``<history>.ready``, waits for the ``go`` file,
  then until the time it holds (``time.monotonic()``, one clock for every namespace) pushes ones to its
  counter (async, ssp: its own; sync: the shared step counter, step by step, a failed step retried) and
  pulls every counter every ``pull_every`` pushes; sync and ssp: leaves at the end (a peer still
  pushing is not held at a barrier).
- ``final``: reads every counter until a read succeeds (bounded by ``end_at``), as process ``FINAL``.
- ``monitor``: reads ``GetStatus`` of every replica every ``interval_s`` until ``end_at``, appending each
  op to the history at once (the nemesis follows the roles from it).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import grpc
import numpy as np

from psload.checker import FINAL
from psload.history import Op, Recorder

log = logging.getLogger("psload.nemesis.client")

_STATUS_TIMEOUT_S = 1.0
_ERROR_PAUSE_S = 0.05  # after a failed call: do not spin on a failing cluster
_CREATE_TIMEOUT_S = 60.0


def _client(args: dict[str, Any]) -> Any:
    import psclient

    return psclient.PSClient(
        [args["addresses"]],
        worker_id=args["name"],
        timeout=args["timeout_s"],
        data_port_min_bytes=args.get("data_port_min_bytes", 1 << 30),
    )


def _read(rec: Recorder, client: Any, counters: list[str], process: str | None = None) -> Op:
    with rec.call("pull") as op:
        if process is not None:
            op.process = process
        values, versions = client.pull_with_versions(counters)
        op.reads = {v: -float(values[v][0]) for v in counters}
        op.versions = {v: int(versions[v]) for v in counters}
    return op


def run_client(args: dict[str, Any]) -> None:
    import psclient

    rec = Recorder(args["name"], args["timeout_s"], errors=(psclient.PSError,))
    counters: list[str] = args["counters"]
    own: str = args["own"]
    sync = args["mode"] == "sync"
    ones = np.ones(1, np.float32)
    with _client(args) as c:
        deadline = time.monotonic() + _CREATE_TIMEOUT_S
        while True:  # before the faults; a slow start of the cluster is retried
            try:
                c.create_many({v: np.zeros(1, np.float32) for v in counters}, psclient.SGD(learning_rate=1.0))
                break
            except psclient.PSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with open(args["history"] + ".ready", "w"):
            pass
        end_at = _wait_go(args["go"], args["end_at"])
        step = n = 0
        while time.monotonic() < end_at:
            with rec.call("push", writes=[own], step=step) as op:
                op.applied = bool(c.push({own: ones}, step=step))
            n += 1
            if op.ok and args["mode"] != "async":
                step += 1
            elif not op.ok:
                time.sleep(_ERROR_PAUSE_S)
            if n % args["pull_every"] == 0:
                _read(rec, c, counters)
        if sync or args["mode"] == "ssp":
            try:
                c.leave()
            except psclient.PSError as err:
                log.warning("%s: leave failed: %s", args["name"], err)
    rec.dump(args["history"])


def _wait_go(path: str, horizon: float) -> float:
    """Waits for the driver's go file (bounded by ``horizon``); returns the end time it holds."""
    while time.monotonic() < horizon:
        try:
            with open(path) as f:
                return float(f.read())
        except (OSError, ValueError):
            time.sleep(0.02)
    return horizon


def run_final(args: dict[str, Any]) -> None:
    import psclient

    rec = Recorder(FINAL, args["timeout_s"], errors=(psclient.PSError,))
    with _client(args) as c:
        while time.monotonic() < args["end_at"]:
            if _read(rec, c, args["counters"], FINAL).ok:
                break
            time.sleep(0.5)
    rec.dump(args["history"])


def run_monitor(args: dict[str, Any]) -> None:
    from psproto.v1 import ps_pb2, ps_pb2_grpc

    replicas: list[str] = args["addresses"].split("|")
    channels = {a: grpc.insecure_channel(a) for a in replicas}
    stubs = {a: ps_pb2_grpc.ParameterServerStub(ch) for a, ch in channels.items()}
    with open(args["history"], "a") as out:
        while time.monotonic() < args["end_at"]:
            started = time.monotonic()
            for address, stub in stubs.items():
                op = Op("monitor", "status", time.monotonic(), deadline_s=_STATUS_TIMEOUT_S, address=address)
                try:
                    status = stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=_STATUS_TIMEOUT_S)
                    op.outcome, op.role, op.lease_s = "ok", status.role or "primary", status.lease_s
                    op.peer = status.peer
                except grpc.RpcError as err:
                    op.outcome, op.error_type, op.error = "error", str(err.code()), str(err.details())[:300]
                op.complete = time.monotonic()
                out.write(json.dumps(op.to_json()) + "\n")
                out.flush()
            time.sleep(max(0.0, args["interval_s"] - (time.monotonic() - started)))
    for ch in channels.values():
        ch.close()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = json.loads(argv[0])
    {"client": run_client, "final": run_final, "monitor": run_monitor}[args["role"]](args)


if __name__ == "__main__":
    main(sys.argv[1:])
