"""All-reduce benchmark: psclient.collective.Ring vs torch.distributed gloo vs TensorFlow RING collectives.

Every system runs as N real processes on this machine (loopback), float32 sum of
1-256 MiB, in place where the system allows it. Per size it reports the median
time per all-reduce, algorithm bandwidth (bytes / time) and bus bandwidth
(algbw * 2 (n-1) / n, the bytes each link carries), and the ratios of our bus
bandwidth to gloo's and TensorFlow's.

    python bench/bench_allreduce.py                      # 2 and 4 ranks, all systems
    python bench/bench_allreduce.py --ranks 2 --sizes 16,64,256 --systems ours,gloo

torch (``pip install torch==2.13.0``, CPU build) and TensorFlow are benchmark-only
dependencies, imported only in their worker processes. Every worker is bounded
by ``--worker-timeout`` seconds and every timing loop by an iteration count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer.cluster import reserve_ports

REPO = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "ALLREDUCE-RESULT "
NOTES_HEADING = "## Notes"
MIB = 1 << 20
SYSTEMS = (
    "ours",
    "gloo",
    "tf",
    "ours_fp16",
    "ours_tcp",
)  # ours_fp16: float32 data sent as float16; ours_tcp: transport="tcp" (neither in the default run)
DEFAULT_SYSTEMS = "ours,gloo,tf"


def iterations(size_mib: int) -> tuple[int, int]:
    """(warmup, timed) iterations for a size: fewer for big sizes (bounded run time)."""
    if size_mib <= 1:
        return 10, 50
    if size_mib <= 16:
        return 5, 20
    if size_mib <= 64:
        return 3, 8
    return 2, 5


def free_ports(n: int) -> list[int]:
    return [int(a.rpartition(":")[2]) for a in reserve_ports(n)]


# --------------------------------------------------------------------------- workers (one per rank)


def _time_loop(fn: Any, size_mib: int, sync: Any) -> list[float]:
    warmup, iters = iterations(size_mib)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def worker_ours(
    rank: int, world: int, ports: list[int], sizes: list[int], opts: dict[str, Any]
) -> dict[int, list[float]]:
    import numpy as np

    from psclient.collective import Ring

    out: dict[int, list[float]] = {}
    with Ring([f"127.0.0.1:{p}" for p in ports], rank, timeout=120.0, **opts) as ring:
        for mib in sizes:
            x = np.ones(mib * MIB // 4, np.float32)
            out[mib] = _time_loop(lambda x=x: ring.allreduce(x, out=x), mib, ring.barrier)
    return out


def worker_gloo(
    rank: int, world: int, ports: list[int], sizes: list[int], opts: dict[str, Any]
) -> dict[int, list[float]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world, timeout=_td(120)
    )
    out: dict[int, list[float]] = {}
    try:
        for mib in sizes:
            x = torch.ones(mib * MIB // 4, dtype=torch.float32)
            out[mib] = _time_loop(lambda x=x: dist.all_reduce(x), mib, dist.barrier)
    finally:
        dist.destroy_process_group()
    return out


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def worker_tf(
    rank: int, world: int, ports: list[int], sizes: list[int], opts: dict[str, Any]
) -> dict[int, list[float]]:
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    out: dict[int, list[float]] = {}

    device = strategy.extended.worker_devices[0]

    def replica_fn(v: Any) -> Any:
        # NOTE: inside tf.function the input has no device, and all_reduce then fails with
        # "destinations can not be empty" (TF 2.21); an identity placed on the worker's CPU fixes it.
        with tf.device(device):
            v = tf.identity(v)
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, v)

    @tf.function
    def step(v: Any) -> Any:
        return strategy.run(replica_fn, args=(v,))

    for mib in sizes:
        with strategy.scope():
            x = tf.ones([mib * MIB // 4], tf.float32)
        # .numpy() of a tiny slice forces completion without copying the whole result.
        out[mib] = _time_loop(lambda x=x: step(x)[:1].numpy(), mib, lambda: step(tf.ones([1]))[:1].numpy())
    return out


def worker_ours_fp16(
    rank: int, world: int, ports: list[int], sizes: list[int], opts: dict[str, Any]
) -> dict[int, list[float]]:
    return worker_ours(rank, world, ports, sizes, {**opts, "compression": "fp16"})


def worker_ours_tcp(
    rank: int, world: int, ports: list[int], sizes: list[int], opts: dict[str, Any]
) -> dict[int, list[float]]:
    return worker_ours(rank, world, ports, sizes, {**opts, "transport": "tcp"})


WORKERS = {
    "ours": worker_ours,
    "gloo": worker_gloo,
    "tf": worker_tf,
    "ours_fp16": worker_ours_fp16,
    "ours_tcp": worker_ours_tcp,
}


def worker_main(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    ports = [int(p) for p in args.ports.split(",")]
    opts = json.loads(args.opts)
    result = WORKERS[args.worker](args.rank, args.world, ports, sizes, opts)
    if args.rank == 0:
        sys.stdout.write(RESULT_PREFIX + json.dumps({str(k): v for k, v in result.items()}) + "\n")
        sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------- driver


def run_system(
    system: str, world: int, sizes: list[int], timeout: float, opts: dict[str, Any]
) -> dict[int, list[float]]:
    """Starts ``world`` worker processes and returns rank 0's per-iteration times per size (MiB)."""
    ports = free_ports(world)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRPC_VERBOSITY": "ERROR", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                system,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--ports",
                ",".join(map(str, ports)),
                "--sizes",
                ",".join(map(str, sizes)),
                "--opts",
                json.dumps(opts),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"{system} with {world} ranks did not finish within {timeout} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"{system} rank {r} exited {p.returncode}: {err[-3000:]}")
    for line in outputs[0][0].splitlines():
        if line.startswith(RESULT_PREFIX):
            return {int(k): v for k, v in json.loads(line[len(RESULT_PREFIX) :]).items()}
    raise RuntimeError(f"{system}: no result line from rank 0")


def row(system: str, world: int, mib: int, times: list[float]) -> dict[str, Any]:
    t = statistics.median(times)
    algbw = mib * MIB / t / 1e9
    return {
        "system": system,
        "ranks": world,
        "size_mib": mib,
        "iters": len(times),
        "median_ms": round(t * 1e3, 3),
        "min_ms": round(min(times) * 1e3, 3),
        "algbw_gb_s": round(algbw, 4),
        "busbw_gb_s": round(algbw * 2 * (world - 1) / world, 4),
    }


def markdown(rows: list[dict[str, Any]], systems: list[str]) -> str:
    """One row per (ranks, size): ms / algbw / busbw per system, then busbw ratios of ours to others."""
    ours = [s for s in systems if s.startswith("ours")]
    others = [s for s in systems if not s.startswith("ours")]
    pairs = [(o, b) for o in ours for b in others]
    header = ["ranks", "size"]
    for s in systems:
        header += [f"{s} ms", f"{s} algbw", f"{s} busbw"]
    header += [f"{o}/{b}" for o, b in pairs]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by = {(r["system"], r["ranks"], r["size_mib"]): r for r in rows}
    for world, mib in sorted({(r["ranks"], r["size_mib"]) for r in rows}):
        cells = [str(world), f"{mib} MiB"]
        for s in systems:
            r = by.get((s, world, mib))
            cells += (
                [f"{r['median_ms']:.1f}", f"{r['algbw_gb_s']:.3f}", f"{r['busbw_gb_s']:.3f}"]
                if r
                else ["-"] * 3
            )
        for o, b in pairs:
            a, c = by.get((o, world, mib)), by.get((b, world, mib))
            cells.append(f"{a['busbw_gb_s'] / c['busbw_gb_s']:.2f}x" if a and c else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_note() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}, "
        f"load average before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--sizes", default="1,16,64,256", help="comma-separated sizes in MiB")
    ap.add_argument(
        "--systems", default=DEFAULT_SYSTEMS, help="comma-separated: ours, gloo, tf, ours_fp16, ours_tcp"
    )
    ap.add_argument(
        "--opts", default="{}", help="JSON keyword options of Ring (e.g. '{\"chunk_bytes\": 4194304}')"
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per system (interleaved); the best median counts"
    )
    ap.add_argument(
        "--worker-timeout", type=float, default=600.0, help="bound on each system x world run (s)"
    )
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)

    systems = [s for s in args.systems.split(",") if s]
    sizes = [int(s) for s in args.sizes.split(",")]
    opts = json.loads(args.opts)
    note = machine_note()
    started = time.time()
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for world in [int(w) for w in args.ranks.split(",")]:
        for rep in range(args.repeat):
            for system in systems:  # interleaved, so that load from others hits every system alike
                t0 = time.monotonic()
                times = run_system(
                    system, world, sizes, args.worker_timeout, opts if system.startswith("ours") else {}
                )
                for mib in sizes:
                    r = row(system, world, mib, times[mib])
                    key = (system, world, mib)
                    if key not in best or r["median_ms"] < best[key]["median_ms"]:
                        best[key] = r
                sys.stderr.write(f"{system} x{world} run {rep + 1}: {time.monotonic() - t0:.0f} s\n")
    rows = list(best.values())
    table = markdown(rows, systems)
    command = "python bench/bench_allreduce.py " + " ".join(argv if argv is not None else sys.argv[1:])
    sys.stdout.write(table + "\n")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": command.strip(),
            "machine": note,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        }
        out.with_suffix(".json").write_text(
            json.dumps({**meta, "ring_options": opts, "rows": rows}, indent=1) + "\n"
        )
        md = out.with_suffix(".md")
        # Hand-written analysis below a "## Notes" heading survives a re-run.
        old = md.read_text() if md.exists() else ""
        notes = old[old.index(NOTES_HEADING) :] if NOTES_HEADING in old else ""
        load_after = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
        md.write_text(
            f"# All-reduce: psclient.collective.Ring vs gloo vs TensorFlow RING\n\n"
            f"Command: `{meta['command']}`  \nMachine: {note}  \nStarted: {meta['started']}\n\n"
            "float32 sum, median of the timed iterations on rank 0 (best of the --repeat runs, which "
            "alternate between systems), algbw = bytes / time, "
            "busbw = algbw * 2 (n-1) / n; GB/s = 1e9 bytes/s; ratios compare busbw. "
            "Load average after the run: "
            + " / ".join(f"{v:.2f}" for v in load_after)
            + ".\n\n"
            + table
            + "\n"
            + ("\n" + notes if notes else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
