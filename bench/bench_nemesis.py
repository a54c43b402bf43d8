"""The nemesis soak (issue 23): clients push and pull counters on a replicated shard on the cluster in a box
while every fault kind is injected at random, one at a time (``psload.nemesis``); the checker
(``psload.checker``) then judges the whole history. Per mode: faults injected, calls, errors, the longest
time a client went without an acknowledged push, how long after a fault healed every client had its next
push acknowledged (p50, max, and the worst fault), and the anomalies (0 expected).

Needs root, iproute2 and nftables (``trainer.netns.netns_available``).

Usage::

    python bench/bench_nemesis.py --seconds 600 [--modes async,sync,ssp] [--seed 1] [--timeout 6]
        [--keep DIR] [--out bench/results/nemesis]

``--seconds`` is per mode. ``--keep DIR``: keep every history (``DIR/<mode>/*.jsonl``), the monitor's status
reads and the processes' logs. Exit status 0 when no mode had an anomaly.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import command_line, machine_note, netns_missing, write_results
from psload.nemesis import FAULTS, MODES, NemesisConfig, run_nemesis


def _table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| mode | faults | pushes ok | failed (unknown outcome) | pulls ok | longest push gap | "
        "recovery after a heal, p50 / max | first ack after the primary paused | errors naming only the pair "
        "| anomalies |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        s = r["report"]["stats"]
        kinds: dict[str, int] = {}
        for f in r["faults"]:
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
        faults = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        anomalies = r["report"]["anomalies_by_kind"] or 0
        cells = [
            r["config"]["mode"], f"{len(r['faults'])} ({faults})", s["pushes_ok"], s["pushes_failed"],
            s["pulls_ok"], f"{s['longest_push_gap_s']} s",
            f"{s.get('recovery_p50_s')} / {s.get('recovery_max_s')} s ({s.get('recovery_worst', '')})",
            ", ".join(f"{t} s" for t in s.get("primary_pause_first_ack_s", [])) or "-",
            s["errors_naming_only_the_pair"], anomalies,
        ]  # fmt: skip
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600.0, help="seconds of faults per mode")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: async, sync, ssp")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--timeout", type=float, default=6.0, help="the clients' deadline per call, seconds")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated fault kinds")
    p.add_argument(
        "--burners", type=int, default=0, help="processes spinning on the CPU all along (a loaded machine)"
    )
    p.add_argument("--keep", help="keep histories and logs under this directory")
    p.add_argument("--out", help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if netns_missing("bench_nemesis.py"):
        return 2
    results = []
    for i, mode in enumerate(m for m in args.modes.split(",") if m):
        config = NemesisConfig(
            mode=mode, seconds=args.seconds, seed=args.seed + i, clients=args.clients, timeout_s=args.timeout,
            faults=tuple(f for f in args.faults.split(",") if f), burners=args.burners,
            workdir=str(Path(args.keep) / mode) if args.keep else None,
        )  # fmt: skip
        result = run_nemesis(config)
        print(f"{mode}: {result['elapsed_s']} s\n{result['summary']}", flush=True)
        results.append(result)
    command = command_line("bench_nemesis.py", argv)
    text = (
        f"# Nemesis soak\n\n`{command}` ({time.strftime('%Y-%m-%d')}; {machine_note()['cpus']} CPUs"
        + (f", {args.burners} CPU burners" if args.burners else "")
        + ")\n\n"
        + _table(results)
        + "\n\n"
        + "\n\n".join(f"{r['config']['mode']}:\n\n```\n{r['summary']}\n```" for r in results)
        + "\n"
    )
    print(text)
    write_results(args.out, text, {"command": command, "machine": machine_note(), "runs": results})
    if args.keep:
        Path(args.keep, "summary.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
