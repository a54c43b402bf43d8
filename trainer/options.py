"""``pstrain``'s shared options: the training flags, the security flags, the shards' flags per mode.

Used by the CLI (``trainer.__main__``) and by the launchers that start worker
processes with the same flags (``trainer.demo``, ``trainer.allreduce_loop``,
``trainer.launch``). No TensorFlow here.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """The flags every training command takes (model, data, epochs, batch size, rate, seed, output)."""
    p.add_argument("--model", choices=("cnn", "resnet", "mlp"), default="cnn", help="(default: %(default)s)")
    p.add_argument(
        "--data",
        choices=("digits", "synthetic", "mnist"),
        default="digits",
        help="digits: scikit-learn's 8x8 digits (shipped); synthetic: random images; "
        "mnist: a local keras mnist.npz given by --data-path (default: %(default)s)",
    )
    p.add_argument("--data-path", help="the .npz file for --data mnist (nothing is downloaded)")
    p.add_argument("--synthetic-size", type=int, default=4096, help="training examples of --data synthetic")
    p.add_argument("--image-size", type=int, default=28, help="side of --data synthetic images")
    p.add_argument("--epochs", type=int, default=10, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default: %(default)s)")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the results to this JSON file")
    p.add_argument("--log-level", default=os.environ.get("PS_LOG_LEVEL", "WARNING"))


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
    )


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
             "--image-size", str(args.image_size), "--log-level", args.log_level]  # fmt: skip
    if args.data_path:
        flags += ["--data-path", args.data_path]
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
