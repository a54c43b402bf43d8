"""What a shard's disk tier costs per step, in process: the same pushes to a piece in memory and on a tier.

One dynamic table piece of ``--rows`` ids x ``--dim`` (float32, Adagrad) in a real ``psserver.store.Store``,
no sockets and no TensorFlow, so the figure is the shard's own work and the machine's other load does not
move it much. It is first filled with every id (zero gradients, ``--batch`` at a time), then each of
``--steps`` steps looks up a batch of ids and pushes their gradients, as one shard of
``bench_embedding.py``'s tiered run does: a batch is the distinct ids of 256 examples x 8 power-law ids
(zipf 0.9) over twice ``--rows`` ids, the half that hash to this shard. Variants:

- ``memory``: the piece in memory (the shard without ``--table-memory``);
- ``tiered``: the same piece with ``--table-memory`` (its hot rows in memory, the others on disk in the
  default store); ``tiered-log``, ``tiered-lmdb``: in that store (``--table-tier-store``).

A variant listed more than once runs that often, in the order listed (interleave them: ``memory,
tiered-log,tiered-lmdb,memory,...``), and the medians are reported.

Reported: CPU ms per step (this process's, which includes LMDB's writes in worker threads and the log's
compaction thread), wall ms per step, and for the tier the rows filled and spilled, the rows in memory at
the end, the records the log's compaction moved (0 on LMDB) and the disk its files take at the end. The
log starts compacting after about 1,000 steps of the defaults (``--steps 4000`` includes it).

``--time-parts``: named parts of the step (the lookup's three calls, the tier's step and its reads and
spill, the id indexes' calls, the log's fetch/gather/append/commit, the optimizer's update) are wrapped and
timed in this thread's CPU (``time.thread_time``: a compaction thread's work is not counted), inclusive of
what they call; the wrappers add about a microsecond a call. Listed per variant, us per step and calls per
step; parts nest (the index's calls are inside the others).

``--paired K``: every variant's piece is made and filled first, then the steps run in blocks of ``K``, the
variants taking turns (each block in the other order from the last), and a tiered variant's CPU is also given
as the median, over the blocks, of its block's CPU over memory's block beside it (with the quartiles). The
machine's load then falls on both alike: on a 2-CPU machine shared with other sessions (loads 6-14), three
runs gave 2.13x, 2.21x and 2.19x, where runs of a variant each (the default) gave 1.84x-4.04x.

``--profile-parts N``: each variant's steps run under ``cProfile`` too (a second pass of the steps is not
made: the profiled run is the measured run, so its CPU per step is inflated by the profiler, several
times for numpy-heavy code; read its parts as shares), and the ``N`` functions of ``psserver``/``pscore``
with the most cumulative time are listed per variant, in microseconds per step, with their calls per step.

Usage:
    python bench/bench_tier_push.py --out bench/results/tier_push
    python bench/bench_tier_push.py --rows 200000 --steps 200     # a quick look
    python bench/bench_tier_push.py --variants memory,tiered-log --paired 50   # on a loaded machine
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import inspect
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_table_options, run_variants

from pscore.optimizers import Adagrad
from psproto.v1 import ps_pb2
from psserver import tables
from psserver.store import Store
from psserver.tier import DEFAULT_STORE, TierConfig, parse_bytes

_ZIPF = 0.9
_IDS_PER_STEP = 256 * 8  # bench_embedding.py's batch of 256 examples of 8 ids


def _batches(rows: int, steps: int) -> list[np.ndarray]:
    """Each step's distinct ids on this shard: power-law ranks over ``2 * rows`` ids, the even half."""
    rng = np.random.default_rng(0)
    top = (2 * rows + 1.0) ** (1.0 - _ZIPF)
    out = []
    for _ in range(steps + 1):
        u = rng.random(_IDS_PER_STEP)
        ranks = np.minimum((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - _ZIPF)) - 1.0, 2 * rows - 1)
        ids = np.unique(ranks.astype(np.int64))
        out.append(ids[ids % 2 == 0] // 2)
    return out


class _Piece:
    """One variant's dynamic table piece in a ``Store`` of its own (``make``), filled with every id."""

    def __init__(self, name: str, args: argparse.Namespace, workdir: Path) -> None:
        tier = None
        if name.startswith("tiered"):  # tiered: the default store; tiered-log, tiered-lmdb: that one
            kind = name.partition("-")[2] or DEFAULT_STORE
            where = str(workdir / f"{name}-{time.monotonic_ns()}")  # a variant may run more than once
            tier = TierConfig(where, parse_bytes(args.table_memory), store=kind)
        self.name, self.dim, self.tiered = name, args.dim, tier is not None
        self.store = Store(tier=tier)
        self.spec = ps_pb2.VariableSpec(
            name="t/rows_0",
            dtype=ps_pb2.DTYPE_FLOAT32,
            shape=[0, args.dim],
            optimizer=Adagrad(0.1).to_proto(),
        )
        self.spec.dynamic.CopyFrom(
            ps_pb2.DynamicTable(
                table="t", dim=args.dim, index=0, count=1,
                initializer=ps_pb2.RowInitializer(name="uniform", args=[-1.0, 1.0]),
            )
        )  # fmt: skip
        self.store.create([self.spec], {})
        self.var = self.store.get(self.spec.name)
        dyn = self.var.dyn
        assert dyn is not None
        self.dyn = dyn
        self.now = 1000.0
        self.fill_s = 0.0

    @classmethod
    async def make(cls, name: str, args: argparse.Namespace, workdir: Path) -> _Piece:
        piece = cls(name, args, workdir)
        t0 = time.perf_counter()
        for start in range(0, args.rows, args.batch):
            await piece.push(np.arange(start, min(args.rows, start + args.batch), dtype=np.int64), 0.0)
        piece.fill_s = time.perf_counter() - t0
        return piece

    async def push(self, ids: np.ndarray, grad: float) -> None:
        self.now += 1.0
        rows = np.full((ids.size, self.dim), grad, np.float32)
        store = self.store
        await store.apply(store.validate_grads({self.spec.name: tables.RowGrad(ids, rows)}), self.now)

    async def step(self, batches: list[np.ndarray], i: int) -> float:
        """Step ``i``: a lookup of the next batch, a push of this one; returns the lookup's process CPU."""
        t = time.process_time()
        lookup = self.dyn.read_begin(
            self.var, batches[i + 1]
        )  # the next batch's rows, as the worker prefetches
        self.dyn.read_cold(lookup)
        self.dyn.read_end(lookup)
        lookup_cpu = time.process_time() - t
        await self.push(batches[i], 0.01)
        return lookup_cpu

    def cell(
        self, args: argparse.Namespace, batches: list[np.ndarray], cpu: float, wall: float
    ) -> dict[str, Any]:
        """The variant's results after its steps (and the tier closed)."""
        dyn, name = self.dyn, self.name
        stats = dyn.proto_stats()
        cell = {
            "variant": name,
            "fill_s": round(self.fill_s, 2),
            "cpu_ms_per_step": round(1e3 * cpu / args.steps, 3),
            "wall_ms_per_step": round(1e3 * wall / args.steps, 3),
            "ids_per_step": round(float(np.mean([b.size for b in batches])), 1),
            "rows_in_memory": int(stats.rows_in_memory) if self.tiered else int(stats.rows),
            "filled": int(stats.filled),
            "spilled": int(stats.spilled),
        }
        if dyn.tier is not None:
            compaction = getattr(dyn.tier, "compaction", None)  # the log store's (LMDB compacts nothing)
            cell["moved"] = compaction.moved if compaction is not None else 0
            cell["disk_mib"] = round(dyn.tier.disk_used / 2**20, 1)
            dyn.close()
        return cell


async def _measure(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    piece = await _Piece.make(name, args, workdir)
    batches = _batches(args.rows, args.steps)
    profile = cProfile.Profile() if args.profile_parts else None
    parts = _PartTimes() if args.time_parts else contextlib.nullcontext(None)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    lookup_cpu = 0.0
    if profile is not None:
        profile.enable()
    with parts as timed:
        for i in range(args.steps):
            lookup_cpu += await piece.step(batches, i)
    if profile is not None:
        profile.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    cell = piece.cell(args, batches, cpu, wall)
    cell["lookup_cpu_ms_per_step"] = round(1e3 * lookup_cpu / args.steps, 3)
    if profile is not None:
        cell["parts"] = _parts(profile, args.steps, args.profile_parts)
    if timed is not None:
        cell["timed_parts"] = timed.per_step(args.steps)
    print(f"{name}: {cell}", file=sys.stderr, flush=True)
    return cell


async def _measure_paired(names: list[str], args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """``--paired K``: every variant's piece made and filled first, then the steps run in blocks of ``K``,
    the variants taking turns (each block in the other order from the last), so that the machine's load
    falls on all of them alike. Each block's process CPU is added to its variant's; a tiered variant's
    ``paired_ratio`` is the median, over the blocks, of its block's CPU over the memory variant's block
    beside it (with the quartiles)."""
    pieces = [await _Piece.make(name, args, workdir) for name in names]
    batches = _batches(args.rows, args.steps)
    k = args.paired
    cpu = [0.0] * len(pieces)
    wall = [0.0] * len(pieces)
    blocks: list[list[float]] = [[] for _ in pieces]
    for b, lo in enumerate(range(0, args.steps, k)):
        order = range(len(pieces)) if b % 2 == 0 else range(len(pieces) - 1, -1, -1)
        for j in order:
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(lo, min(args.steps, lo + k)):
                await pieces[j].step(batches, i)
            blocks[j].append(time.process_time() - c0)
            cpu[j] += blocks[j][-1]
            wall[j] += time.perf_counter() - w0
    cells = [p.cell(args, batches, cpu[j], wall[j]) for j, p in enumerate(pieces)]
    base = next((j for j, name in enumerate(names) if name == "memory"), None)
    for j, cell in enumerate(cells):
        cell["paired_blocks"] = len(blocks[j])
        if base is not None and j != base:
            ratios = np.array(blocks[j]) / np.maximum(np.array(blocks[base]), 1e-9)
            q1, q2, q3 = np.percentile(ratios, [25, 50, 75])
            cell["paired_ratio"] = {
                "median": round(float(q2), 3),
                "q1": round(float(q1), 3),
                "q3": round(float(q3), 3),
            }
        print(f"{cell['variant']}: {cell}", file=sys.stderr, flush=True)
    return cells


def _timed_methods() -> list[tuple[str, type, str]]:
    """``--time-parts``' parts: (label, class, method)."""
    from psserver.hashindex import HashIndex
    from psserver.logtier import LogTier
    from psserver.optimizers import ServerOptimizer
    from psserver.rows.piece import DynamicRows
    from psserver.rows.reads import RowReads
    from psserver.rows.tiering import TierSteps
    from psserver.tier import ColdTier

    return [
        ("lookup: read_begin", RowReads, "read_begin"),
        ("lookup: read_cold", RowReads, "read_cold"),
        ("lookup: read_end", RowReads, "read_end"),
        ("push: optimizer apply_rows", ServerOptimizer, "apply_rows"),
        ("push: tier_step (its resumes)", TierSteps, "tier_step"),
        ("push: tier reads (_tier_reads)", TierSteps, "_tier_reads"),
        ("push: spill (_spill)", TierSteps, "_spill"),
        ("push: spill victims (_spill_victims)", TierSteps, "_spill_victims"),
        ("push: rows released (_release)", DynamicRows, "_release"),
        ("tier: read", ColdTier, "read"),
        ("tier: view", ColdTier, "view"),
        ("log: fetch (index + gather)", LogTier, "_fetch"),
        ("log: gather", LogTier, "_gather"),
        ("log: write", LogTier, "write"),
        ("log: append", LogTier, "_append"),
        ("log: commit", LogTier, "_commit"),
        ("index: get", HashIndex, "get"),
        ("index: positions", HashIndex, "positions"),
        ("index: insert", HashIndex, "insert"),
        ("index: remove", HashIndex, "remove"),
    ]


class _PartTimes:
    """``--time-parts``: wraps ``_timed_methods`` (their classes' attributes, put back on exit) to add up
    each one's thread CPU and calls; a generator's resumes are timed, not the consumer between them."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> _PartTimes:
        for label, cls, attr in _timed_methods():
            fn = cls.__dict__[attr]
            self._saved.append((cls, attr, fn))
            setattr(cls, attr, self._wrap(label, fn))
            self.cpu[label], self.calls[label] = 0.0, 0
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, attr, fn in reversed(self._saved):
            setattr(cls, attr, fn)

    def _wrap(self, label: str, fn: Any) -> Any:
        clock, cpu, calls = time.thread_time, self.cpu, self.calls
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen(*a: Any, **k: Any) -> Any:
                g = fn(*a, **k)
                calls[label] += 1
                sent = None
                while True:
                    t = clock()
                    try:
                        out = g.send(sent)
                    except StopIteration as stop:
                        cpu[label] += clock() - t
                        return stop.value
                    cpu[label] += clock() - t
                    sent = yield out

            return gen

        @functools.wraps(fn)
        def call(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                cpu[label] += clock() - t
                calls[label] += 1

        return call

    def per_step(self, steps: int) -> list[dict[str, Any]]:
        return [
            {"part": k, "us": round(1e6 * self.cpu[k] / steps, 1), "calls": round(self.calls[k] / steps, 2)}
            for k in self.cpu
            if self.calls[k]
        ]


def _parts(profile: cProfile.Profile, steps: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions of psserver/pscore by cumulative time: us per step (under the profiler), calls
    per step."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.items():
        part = Path(path).parts
        if "psserver" not in part and "pscore" not in part:
            continue
        where = "/".join(part[part.index("psserver" if "psserver" in part else "pscore") :])
        rows.append(
            {
                "function": f"{where}:{line}:{func}",
                "cum_us": round(1e6 * cumtime / steps, 1),
                "own_us": round(1e6 * tottime / steps, 1),
                "calls": round(calls / steps, 2),
            }
        )
    rows.sort(key=lambda r: -r["cum_us"])
    return rows[:top]


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    return asyncio.run(_measure(name, args, workdir))


def _markdown(
    args: argparse.Namespace, note: dict[str, Any], cells: list[dict[str, Any]], command: str
) -> str:
    lines = [
        "# A shard's disk tier per training step, in process",
        "",
        f"Command: `{command}`",
        "",
        f"One dynamic table piece of {args.rows:,} ids x {args.dim} (float32, Adagrad) in a `Store`, filled "
        f"with every id, then {args.steps:,} steps of a lookup of the next batch and a push of this one "
        f"(one shard's half of `bench_embedding.py`'s batches). `tiered`: `--table-memory "
        f"{args.table_memory}`. Machine: {note}",
        "",
        "| variant | CPU ms / step | wall ms / step | ids / step | rows in memory | filled | spilled "
        "| moved by compaction | disk MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['variant']} | {c['cpu_ms_per_step']} | {c['wall_ms_per_step']} | {c['ids_per_step']} | "
            f"{c['rows_in_memory']:,} | {c['filled']:,} | {c['spilled']:,} | {c.get('moved', 0):,} | "
            f"{c.get('disk_mib', 0)} |"
        )
    runs: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        runs.setdefault(c["variant"], []).append(c)
    med = {v: statistics.median(c["cpu_ms_per_step"] for c in cs) for v, cs in runs.items()}
    if any(len(cs) > 1 for cs in runs.values()):  # variants repeated (interleaved): their medians
        lines += ["", "Medians (the variants interleaved, each run as often as listed):", ""]
        lines += ["| variant | runs | CPU ms / step (median) | vs memory |", "|---|---|---|---|"]
        for v, cs in runs.items():
            ratio = f"{med[v] / med['memory']:.2f}x" if "memory" in med else "-"
            lines.append(f"| {v} | {len(cs)} | {med[v]:.3f} | {ratio} |")
    for v in med:
        if v.startswith("tiered") and "memory" in med:
            lines += ["", f"The tier's own cost ({v}): {med[v] - med['memory']:.3f} ms of CPU per step."]
    for c in cells:
        if "paired_ratio" in c:  # --paired
            r = c["paired_ratio"]
            lines += [
                "",
                f"Paired (`--paired {args.paired}`, {c['paired_blocks']} blocks a variant): "
                f"`{c['variant']}`'s CPU is {r['median']:.2f}x memory's, the median of its blocks' ratios "
                f"(quartiles {r['q1']:.2f}-{r['q3']:.2f}).",
            ]
    timed: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        if "timed_parts" in c:
            timed.setdefault(c["variant"], []).append(c)
    for v, cs in timed.items():  # --time-parts: medians over the variant's runs
        labels = [r["part"] for r in cs[-1]["timed_parts"]]
        lines += ["", f"Parts of `{v}` (thread CPU us per step, inclusive; medians of {len(cs)} runs):", ""]
        lines += ["| part | us / step | calls / step |", "|---|---|---|"]
        for label in labels:
            got = [r for c in cs for r in c["timed_parts"] if r["part"] == label]
            us = statistics.median(r["us"] for r in got)
            lines.append(f"| {label} | {us:.1f} | {got[-1]['calls']} |")
        lookup = statistics.median(c["lookup_cpu_ms_per_step"] for c in cs)
        lines.append(f"| (the bench's lookup calls, process CPU) | {1e3 * lookup:.1f} | 1 |")
    for c in cells:
        if "parts" in c:  # --profile-parts: the last run of each variant is listed
            runs[c["variant"]] = [c]
    for v, cs in runs.items():
        if "parts" not in cs[-1]:
            continue
        head = f"Parts of `{v}` under cProfile (us per step, inflated by the profiler; read as shares):"
        lines += ["", head, ""]
        lines += ["| function | cumulative us | own us | calls / step |", "|---|---|---|---|"]
        for r in cs[-1]["parts"]:
            lines.append(f"| `{r['function']}` | {r['cum_us']} | {r['own_us']} | {r['calls']} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_table_options(
        ap, rows=1_000_000, batch=16_384, variants="memory,tiered", dir_help="where the tier goes"
    )
    ap.add_argument("--steps", type=int, default=800, help="steps measured (default 800)")
    ap.add_argument("--table-memory", default="40MiB", help="the tier's budget (default 40MiB)")
    ap.add_argument(
        "--time-parts",
        action="store_true",
        help="time named parts of the step (thread CPU, inclusive) and list them per variant",
    )
    ap.add_argument(
        "--profile-parts",
        type=int,
        default=0,
        metavar="N",
        help="profile the steps (cProfile) and list each variant's N psserver/pscore functions with the most "
        "cumulative time per step (default 0: no profile)",
    )
    ap.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="K",
        help="make and fill every variant's piece first, then run the steps in blocks of K steps, the "
        "variants taking turns, and give each tiered variant's CPU as a median ratio of its blocks to "
        "memory's beside them (steadier on a loaded machine; default 0: each variant's steps in a run of "
        "its own)",
    )
    args = ap.parse_args(argv)
    if args.paired:
        if args.time_parts or args.profile_parts:
            ap.error("--paired times whole blocks: not with --time-parts or --profile-parts")
        run_variants("bench_tier_push.py", argv, args, "bench-tier-push-", _paired_runner(args), _markdown)
        return
    run_variants("bench_tier_push.py", argv, args, "bench-tier-push-", run_variant, _markdown)


def _paired_runner(args: argparse.Namespace) -> Any:
    """``run_variants``' ``run_variant`` for ``--paired``: its first call runs every variant listed
    (``_measure_paired``), and each call returns the next variant's cell, in the order listed."""
    names = [v for v in args.variants.split(",") if v]
    cells: list[dict[str, Any]] = []
    calls = 0

    def run(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
        nonlocal calls
        if not cells:
            cells.extend(asyncio.run(_measure_paired(names, args, workdir)))
        cell = cells[calls]
        calls += 1
        assert cell["variant"] == name
        return cell

    return run


if __name__ == "__main__":
    main()
