"""Shared helpers of the benchmarks: bounded timing loops, percentiles, child processes, free ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH-RESULT "  # children print one line "BENCH-RESULT <json>" on stdout


@dataclass(frozen=True, slots=True)
class Stat:
    """One measured case: ``iters`` operations of ``nbytes`` payload bytes each."""

    system: str
    op: str
    nbytes: int
    concurrency: int
    iters: int
    seconds: float
    ops_s: float
    gb_s: float
    p50_ms: float
    p99_ms: float


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def summarize(
    system: str, op: str, nbytes: int, concurrency: int, latencies: list[float], elapsed: float
) -> Stat:
    n = len(latencies)
    ops = n / elapsed if elapsed > 0 else 0.0
    return Stat(
        system=system,
        op=op,
        nbytes=nbytes,
        concurrency=concurrency,
        iters=n,
        seconds=round(elapsed, 4),
        ops_s=round(ops, 2),
        gb_s=round(ops * nbytes / 1e9, 4),
        p50_ms=round(percentile(latencies, 50) * 1e3, 4) if n else float("nan"),
        p99_ms=round(percentile(latencies, 99) * 1e3, 4) if n else float("nan"),
    )


async def measure_async(
    op: Callable[[int], Awaitable[Any]],
    *,
    concurrency: int,
    max_iters: int,
    max_seconds: float,
    warmup: int,
) -> tuple[list[float], float]:
    """Runs ``op(worker)`` from ``concurrency`` tasks until ``max_iters`` ops or ``max_seconds`` pass.

    Returns the per-op latencies (seconds) and the wall time of the timed part.
    """
    for w in range(warmup):
        await op(w % concurrency)
    latencies: list[float] = []
    started = 0
    t0 = time.perf_counter()
    deadline = t0 + max_seconds

    async def worker(i: int) -> None:
        nonlocal started
        while started < max_iters and time.perf_counter() < deadline:
            started += 1
            t = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies, time.perf_counter() - t0


def measure_threads(
    op: Callable[[int], Any], *, concurrency: int, max_iters: int, max_seconds: float, warmup: int
) -> tuple[list[float], float]:
    """``measure_async`` for blocking ops: ``concurrency`` threads."""
    for w in range(warmup):
        op(w % concurrency)
    latencies: list[float] = []
    lock = threading.Lock()
    started = 0
    t0 = time.perf_counter()
    deadline = t0 + max_seconds

    def worker(i: int) -> None:
        nonlocal started
        while True:
            with lock:
                if started >= max_iters or time.perf_counter() >= deadline:
                    return
                started += 1
            t = time.perf_counter()
            op(i)
            dt = time.perf_counter() - t
            with lock:
                latencies.append(dt)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max_seconds * 4 + 120)
    return latencies, time.perf_counter() - t0


def emit(stats: list[Stat]) -> None:
    """Prints the child's results as the one line the parent reads."""
    print(RESULT_PREFIX + json.dumps([asdict(s) for s in stats]), flush=True)


def run_child(argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Runs a child benchmark process and returns its results.

    Raises:
        RuntimeError: the child failed or printed no result line.
    """
    proc = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(
        f"child {argv} exited {proc.returncode} without results:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (for peers that need a fixed port up front, e.g. TF)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_file(path: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> str:
    """Waits (bounded) until ``path`` exists; returns its stripped content.

    Raises:
        RuntimeError: the process exited or the file did not appear in time.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args} exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear within {timeout:.0f}s")


def ints(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (an argparse type)."""
    return [int(x) for x in text.split(",") if x]


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all cores so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def machine_note() -> dict[str, Any]:
    """What the machine is and how loaded it was."""
    load = os.getloadavg()
    mem_kb = 0
    model = platform.processor()
    with contextlib.suppress(OSError, StopIteration, ValueError):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        mem_kb = int(next(line.split()[1] for line in meminfo if line.startswith("MemTotal")))
    with contextlib.suppress(OSError, StopIteration):
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "mem_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
    }


def results_record(
    command: str, note: dict[str, Any], cells: list[dict[str, Any]], **fields: Any
) -> dict[str, Any]:
    """A run's JSON record: its command, machine, ``fields``, every cell, and what else ran at its end."""
    return {
        "command": command,
        "machine": note,
        **fields,
        "cells": cells,
        "top_processes_after": top_processes(),
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def write_results(out: str | None, text: str, results: dict[str, Any]) -> None:
    """Writes ``OUT.md`` (the rendered tables) and ``OUT.json`` (every number) when ``--out`` is given."""
    if not out:
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    Path(f"{out}.json").write_text(json.dumps(results, indent=2) + "\n")


def add_table_options(ap: Any, *, rows: int, batch: int, variants: str, dir_help: str, dim: int = 32) -> None:
    """The options of the benches of one dynamic table on fresh shards (``run_variants`` reads
    ``--variants``, ``--dir`` and ``--out``): its ids, row width, ids per fill push, the variants to run
    (``variants``: the default, comma-separated), where the files go, and the results' path."""
    ap.add_argument("--rows", type=int, default=rows, help=f"ids in the table (default {rows:,})")
    ap.add_argument("--dim", type=int, default=dim, help=f"row width (default {dim})")
    ap.add_argument("--batch", type=int, default=batch, help=f"ids per fill push (default {batch:,})")
    ap.add_argument("--variants", default=variants, help=f"comma-separated among {variants} (default all)")
    ap.add_argument("--dir", default=None, help=f"{dir_help} (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")


def run_variants(
    script: str,
    argv: Sequence[str] | None,
    args: Any,
    prefix: str,
    run_variant: Callable[[str, Any, Path], dict[str, Any]],
    markdown: Callable[[Any, dict[str, Any], list[dict[str, Any]], str], str],
) -> None:
    """Runs ``run_variant(name, args, workdir)`` for each of ``args.variants`` (comma-separated) in a
    temporary directory under ``args.dir``, prints ``markdown(args, note, cells, command)`` and writes
    the results (``--out``: ``args.out``)."""
    note = machine_note()
    command = command_line(script, argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=prefix) as tmp:
        cells = [run_variant(v, args, Path(tmp)) for v in args.variants.split(",") if v]
    text = markdown(args, note, cells, command)
    print(text)
    write_results(args.out, text, results_record(command, note, cells, args=vars(args)))


def top_processes(limit: int = 8) -> list[str]:
    """The busiest processes right now (what else ran on the machine)."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "pcpu,etimes,args", "--sort=-pcpu"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip()[:160] for line in out.splitlines()[1 : limit + 1]]


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """How this run was started, for its results: ``python bench/SCRIPT ARGS`` (``argv``: sys.argv's)."""
    return f"python bench/{script} " + shlex.join(sys.argv[1:] if argv is None else argv)


def netns_missing(script: str) -> bool:
    """True, having said why on stderr, where ``script`` cannot build its namespace cluster (not root, no
    ``ip``/``tc``/``nft``); the bench then exits 2."""
    from trainer.netns import netns_available

    ok, why = netns_available()
    if not ok:
        print(f"{script} needs network namespaces: {why}", file=sys.stderr)
    return not ok


def add_congestion_arg(parser: Any) -> None:
    """``--congestion``: the TCP congestion control of every host of a namespace cluster."""
    from trainer.netns import DEFAULT_CONGESTION

    parser.add_argument(
        "--congestion",
        default=DEFAULT_CONGESTION,
        help=f"TCP congestion control inside every host (default {DEFAULT_CONGESTION}, Linux's default; "
        "'machine': the machine's own, which namespaces inherit, e.g. bbr)",
    )


def add_link_args(parser: Any) -> None:
    """``--acks`` and ``--peer-queues``: how a namespace cluster's shaped links queue (``link_options``)."""
    parser.add_argument(
        "--acks",
        choices=("first", "queued"),
        default="first",
        help="first (default since 2026-12-07): every link puts pure ACKs in an htb class of their own that "
        "goes first (NetnsCluster(small_first=True)), as a host's fq_codel and a shallow switch queue would; "
        "queued: one queue for all, ACKs behind up to 1,000 packets of data (the results before)",
    )
    parser.add_argument(
        "--peer-queues",
        type=int,
        default=32,
        help="each host sends its data through this many queues by peer, served in turn "
        "(NetnsCluster(peer_queues=...), a power of two; as a Linux host's per-flow qdisc; default 32 since "
        "2026-12-07); 0: one FIFO (the results before)",
    )


def link_options(args: Any) -> dict[str, Any]:
    """``--acks`` and ``--peer-queues`` as ``NetnsCluster``'s keyword arguments."""
    return {"small_first": args.acks == "first", "peer_queues": args.peer_queues}


def link_text(args: Any) -> str:
    """How a report names the links' queues: "htb, ACKs first, 32 queues by peer on the hosts' side"."""
    text = "htb" + (", ACKs first" if args.acks == "first" else "")
    return text + (f", {args.peer_queues} queues by peer on the hosts' side" if args.peer_queues else "")


def add_sysctl_arg(parser: Any) -> None:
    """``--sysctl KEY=VALUE`` (repeatable): a per-namespace setting of every host of a namespace cluster."""
    parser.add_argument(
        "--sysctl",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a net.* setting inside every host, e.g. net.ipv4.tcp_slow_start_after_idle=0 (repeatable)",
    )


def sysctls_of(args: Any) -> dict[str, str]:
    """``--sysctl``'s settings for ``NetnsCluster(sysctls=)``."""
    return dict(item.split("=", 1) for item in args.sysctl)


def congestion_of(args: Any) -> str | None:
    """``--congestion``'s value for ``NetnsCluster(congestion=)`` (None: the machine's default)."""
    return None if args.congestion == "machine" else args.congestion


def congestion_text(args: Any) -> str:
    """How a report names the hosts' congestion control: what they ran (``args.congestion_ran``, set by
    ``note_congestion``), and what was asked where that differs."""
    ran = getattr(args, "congestion_ran", None) or args.congestion
    text = f"TCP {ran}"
    if args.congestion == "machine":
        text += " (the machine's)"
    elif ran != args.congestion:
        text += f" (the machine's: the kernel refused {args.congestion} in a namespace)"
    return text + "".join(f", {item}" for item in getattr(args, "sysctl", []))


def note_congestion(args: Any, net: Any, host: Any) -> None:
    """Records what congestion control ``host`` of cluster ``net`` runs, for ``congestion_text``."""
    args.congestion_ran = net.congestion_of(host)
