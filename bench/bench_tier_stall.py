"""How long other clients wait while a shard reads and writes a table's disk tier for one large request.

One shard (a real ``psserver`` process, ``--table-memory BUDGET --table-dir``) holds one dynamic table of
``--rows`` ids x ``--dim`` (float32, Adagrad), filled by pushes of ``--batch`` new ids, most of its rows
on disk. Then, for ``--seconds``, a heavy client looks up ``--ids`` ids drawn uniformly from the table
(nearly all on disk) and pushes their gradients (which fills them and spills as many), over and over,
while a probe client, in a thread of its own, looks up 8 ids in memory every ``--probe-every-ms`` (or
as soon as its last lookup returns, when that took longer) and times each lookup: its waits are the
shard's event loop busy with the heavy client's disk work. Variants, each on
a fresh shard:

- ``inline``: ``--inline-apply-bytes 1TiB``: every disk read and write on the event loop (the peer: the
  shard before disk work moved to worker threads);
- ``threads``: the default ``--inline-apply-bytes`` (1 MiB): a request's disk work on more than that
  many bytes of records in a worker thread.

Reported per variant: the probe's lookups (count, median, p99, longest) and the heavy client's rounds
(a lookup and a push) per second.

Usage:
    python bench/bench_tier_stall.py --out bench/results/tier_stall
    python bench/bench_tier_stall.py --rows 200000 --seconds 5       # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_table_options, percentile, run_variants

import psclient
from trainer.cluster import LocalCluster

_WAIT_S = 1800.0  # a fill of millions of rows through a small budget takes minutes
_INLINE = {"inline": "1TiB", "threads": None}  # --inline-apply-bytes per variant (None: the default)
_HOT = np.arange(8, dtype=np.int64)  # the probe's ids: pushed in every heavy round, so kept in memory


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One variant on a fresh shard: the fill, then ``--seconds`` of heavy rounds beside the probe."""
    server_args = ["--table-memory", args.table_memory, "--table-dir", str(workdir / name)]
    if _INLINE[name] is not None:
        server_args += ["--inline-apply-bytes", _INLINE[name]]
    cell: dict[str, Any] = {"variant": name, "inline_apply_bytes": _INLINE[name] or "1MiB (default)"}
    rng = np.random.default_rng(5)
    with (
        LocalCluster(1, server_args, start_timeout=_WAIT_S, stop_timeout=_WAIT_S) as cluster,
        psclient.PSClient(cluster.addresses, "heavy", timeout=_WAIT_S) as c,
    ):
        c.create_embedding(
            "emb", None, args.dim, optimizer=psclient.Adagrad(0.1), initializer=("uniform", -1, 1)
        )
        t0 = time.perf_counter()
        for start in range(0, args.rows, args.batch):
            ids = np.arange(start, min(args.rows, start + args.batch), dtype=np.int64)
            c.push({"emb": psclient.Rows(ids, np.zeros((ids.size, args.dim), np.float32))})
        cell["fill_s"] = round(time.perf_counter() - t0, 2)
        waits: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with psclient.PSClient(cluster.addresses, "probe", timeout=60.0) as p:
                due = time.perf_counter()
                while not stop.is_set() and len(waits) < 1_000_000:  # bounded in time and count
                    t = time.perf_counter()
                    p.lookup("emb", _HOT)
                    waits.append(time.perf_counter() - t)
                    due += args.probe_every_ms / 1e3  # a fixed rate: the same load in every variant
                    time.sleep(max(0.0, due - time.perf_counter()))

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        rounds, end = 0, time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            ids = np.unique(np.concatenate([_HOT, rng.integers(8, args.rows, args.ids)]))
            c.lookup("emb", ids)
            c.push({"emb": psclient.Rows(ids, np.full((ids.size, args.dim), 1e-3, np.float32))})
            rounds += 1
        stop.set()
        prober.join(60)
    ms = [1e3 * w for w in waits]
    cell.update(
        probe_lookups=len(ms),
        probe_median_ms=round(statistics.median(ms), 2),
        probe_p99_ms=round(percentile(ms, 99), 2),
        probe_max_ms=round(max(ms), 1),
        heavy_rounds_per_s=round(rounds / args.seconds, 2),
    )
    print(f"{name}: {cell}", file=sys.stderr, flush=True)
    return cell


def _markdown(
    args: argparse.Namespace, note: dict[str, Any], cells: list[dict[str, Any]], command: str
) -> str:
    lines = [
        "# A shard's other clients while it works a table's disk tier",
        "",
        f"Command: `{command}`",
        "",
        f"One shard (`--table-memory {args.table_memory}`), one dynamic table of {args.rows:,} ids x "
        f"{args.dim} (float32, Adagrad), filled by pushes of {args.batch:,} new ids; then for "
        f"{args.seconds:g} s a heavy client looks up and pushes {args.ids:,} ids drawn uniformly (nearly "
        f"all on disk) while a probe client times lookups of 8 ids in memory, one every "
        f"{args.probe_every_ms:g} ms at most. Machine: "
        f"{note}",
        "",
        "| variant | --inline-apply-bytes | fill s | probe lookups | probe median ms | p99 ms | max ms | "
        "heavy rounds/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['variant']} | {c['inline_apply_bytes']} | {c['fill_s']} | {c['probe_lookups']:,} | "
            f"{c['probe_median_ms']} | {c['probe_p99_ms']} | {c['probe_max_ms']} | "
            f"{c['heavy_rounds_per_s']} |"
        )
    lines += [
        "",
        "A probe lookup waits for whatever holds the shard's event loop: with `inline`, the heavy "
        "client's whole disk read (its lookup) and its push's fill and spill; with `threads`, only the "
        "parts under the limit and the steps that change memory.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_table_options(
        ap, rows=1_000_000, batch=20_000, variants="inline,threads", dir_help="where the tier goes"
    )
    ap.add_argument("--ids", type=int, default=20_000, help="ids per heavy lookup and push (default 20,000)")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds measured per variant (default 20)")
    ap.add_argument("--table-memory", default="16MiB", help="the shard's budget (default 16MiB)")
    ap.add_argument(
        "--probe-every-ms", type=float, default=10.0, help="the probe's lookup period (default 10 ms)"
    )
    run_variants(
        "bench_tier_stall.py", argv, ap.parse_args(argv), "bench-tier-stall-", run_variant, _markdown
    )


if __name__ == "__main__":
    main()
