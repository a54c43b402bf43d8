"""``psctl``: operate a running cluster from the command line (``psctl status ADDR...``).

A client tool: it talks to the shards through ``psclient`` and the generated
stubs only, never imports the server. Subcommands are registered in
``build_parser`` (one ``_cmd_<name>`` function each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from psclient.admin import ShardStatus, cluster_status
from psclient.config import ps_addresses_from_tf_config
from pscore.security import read_token_file

_EPILOG = """\
examples:
  psctl status 127.0.0.1:50051 127.0.0.1:50052
  psctl status --json ps0:2222 ps1:2222
  TF_CONFIG=... psctl status            # the ps addresses of TF_CONFIG
  psctl save 127.0.0.1:50051 127.0.0.1:50052   # every shard writes a checkpoint now
  psctl save --consistent ps0:2222 ps1:2222     # ... all at one cut of the cluster (one model version)
  psctl export users --out /tmp/users 127.0.0.1:50051 127.0.0.1:50052   # ids.npy, rows.npy, table.json

exit status: 0 when every shard is SERVING, 1 otherwise, 2 on bad arguments.
"""


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _duration(s: float) -> str:
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain left-aligned text table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _rates(first: ShardStatus, second: ShardStatus | None) -> tuple[float | None, float | None]:
    if second is None or not (first.ok and second.ok) or second.sampled_at <= first.sampled_at:
        return None, None
    dt = second.sampled_at - first.sampled_at
    return (second.pushes - first.pushes) / dt, (second.pulls - first.pulls) / dt


def status_report(statuses: list[ShardStatus], later: list[ShardStatus] | None) -> dict[str, Any]:
    """The JSON-able summary ``psctl status --json`` prints."""
    shards = []
    variables: dict[str, dict[str, Any]] = {}
    for i, s in enumerate(statuses):
        push_rate, pull_rate = _rates(s, later[i] if later else None)
        last = later[i] if later and later[i].ok else s
        row = {k: v for k, v in asdict(last).items() if k not in ("tensors", "sampled_at")}
        row["push_rate"], row["pull_rate"] = push_rate, pull_rate
        shards.append(row)
        for t in s.tensors:
            v = variables.setdefault(
                t.variable,
                {"name": t.variable, "dtype": t.dtype, "shape": list(t.full_shape), "bytes": 0, "shards": [],
                 "version_min": t.version, "version_max": t.version, "optimizer": t.optimizer,
                 "partitions": 0},
            )  # fmt: skip
            v["bytes"] += t.nbytes
            if t.dynamic is not None:  # a dynamic table: its counters summed over its shards
                counts = v.setdefault("dynamic", dict.fromkeys(t.dynamic, 0))
                for k, n in t.dynamic.items():
                    counts[k] += n
            v["shards"] = sorted({*v["shards"], s.index})
            v["version_min"] = min(v["version_min"], t.version)
            v["version_max"] = max(v["version_max"], t.version)
            v["partitions"] += 1 if t.partition else 0
    healthy = sum(1 for s in statuses if s.ok and (not later or later[s.index].ok))
    modes = sorted({s.mode for s in statuses if s.mode})
    return {
        "shards": shards,
        "variables": sorted(variables.values(), key=lambda v: v["name"]),
        "healthy": healthy,
        "num_shards": len(statuses),
        "modes": modes,
        "total_bytes": sum(s.total_bytes for s in statuses),
    }


def format_status(report: dict[str, Any]) -> str:
    """The text tables of ``psctl status``."""
    n = report["num_shards"]
    lines = [
        f"cluster: {n} shard(s), {report['healthy']}/{n} healthy, mode {'/'.join(report['modes']) or '?'}, "
        f"{len(report['variables'])} variable(s), {_human_bytes(report['total_bytes'])}"
    ]

    def rate(r: float | None) -> str:
        return "-" if r is None else f"{r:.1f}"

    def role(s: dict[str, Any]) -> str:
        if s["error"] is not None:
            return "-"
        term = f" t{s['term']}" if s.get("term", 0) > 1 else ""  # after a takeover
        if s["role"] == "primary" and s.get("lease_s") == 0:
            return "primary (no lease)" + term  # replicated, without its backup: it refuses client calls
        if s["role"] == "primary" and s.get("unprotected"):
            return "primary (unprotected)" + term  # --serve-alone, no backup yet: acknowledges alone
        return ("primary+backup" if s["role"] == "primary" and s["peer"] else s["role"]) + term

    headers = [
        "SHARD",
        "ADDRESS",
        "HEALTH",
        "ROLE",
        "MODE",
        "VARS",
        "BYTES",
        "PUSHES",
        "PUSH/S",
        "PULLS",
        "PULL/S",
    ]
    rows = [
        [s["index"], s["address"], s["health"], role(s), s["mode"] or "-", s["num_variables"],
         _human_bytes(s["total_bytes"]), s["pushes"], rate(s["push_rate"]), s["pulls"], rate(s["pull_rate"]),
         _duration(s["uptime_s"]) if s["error"] is None else "-"]
        for s in report["shards"]
    ]  # fmt: skip
    lines += ["", table([*headers, "UPTIME"], rows)]
    lines += [f"shard {s['index']} ({s['address']}): {s['error']}" for s in report["shards"] if s["error"]]
    lines += [
        f"shard {s['index']} ({s['address']}): "
        + (f"backed up by {s['peer']}" if s["role"] == "primary" else f"{s['role']} of {s['peer']}")
        for s in report["shards"]
        if s["error"] is None and s["peer"]
    ]
    if report["variables"]:
        vrows = []
        for v in report["variables"]:
            version = (
                str(v["version_max"])
                if v["version_min"] == v["version_max"]
                else f"{v['version_min']}..{v['version_max']}"
            )
            shape = "x".join(map(str, v["shape"])) or "scalar"
            if "dynamic" in v:
                shape = f"dynamic x {v['shape'][-1]}"
            if v["partitions"]:
                shape += f" ({v['partitions']} parts)"
            vrows.append(
                [v["name"], v["dtype"], shape, _human_bytes(v["bytes"]),
                 ",".join(map(str, v["shards"])), version, v["optimizer"]]
            )  # fmt: skip
        lines.append("")
        lines.append(
            table(["VARIABLE", "DTYPE", "SHAPE", "SIZE", "ON SHARDS", "VERSION", "OPTIMIZER"], vrows)
        )
    dynamic = [v for v in report["variables"] if "dynamic" in v]
    if dynamic:
        drows = [
            [v["name"], d["rows"], d["capacity"] or "unbounded", d["admitted"], d["evicted"], d["expired"],
             d["dropped_updates"], d["initializer_reads"]]
            for v in dynamic
            for d in [v["dynamic"]]
        ]  # fmt: skip
        headers = [
            "DYNAMIC TABLE",
            "ROWS",
            "CAPACITY",
            "ADMITTED",
            "EVICTED",
            "EXPIRED",
            "DROPPED",
            "INIT READS",
        ]
        lines += ["", table(headers, drows)]
    tiered = [v for v in dynamic if v["dynamic"].get("memory_rows_max")]
    if tiered:  # psserver --table-memory: rows in memory and on disk
        trows = []
        for v in tiered:
            d = v["dynamic"]
            looked = d["memory_hits"] + d["disk_hits"]
            trows.append(
                [v["name"], d["rows_in_memory"], d["memory_rows_max"], _human_bytes(d["memory_bytes"]),
                 d["rows_on_disk"], _human_bytes(d["disk_bytes"]),
                 f"{100 * d['memory_hits'] / looked:.1f}%" if looked else "-", d["spilled"], d["filled"]]
            )  # fmt: skip
        headers = ["TIERED TABLE", "IN MEMORY", "AT MOST", "MEM SIZE", "ON DISK", "DISK SIZE", "HIT RATE",
                   "SPILLED", "FILLED"]  # fmt: skip
        lines += ["", table(headers, trows)]
    return "\n".join(lines)


def _addresses(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    addresses = [a for item in args.addresses for a in item.split(",") if a]
    if not addresses:
        try:
            addresses = list(ps_addresses_from_tf_config(os.environ))
        except ValueError as err:
            parser.error(f"no shard addresses given and {err}")
    return addresses


def _security(args: argparse.Namespace) -> dict[str, Any]:
    token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    return {"auth_token": token, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}


async def _status(args: argparse.Namespace, addresses: list[str]) -> dict[str, Any]:
    kw = {"timeout": args.timeout, **_security(args)}
    first = await cluster_status(addresses, variables=not args.no_variables, **kw)
    later = None
    if args.interval > 0:
        await asyncio.sleep(args.interval)
        later = await cluster_status(addresses, variables=False, **kw)
    return status_report(first, later)


def _cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    addresses = _addresses(args, parser)
    try:
        report = asyncio.run(_status(args, addresses))
    except ValueError as err:  # malformed addresses or TLS settings
        parser.error(str(err))
    report["time"] = time.time()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_status(report))
    return 0 if report["healthy"] == report["num_shards"] else 1


async def _save(args: argparse.Namespace, addresses: list[str]) -> list[Any]:
    from psclient import AsyncPSClient

    async with AsyncPSClient(addresses, worker_id="psctl", timeout=args.timeout, **_security(args)) as c:
        return await c.save_checkpoint(consistent=args.consistent)


def _cmd_save(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pscore.errors import PSError

    addresses = _addresses(args, parser)
    try:
        replies = asyncio.run(_save(args, addresses))
    except ValueError as err:  # malformed addresses or TLS settings
        parser.error(str(err))
    except PSError as err:
        print(f"psctl save: {err}", file=sys.stderr)
        return 1
    rows = [
        {"shard": i, "address": a, "id": r.id, "path": r.path, "variables": r.num_variables,
         "bytes": r.bytes, "seconds": round(r.seconds, 3)}
        for i, (a, r) in enumerate(zip(addresses, replies, strict=True))
    ]  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        headers = ["SHARD", "ADDRESS", "ID", "VARS", "BYTES", "SECONDS", "PATH"]
        print(table(headers, [[r["shard"], r["address"], r["id"], r["variables"], _human_bytes(r["bytes"]),
                               r["seconds"], r["path"]] for r in rows]))  # fmt: skip
    return 0


def _cmd_export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from psclient import PSClient
    from psclient.export import Progress, export_table
    from pscore.errors import PSError

    addresses = _addresses(args, parser)
    if args.batch_rows is not None and args.batch_rows < 1:
        parser.error("--batch-rows must be >= 1")
    shown = [0.0]

    def progress(p: Progress) -> None:  # on stderr, at most every --progress-every seconds
        if args.quiet or p.seconds - shown[0] < args.progress_every:
            return
        shown[0] = p.seconds
        share = f" ({100 * p.rows / p.expected:.0f}%)" if p.expected else ""
        rate = p.bytes / p.seconds / 1e6 if p.seconds > 0 else 0.0
        line = f"export {p.table}: {p.rows:,} / {p.expected:,} rows{share}, {_human_bytes(p.bytes)}"
        print(f"{line}, {rate:.1f} MB/s", file=sys.stderr, flush=True)

    try:
        with PSClient(addresses, worker_id="psctl", timeout=args.timeout, **_security(args)) as client:
            summary = export_table(
                client, args.table, args.out, batch_rows=args.batch_rows, progress=progress
            )
    except ValueError as err:  # malformed addresses or TLS settings
        parser.error(str(err))
    except (PSError, OSError) as err:
        print(f"psctl export: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    else:
        print(
            f"exported {summary.table} ({summary.kind}, {summary.key_type} ids): {summary.rows:,} rows of "
            f"{summary.dim} {summary.dtype}, {_human_bytes(summary.bytes)} in {summary.seconds:.1f}s -> "
            f"{os.path.join(args.out, summary.ids_file)}, {os.path.join(args.out, summary.rows_file)}"
        )
    return 0


def _add_connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default: %(default)s)")
    p.add_argument("--auth-token-file", help="file holding the cluster's auth token")
    p.add_argument("--tls-ca", help="PEM CA bundle that signed the shards' certificates (enables TLS)")
    p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psctl",
        description="Inspect and operate a running paramserver cluster.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = sub.add_parser(
        "status",
        help="table of shards (health, mode, sizes, push/pull rates) and variables (sizes, versions)",
        description="Show every shard's health, mode, variables, bytes, push/pull counts and rates, and "
        "every variable's dtype, shape, size, shards and version; dynamic tables' counters, and for "
        "tables on a disk tier (psserver --table-memory) their rows and bytes in memory and on disk, "
        "the memory hit rate, and the rows spilled and filled.",
    )
    status.add_argument(
        "addresses", nargs="*", help="HOST:PORT of every shard (default: TF_CONFIG's ps tasks)"
    )
    status.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between the two samples rates come from (0: none)",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--no-variables", action="store_true", help="skip the variables table")
    _add_connection_flags(status)
    status.set_defaults(func=_cmd_status)
    save = sub.add_parser(
        "save",
        help="make every shard write a checkpoint now (into its --checkpoint-dir)",
        description="Make every shard write a checkpoint now; prints each file written. Exit status 1 if a "
        "shard failed (e.g. it runs without --checkpoint-dir).",
    )
    save.add_argument("addresses", nargs="*", help="HOST:PORT of every shard (default: TF_CONFIG's ps tasks)")
    save.add_argument("--json", action="store_true", help="print JSON instead of a table")
    save.add_argument(
        "--consistent",
        action="store_true",
        help="hold every shard at one cut (two-phase: prepare, save, release; all within --timeout), so "
        "the files are one version of the whole model; aborted, with nothing left held or written, if a "
        "shard is down or the deadline passes",
    )
    _add_connection_flags(save)
    save.set_defaults(func=_cmd_save, timeout=60.0)
    export = sub.add_parser(
        "export",
        help="write every row of an embedding table to .npy files (for serving)",
        description="Read every row of an embedding table (fixed or dynamic), batch by batch, shard by shard "
        "in ascending id order, into OUT/ids.npy (int64 [n]; a string-keyed table's hashed ids), "
        "OUT/rows.npy ([n, dim]) and OUT/table.json. Memory stays O(batch). Progress goes to stderr. "
        "While training runs a dynamic table may change under the export: run it after training for "
        "one consistent table. Exit status 1 if a shard failed (no partial files are left).",
    )
    export.add_argument("table", help="the table's name")
    export.add_argument(
        "addresses", nargs="*", help="HOST:PORT of every shard (default: TF_CONFIG's ps tasks)"
    )
    export.add_argument("--out", required=True, help="output folder (created if missing)")
    export.add_argument(
        "--batch-rows", type=int, help="rows per read (default: 4 MiB of rows, the client's unary_max_bytes)"
    )
    export.add_argument(
        "--progress-every", type=float, default=1.0, help="seconds between progress lines (default: 1)"
    )
    export.add_argument("--quiet", action="store_true", help="no progress lines")
    export.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_connection_flags(export)
    export.set_defaults(func=_cmd_export, timeout=60.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "interval", 0) < 0:
        parser.error("--interval must be >= 0")
    return int(args.func(args, parser))


if __name__ == "__main__":
    sys.exit(main())
