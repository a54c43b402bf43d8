"""A disk tier's expiry batches, in process: what a push's ``expired`` call costs while a mass expiry drains.

One store (``log`` or ``lmdb``, as ``--table-tier-store`` opens it) of ``--rows`` records of a row of
``--dim`` float32 and its Adagrad slot, with a ``ttl_steps`` expiry index, written as a tiered piece
spills: batches of ``--batch`` ids in random order, each record stamped with a step a little before its
batch's (rows spilled are the least recently used), and a fifth of the ids spilled a second time over
their first record (dead records on disk). Then a cut that expires ``--expire`` of the records (by their
stamps), drained as ``DynamicRows.tier_step`` drains it: each call ``expired(cut, limit=2048)``, then a
write that deletes the batch, until a batch is short. No sockets, no other work: the figure is the
store's own CPU, which the machine's other load barely moves.

Reported per variant: the first call's CPU ms (the push that runs the sweep), the median and the largest
of the calls after it, the calls, and the records deleted; each call's and each delete's thread CPU time.

Usage:
    python bench/bench_tier_expiry.py --out bench/results/tier_expiry
    python bench/bench_tier_expiry.py --rows 200000 --variants log     # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_table_options, run_variants

from psserver.tier import TierConfig, record_dtype

_LIMIT = 2048  # ``_EXPIRE_BATCH`` in psserver.rows.tiering: a push's batch


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Fills one store, expires ``--expire`` of it, drains the expiry; the calls' CPU."""
    store = name.split("-")[0]
    dtype = np.dtype(np.float32)
    record = record_dtype(args.dim, dtype, {"accumulator": dtype})
    config = TierConfig(str(workdir / f"{name}-{time.monotonic_ns()}"), 1 << 30, store=store)
    config.root.mkdir(parents=True, exist_ok=True)
    tier = config.open_piece("t", record, "t", expiry=("last_step",))
    rng = np.random.default_rng(0)
    ids = rng.permutation(args.rows).astype(np.int64)
    again = rng.permutation(args.rows)[: args.rows // 5].astype(np.int64)
    batches = [ids[i : i + args.batch] for i in range(0, ids.size, args.batch)]
    batches += [again[i : i + args.batch] for i in range(0, again.size, args.batch)]
    stamped = np.full(args.rows, -1, np.int64)  # each id's record's stamp on disk (-1: none yet)
    t0 = time.perf_counter()
    for step, part in enumerate(batches):
        recs = np.zeros(part.size, record)
        recs["value"] = rng.standard_normal((part.size, args.dim)).astype(np.float32)
        recs["last_step"] = step * args.batch + rng.integers(0, 4 * args.batch, part.size)
        had = part[stamped[part] >= 0]  # their older copies (LMDB's expiry index drops their entries)
        older = np.zeros(had.size, tier.stamps)
        older["last_step"] = stamped[had]
        tier.write(part, recs, older=(had, older))
        stamped[part] = recs["last_step"]
    fill_s = time.perf_counter() - t0
    stamps = np.concatenate([r["last_step"] for _, r in tier.items()])
    cut = int(np.quantile(stamps, args.expire))
    calls: list[float] = []
    deletes: list[float] = []
    deleted = 0
    while len(calls) < 10 * args.rows // _LIMIT + 10:  # bounded: each batch is deleted
        c0 = time.thread_time()
        batch = tier.expired(cut, None, limit=_LIMIT)
        calls.append(time.thread_time() - c0)
        c0 = time.thread_time()
        tier.write(batch[:0], np.zeros(0, record), delete=[batch])
        deletes.append(time.thread_time() - c0)
        deleted += batch.size
        if batch.size < _LIMIT:
            break
    tier.check()
    tier.close()
    cell = {
        "variant": name,
        "fill_s": round(fill_s, 2),
        "records": int(stamps.size),
        "first_call_ms": round(1e3 * calls[0], 2),
        "call_median_ms": round(1e3 * statistics.median(calls[1:] or calls), 3),
        "call_max_ms": round(1e3 * max(calls[1:] or calls), 2),
        "delete_median_ms": round(1e3 * statistics.median(deletes), 3),
        "calls": len(calls),
        "deleted": deleted,
    }
    print(f"{name}: {cell}", file=sys.stderr, flush=True)
    return cell


def _markdown(
    args: argparse.Namespace, note: dict[str, Any], cells: list[dict[str, Any]], command: str
) -> str:
    lines = [
        "# A disk tier's expiry batches, in process",
        "",
        f"Command: `{command}`",
        "",
        f"{args.rows:,} records of {args.dim} float32 and an Adagrad slot spilled in batches of "
        f"{args.batch:,} (a fifth spilled again), then a cut expiring {args.expire:.0%} of them, drained "
        f"{_LIMIT} ids a call, each batch deleted. CPU of this thread. Machine: {note}",
        "",
        "| variant | records | first call, CPU ms | later calls, median ms | max ms | delete median ms "
        "| calls | deleted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['variant']} | {c['records']:,} | {c['first_call_ms']} | {c['call_median_ms']} | "
            f"{c['call_max_ms']} | {c['delete_median_ms']} | {c['calls']} | {c['deleted']:,} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_table_options(ap, rows=1_000_000, batch=2048, variants="log,lmdb", dir_help="where the stores go")
    ap.add_argument("--expire", type=float, default=0.58, help="the fraction of records the cut expires")
    args = ap.parse_args(argv)
    run_variants("bench_tier_expiry.py", argv, args, "bench-tier-expiry-", run_variant, _markdown)


if __name__ == "__main__":
    main()
