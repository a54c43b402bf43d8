"""``pstrain demo``: a whole job on this machine: ps shards and workers as processes, then evaluation.

(``--mode allreduce`` has no shards: ``trainer.allreduce_loop`` runs it.)

The workers' progress lines are relayed as they come; once every worker has
finished, this process loads the shards' final values into the model and
prints its test accuracy and the training throughput (the sum of the workers'
steps per second).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer import options, report, supervise
from trainer.cluster import LocalCluster, backups_of

_WORKER_TIMEOUT_S = 1800.0  # a demo run takes a minute or two; this only bounds a hung worker


@contextlib.contextmanager
def native_stderr_held() -> Iterator[None]:
    """Holds back what native code writes to fd 2 in the block; replays it only if the block fails.

    TensorFlow's C++ runtime logs start-up lines (and, on machines without a GPU, a
    "failed call to cuInit" error) straight to fd 2, which TF_CPP_MIN_LOG_LEVEL does not
    silence; in the demo's own process they are noise between the progress lines.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
                sys.stderr.flush()


def _server_args(args: argparse.Namespace) -> list[str]:
    return options.server_args(
        args.mode,
        args.workers,
        replicas_to_aggregate=args.replicas_to_aggregate,
        staleness=args.staleness,
        barrier_timeout=args.barrier_timeout,
    )


def worker_command(
    args: argparse.Namespace,
    index: int,
    addresses: list[str],
    result_json: str | os.PathLike[str],
    evaluate_json: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The ``pstrain worker`` command line of parameter-server worker ``index`` of the demo ``args``
    describe, training against the shards at ``addresses`` and writing its result to ``result_json``
    (with ``evaluate_json``, it then scores the shards' model when told: ``--evaluate-json``).

    The demo runs it on loopback; ``bench/bench_keras_netns.py`` runs the same command inside a network
    namespace host, against shards on other hosts.
    """
    cmd = [sys.executable, "-m", "trainer", "worker", "--ps", ",".join(addresses),
           "--worker-index", str(index), "--num-workers", str(args.workers), "--mode", args.mode,
           "--result-json", str(result_json), *options.train_flags(args)]  # fmt: skip
    if evaluate_json is not None:
        cmd += ["--evaluate-json", str(evaluate_json)]
    if args.overlap != "auto":
        cmd += ["--overlap", args.overlap]
    if args.partition_bytes is not None:
        cmd += ["--partition-bytes", str(args.partition_bytes)]
    if args.sync_parts != 1:
        cmd += ["--sync-parts", str(args.sync_parts)]
    return cmd


def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo; returns the exit code.

    Raises:
        ValueError: bad flags.
    """
    if args.workers < 1 or args.shards < 1 or args.epochs < 1:
        raise ValueError("--workers, --shards and --epochs must be >= 1")
    if args.backups and args.mode not in ("async", "sync", "ssp"):
        raise ValueError(f"--backups needs shards: --mode async, sync or ssp (not {args.mode})")
    if args.kill_primary is not None and not args.backups:
        raise ValueError("--kill-primary needs --backups (without a backup the shard's state is gone)")
    started = time.perf_counter()
    if args.mode == "local":
        with native_stderr_held():
            from trainer.train import train_local  # imports TensorFlow

            local, accuracy = train_local(options.train_config(args))
        report.print_result(
            {
                "mode": "local",
                "test_accuracy": accuracy,
                "epochs": args.epochs,
                "workers": 1,
                "steps_per_second": local.steps_per_second,
                "steps": local.steps,
                "wall_seconds": time.perf_counter() - started,
                **local.extra,  # wide_deep: test_auc, best_auc, peak_rss_mib, ...
            },
            args.result_json,
        )
        return 0
    if args.mode == "allreduce":  # no ps shards: the workers average gradients over a ring
        from trainer.allreduce_loop import run_allreduce_demo

        return int(run_allreduce_demo(args))
    print(
        f"starting {args.shards} ps shards ({args.mode} mode) and {args.workers} workers; "
        f"{args.model} on {args.data}, {args.epochs} epochs",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(LocalCluster(args.shards, server_args=_server_args(args)))
        addresses = list(cluster.addresses)
        if args.backups:
            backups = stack.enter_context(backups_of(cluster, _server_args(args)))
            print(f"backups following: {', '.join(backups.addresses)}", flush=True)
            addresses = [f"{p}|{b}" for p, b in zip(cluster.addresses, backups.addresses, strict=True)]
        workdir = Path(cluster.workdir)
        procs: list[subprocess.Popen[str]] = []
        tails: list[list[str]] = []
        threads = []
        drill = None
        fired = threading.Event()  # the drill's kill was made (the process is restarted since)
        if args.kill_primary is not None:
            drill = threading.Timer(
                args.kill_primary, _kill_primary, args=(cluster, backups.addresses[0], fired)
            )
            stack.callback(drill.cancel)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        env.pop("TF_CONFIG", None)
        try:
            scores = workdir / "evaluation.json"  # worker 0 scores the shards' model once all are done
            for i in range(args.workers):
                cmd = worker_command(
                    args, i, addresses, workdir / f"worker{i}.json", scores if i == 0 else None
                )
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
                )
                procs.append(proc)
                tails.append([])
                t = threading.Thread(target=supervise.relay_worker_lines, args=(proc, tails[-1]), daemon=True)
                t.start()
                threads.append(t)
            if drill is not None:
                drill.start()
            failed = _wait_for_workers(procs, threads, workdir / "worker0.json", scores)
            if failed:
                for i in failed:
                    print(f"--- worker {i} failed; last lines ---\n{''.join(tails[i])}", file=sys.stderr)
                return 1
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        workers = [json.loads((workdir / f"worker{i}.json").read_text()) for i in range(args.workers)]
        extra: dict[str, Any] = json.loads(scores.read_text())  # worker 0's scores of the shards' model
        accuracy = extra.pop("test_accuracy")
        if args.model == "wide_deep":
            extra.update(
                bytes_per_step=sum(w["bytes_per_step"] for w in workers) / len(workers),
                worker_peak_rss_mib=[w["peak_rss_mib"] for w in workers],
                shard_rss_mib=cluster.shard_rss_mib(),
                shard_peak_rss_mib=cluster.shard_rss_mib("VmHWM"),
            )
        killed = fired.is_set()
    report.print_result(
        {
            "mode": args.mode,
            "test_accuracy": accuracy,
            "epochs": args.epochs,
            "workers": args.workers,
            "shards": args.shards,
            "steps_per_second": sum(w["steps_per_second"] for w in workers),
            "steps": sum(w["steps"] for w in workers),
            "stale_steps": sum(w.get("stale_steps", 0) for w in workers),
            "per_worker": workers,
            "wall_seconds": time.perf_counter() - started,
            "backups": bool(args.backups),
            "primary_killed": killed,  # --kill-primary fired while the workers were training
            **extra,
        },
        args.result_json,
    )
    return 0


def _wait_for_workers(
    procs: list[subprocess.Popen[str]], relays: list[threading.Thread], trained: Path, scores: Path
) -> list[int]:
    """Waits for the workers to end (``_WORKER_TIMEOUT_S`` at most, then kills them); returns the indices
    of those that failed. The first failure ends the others (a failed worker stalls them in sync and ssp
    modes). Once worker 0 trained (its result file ``trained`` exists) and every other worker ended well, it
    is told to score the shards' model (``scores``'s ``.go`` file: ``--evaluate-json``)."""
    deadline = time.monotonic() + _WORKER_TIMEOUT_S
    running = set(range(len(procs)))
    failed: list[int] = []
    told = False
    while running and time.monotonic() < deadline:
        for i in sorted(running):
            code = procs[i].poll()
            if code is None:
                continue
            running.discard(i)
            relays[i].join(timeout=5)
            if code != 0:
                failed.append(i)
                if len(failed) == 1:
                    for other in procs:
                        if other.poll() is None:
                            other.terminate()
        if not told and not failed and running == {0} and trained.exists():
            Path(f"{scores}.go").touch()
            told = True
        time.sleep(0.05)
    for i in sorted(running):  # hung: the deadline passed
        procs[i].kill()
        procs[i].wait()
        relays[i].join(timeout=5)
        failed.append(i)
    return failed


def _kill_primary(cluster: LocalCluster, backup: str, fired: threading.Event) -> None:
    """kill -9 of shard 0's primary, then its restart as a supervisor would: same port, ``--backup-at`` its
    backup, so that it rejoins as the backup of the one that took over (which serves once it has)."""
    address = cluster.addresses[0]
    print(f"fault drill: kill -9 of shard 0's primary ({address}); restarting it with --backup-at {backup}",
          flush=True)  # fmt: skip
    cluster.kill_shard(0)
    fired.set()
    cluster.shard_args[0] = [*cluster.shard_args.get(0, ()), "--backup-at", backup]
    cluster.start_shard(0, port=int(address.rpartition(":")[2]))
