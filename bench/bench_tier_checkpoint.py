"""Saving and restoring a dynamic table past memory: a shard with a disk tier against one all in memory.

One shard (a real ``psserver`` process) holds one dynamic table of ``--rows``
ids x ``--dim`` (float32, Adagrad: a value and a slot per row), filled by
pushes of ``--batch`` ids. Then a checkpoint is saved while a second client
keeps pushing small batches of existing ids (its longest push is how long the
save held updates back), and the shard is restarted from the file. Variants:
``memory`` (no tier: the peer, every row in the process) and ``tiered``
(``--table-memory BUDGET --table-dir``: most rows on disk). Reported per variant:

- the fill's, the save's and the restore's seconds (the restore: the shard's
  start until it answers, the file read and the table rebuilt);
- the shard's own memory (``RssAnon``, sampled every 20 ms): its peak during
  the save and the restore, and what it keeps after each (glibc keeps freed heap
  for reuse: ``pscore.memory.tune_malloc``), against ``--table-memory``;
- the longest and the median push of the concurrent pusher during the save;
- the checkpoint file's size, and whether a sample of rows read back after the
  restore equals what was read before the save.

Usage:
    python bench/bench_tier_checkpoint.py --out bench/results/tier_checkpoint       # 2M rows, 32 MiB budget
    python bench/bench_tier_checkpoint.py --rows 200000 --variants tiered           # a quick look
    python bench/bench_tier_checkpoint.py --rows 25000000 --table-memory 1GiB --batch 50000 \
        --variants tiered --out bench/results/tier_checkpoint_25m                   # 6 GiB: ~15 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_table_options, run_variants

import psclient
from psserver.tier import parse_bytes
from trainer.cluster import LocalCluster

_MIB = 2**20
_WAIT_S = 3600.0  # a restore or a final checkpoint of tens of millions of rows takes minutes


def _memory(pid: int) -> dict[str, int]:
    """The process's resident memory in MiB: its own (RssAnon), mapped files (RssFile), peak (VmHWM)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


class _Peak:
    """Samples a process's RssAnon every 20 ms in a thread until ``stop``; ``stop`` returns the peak (MiB)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._done = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, _memory(self.pid)["RssAnon"])
            self._done.wait(0.02)

    def stop(self) -> int:
        self._done.set()
        self._thread.join(timeout=5)
        return self.peak


def _pusher(address: list[str], rows: int, dim: int, stop: threading.Event, took: list[float]) -> None:
    """Pushes 256 existing ids at a time until ``stop``, recording each push's seconds."""
    rng = np.random.default_rng(7)
    with psclient.PSClient(address, "pusher", timeout=600) as c:
        while not stop.is_set() and len(took) < 1_000_000:
            ids = np.unique(rng.integers(0, rows, 256))
            t0 = time.perf_counter()
            c.push({"emb": psclient.Rows(ids, np.full((ids.size, dim), 1e-3, np.float32))})
            took.append(time.perf_counter() - t0)


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One variant's fill, save (with a concurrent pusher) and restore; its figures."""
    ckpt = workdir / name / "ckpt"
    server_args = ["--checkpoint-dir", str(ckpt)]
    if name == "tiered":
        server_args += ["--table-memory", args.table_memory, "--table-dir", str(workdir / name / "tier")]
    cell: dict[str, Any] = {"variant": name}
    probe = np.random.default_rng(1).integers(0, args.rows, 2000)
    with LocalCluster(1, server_args, start_timeout=_WAIT_S, stop_timeout=_WAIT_S) as cluster:
        proc = cluster.procs[0]
        assert proc is not None
        with psclient.PSClient(cluster.addresses, "w0", timeout=_WAIT_S) as c:
            c.create_embedding(
                "emb", None, args.dim, optimizer=psclient.Adagrad(0.1), initializer=("uniform", -1, 1)
            )
            t0 = time.perf_counter()
            for start in range(0, args.rows, args.batch):
                ids = np.arange(start, min(args.rows, start + args.batch), dtype=np.int64)
                c.push({"emb": psclient.Rows(ids, np.zeros((ids.size, args.dim), np.float32))})
            cell["fill_s"] = round(time.perf_counter() - t0, 2)
            cell["after_fill_mib"] = _memory(proc.pid)
            stop, took = threading.Event(), []
            pusher = threading.Thread(
                target=_pusher, args=(cluster.addresses, args.rows, args.dim, stop, took)
            )
            pusher.start()
            time.sleep(1.0)  # the pusher is connected and pushing
            took.clear()
            peak = _Peak(proc.pid)
            t0 = time.perf_counter()
            c.save_checkpoint()
            cell["save_s"] = round(time.perf_counter() - t0, 2)
            cell["save_peak_rss_anon_mib"] = peak.stop()
            stop.set()
            pusher.join(timeout=600)
            cell["pushes_during_save"] = len(took)
            cell["push_max_ms_during_save"] = round(1e3 * max(took, default=0.0), 1)
            cell["push_median_ms_during_save"] = round(1e3 * statistics.median(took), 2) if took else None
            cell["after_save_mib"] = _memory(proc.pid)
            before = c.lookup("emb", probe)
        t0 = time.perf_counter()
        cluster.stop()  # SIGTERM: a final checkpoint, then exit
        cell["stop_s"] = round(time.perf_counter() - t0, 2)
    files = sorted(ckpt.glob("*.npz"))
    cell["checkpoint_mib"] = round(files[-1].stat().st_size / _MIB, 1) if files else None
    t0 = time.perf_counter()
    with LocalCluster(1, server_args, start_timeout=_WAIT_S, stop_timeout=_WAIT_S) as cluster:
        proc = cluster.procs[0]
        assert proc is not None
        peak = _Peak(proc.pid)
        with psclient.PSClient(cluster.addresses, "w1", timeout=_WAIT_S) as c:
            c.list_variables()
            cell["restore_s"] = round(time.perf_counter() - t0, 2)
            cell["restore_peak_rss_anon_mib"] = peak.stop()
            cell["after_restore_mib"] = _memory(proc.pid)
            after = c.lookup("emb", probe)
            cell["restored_equal"] = bool(np.array_equal(after, before))
    shutil.rmtree(workdir / name, ignore_errors=True)
    print(f"{name}: {cell}", file=sys.stderr, flush=True)
    return cell


def _markdown(
    args: argparse.Namespace, note: dict[str, Any], cells: list[dict[str, Any]], command: str
) -> str:
    budget = parse_bytes(args.table_memory) / _MIB
    table_mib = args.rows * args.dim * 4 * 2 / _MIB
    lines = [
        "# Saving and restoring a dynamic table: with a disk tier vs all in memory",
        "",
        f"Command: `{command}`",
        "",
        f"One shard, one dynamic table of {args.rows:,} ids x {args.dim} (float32, Adagrad: "
        f"{table_mib:,.0f} MiB of values and slots), filled by pushes of {args.batch:,} ids; a checkpoint "
        "saved while another client pushes 256 ids at a time; the shard restarted from it. `tiered`: "
        f"`--table-memory {args.table_memory}` ({budget:.0f} MiB). Machine: {note}",
        "",
        "| variant | fill s | save s | stop s (a final save) | restore s | checkpoint MiB | "
        "RssAnon MiB: after fill / save peak / "
        "after save / restore peak / after restore | pushes during save: count, median ms, max ms | "
        "restored rows equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['variant']} | {c['fill_s']} | {c['save_s']} | {c['stop_s']} | {c['restore_s']} | "
            f"{c['checkpoint_mib']} | "
            f"{c['after_fill_mib']['RssAnon']} / {c['save_peak_rss_anon_mib']} / "
            f"{c['after_save_mib']['RssAnon']} / "
            f"{c['restore_peak_rss_anon_mib']} / {c['after_restore_mib']['RssAnon']} | "
            f"{c['pushes_during_save']}, {c['push_median_ms_during_save']}, {c['push_max_ms_during_save']} | "
            f"{c['restored_equal']} |"
        )
    lines += [
        "",
        "RssAnon is the shard's own memory (what `--table-memory` bounds), sampled every 20 ms; mapped file "
        "pages (LMDB's, the checkpoint's while it is read, a save's scratch files) are the page cache's and "
        "not counted. The longest push during the save is how long the save held updates back.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_table_options(
        ap, rows=2_000_000, batch=20_000, variants="memory,tiered", dir_help="where the files go"
    )
    ap.add_argument("--table-memory", default="32MiB", help="the tiered shard's budget (default 32MiB)")
    run_variants(
        "bench_tier_checkpoint.py", argv, ap.parse_args(argv), "bench-tier-ckpt-", run_variant, _markdown
    )


if __name__ == "__main__":
    main()
