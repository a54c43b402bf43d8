"""CPU cost of an all-reduce per MiB and rank: psclient.collective.Ring (grpc and tcp transports) vs gloo.

Wall-clock bandwidth on a shared 2-core machine mostly measures the other
processes' load; the CPU time a rank spends per MiB (``time.process_time``,
every thread of the process) does not, and it bounds the bandwidth once the
cores are busy. Two ranks per system, float32 sum in place, systems interleaved.

    python bench/bench_allreduce_cpu.py --sizes 16,64,256 --repeat 2

torch (CPU build) is needed for ``gloo`` only (imported in its worker processes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer.cluster import reserve_ports

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
SYSTEMS = ("grpc", "tcp", "gloo")
PREFIX = "CPU-RESULT "


def _ports(n: int) -> list[int]:
    return [int(a.rpartition(":")[2]) for a in reserve_ports(n)]


def _measure(fn: Any, sync: Any, iters: int) -> tuple[float, float]:
    for _ in range(2):
        fn()
    sync()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


def worker(system: str, rank: int, ports: list[int], mib: int, iters: int) -> dict[str, float]:
    import numpy as np

    if system == "gloo":
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{ports[0]}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            t = torch.ones(mib * MIB // 4, dtype=torch.float32)
            wall, cpu = _measure(lambda: dist.all_reduce(t), dist.barrier, iters)
        finally:
            dist.destroy_process_group()
    else:
        from psclient.collective import Ring

        with Ring([f"127.0.0.1:{p}" for p in ports], rank, timeout=120.0, transport=system) as ring:
            x = np.ones(mib * MIB // 4, np.float32)
            wall, cpu = _measure(lambda: ring.allreduce(x, out=x), ring.barrier, iters)
    return {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3}


def run(system: str, mib: int, iters: int, timeout: float) -> list[dict[str, float]]:
    ports = _ports(2)
    cmd = [sys.executable, __file__, "--worker", system, "--ports", ",".join(map(str, ports))]
    cmd += ["--sizes", str(mib), "--iters", str(iters)]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        for r in range(2)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        line = next(s for s in stdout.splitlines() if s.startswith(PREFIX))
        out.append(json.loads(line[len(PREFIX) :]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256", help="comma-separated sizes in MiB")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: grpc, tcp, gloo")
    ap.add_argument("--repeat", type=int, default=2, help="runs per system and size (best kept)")
    ap.add_argument("--iters", type=int, default=0, help="timed iterations (default: by size)")
    ap.add_argument("--worker-timeout", type=float, default=300.0)
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        res = worker(args.worker, args.rank, [int(p) for p in args.ports.split(",")], sizes[0], args.iters)
        print(PREFIX + json.dumps(res), flush=True)
        return 0
    systems = args.systems.split(",")
    print("| size | " + " | ".join(f"{s} wall ms | {s} CPU ms/MiB" for s in systems) + " |")
    print("|---|" + "---|---|" * len(systems))
    for mib in sizes:
        iters = args.iters or (10 if mib <= 16 else 6 if mib <= 64 else 4)
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):
            for s in systems:  # interleaved
                ranks = run(s, mib, iters, args.worker_timeout)
                wall = max(r["wall_ms"] for r in ranks)
                cpu = sum(r["cpu_ms"] for r in ranks) / len(ranks) / mib
                old = best.get(s)
                best[s] = (min(wall, old[0]), min(cpu, old[1])) if old else (wall, cpu)
        cells = " | ".join(f"{best[s][0]:.1f} | {best[s][1]:.2f}" for s in systems)
        print(f"| {mib} MiB | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
