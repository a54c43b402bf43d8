"""``pstrain launch``: runs a user's training script on a local cluster, in any mode, with TF_CONFIG set.

For each of ``--workers`` processes it sets ``TF_CONFIG`` (the ``ps`` shards it
started, the ``worker`` list and this process's task index) and ``PSTRAIN_MODE``
(``local``, ``async``, ``sync``, ``ssp`` or ``allreduce``), runs the command, prefixes
every output line with the worker's index (``[1] ...``), and waits for all of them
within ``--timeout``. A worker that fails stops the others; the exit status is the
first failure's. Imports no TensorFlow.

    pstrain launch --mode sync --workers 2 -- python examples/batchnorm_cnn.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from trainer import options, supervise
from trainer.cluster import LocalCluster, reserve_ports

LAUNCH_MODES = ("local", "async", "sync", "ssp", "allreduce")


def add_launch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds the ``launch`` subcommand to ``pstrain``'s parser."""
    p = sub.add_parser(
        "launch",
        help="run your training script on a local cluster (TF_CONFIG and PSTRAIN_MODE set per worker)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", choices=LAUNCH_MODES, default="async", help="training mode (default async)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2; local: 1)")
    p.add_argument("--shards", type=int, default=2, help="ps shards for the ps modes (default 2)")
    p.add_argument("--staleness", type=int, default=2, help="ssp: the staleness bound (default 2)")
    p.add_argument("--barrier-timeout", type=float, default=120.0, help="sync/ssp barrier timeout, seconds")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")


def _relay(index: int, proc: subprocess.Popen[str], prefix: bool) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(f"[{index}] {line}" if prefix else line)
        sys.stdout.flush()


def launch(
    cmd: Sequence[str],
    *,
    mode: str,
    workers: int = 2,
    shards: int = 2,
    staleness: int = 2,
    barrier_timeout: float = 120.0,
    timeout: float = 1800.0,
) -> int:
    """Runs ``cmd`` as ``workers`` processes in ``mode`` (starting the shards it needs); the exit status.

    Raises:
        ValueError: bad arguments.
    """
    if not cmd:
        raise ValueError("give the command to run after --, e.g. pstrain launch -- python train.py")
    if mode not in LAUNCH_MODES:
        raise ValueError(f"mode must be one of {', '.join(LAUNCH_MODES)}, got {mode!r}")
    workers = 1 if mode == "local" else workers
    if workers < 1 or shards < 1:
        raise ValueError("--workers and --shards must be >= 1")
    with contextlib.ExitStack() as stack:
        cluster: dict[str, list[str]] = {}
        if mode in ("async", "sync", "ssp"):
            args = options.server_args(mode, workers, staleness=staleness, barrier_timeout=barrier_timeout)
            ps = stack.enter_context(LocalCluster(shards, server_args=args))
            cluster["ps"] = list(ps.addresses)
            print(f"launch: {shards} ps shard(s) in {mode} mode at {', '.join(ps.addresses)}", flush=True)
        if mode != "local":
            cluster["worker"] = reserve_ports(workers)  # the ring's addresses in allreduce mode
        procs: list[subprocess.Popen[str]] = []
        relays = []
        try:
            for i in range(workers):
                env = {**os.environ, "PSTRAIN_MODE": mode, "PYTHONUNBUFFERED": "1"}
                env.pop("TF_CONFIG", None)
                if cluster:
                    env["TF_CONFIG"] = json.dumps(
                        {"cluster": cluster, "task": {"type": "worker", "index": i}}
                    )
                proc = subprocess.Popen(
                    list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
                )
                procs.append(proc)
                t = threading.Thread(target=_relay, args=(i, proc, workers > 1), daemon=True)
                t.start()
                relays.append(t)
            return supervise.wait_all(procs, timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for t in relays:
                t.join(timeout=5)
