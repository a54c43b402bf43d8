"""``pstrain``'s shared options: the training flags, the security flags, the shards' flags per mode.

Used by the CLI (``trainer.__main__``) and by the launchers that start worker
processes with the same flags (``trainer.demo``, ``trainer.allreduce_loop``,
``trainer.launch``). No TensorFlow here.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

# Per-model defaults of the train flags left unset: (image models, wide_deep); see resolve_model_defaults.
_MODEL_DEFAULTS = {
    "data": ("digits", "clicks"),
    "synthetic_size": (4096, 500_000),
    "epochs": (10, 1),
    "batch_size": (32, 256),
    "learning_rate": (1e-3, 0.1),
}


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """The flags every training command takes (model, data, epochs, batch size, rate, seed, output).

    Some defaults depend on the model: ``resolve_model_defaults`` fills them after parsing.
    """
    p.add_argument(
        "--model",
        choices=("cnn", "resnet", "mlp", "wide_deep"),
        default="cnn",
        help="wide_deep: a recommender whose user, item and category tables are dynamic embedding tables "
        "on the shards, trained on a synthetic click log (--data clicks) (default: %(default)s)",
    )
    p.add_argument(
        "--data",
        choices=("digits", "synthetic", "mnist", "clicks"),
        help="digits: scikit-learn's 8x8 digits (shipped); synthetic: random images; "
        "mnist: a local keras mnist.npz given by --data-path; clicks: a synthetic click log with power-law "
        "users and items and a known ground-truth model (wide_deep's) (default: digits; wide_deep: clicks)",
    )
    p.add_argument("--data-path", help="the .npz file for --data mnist (nothing is downloaded)")
    p.add_argument(
        "--synthetic-size",
        type=int,
        help="training examples of --data synthetic or clicks (default: 4096; clicks: 500000; the click "
        "log's test split is a tenth of it, at least 2000)",
    )
    p.add_argument("--image-size", type=int, default=28, help="side of --data synthetic images")
    p.add_argument("--epochs", type=int, help="(default: 10; wide_deep: 1)")
    p.add_argument("--batch-size", type=int, help="per worker (default: 32; wide_deep: 256)")
    p.add_argument(
        "--learning-rate", type=float, help="Adam's; wide_deep: Adagrad's (default: 1e-3; wide_deep: 0.1)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--users",
        type=int,
        default=2_000_000,
        help="--data clicks: users in the vocabulary, drawn by a power law (items: a tenth) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--table-capacity",
        type=int,
        help="wide_deep: rows each dynamic table holds at most (LRU eviction beyond; default: unbounded)",
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=1,
        help="wide_deep: pushes of an id before its row is created (default: %(default)s: on the first)",
    )
    p.add_argument("--result-json", help="write the results to this JSON file")
    p.add_argument("--log-level", default=os.environ.get("PS_LOG_LEVEL", "WARNING"))


def resolve_model_defaults(args: argparse.Namespace) -> None:
    """Fills the train flags left unset with the model's defaults (``_MODEL_DEFAULTS``); checks the pairing.

    Raises:
        ValueError: wide_deep without the click log or the reverse, wide_deep in allreduce mode, or a
            table option out of range.
    """
    wide = args.model == "wide_deep"
    for name, defaults in _MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[wide])
    if wide != (args.data == "clicks"):
        raise ValueError("--model wide_deep trains on --data clicks, and only it does")
    if wide and getattr(args, "mode", "local") == "allreduce":
        raise ValueError(
            "--model wide_deep keeps its tables on the parameter server: use --mode async, sync, ssp or local"
        )
    if args.table_capacity is not None and args.table_capacity < 1:
        raise ValueError(f"--table-capacity must be >= 1, got {args.table_capacity}")
    if args.min_count < 1:
        raise ValueError(f"--min-count must be >= 1, got {args.min_count}")
    if args.users < 10:
        raise ValueError(f"--users must be >= 10, got {args.users}")


def train_config(args: argparse.Namespace) -> Any:
    """The ``trainer.train.TrainConfig`` of the parsed training flags (imports TensorFlow)."""
    from trainer.train import TrainConfig  # TensorFlow: only when called

    return TrainConfig(
        model=args.model,
        data=args.data,
        data_path=args.data_path,
        synthetic_size=args.synthetic_size,
        image_size=args.image_size,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        num_users=args.users,
        table_capacity=args.table_capacity,
        min_count=args.min_count,
    )


# Overlap (``PSWorker(overlap=True)``) adds a round of staleness: with n async workers each gradient lands
# about 2n - 1 updates late instead of n - 1. Adam 1e-3 on the demo's MLP (in-process simulation of delayed
# gradients, bench/results/async_staleness_sim_2026-12-07e/) reached 0.95 test accuracy at a delay of 3,
# 0.91-0.92 at 7, and 0.60-0.61 at 15 (local 0.96); 8 async workers with overlap on 50 Mbit/s links scored
# 0.33-0.84. So ``--overlap auto`` overlaps while 2n - 1 <= 7: up to 4 workers.
AUTO_OVERLAP_MAX_WORKERS = 4
OVERLAP_HELP = (
    "async/ssp: overlap a step's push_pull with the next step's compute, one round more of staleness for "
    f"less waiting. auto (default): on up to {AUTO_OVERLAP_MAX_WORKERS} workers, off above, where each "
    "gradient would land about 2 x workers updates late (a staleness that made 8 async workers train "
    "worse than locally)"
)


def add_overlap_flags(p: argparse.ArgumentParser) -> None:
    """``--overlap auto|on|off`` (``args.overlap``), and ``--no-overlap``, the same as ``--overlap off``."""
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto", help=OVERLAP_HELP)
    p.add_argument(
        "--no-overlap", dest="overlap", action="store_const", const="off", help="the same as --overlap off"
    )


def overlap(choice: str, mode: str, num_workers: int) -> bool:
    """Whether a worker overlaps (``PSWorker(overlap=...)``) for ``--overlap choice``.

    >>> overlap("auto", "async", 4), overlap("auto", "async", 8), overlap("on", "async", 8)
    (True, False, True)
    """
    if choice != "auto":
        return choice == "on"
    return mode in ("async", "ssp") and num_workers <= AUTO_OVERLAP_MAX_WORKERS


def learning_rate(args: argparse.Namespace) -> float:
    """The workers' learning rate: in sync mode each update averages N gradients, an N-times larger
    batch, so the linear scaling rule multiplies the rate by N (unless --no-lr-scaling)."""
    if args.mode == "sync" and not args.no_lr_scaling:
        return float(args.learning_rate) * (args.replicas_to_aggregate or args.workers)
    return float(args.learning_rate)


def train_flags(args: argparse.Namespace) -> list[str]:
    """The training flags again, for a worker process a launcher starts."""
    flags = ["--model", args.model, "--data", args.data, "--epochs", str(args.epochs),
             "--batch-size", str(args.batch_size), "--learning-rate", str(learning_rate(args)),
             "--seed", str(args.seed), "--synthetic-size", str(args.synthetic_size),
             "--image-size", str(args.image_size), "--log-level", args.log_level,
             "--users", str(args.users), "--min-count", str(args.min_count)]  # fmt: skip
    if args.data_path:
        flags += ["--data-path", args.data_path]
    if args.table_capacity is not None:
        flags += ["--table-capacity", str(args.table_capacity)]
    return flags


def server_args(
    mode: str,
    workers: int,
    *,
    replicas_to_aggregate: int | None = None,
    staleness: int = 2,
    barrier_timeout: float = 120.0,
) -> list[str]:
    """The psserver flags of a ps mode with ``workers`` workers.

    sync: ``replicas_to_aggregate`` gradients per step (default: every worker's).
    """
    if mode == "sync":
        n = replicas_to_aggregate or workers
        return ["--mode", "sync", "--replicas-to-aggregate", str(n), "--total-replicas", str(workers),
                "--barrier-timeout", str(barrier_timeout)]  # fmt: skip
    if mode == "ssp":
        return ["--mode", "ssp", "--total-replicas", str(workers), "--staleness", str(staleness),
                "--barrier-timeout", str(barrier_timeout)]  # fmt: skip
    return []


_TLS_FLAGS = ("tls_ca", "tls_cert", "tls_key", "tls_client_ca")
SECURITY_FLAGS = ("auth_token_file", *_TLS_FLAGS)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """The ring's auth and TLS flags (named as psserver's); see :func:`ring_security_options`."""
    g = parser.add_argument_group(
        "security (worker: towards the shards, or the ring with --mode allreduce; demo: allreduce only)"
    )
    g.add_argument("--auth-token-file", help="file with the shared token every call must carry")
    g.add_argument(
        "--tls-cert", help="PEM certificate of this worker: TLS on every ring stream (also its client cert)"
    )
    g.add_argument("--tls-key", help="PEM private key for --tls-cert")
    g.add_argument("--tls-ca", help="PEM CA the other workers' certificates chain to (default: system roots)")
    g.add_argument(
        "--tls-client-ca", help="PEM CA bundle: require ring client certificates signed by it (mTLS)"
    )


def ring_security_options(args: argparse.Namespace) -> dict[str, Any]:
    """``Ring`` keyword options from the security flags (reads the token file).

    Raises:
        ValueError: an unreadable or malformed token file.
    """
    from pscore.security import read_token_file

    opts: dict[str, Any] = {k: getattr(args, k) for k in _TLS_FLAGS if getattr(args, k, None)}
    if getattr(args, "auth_token_file", None):
        opts["auth_token"] = read_token_file(args.auth_token_file)
    return opts


def security_argv(args: argparse.Namespace) -> list[str]:
    """The security flags again, for a worker process started by the demo."""
    argv: list[str] = []
    for name in SECURITY_FLAGS:
        if value := getattr(args, name, None):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
