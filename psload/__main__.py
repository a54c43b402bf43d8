"""``psload``: load-test a paramserver cluster (a running one, or a local one it starts)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from psload import report
from psload.runner import MODES, OPS, LoadConfig, LoadError, run_load
from psload.spec import ModelSpec, parse_size

_EPILOG = """\
examples:
  psload --workers 4 --model 8x1MiB --duration 10                 # starts a local 2-shard cluster
  psload --workers 4 --mode sync --json out.json --plot out.png
  psload --workers 8 --model 16x4MiB,1x64MiB 10.0.0.5:2222 10.0.0.6:2222
  psload --workers 4 --clients-per-worker 16 --exact --duration 15  # 64 simulated workers, exact counts
  psload --chaos --kill-every 5 --workers 4 --model 4x64KiB --duration 300 --json chaos.json
  psload --chaos --mode sync --kill-every 5 --workers 4 --duration 60

Model spec: COUNTxSIZE[,COUNTxSIZE...] of float32 variables (sizes: 4096, 64KiB, 1MiB, 2.5MB).
Each step a worker pushes a gradient for every variable and reads them back
(--op push_pull; or push / pull only). Throughput counts bytes sent plus bytes
received. Live progress goes to stderr once a second; the summary to stdout.
Variables left behind: a local cluster goes with the run; on a running cluster the
model's variables (PREFIX/v<i>_<elements>) stay, because the shards have no delete.
They go only when the shards restart (without restoring a checkpoint written since).
Their names carry the sizes, so a rerun with the same --prefix and --model reuses
them instead of adding more; the summary's "left" line names them.
Chaos soak (--chaos): a local cluster of primary+backup pairs (psserver --backup-at/--backup-of on
fixed ports, in --mode async, sync or ssp); every --kill-every seconds the next shard's primary is
kill -9-ed and restarted with the same command (it rejoins as the backup of the process that took
over). Every push also adds 1 to an exact counter per shard (sync mode: every step adds 1): at the
end counters and versions must equal the acknowledged pushes (steps), none lost, none applied twice.
Reported: failover and redundancy-restored time per kill (p50/max), and the RSS of shard and worker
processes after warm-up vs at the end (Linux /proc).
Many workers (--clients-per-worker C): each of the W processes runs C simulated workers (an
AsyncPSClient and worker id each, on one event loop), W x C in all (sync/ssp: W x C replicas);
"per worker steps max/min" is the spread of their step counts. --exact: the chaos soak's exact
counters without the kills (on a running cluster they stay as PREFIX/counter_<i>: use a fresh one).
exit status: 0 when the run had no errors (and with --chaos or --exact: counters exact; with --chaos:
RSS growth below --max-rss-growth), 1 otherwise, 2 on bad arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psload",
        description="Drive a paramserver cluster with simulated worker processes and report throughput, "
        "latency, errors and per-shard balance.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("addresses", nargs="*", help="HOST:PORT of every shard (default: start a local cluster)")
    p.add_argument("-w", "--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    p.add_argument(
        "-c",
        "--clients-per-worker",
        type=int,
        default=1,
        help="simulated workers per process, an AsyncPSClient and worker id each (default: %(default)s)",
    )
    p.add_argument("-m", "--model", default="8x1MiB", help="variables, COUNTxSIZE,... (default: %(default)s)")
    p.add_argument("-d", "--duration", type=float, default=10.0, help="seconds to run (default: %(default)s)")
    p.add_argument(
        "--mode", choices=MODES, help="local cluster's mode (default async); checked on a running one"
    )
    p.add_argument(
        "--staleness", type=int, default=1, help="ssp: the local cluster's S (default: %(default)s)"
    )
    p.add_argument("--shards", type=int, default=2, help="local cluster's shard count (default: %(default)s)")
    p.add_argument("--op", choices=OPS, default="push_pull", help="what one step does (default: %(default)s)")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="per-call deadline, seconds (default: %(default)s)"
    )
    p.add_argument(
        "--prefix",
        default="psload",
        help="variable name prefix; the variables stay on a running cluster (default: %(default)s)",
    )
    p.add_argument("--chunk-size", help="client streaming chunk size, e.g. 4MiB")
    p.add_argument(
        "--data-port-min-bytes",
        help="pushes and pulls of this much per shard or more take the raw-TCP data port, one connection "
        "per client and shard (client default 256KiB; 0: all of them)",
    )
    p.add_argument("--auth-token-file", help="file holding the cluster's auth token")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra psserver flag for the local cluster"
    )
    p.add_argument(
        "--chaos",
        action="store_true",
        help="chaos soak: replicated local cluster, a primary kill -9-ed every --kill-every seconds",
    )
    p.add_argument(
        "--kill-every", type=float, default=10.0, help="--chaos: seconds between kills (default: %(default)s)"
    )
    p.add_argument(
        "--max-rss-growth",
        type=float,
        default=10.0,
        help="--chaos: largest accepted RSS growth after warm-up, percent (default: %(default)s)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="every push also adds 1 to an exact counter per shard; check counters and versions at the end",
    )
    p.add_argument(
        "--warm-up",
        action="store_true",
        help="every simulated worker pulls the model once before the clock starts (opens data connections)",
    )
    p.add_argument(
        "--worker-netns",
        default="",
        metavar="NS[,NS...]",
        help="network namespaces the worker processes run in, round robin (Linux, root)",
    )
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    p.add_argument("--plot", metavar="FILE", help="write a PNG plot of throughput and latency over time")
    p.add_argument("-q", "--quiet", action="store_true", help="no live progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("PSLOAD_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s psload: %(message)s",
    )
    addresses = tuple(a for item in args.addresses for a in item.split(",") if a)
    if args.chaos and addresses:
        parser.error("--chaos starts (and kills) its own local cluster: give no addresses")
    token = None
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = f.read().strip()
    try:
        options = {}
        if args.chunk_size:
            options["chunk_bytes"] = parse_size(args.chunk_size)
        if args.data_port_min_bytes is not None:
            options["data_port_min_bytes"] = parse_size(args.data_port_min_bytes)
        config = LoadConfig(
            workers=args.workers, clients_per_worker=args.clients_per_worker,
            model=ModelSpec.parse(args.model), duration_s=args.duration, exact=args.exact,
            warm_up=args.warm_up,
            worker_netns=tuple(n for n in args.worker_netns.split(",") if n),
            addresses=addresses, local_shards=args.shards, mode=args.mode, staleness=args.staleness,
            op=args.op, timeout_s=args.timeout, prefix=args.prefix, auth_token=token,
            server_args=tuple(args.server_arg), client_options=options,
            chaos_every_s=args.kill_every if args.chaos else None, max_rss_growth=args.max_rss_growth / 100,
        )  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    try:
        result = run_load(config, progress=None if args.quiet else sys.stderr)
    except LoadError as err:
        print(f"psload: {err}", file=sys.stderr)
        return 1
    print(report.format_summary(result))
    if args.json:
        report.write_json(args.json, result)
        print(f"  json        {args.json}")
    if args.plot:
        why = report.plot(args.plot, result)
        print(f"  plot        {args.plot}" if why is None else f"  plot        skipped: {why}")
    ok = result["summary"]["errors"] == 0 and not result["summary"]["failed_workers"]
    if "counts" in result:
        ok = ok and result["counts"]["ok"]
    if "chaos" in result:
        ok = ok and all(result["chaos"]["ok"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
