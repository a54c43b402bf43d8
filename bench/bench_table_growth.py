"""A dynamic table's housekeeping in memory (growth, evictions): how long its shard stops answering.

A dynamic table without a ``capacity`` doubles its storage when full, copying
every row and slot (``psserver.rows``); a full one evicts (its id index has no
tombstones, so it is never rebuilt as rows come and go). One shard (a real ``psserver``
process) holds the table, ``--rows`` ids x ``--dim`` (float32, Adagrad), filled
by one client's pushes of ``--batch`` new ids, while a second client pulls a
small variable of the same shard every ``--ping-ms`` and records how long each
pull took: a pull waits for whatever holds the shard's event loop. Variants,
each on a fresh shard:

- ``grows``: the table starts small and doubles as it fills;
- ``preallocated``: the peer: a ``capacity`` of ``--rows`` from the start, so it
  never grows (the same pushes, the same rows);
- ``evicting``: a ``capacity`` of a quarter of the rows: once full, every push evicts
  rows (LRU).

Reported per variant: the fill's seconds, the pushes' median and longest time,
the pulls' median, p99 and longest time, and how many pulls took over 100 ms
(a client's view of the shard stopping; a replicated shard's lease is about
2 s).

Usage:
    python bench/bench_table_growth.py --out bench/results/table_growth      # 5M rows x 32
    python bench/bench_table_growth.py --rows 1000000                        # a quick look
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

_WAIT_S = 600.0
_SLOW_MS = 100.0


def _pinger(address: str, every_s: float, stop: threading.Event, out: list[float]) -> None:
    """Pulls the small variable every ``every_s`` until ``stop``; appends each pull's seconds."""
    with psclient.PSClient([address], "pinger", timeout=_WAIT_S) as c:
        while not stop.is_set():  # bounded by the fill, which sets ``stop``
            t0 = time.perf_counter()
            c.pull(["small"])
            out.append(time.perf_counter() - t0)
            stop.wait(every_s)


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One variant on a fresh shard: the fill, timed, with the pinger running; its figures."""
    cell: dict[str, Any] = {"variant": name}
    capacity = {"capacity": args.rows // (4 if name == "evicting" else 1)} if name != "grows" else {}
    pulls: list[float] = []
    stop = threading.Event()
    with (
        LocalCluster(1, workdir=workdir / name, start_timeout=_WAIT_S, stop_timeout=_WAIT_S) as cluster,
        psclient.PSClient(cluster.addresses, "w0", timeout=_WAIT_S) as c,
    ):
        c.create("small", np.zeros(16, np.float32))
        c.create_embedding(
            "emb", None, args.dim, optimizer=psclient.Adagrad(0.1), initializer="zeros", **capacity
        )
        pinger = threading.Thread(
            target=_pinger, args=(cluster.addresses[0], args.ping_ms / 1e3, stop, pulls), daemon=True
        )
        pinger.start()
        took = []
        t0 = time.perf_counter()
        try:
            for start in range(0, args.rows, args.batch):
                ids = np.arange(start, min(args.rows, start + args.batch), dtype=np.int64)
                p0 = time.perf_counter()
                c.push({"emb": psclient.Rows(ids, np.full((ids.size, args.dim), 1e-3, np.float32))})
                took.append(time.perf_counter() - p0)
        finally:
            stop.set()
            pinger.join(_WAIT_S)
        cell["fill_s"] = round(time.perf_counter() - t0, 2)
        rows = sum(x.size for x, _ in c.export("emb"))
    ms, pull_ms = [1e3 * t for t in took], [1e3 * t for t in pulls]
    cell.update(
        pushes=len(took),
        push_median_ms=round(statistics.median(ms), 1),
        push_max_ms=round(max(ms), 1),
        pulls=len(pull_ms),
        pull_median_ms=round(statistics.median(pull_ms), 2),
        pull_p99_ms=round(percentile(pull_ms, 99), 1),
        pull_max_ms=round(max(pull_ms), 1),
        pulls_over_100ms=sum(1 for t in pull_ms if t > _SLOW_MS),
        rows=rows,
    )
    print(f"{name}: {cell}", file=sys.stderr, flush=True)
    return cell


def _markdown(
    args: argparse.Namespace, note: dict[str, Any], cells: list[dict[str, Any]], command: str
) -> str:
    lines = [
        "# A dynamic table's housekeeping in memory (growth, evictions): the shard's other clients",
        "",
        f"Command: `{command}`",
        "",
        f"One shard, one dynamic table of {args.rows:,} ids x {args.dim} (float32, Adagrad) filled by pushes "
        f"of {args.batch:,} new ids, while another client pulls a 16-float variable of the shard every "
        f"{args.ping_ms} ms. `grows`: no capacity (the table doubles when full, copying its rows); "
        f"`preallocated`: `capacity={args.rows:,}` (never grows); `evicting`: `capacity={args.rows // 4:,}` "
        f"(once full, each push evicts). Machine: {note}",
        "",
        "| variant | fill s | pushes | push median ms | push max ms | pulls | pull median ms | pull p99 ms | "
        "pull max ms | pulls over 100 ms | rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['variant']} | {c['fill_s']} | {c['pushes']} | {c['push_median_ms']} | "
            f"{c['push_max_ms']} | {c['pulls']} | {c['pull_median_ms']} | {c['pull_p99_ms']} | "
            f"{c['pull_max_ms']} | {c['pulls_over_100ms']} | {c['rows']:,} |"
        )
    lines += [
        "",
        "A pull waits for whatever holds the shard's event loop; the longest pull is how long the shard "
        "stopped answering. A push that grows the table includes the copy in its own time, wherever the "
        "copy runs.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_table_options(
        ap, rows=5_000_000, batch=50_000, variants="grows,preallocated,evicting", dir_help="where logs go"
    )
    ap.add_argument("--ping-ms", type=float, default=2.0, help="pause between the pinger's pulls (default 2)")
    run_variants(
        "bench_table_growth.py", argv, ap.parse_args(argv), "bench-table-growth-", run_variant, _markdown
    )


if __name__ == "__main__":
    main()
