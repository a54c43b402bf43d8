"""Packet loss (issue 23): how push_pull rounds degrade when every link drops a share of its packets, against
plain TCP sockets doing the same rounds on the same links in the same run.

The cluster in a box of ``bench_scaling.py`` (each shard and worker a network namespace, every link shaped
to ``--rate-mbit``), with nftables dropping ``--drop`` % of every host's packets at random, each way. For
each message size, mode and loss, two systems run the same rounds from n workers on k shards:

- ``ps``: psclient push_pull (async; or sync: one step of every worker, the barrier on the shard);
- ``raw``: one TCP connection per worker and shard, the whole push then the whole answer (sync: no
  answer before every worker's push is in, as the barrier).

The figure that matters is the *retained* throughput, rounds/s under loss / rounds/s without loss, of
each system: a project that degrades no worse than one TCP flow doing its rounds retains as much as raw.

    sudo python bench/bench_loss.py --sizes-kib 16,1024 --drop 0,5 --modes async,sync --workers 4 \\
        --out bench/results/loss

Needs root, iproute2 and nftables. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm
from bench_scaling import cell_line, run_ps_cell

from trainer.netns import NetnsCluster

SYSTEMS = ("ps", "raw")


def _per_round(cell: dict[str, Any], counter: str) -> str:
    """A TCP counter of the cell (every host) per round of one worker."""
    rounds = sum(cell["rounds"]) / len(cell["rounds"])
    return f"{cell.get(counter, 0) / max(rounds, 1):.2f}"


def render(cells: list[dict[str, Any]], args: argparse.Namespace, note: dict[str, Any], command: str) -> str:
    by = {(c["size_kib"], c["mode"], c["drop"], c["system"]): c for c in cells}
    lines = [
        "# Packet loss on the namespace cluster (bench/bench_loss.py)",
        "",
        f"Command: `{command}`",
        "",
        f"n = {args.workers} workers, k = {args.shards} shard(s), psclient over {args.wire}, each host a "
        "namespace of its own, every link "
        f"{args.rate_mbit:g} Mbit/s each way; loss dropped at random by nftables on every host, each way. "
        f"{args.seconds:g} s per cell. Machine: {note['cpus']} x {note['cpu_model']}, load before "
        f"{note['loadavg_1_5_15']}.",
        "",
        "Rounds/s of each system, and retained = rounds/s with loss / rounds/s without (1.00: no loss of "
        "throughput). raw = plain TCP sockets doing the same rounds. RTOs and retransmits: the kernel's TCP "
        "counters (retransmission timeouts, each at least 200 ms of a stalled flow; retransmitted segments), "
        "summed over every host, per round of one worker.",
        "",
        "| size | mode | loss % | ps rounds/s | raw rounds/s | ps / raw | ps retained | raw retained "
        "| ps RTOs / round | raw RTOs / round | ps retransmits / round | raw retransmits / round "
        "| machine CPU % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size in args.sizes_kib:
        for mode in args.modes:
            for drop in args.drop:
                ps, raw = by.get((size, mode, drop, "ps")), by.get((size, mode, drop, "raw"))
                if ps is None or raw is None:
                    continue
                base_ps, base_raw = by.get((size, mode, 0.0, "ps")), by.get((size, mode, 0.0, "raw"))
                rate_ps, rate_raw = 1 / ps["round_s"], 1 / raw["round_s"]
                kept_ps = f"{base_ps['round_s'] / ps['round_s']:.2f}" if base_ps else "-"
                kept_raw = f"{base_raw['round_s'] / raw['round_s']:.2f}" if base_raw else "-"
                lines.append(
                    f"| {size:g} KiB | {mode} | {drop:g} | {rate_ps:.1f} | {rate_raw:.1f} | "
                    f"{rate_ps / rate_raw:.2f} | {kept_ps} | {kept_raw} | {_per_round(ps, 'tcp_timeouts')} | "
                    f"{_per_round(raw, 'tcp_timeouts')} | {_per_round(ps, 'tcp_retrans_segs')} | "
                    f"{_per_round(raw, 'tcp_retrans_segs')} | {ps['machine_cpu_pct']} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-kib", type=cm.ints, default=cm.ints("16,1024"), help="M values (KiB)")
    parser.add_argument("--drop", default="0,5", help="loss percentages, 0 first (default 0,5)")
    parser.add_argument("--modes", default="async,sync", help="ps modes (default async,sync)")
    parser.add_argument("--workers", type=int, default=4, help="n (default 4)")
    parser.add_argument("--shards", type=int, default=1, help="k (default 1)")
    parser.add_argument(
        "--rate-mbit", type=float, default=500, help="every link's rate each way (default 500)"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per cell (default 8)")
    parser.add_argument("--min-rounds", type=int, default=3, help="and at least this many rounds (default 3)")
    parser.add_argument(
        "--wire",
        choices=("data_port", "grpc"),
        default="data_port",
        help="psclient's wire (default data_port)",
    )
    parser.add_argument("--out", help="write OUT.md and OUT.json (e.g. bench/results/loss)")
    args = parser.parse_args(argv)
    args.drop = [float(x) for x in args.drop.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.drop or args.drop[0] != 0:
        parser.error("--drop must start with 0 (the baseline)")
    if cm.netns_missing("bench_loss.py"):
        return 2
    command = cm.command_line("bench_loss.py", argv)
    note = cm.machine_note()
    cells: list[dict[str, Any]] = []
    args.max_shards = args.shards
    with NetnsCluster(args.shards + args.workers, rate_mbit=args.rate_mbit) as net:
        for size in args.sizes_kib:
            args.size_bytes, args.size_mib = size << 10, 0
            for mode in args.modes:
                args.mode = mode
                for drop in args.drop:
                    for host in net.hosts:
                        net.drop(host, drop)
                    for system in SYSTEMS:
                        cell = run_ps_cell(net, args, system, args.workers, args.shards, args.rate_mbit)
                        cells.append({**cell, "size_kib": size, "mode": mode, "drop": drop})
                        print(
                            f"{size} KiB {mode} loss {drop:g} %: {cell_line(cell)}",
                            file=sys.stderr,
                            flush=True,
                        )
    text = render(cells, args, note, command)
    print(text)
    results = cm.results_record(command, note, cells, rate_mbit=args.rate_mbit)
    cm.write_results(args.out, text, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
