"""``pstrain``: train the seed articles' models on the parameter server (demo, one worker, or locally)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pscore.errors import PSError
from pscore.tf_config import read_tf_config
from trainer import options, report

_EPILOG = """\
examples:
  pstrain demo                          # 2 ps shards + 2 workers on this machine, async mode, digits
  pstrain demo --mode sync --epochs 10 --result-json result.json
  pstrain worker --ps 10.0.0.1:50051,10.0.0.2:50051 --worker-index 0 --num-workers 2
  pstrain demo --mode allreduce         # 2 workers averaging gradients over a ring, no ps shards
  pstrain worker --mode allreduce --ring 10.0.0.1:7000,10.0.0.2:7000 --worker-index 1 \\
      --auth-token-file token --tls-cert w1.pem --tls-key w1.key --tls-ca ca.pem --tls-client-ca ca.pem
  TF_CONFIG='{"cluster": {"ps": ["ps0:2222"], "worker": ["w0:2222", "w1:2222"]},
              "task": {"type": "worker", "index": 1}}' pstrain worker
  pstrain local --model resnet
  pstrain demo --model wide_deep        # a recommender on dynamic embedding tables, synthetic click log
  pstrain demo --model wide_deep --mode local --result-json local.json   # its full-size-table baseline
"""

_TRANSPORT_HELP = (
    "allreduce: the ring's data plane: tcp (default: raw sockets negotiated over the authenticated gRPC "
    "service, about 2x the bandwidth of grpc; TLS too with the --tls-* flags) or grpc (frames on the "
    "ring's gRPC stream: only the ring port need be reachable)"
)
DEMO_MODES = ("async", "sync", "ssp", "allreduce", "local")
_NO_LR_SCALING_HELP = (
    "allreduce and sync modes: keep --learning-rate as is (by default it is multiplied by the number of "
    "gradients averaged per update, the linear scaling rule for the N-times larger effective batch)"
)


_PARTITION_HELP = (
    "ps modes: a variable of at least this many bytes is cut over the shards, into up to one piece a "
    "shard (default 65536, 64 KiB; TensorFlow's tutorials use 262144). It spreads a model's large kernels "
    "(an MLP's first layer) instead of loading one shard's link with most of every step; 0 never cuts"
)


_SYNC_PARTS_HELP = (
    "sync: push each step to each shard in N parts, so that a shard answers the first part while the rest "
    "still arrive (on slow links the answers' download overlaps the next parts' upload; the model's "
    "variables must be cut small enough to fill the parts: --partition-bytes). Models without embedding "
    "tables (default 1: one push per shard a step)"
)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _partition_bytes(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: never cut), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pstrain",
        description="Train Keras 3 models on the parameter server.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="start a local cluster (ps shards and workers as processes) and train")
    demo.add_argument("--mode", choices=DEMO_MODES, default="async", help="(default: %(default)s)")
    demo.add_argument("--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    demo.add_argument("--shards", type=int, default=2, help="ps shard processes (default: %(default)s)")
    demo.add_argument("--replicas-to-aggregate", type=int, help="sync: N (default: all workers)")
    demo.add_argument("--staleness", type=int, default=2, help="ssp: S (default: %(default)s)")
    demo.add_argument("--barrier-timeout", type=float, default=60.0, help="sync/ssp wait bound, seconds")
    demo.add_argument(
        "--compression", choices=("none", "fp16"), default="none", help="allreduce: gradients on the wire"
    )
    demo.add_argument("--ring-transport", choices=("grpc", "tcp"), default="tcp", help=_TRANSPORT_HELP)
    demo.add_argument("--no-lr-scaling", action="store_true", help=_NO_LR_SCALING_HELP)
    options.add_overlap_flags(demo)
    demo.add_argument("--partition-bytes", type=_partition_bytes, help=_PARTITION_HELP)
    demo.add_argument("--sync-parts", type=_positive_int, default=1, metavar="N", help=_SYNC_PARTS_HELP)
    demo.add_argument(
        "--backups",
        action="store_true",
        help="async/sync/ssp: run a backup process per shard (psserver --backup-of); workers fail over to it",
    )
    demo.add_argument(
        "--kill-primary",
        type=float,
        metavar="SECONDS",
        help="fault drill (needs --backups): kill -9 shard 0's primary this long after the workers start, "
        "then restart it as a supervisor would (it rejoins as the backup of the one that took over)",
    )
    options.add_train_flags(demo)
    options.add_security_flags(demo)

    worker = sub.add_parser("worker", help="run one worker (from TF_CONFIG or flags)")
    worker.add_argument("--ps", help="comma-separated HOST:PORT of the shards (default: TF_CONFIG)")
    worker.add_argument("--worker-index", type=int, help="this worker's index (default: TF_CONFIG)")
    worker.add_argument("--num-workers", type=int, help="number of workers (default: TF_CONFIG)")
    worker.add_argument(
        "--mode",
        choices=("async", "sync", "ssp", "allreduce"),
        default="async",
        help="allreduce: no ps; gradients averaged over a ring of the workers (default: %(default)s)",
    )
    worker.add_argument(
        "--ring",
        help="allreduce: comma-separated HOST:PORT of every worker, in rank order; this worker serves on "
        "its own (default: TF_CONFIG's chief and worker tasks)",
    )
    worker.add_argument("--compression", choices=("none", "fp16"), default="none", help="allreduce")
    worker.add_argument("--ring-transport", choices=("grpc", "tcp"), default="tcp", help=_TRANSPORT_HELP)
    worker.add_argument("--no-lr-scaling", action="store_true", help=_NO_LR_SCALING_HELP)
    options.add_overlap_flags(worker)
    worker.add_argument("--partition-bytes", type=_partition_bytes, help=_PARTITION_HELP)
    worker.add_argument("--sync-parts", type=_positive_int, default=1, metavar="N", help=_SYNC_PARTS_HELP)
    worker.add_argument("--timeout", type=float, default=120.0, help="per-call deadline, seconds")
    # ``pstrain demo``'s worker 0: after training, waits for FILE.go (the demo writes it once every worker
    # is done), scores the shards' model on the test split and writes the scores to FILE, so that the
    # demo's own process needs no TensorFlow
    worker.add_argument("--evaluate-json", metavar="FILE", help=argparse.SUPPRESS)
    options.add_train_flags(worker)
    options.add_security_flags(worker)

    from trainer.launch import add_launch_parser

    add_launch_parser(sub)
    local = sub.add_parser("local", help="the single-process baseline (no parameter server)")
    options.add_train_flags(local)
    return p


def worker_from_tf_config(environ: Mapping[str, str] = os.environ) -> tuple[list[str], int, int]:
    """``(ps addresses, worker rank, number of workers)`` of a ``chief``/``worker`` task in ``TF_CONFIG``.

    Raises:
        ValueError: TF_CONFIG is unset, malformed, or not a worker task.
    """
    cfg = read_tf_config(environ, unset_hint="give --ps, --worker-index and --num-workers instead")
    return cfg.ps, cfg.worker_rank(), len(cfg.workers)


def _quiet_tf() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _import_tf_quietly() -> None:
    """Imports TensorFlow (through ``trainer.train``) with its native start-up lines held back.

    TensorFlow's C++ runtime writes its oneDNN and CUDA banners straight to fd 2 while it
    loads, and "failed call to cuInit" on a machine without a GPU when the devices are first
    listed, which TF_CPP_MIN_LOG_LEVEL does not silence; both happen here, under
    ``native_stderr_held``, so they are shown only if the import itself fails.
    """
    from trainer.demo import native_stderr_held

    with native_stderr_held():
        import tensorflow as tf

        import trainer.train  # noqa: F401  (Keras, the models)

        gpus = tf.config.list_physical_devices("GPU")  # CUDA's probe runs here, not at import
    logging.getLogger("pstrain").info("TensorFlow %s, %d GPU(s)", tf.__version__, len(gpus))


def run_allreduce_worker(args: argparse.Namespace) -> int:
    from psclient.keras import ring_from_tf_config
    from pscore.errors import UnavailableError

    if args.ring:
        if args.worker_index is None:
            raise ValueError("--ring needs --worker-index")
        ring, rank = [a for a in args.ring.split(",") if a], args.worker_index
    else:
        ring, rank = ring_from_tf_config()
        rank = rank if args.worker_index is None else args.worker_index
    if args.num_workers is not None and args.num_workers != len(ring):
        raise ValueError(f"--num-workers {args.num_workers} but the ring has {len(ring)} addresses")
    from trainer.allreduce_loop import EXIT_BIND_FAILED, train_rank

    try:
        result = train_rank(
            options.train_config(args),
            ring,
            rank,
            timeout=args.timeout,
            compression=args.compression,
            lr_scaling=not args.no_lr_scaling,
            ring_options={**options.ring_security_options(args), "transport": args.ring_transport},
        )
    except UnavailableError as err:
        if "cannot bind" not in str(err):
            raise
        print(f"pstrain: error: {err}", file=sys.stderr)
        return EXIT_BIND_FAILED
    accuracy = "" if result.test_accuracy is None else f", test accuracy {result.test_accuracy:.4f}"
    print(
        f"[worker {rank}] done: {result.steps} steps, {result.steps_per_second:.1f} steps/s{accuracy}"
        + ("" if result.in_sync else ", REPLICAS DIVERGED"),
        flush=True,
    )
    report.write_json(args.result_json, {"mode": "allreduce", **result.to_dict()})
    return 0 if result.in_sync else 1


def run_worker(args: argparse.Namespace) -> int:
    if args.mode == "allreduce":
        return run_allreduce_worker(args)
    if args.ps is not None and args.worker_index is not None and args.num_workers is not None:
        ps, index, count = [a for a in args.ps.split(",") if a], args.worker_index, args.num_workers
    else:
        ps, index, count = worker_from_tf_config()
        ps = [a for a in args.ps.split(",") if a] if args.ps else ps
        index = index if args.worker_index is None else args.worker_index
        count = count if args.num_workers is None else args.num_workers
    from trainer.train import train_worker

    overlap = options.overlap(args.overlap, args.mode, count)
    if args.overlap == "auto" and args.mode in ("async", "ssp") and not overlap and index == 0:
        print(
            f"[worker {index}] overlap off (--overlap auto): with {count} {args.mode} workers it would make "
            f"each gradient about {2 * count - 1} updates stale, not {count - 1}; --overlap on keeps it",
            flush=True,
        )
    result = train_worker(
        options.train_config(args),
        ps,
        worker_index=index,
        num_workers=count,
        mode=args.mode,
        overlap=overlap,
        timeout=args.timeout,
        sync_parts=args.sync_parts,
        client_options=options.ring_security_options(args)  # auth token and client TLS towards the shards
        | ({} if args.partition_bytes is None else {"partition_bytes": args.partition_bytes}),
    )
    print(
        f"[worker {index}] done: {result.steps} steps, {result.steps_per_second:.1f} steps/s"
        + (f", {result.stale_steps} stale" if result.stale_steps else ""),
        flush=True,
    )
    report.write_json(args.result_json, {"mode": args.mode, **result.to_dict()})
    if args.evaluate_json:
        return evaluate_when_told(args, ps)
    return 0


EVALUATE_WAIT_S = 1800.0  # bounds the wait for the word to evaluate (the demo's bound on its workers)


def evaluate_when_told(args: argparse.Namespace, ps: list[str]) -> int:
    """``--evaluate-json FILE``: waits until ``FILE.go`` exists (the demo writes it once every worker is
    done), then scores the model on the shards with the test split and writes the scores to ``FILE``
    (``test_accuracy``; the wide_deep model's AUC and table counts too). Gives up (exit 1) when its
    parent process is gone or after ``EVALUATE_WAIT_S``."""
    go = Path(f"{args.evaluate_json}.go")
    parent = os.getppid()
    deadline = time.monotonic() + EVALUATE_WAIT_S
    while not go.exists():
        if os.getppid() != parent or time.monotonic() > deadline:
            print(
                f"[worker {args.worker_index}] no word to evaluate the model came; not evaluating", flush=True
            )
            return 1
        time.sleep(0.05)
    config = options.train_config(args)
    if args.model == "wide_deep":
        from trainer import recsys

        scores = recsys.evaluate_from_ps(config, ps)
    else:
        from trainer.train import evaluate_from_ps

        scores = {"test_accuracy": evaluate_from_ps(config, ps)}
    report.write_json(args.evaluate_json, scores)
    return 0


def run_local(args: argparse.Namespace) -> int:
    from trainer.train import train_local

    result, accuracy = train_local(options.train_config(args))
    auc = f", test AUC {result.extra['test_auc']:.4f}" if "test_auc" in result.extra else ""
    print(f"[local] test accuracy {accuracy:.4f}{auc}, {result.steps_per_second:.1f} steps/s", flush=True)
    report.write_json(
        args.result_json,
        {"mode": "local", "test_accuracy": accuracy, "epochs": args.epochs, **_summary(result.to_dict()),
         **result.extra},
    )  # fmt: skip
    return 0


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    """The local run's steps, rate and final epoch's training loss and accuracy (for a launcher comparing
    distributed runs with it)."""
    keys = ("steps", "steps_per_second", "cpu_seconds_per_step", "train_seconds", "final_loss")
    keys += ("final_accuracy",)
    return {k: result[k] for k in keys}


def main(argv: list[str] | None = None) -> int:
    """``pstrain``: runs a subcommand; Ctrl-C stops what it started and exits 130 with one line."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # the clusters and workers it started are stopped while unwinding
        print("pstrain: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "launch":  # the user's script configures its own logging
        from trainer.launch import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        try:
            return launch(cmd, mode=args.mode, workers=args.workers, shards=args.shards,
                          staleness=args.staleness, barrier_timeout=args.barrier_timeout,
                          timeout=args.timeout)  # fmt: skip
        except ValueError as err:
            print(f"pstrain: error: {err}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s pstrain[%(process)d] %(name)s: %(message)s",
    )
    _quiet_tf()
    try:
        options.resolve_model_defaults(args)
        if args.command != "local" and args.mode != "allreduce":
            # A PS worker is a client of the shards: token and client-side TLS apply; the demo's local
            # shards run without either.
            allowed = () if args.command == "demo" else ("auth_token_file", "tls_ca", "tls_cert", "tls_key")
            given = [
                f"--{n.replace('_', '-')}"
                for n in options.SECURITY_FLAGS
                if getattr(args, n) and n not in allowed
            ]
            if given:
                where = "pstrain demo" if args.command == "demo" else "a parameter-server worker"
                raise ValueError(f"{', '.join(given)}: not used by {where} (only --mode allreduce's ring)")
        if args.command in ("worker", "local"):
            _import_tf_quietly()
        if args.command == "worker":
            return run_worker(args)
        if args.command == "local":
            return run_local(args)
        from trainer.demo import run_demo

        return run_demo(args)
    except ValueError as err:
        print(f"pstrain: error: {err}", file=sys.stderr)
        return 2
    except PSError as err:
        print(f"pstrain: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
