"""Mirrored (all-reduce) training: one ring rank's ``fit``, and ``pstrain demo --mode allreduce``'s launcher.

No parameter server: every worker holds a replica of the model, trains on its
shard of the data, and averages gradients with the others over the ring
(``psclient.keras.AllReduceOptimizer``). The demo starts the workers as processes
on loopback; rank 0 evaluates its replica (all replicas are equal, which the
workers check at the end) and the launcher prints the test accuracy.

TensorFlow is imported only by ``train_rank`` (inside the worker processes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer import options, report, supervise
from trainer.cluster import reserve_ports

EXIT_BIND_FAILED = 3  # a worker could not bind its ring address: the launcher retries with new ports
_BIND_ATTEMPTS = 3
_WORKER_TIMEOUT_S = 1800.0  # a demo run takes a minute or two; this only bounds a hung worker
_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class RankResult:
    """One rank's outcome (rank 0 also reports the test accuracy of its replica)."""

    worker_index: int
    steps: int
    train_seconds: float
    steps_per_second: float
    final_loss: float
    final_accuracy: float
    in_sync: bool
    test_accuracy: float | None = None
    cpu_seconds_per_step: float = float("nan")  # this process's CPU per timed step (EpochPrinter)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_rank(
    config: Any,
    addresses: list[str],
    rank: int,
    *,
    timeout: float = 120.0,
    compression: str = "none",
    lr_scaling: bool = True,
    evaluate: bool | None = None,
    ring_options: Mapping[str, Any] | None = None,
) -> RankResult:
    """Trains one rank of a mirrored job with Keras ``fit`` on its shard of the data.

    Args:
        config: a ``trainer.train.TrainConfig`` (the same on every rank).
        addresses: every rank's ring ``HOST:PORT``, in rank order.
        rank: this worker's rank.
        timeout: deadline of each ring operation, seconds.
        compression: ``"none"`` or ``"fp16"`` (gradients travel as float16).
        lr_scaling: multiply the learning rate by the number of ranks (the linear scaling rule for
            the ``world``-times larger effective batch, as Horovod recommends).
        evaluate: compute the test accuracy of the trained replica (default: on rank 0).
        ring_options: more ``Ring`` settings (``auth_token``, ``tls_*``: see
            :func:`trainer.options.ring_security_options`).

    Raises:
        psclient.PSError: the ring failed or timed out, or the replicas diverged.
        UnavailableError: this rank's address cannot be bound.
    """
    import keras

    import psclient.keras as psk
    from trainer.train import build_model, fit_shard, test_accuracy

    split = config.load()
    world = len(addresses)
    options = {"compression": compression, **(ring_options or {})}
    with psk.AllReduceWorker(addresses, rank, timeout=timeout, **options) as worker:
        learning_rate = config.learning_rate * (world if lr_scaling else 1)
        optimizer = psk.AllReduceOptimizer(keras.optimizers.Adam(learning_rate), worker)
        model = build_model(config, split, optimizer)  # seeded: the callback's broadcast makes sure
        keras.utils.set_random_seed(config.seed + 1000 * (rank + 1))  # dropout: different masks per rank
        printer = fit_shard(
            model,
            config,
            split,
            num_workers=world,
            worker_index=rank,
            callbacks=[worker.callback(check_sync=True)],
        )
        in_sync = worker.weights_in_sync(model)
        accuracy = test_accuracy(model, split) if (evaluate if evaluate is not None else rank == 0) else None
        return RankResult(
            worker_index=rank,
            **printer.summary(),
            in_sync=in_sync,
            test_accuracy=accuracy,
        )


def rank_command(
    args: argparse.Namespace, rank: int, addresses: list[str], result_json: str | os.PathLike[str]
) -> list[str]:
    """The ``pstrain worker --mode allreduce`` command line of ``rank`` in the demo ``args`` describe, on
    the ring ``addresses`` (every rank's ``HOST:PORT``), writing its result to ``result_json``.

    The demo runs it on loopback; ``bench/bench_keras_netns.py`` runs the same command inside a network
    namespace host, each rank on its own host.
    """
    return [sys.executable, "-m", "trainer", "worker", "--mode", "allreduce",
            "--ring", ",".join(addresses), "--worker-index", str(rank),
            "--compression", args.compression, "--ring-transport", args.ring_transport,
            *(["--no-lr-scaling"] if args.no_lr_scaling else []),
            "--result-json", str(result_json), *options.train_flags(args),
            *options.security_argv(args)]  # fmt: skip


def _launch(
    args: argparse.Namespace, workdir: Path, addresses: list[str]
) -> tuple[list[int], list[list[str]]]:
    """Runs one attempt; returns the workers' exit codes (``-1``: stopped, another failed) and tails."""

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    procs: list[subprocess.Popen[str]] = []
    tails: list[list[str]] = []
    threads: list[threading.Thread] = []
    try:
        for rank in range(args.workers):
            cmd = rank_command(args, rank, addresses, workdir / f"worker{rank}.json")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            procs.append(proc)
            tails.append([])
            t = threading.Thread(target=supervise.relay_worker_lines, args=(proc, tails[-1]), daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + _WORKER_TIMEOUT_S
        codes: list[int | None] = [None] * len(procs)
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):  # one failed: the others would wait for it
                supervise.stop(procs)
                codes = [c if c is not None else -1 for c in codes]
                break
            if time.monotonic() > deadline:
                supervise.stop(procs)
                codes = [c if c is not None else -1 for c in codes]
                break
            time.sleep(_POLL_S)
        for t in threads:
            t.join(timeout=5)
        return [int(c) for c in codes if c is not None], tails
    finally:
        supervise.stop(procs)


def run_allreduce_demo(args: argparse.Namespace) -> int:
    """``pstrain demo --mode allreduce``: N worker processes on a loopback ring; returns the exit code.

    Raises:
        ValueError: bad flags.
    """

    if args.workers < 1:
        raise ValueError("--workers must be >= 1")
    options.ring_security_options(args)  # a bad token file fails here, not in every worker
    started = time.perf_counter()
    print(
        f"starting {args.workers} workers on a ring all-reduce (no ps shards); "
        f"{args.model} on {args.data}, {args.epochs} epochs",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="pstrain-allreduce-") as tmp:
        workdir = Path(tmp)
        for attempt in range(1, _BIND_ATTEMPTS + 1):
            addresses = reserve_ports(args.workers)
            codes, tails = _launch(args, workdir, addresses)
            if all(c == 0 for c in codes):
                break
            if EXIT_BIND_FAILED in codes and attempt < _BIND_ATTEMPTS:
                print(f"a ring port was taken before its worker bound it; retrying ({attempt})", flush=True)
                continue
            for i, c in enumerate(codes):
                if c not in (0, -1):
                    print(f"--- worker {i} failed; last lines ---\n{''.join(tails[i])}", file=sys.stderr)
            return 1
        workers = [json.loads((workdir / f"worker{i}.json").read_text()) for i in range(args.workers)]
    accuracy = workers[0]["test_accuracy"]
    in_sync = all(w["in_sync"] for w in workers)
    report.print_result(
        {
            "mode": "allreduce",
            "test_accuracy": accuracy,
            "epochs": args.epochs,
            "workers": args.workers,
            "shards": 0,
            "compression": args.compression,
            "ring_transport": args.ring_transport,
            "learning_rate": args.learning_rate * (1 if args.no_lr_scaling else args.workers),
            "steps_per_second": sum(w["steps_per_second"] for w in workers),
            "steps": sum(w["steps"] for w in workers),
            "in_sync": in_sync,
            "per_worker": workers,
            "wall_seconds": time.perf_counter() - started,
        },
        args.result_json,
    )
    return 0 if in_sync else 1
