"""The replication protocol's long run: many fault-seeds of the deterministic simulation, in every mode.

    python bench/bench_simulation.py --seeds 100000 --jobs 2 --out bench/results/simulation

Modes are interleaved (chunks of 50 seeds). ``--minutes`` stops the run after that long and reports the
seeds done. Each seed runs a replicated shard (the real ``psserver`` code on virtual time,
``psload.simulation``) under its own faults and proves the history; a seed with an anomaly is listed
with its faults (replay it with ``python -m psload.simulation --seed N --mode MODE -v``). Prints
progress every 1,000 seeds and writes a Markdown summary: seeds, anomalies, seeds a minute per core.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from psload.simulation import MODES, Options, run_seed

_CHUNK = 50


def _run(job: tuple[str, int, int, bool]) -> tuple[str, int, list[str], float]:
    mode, first, count, serve_alone = job
    started = time.process_time()
    failed = []
    for seed in range(first, first + count):
        result = run_seed(seed, Options(mode=mode, serve_alone=serve_alone))
        if not result.ok:
            kinds = sorted({a.kind for a in result.extra} | set(result.report.kinds()))
            failed.append(
                f"{mode} seed {seed}: {', '.join(kinds)}; faults: " + "; ".join(map(str, result.faults))
            )
    return mode, count, failed, time.process_time() - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3000, help="seeds per mode (default: %(default)s)")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: every core)"
    )
    parser.add_argument("--serve-alone", action="store_true", help="the shards' --serve-alone")
    parser.add_argument(
        "--minutes",
        type=float,
        help="stop after this long, with the seeds done by then (default: all of them)",
    )
    parser.add_argument("--out", help="write OUT.md")
    args = parser.parse_args()
    modes = args.modes.split(",")
    jobs = [  # the modes interleaved: a run cut short has some of each
        (mode, start, min(_CHUNK, args.first + args.seeds - start), args.serve_alone)
        for start in range(args.first, args.first + args.seeds, _CHUNK)
        for mode in modes
    ]
    started = time.perf_counter()
    done, cpu = Counter[str](), 0.0
    failed: list[str] = []
    budget = started + args.minutes * 60 if args.minutes else float("inf")
    with multiprocessing.Pool(args.jobs) as pool:
        for mode, count, bad, seconds in pool.imap_unordered(_run, jobs):
            if time.perf_counter() > budget:
                print(f"stopped after {args.minutes:g} minutes", flush=True)
                pool.terminate()
                break
            done[mode] += count
            cpu += seconds
            failed += bad
            for line in bad:
                print("ANOMALY", line, flush=True)
            total = sum(done.values())
            if total % 1000 < count:
                print(f"{total} seeds, {len(failed)} with anomalies, {time.perf_counter() - started:.0f}s",
                      flush=True)  # fmt: skip
    total = sum(done.values())
    elapsed = time.perf_counter() - started
    per_core = total / cpu * 60 if cpu else 0.0
    per_mode = ", ".join(f"{m} {n}" for m, n in sorted(done.items()))
    summary = (
        f"{total} seeds ({per_mode}), {len(failed)} with anomalies; "
        f"{elapsed:.0f} s on {args.jobs} processes, {per_core:.0f} seeds a minute per core (CPU time)"
    )
    print(summary)
    if args.out:
        command = "python bench/bench_simulation.py " + " ".join(sys.argv[1:])
        text = [
            "# The replication protocol in the deterministic simulation",
            "",
            f"Command: `{command}` ({time.strftime('%Y-%m-%d', time.gmtime())}, this machine: "
            f"{os.cpu_count()} cores).",
            "",
            summary + ".",
            "",
            *(f"- {line}" for line in failed[:50]),
        ]
        Path(f"{args.out}.md").write_text("\n".join(text) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
