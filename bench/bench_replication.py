"""What a backup costs: pushes to a replicated shard (``--backup-of``) beside an unreplicated one.

Two one-shard clusters run side by side, one with a backup process; the same
clients alternate between them round by round, so load from other work on the
machine hits both alike. Per payload size: ``push`` latency (p50, p99) and
throughput, SGD on the shard, ``--clients`` concurrent clients (default 1),
``--rounds`` rounds of ``--calls`` pushes per client.

Usage::

    python bench/bench_replication.py [--rounds 4] [--calls 100] [--clients 1] [--out OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psclient
from bench._common import machine_note, summarize
from trainer.cluster import LocalCluster, backups_of

SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=100, help="pushes per round (16 MiB: a tenth of it)")
    p.add_argument(
        "--clients", type=int, default=1, help="concurrent clients (threads), each its own PSClient"
    )
    p.add_argument("--out", help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    with LocalCluster(1) as plain, LocalCluster(1) as primary, backups_of(primary) as backup:
        systems = {
            "unreplicated": [plain.addresses[0]],
            "primary+backup": [f"{primary.addresses[0]}|{backup.addresses[0]}"],
        }
        clients = {
            name: [psclient.PSClient(a, f"bench-{name}-{i}", timeout=60) for i in range(args.clients)]
            for name, a in systems.items()
        }
        pool = concurrent.futures.ThreadPoolExecutor(args.clients)
        stats = []
        try:
            for size in SIZES:
                n = size // 4
                name = f"v{size}"
                for group in clients.values():
                    group[0].create(name, np.zeros(n, np.float32), optimizer=psclient.SGD(1e-6, momentum=0.0))
                grad = {name: np.ones(n, np.float32)}
                calls = max(5, args.calls // 10) if size >= 16 << 20 else args.calls
                latencies: dict[str, list[float]] = {s: [] for s in clients}
                elapsed = dict.fromkeys(clients, 0.0)
                for group in clients.values():  # warm-up
                    for c in group:
                        for _ in range(3):
                            c.push(grad)

                def run(
                    c: psclient.PSClient, out: list[float], calls: int = calls, grad: dict = grad
                ) -> None:
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        c.push(grad)
                        out.append(time.perf_counter() - t0)

                for _ in range(args.rounds):
                    for system, group in clients.items():
                        start = time.perf_counter()
                        for f in [pool.submit(run, c, latencies[system]) for c in group]:
                            f.result(timeout=600)
                        elapsed[system] += time.perf_counter() - start
                for system in clients:
                    stat = summarize(system, "push", size, args.clients, latencies[system], elapsed[system])
                    stats.append(stat)
                    print(
                        f"{size / 2**10:>8.0f} KiB  {system:<15} p50 {stat.p50_ms:8.3f} ms  "
                        f"p99 {stat.p99_ms:8.3f} ms  {stat.ops_s:8.1f} push/s  {stat.gb_s:.3f} GB/s",
                        flush=True,
                    )
        finally:
            pool.shutdown()
            for group in clients.values():
                for c in group:
                    c.close()

    if args.out:
        out = Path(args.out)
        rows = {(s.nbytes, s.system): s for s in stats}
        lines = [
            "# Replication cost: push to a shard with a backup vs without",
            "",
            f"`python bench/bench_replication.py --rounds {args.rounds} --calls {args.calls} "
            f"--clients {args.clients} --out {args.out}` ({args.clients} client(s), each pushing in a loop; "
            "SGD; 2 cores shared by clients, shards and backup)",
            "",
            "| payload | unreplicated p50 ms | with backup p50 ms | unreplicated push/s | with backup push/s "
            "| backup / unreplicated throughput |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for size in SIZES:
            a, b = rows[(size, "unreplicated")], rows[(size, "primary+backup")]
            ratio = b.ops_s / a.ops_s if a.ops_s else float("nan")
            lines.append(
                f"| {size / 2**10:.0f} KiB | {a.p50_ms:.3f} | {b.p50_ms:.3f} | {a.ops_s:.1f} | {b.ops_s:.1f} "
                f"| {ratio:.2f}x |"
            )
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        out.with_suffix(".json").write_text(
            json.dumps({"machine": machine_note(), "stats": [asdict(s) for s in stats]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
