"""``psserver``: run one parameter-server shard."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from psserver.config import (
    DEFAULT_INLINE_APPLY_BYTES,
    MODES,
    ConfigError,
    ServerConfig,
    ps_task_from_tf_config,
)
from psserver.lease import DEFAULT_LEASE_S
from psserver.tier import DEFAULT_DISK_BYTES, DEFAULT_STORE, STORES, parse_bytes

_EPILOG = """\
examples:
  psserver --shard 0 --num-shards 2 --port 50051
  psserver --shard 1 --num-shards 2 --port 0 --ready-file /tmp/ps1.addr
  psserver --shard 0 --num-shards 2 --port 50051 --backup-at ps0b:50061   # primary of shard 0 ...
  psserver --shard 0 --num-shards 2 --port 50061 --backup-of ps0:50051    # ... and its backup
  TF_CONFIG='{"cluster": {"ps": ["ps0:2222", "ps1:2222"]}, "task": {"type": "ps", "index": 0}}' psserver

Without --shard, the shard index, shard count and port come from TF_CONFIG.
Replication (every mode): clients given PRIMARY|BACKUP for a shard fail over to the backup when the
primary dies; an update is acknowledged once the backup has applied it too. A replicated primary serves
only while its backup renews its --lease; cut off from its backup it refuses client calls (UNAVAILABLE),
and the backup takes over once that lease has expired, in a newer term; it serves once the old primary
(restarted with its usual flags, or back from a partition) has caught up as its backup, so that nothing
acknowledged is on one process only (--serve-alone: at once; see the docs, "Replication and leases").
Disk tier: with --table-memory and --table-dir, the dynamic tables without a capacity keep their hot
rows (values, optimizer slots, bookkeeping) in memory under one budget for the shard, shared as they
grow (each may hold an equal share), and spill the others to a store under --table-dir
(--table-tier-store: log-structured segments or LMDB; rebuilt from checkpoints, wiped at start); see the
docs, "Disk tier".
Exit status: 0 after SIGTERM/SIGINT; 2 for bad flags, an address that cannot be bound or a --table-dir
that cannot hold the tier (one line on stderr:
"psserver: error: cannot bind 127.0.0.1:50051: address already in use").
SIGUSR1: write every thread's stack to stderr (the log) and carry on: for a shard that looks hung. A shard
whose event loop stops turning for 2 s logs a WARNING with where it is stuck.
SIGUSR2: write every asyncio task and the coroutines it awaits in to the log: for a call that hangs while
the loop turns.
SIGTERM: stop taking new work, end idle client streams at once (UNAVAILABLE: clients retry), finish
in-flight requests (up to --grace), write a checkpoint (with --checkpoint-dir), exit 0.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psserver",
        description="Run one parameter-server shard: holds its share of the model's variables and applies "
        "pushed gradients with server-side optimizers.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ.get
    p.add_argument("--shard", type=int, default=None, help="this shard's index, 0-based (default: TF_CONFIG)")
    p.add_argument(
        "--num-shards", type=int, default=None, help="number of shards in the cluster (default: 1)"
    )
    p.add_argument(
        "--host", default=env("PS_HOST", "127.0.0.1"), help="address to bind (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=None, help="port to bind; 0 picks a free one (default: 0 or TF_CONFIG's)"
    )
    p.add_argument("--ready-file", help="once serving, write HOST:PORT to this file (atomically)")
    p.add_argument("--mode", choices=MODES, default="async", help="update discipline (default: %(default)s)")
    p.add_argument("--replicas-to-aggregate", type=int, help="sync mode: gradients averaged per step (N)")
    p.add_argument("--total-replicas", type=int, help="sync/ssp modes: number of workers (M)")
    p.add_argument("--staleness", type=int, default=0, help="ssp mode: max steps a worker may run ahead")
    p.add_argument(
        "--barrier-timeout", type=float, default=60.0, help="sync/ssp: seconds a step may wait (default: 60)"
    )
    p.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="apply gradients containing NaN/Inf instead of rejecting",
    )
    p.add_argument(
        "--max-message-mib", type=int, default=64, help="largest gRPC message accepted, MiB (default: 64)"
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds to finish in-flight calls on SIGTERM")
    p.add_argument("--checkpoint-dir", help="directory for checkpoints (restored on start)")
    p.add_argument(
        "--checkpoint-every",
        type=float,
        help="seconds between periodic checkpoints (sync mode: shard 0's paces every shard, all at one step)",
    )
    p.add_argument("--auth-token-file", help="file holding the shared auth token clients must send")
    p.add_argument("--tls-cert", help="PEM server certificate (enables TLS)")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates signed by it (mTLS)")
    p.add_argument(
        "--tls-ca",
        help="PEM CA bundle trusted when this shard dials another (a backup its primary; default: "
        "--tls-client-ca); with TLS, --tls-cert/--tls-key are its client certificate there",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--backup-of",
        metavar="HOST:PORT",
        help="run as the standby backup of this primary shard: follow its updates, take over when it dies",
    )
    p.add_argument(
        "--backup-at",
        metavar="HOST:PORT",
        help="this primary's backup: if that backup has taken over while this process was down, start as "
        "its backup instead of serving an older checkpoint",
    )
    p.add_argument(
        "--replication-timeout",
        type=float,
        default=30.0,
        help="primary: seconds an update waits for its backup's acknowledgement before the backup is "
        "detached (default: 30)",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        help="primary: once its backup has confirmed, it serves only while the backup's acknowledgements "
        "renew this lease (seconds); the backup takes over only after it has surely expired "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--serve-alone",
        action="store_true",
        help="replicated shard: after a failover (or its backup's resignation) serve at once, with no "
        "backup to acknowledge updates, instead of refusing client calls until a backup has caught up and "
        "confirmed; availability before durability: what it acknowledges alone is lost if it dies before a "
        "backup rejoins (default: off, nothing acknowledged is on one process only)",
    )
    p.add_argument(
        "--data-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the raw-TCP port for big pulls and pushes, on --host, advertised to clients by the "
        "token-guarded DataPort call (default 0: an ephemeral port; give one to open it in a firewall)",
    )
    p.add_argument(
        "--no-data-port",
        dest="data_port",
        action="store_const",
        const=None,
        help="serve no data port: clients pull and push over gRPC only",
    )
    p.add_argument(
        "--table-memory",
        type=_size,
        metavar="BYTES",
        help="disk tier: the in-memory budget of this shard's dynamic tables' hot rows, all tables "
        "together (values, optimizer slots, bookkeeping), e.g. 2GiB; colder rows spill to --table-dir "
        "(tables with a capacity stay in memory)",
    )
    p.add_argument(
        "--table-dir",
        help="disk tier: a local directory for the spilled rows (each process uses and wipes its own "
        "subdirectory, psserver-tier-shardI[-backup]: the shards of a machine may share it)",
    )
    p.add_argument(
        "--table-disk-limit",
        type=_size,
        default=DEFAULT_DISK_BYTES,
        metavar="BYTES",
        help="disk tier: the most bytes one table's spilled rows may take on disk; a push past it fails "
        "with RESOURCE_EXHAUSTED and changes nothing (default: 1TiB)",
    )
    p.add_argument(
        "--table-tier-store",
        choices=STORES,
        default=DEFAULT_STORE,
        help="disk tier: how each table keeps its spilled rows: log (fixed-length records appended to "
        "segment files, an index in memory, compacted in a thread) or lmdb (an LMDB B-tree) "
        f"(default: {DEFAULT_STORE})",
    )
    p.add_argument(
        "--inline-apply-bytes",
        type=_size,
        default=DEFAULT_INLINE_APPLY_BYTES,
        metavar="BYTES",
        help="an update's computations and disk reads and writes on more than this many bytes run in a "
        "worker thread, so the shard goes on answering meanwhile; smaller ones on the event loop, which "
        "saves a thread hop (default: 1MiB; 0: every one in a thread)",
    )
    p.add_argument("--log-level", default=env("PS_LOG_LEVEL", "INFO"), help="logging level (default: INFO)")
    return p


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Builds the ServerConfig from parsed flags (and TF_CONFIG when --shard is absent).

    Raises:
        ConfigError: inconsistent flags.
    """
    shard, num_shards, host, port = args.shard, args.num_shards, args.host, args.port
    if shard is None:
        task = ps_task_from_tf_config()
        shard = task.shard
        num_shards = num_shards or task.num_shards
        port = task.port if port is None else port
        if args.host == "127.0.0.1" and "PS_HOST" not in os.environ:
            host = "0.0.0.0"  # a TF_CONFIG address is reached from other machines
    return ServerConfig(
        shard=shard,
        num_shards=num_shards or 1,
        host=host,
        port=0 if port is None else port,
        ready_file=args.ready_file,
        mode=args.mode,
        replicas_to_aggregate=args.replicas_to_aggregate,
        total_replicas=args.total_replicas,
        staleness=args.staleness,
        barrier_timeout_s=args.barrier_timeout,
        allow_non_finite=args.allow_non_finite,
        max_message_bytes=args.max_message_mib << 20,
        grace_s=args.grace,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every_s=args.checkpoint_every,
        auth_token_file=args.auth_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        tls_ca=args.tls_ca,
        metrics_port=args.metrics_port,
        backup_of=args.backup_of,
        backup_at=args.backup_at,
        replication_timeout_s=args.replication_timeout,
        data_port=args.data_port,
        lease_s=args.lease,
        serve_alone=args.serve_alone,
        table_memory_bytes=args.table_memory,
        table_dir=args.table_dir,
        table_disk_bytes=args.table_disk_limit,
        table_tier_store=args.table_tier_store,
        inline_apply_bytes=args.inline_apply_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as err:
        build_parser().error(str(err))
    logging.basicConfig(  # every line names the shard: logs of a whole cluster can be merged
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s psserver[shard={config.shard} pid=%(process)d] "
        "%(name)s: %(message)s",
    )
    from pscore.loopwatch import dump_stacks_on
    from pscore.memory import tune_malloc
    from pscore.security import BindError
    from psserver.server import serve  # after arg parsing: --help stays instant
    from psserver.tier import TierDirError

    # Before any large buffer or thread: see pscore.memory. One arena: the update threads' and the disk
    # tier's compaction thread's freed buffers serve the event loop's too (each arena keeps its peak).
    tune_malloc(arenas=1)
    dump_stacks_on()  # kill -USR1: every thread's stack into the log, for a shard that looks hung
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # until the loop dumps its tasks on it (server.serve)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        import asyncio

        run = asyncio.run
    else:
        run = uvloop.run
    try:
        run(serve(config))
    except BindError as err:  # a port in use: one line, as for a bad flag
        print(f"psserver: error: {err.strerror}", file=sys.stderr)
        return 2
    except TierDirError as err:  # an unwritable or busy --table-dir: one line, at start-up
        print(f"psserver: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
