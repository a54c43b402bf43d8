"""Integration: concurrent workers lose no update, and a pull never sees a half-applied tensor."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import psclient
from trainer.cluster import LocalCluster

WORKERS = 4
PUSHES = 200

# One worker process: discovers the variables by name and pushes ones PUSHES times.
_WORKER = """
import json, sys
import numpy as np
import psclient
addresses, names, worker, pushes = json.loads(sys.argv[1])
with psclient.PSClient(addresses, worker_id=worker, timeout=30) as c:
    ones = {n: np.ones(3, np.float32) for n in names}
    for _ in range(pushes):
        assert c.push(ones) is True
"""


@pytest.mark.timeout(120)
def test_ps_no_lost_updates_from_concurrent_worker_processes(cluster: LocalCluster, var_name: str) -> None:
    names = [f"{var_name}/a", f"{var_name}/b"]
    with psclient.PSClient(cluster.addresses) as c:
        c.create_many({n: np.zeros(3, np.float32) for n in names}, optimizer=psclient.SGD(learning_rate=1.0))
        assert {c._async.registry.pieces[n][0].shard for n in names} == {0, 1}  # both shards take part
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, json.dumps([cluster.addresses, names, f"w{i}", PUSHES])],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for i in range(WORKERS)
        ]
        try:
            outputs = [p.communicate(timeout=100)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, out in zip(procs, outputs, strict=True):
            assert p.returncode == 0, out
        values, versions = c.pull_with_versions(names)
    for n in names:
        np.testing.assert_array_equal(values[n], np.full(3, -WORKERS * PUSHES, np.float32))
        assert versions[n] == WORKERS * PUSHES


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mib", "partition_bytes"),
    [(2, 0), (6, 0), (2, None), (6, None)],
    ids=["unary-pull", "streamed-pull", "cut-unary-pull", "cut-streamed-pull"],
)
def test_ps_concurrent_pull_never_sees_a_half_applied_tensor(
    cluster: LocalCluster, var_name: str, mib: int, partition_bytes: int | None
) -> None:
    """A pull reads each stored tensor at one version: a variable kept whole never mixes two versions, and
    one cut over the shards (the default ``partition_bytes`` cuts both sizes) never mixes them inside a piece.

    Both sizes are above the shard's in-thread apply threshold (1 MiB), so the update runs off the event
    loop while pulls are served; 6 MiB pulls are streamed."""
    n = (mib << 20) // 4
    duration_s = 2.0
    placement = {} if partition_bytes is None else {"partition_bytes": partition_bytes}
    with (
        psclient.PSClient(cluster.addresses, worker_id="pusher", **placement) as pusher,
        psclient.PSClient(cluster.addresses, worker_id="puller") as puller,
    ):
        pusher.create(var_name, np.zeros(n, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        puller.pull([var_name])  # the puller learns the placement from the shards
        pieces = puller._async.registry.pieces[var_name]
        assert len(pieces) == (1 if partition_bytes == 0 else 2), pieces  # whole, or one piece a shard
        bounds = [(p.offset, p.offset + p.size) for p in pieces] if len(pieces) > 1 else [(0, n)]
        stop = threading.Event()
        errors: list[BaseException] = []

        def push_loop() -> None:
            ones = {var_name: np.ones(n, np.float32)}
            try:
                while not stop.is_set():
                    pusher.push(ones)
            except BaseException as err:  # reported by the main thread
                errors.append(err)

        thread = threading.Thread(target=push_loop, daemon=True)
        thread.start()
        pulls, seen = 0, set()
        try:
            deadline = time.monotonic() + duration_s
            while time.monotonic() < deadline and not errors:
                values, versions = puller.pull_with_versions([var_name])
                v = values[var_name]
                firsts = []
                for lo, hi in bounds:
                    piece = v[lo:hi]
                    assert (piece == piece[0]).all(), f"pull {pulls} mixes values {np.unique(piece)[:5]}"
                    firsts.append(int(piece[0]))
                # the variable's version is its oldest piece's: the value of the piece that applied fewest
                assert -max(firsts) == versions[var_name], (firsts, versions)
                seen.add(min(firsts))
                pulls += 1
        finally:
            stop.set()
            thread.join(timeout=30)
        assert not errors, errors
        assert not thread.is_alive()
    assert pulls >= 3 and len(seen) >= 2, (pulls, seen)  # the pulls really overlapped updates
