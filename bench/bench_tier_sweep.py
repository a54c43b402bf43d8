"""Expiry sweeps of a dynamic table past memory: the push that runs one, against the pushes that do not.

A dynamic table with a TTL sweeps its expired rows every 1/8 of the TTL, from
the push that is due (``psserver.rows``), over both tiers when the shard has
a disk tier. One shard (a real ``psserver`` process, ``--table-memory BUDGET
--table-dir``) holds one table of ``--rows`` ids x ``--dim`` (float32, Adagrad),
filled by pushes of ``--batch`` new ids; then a client pushes ``--ids`` ids of
the table at a time (power-law ranks: a few hot, a long tail) for ``--pushes``
pushes and records each push's time. Variants, each on a fresh shard:

- ``none``: no TTL (the peer: no sweep ever runs);
- ``steps``: ``ttl_steps`` so that a sweep is due every ``--sweep-every`` pushes,
  a TTL long enough that the rows filled stay (what most sweeps of a healthy
  table find: little to expire);
- ``expiring``: the same, but the filled rows are past their TTL: the first
  sweep removes every row the pushes did not touch.

Reported per variant: the fill's seconds, the pushes' median and p99, the
longest push and the median of the pushes that ran a sweep (the event loop
does nothing else meanwhile: every client of the shard waits that long), and
rows left; for ``expiring``, the seconds of an export of the whole table right
after the first sweep, while the expired records are still on disk (the scan
under it skips them).

Usage:
    python bench/bench_tier_sweep.py --out bench/results/tier_sweep               # 1M rows, 16 MiB budget
    python bench/bench_tier_sweep.py --rows 200000 --pushes 200                   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_table_options, percentile, run_variants

import psclient
from trainer.cluster import LocalCluster

_WAIT_S = 1800.0  # a fill of millions of rows through a small budget takes minutes


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One variant on a fresh shard: the fill, then ``--pushes`` timed pushes; its figures."""
    server_args = ["--table-memory", args.table_memory, "--table-dir", str(workdir / name)]
    fill_pushes = -(-args.rows // args.batch)
    ttl: dict[str, Any] = {}
    if name == "steps":  # a sweep every ``sweep_every`` pushes; the filled rows stay
        ttl = {"ttl_steps": 8 * args.sweep_every}
        assert fill_pushes + args.pushes < 8 * args.sweep_every, "raise --sweep-every: rows would expire"
    elif name == "expiring":  # the filled rows expire at the first sweep after the fill
        ttl = {"ttl_steps": 8 * args.sweep_every}
    cell: dict[str, Any] = {"variant": name, **ttl}
    rng = np.random.default_rng(3)
    with (
        LocalCluster(1, server_args, start_timeout=_WAIT_S, stop_timeout=_WAIT_S) as cluster,
        psclient.PSClient(cluster.addresses, "w0", timeout=_WAIT_S) as c,
    ):
        c.create_embedding(
            "emb", None, args.dim, optimizer=psclient.Adagrad(0.1), initializer=("uniform", -1, 1), **ttl
        )
        t0 = time.perf_counter()
        for start in range(0, args.rows, args.batch):
            ids = np.arange(start, min(args.rows, start + args.batch), dtype=np.int64)
            c.push({"emb": psclient.Rows(ids, np.zeros((ids.size, args.dim), np.float32))})
        cell["fill_s"] = round(time.perf_counter() - t0, 2)
        if name == "expiring":  # idle pushes of one hot id until the filled rows are past their TTL
            one = psclient.Rows(np.array([0], np.int64), np.zeros((1, args.dim), np.float32))
            for _ in range(8 * args.sweep_every - fill_pushes + 1):
                c.push({"emb": one})
        clock = fill_pushes + (8 * args.sweep_every - fill_pushes + 1 if name == "expiring" else 0)
        took, swept = [], []
        for _ in range(args.pushes):
            ranks = np.floor(args.rows * rng.random(args.ids) ** 3).astype(np.int64)
            ids = np.unique(ranks)
            grads = np.full((ids.size, args.dim), 1e-3, np.float32)
            t0 = time.perf_counter()
            c.push({"emb": psclient.Rows(ids, grads)})
            took.append(time.perf_counter() - t0)
            clock += 1
            if ttl and clock % args.sweep_every == 0:
                swept.append(took[-1])
                if name == "expiring" and "export_after_sweep_s" not in cell:
                    # Right after the mass expiry, its records still on disk: a scan of the table (ScanRows,
                    # psctl's and export's paging) skips them, a batch of records checked at a time.
                    t0 = time.perf_counter()
                    cell["rows_at_sweep"] = sum(x.size for x, _ in c.export("emb"))
                    cell["export_after_sweep_s"] = round(time.perf_counter() - t0, 2)
        rows = sum(x.size for x, _ in c.export("emb"))
    ms = [1e3 * t for t in took]
    cell.update(
        pushes=len(took),
        sweeps=len(swept),
        push_median_ms=round(statistics.median(ms), 2),
        push_p99_ms=round(percentile(ms, 99), 2),
        push_max_ms=round(max(ms), 1),
        sweep_push_median_ms=round(1e3 * statistics.median(swept), 1) if swept else None,
        rows_after=rows,
    )
    print(f"{name}: {cell}", file=sys.stderr, flush=True)
    return cell


def _markdown(
    args: argparse.Namespace, note: dict[str, Any], cells: list[dict[str, Any]], command: str
) -> str:
    lines = [
        "# Expiry sweeps of a dynamic table past memory",
        "",
        f"Command: `{command}`",
        "",
        f"One shard (`--table-memory {args.table_memory}`), one dynamic table of {args.rows:,} ids "
        f"x {args.dim} "
        f"(float32, Adagrad), filled by pushes of {args.batch:,} new ids; then {args.pushes} pushes of "
        f"{args.ids} power-law ids, a sweep due every {args.sweep_every} pushes where the table has a TTL. "
        f"Machine: {note}",
        "",
        "| variant | fill s | pushes | sweeps | push median ms | p99 ms | max ms | "
        "median of the pushes that swept, ms | rows after | export right after the first sweep, s (rows) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        export = (
            f"{c['export_after_sweep_s']} ({c['rows_at_sweep']:,})" if "export_after_sweep_s" in c else "-"
        )
        lines.append(
            f"| {c['variant']} | {c['fill_s']} | {c['pushes']} | {c['sweeps']} | {c['push_median_ms']} | "
            f"{c['push_p99_ms']} | {c['push_max_ms']} | {c['sweep_push_median_ms']} | {c['rows_after']:,} | "
            f"{export} |"
        )
    lines += [
        "",
        "A push holds the shard's event loop for its whole time, its share of a sweep included: every "
        "client of the shard waits. A sweep expires the rows in memory at once and raises the disk "
        "tier's cut (reads skip the records before it); then each push deletes at most a batch of the "
        "expired records (`_EXPIRE_BATCH` in `psserver.rows.tiering`), so the longest push is the figure "
        "to read in the expiring row, and its median counts the pushes that deleted a batch.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_table_options(
        ap, rows=1_000_000, batch=20_000, variants="none,steps,expiring", dir_help="where the tier goes"
    )
    ap.add_argument("--ids", type=int, default=2048, help="ids drawn per timed push (default 2048)")
    ap.add_argument("--pushes", type=int, default=400, help="timed pushes per variant (default 400)")
    ap.add_argument("--sweep-every", type=int, default=60, help="pushes between sweeps (default 60)")
    ap.add_argument("--table-memory", default="16MiB", help="the shard's budget (default 16MiB)")
    run_variants(
        "bench_tier_sweep.py", argv, ap.parse_args(argv), "bench-tier-sweep-", run_variant, _markdown
    )


if __name__ == "__main__":
    main()
