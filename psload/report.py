"""Load-test statistics: per-second timeline, latency percentiles, live progress, JSON and a PNG plot."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

GB = 1e9


def percentiles(latencies: list[float] | np.ndarray) -> dict[str, float | None]:
    """p50/p95/p99/max of latencies in seconds, reported in milliseconds (None when empty)."""
    if len(latencies) == 0:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    arr = np.asarray(latencies, dtype=np.float64) * 1e3
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {
        "p50_ms": round(float(p50), 3),
        "p95_ms": round(float(p95), 3),
        "p99_ms": round(float(p99), 3),
        "max_ms": round(float(arr.max()), 3),
        "mean_ms": round(float(arr.mean()), 3),
    }


@dataclass
class Window:
    """Everything finished in one second of the run, over all workers."""

    steps: int = 0
    bytes: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)


class Collector:
    """Accumulates the workers' per-second windows."""

    def __init__(self) -> None:
        self.windows: dict[int, Window] = defaultdict(Window)

    def add(self, second: int, steps: int, nbytes: int, errors: int, latencies: list[float]) -> None:
        w = self.windows[second]
        w.steps += steps
        w.bytes += nbytes
        w.errors += errors
        w.latencies.extend(latencies)

    def progress_line(self, second: int, duration_s: float, workers: int) -> str:
        """The live line for second ``second`` (what has arrived for it so far)."""
        w = self.windows.get(second, Window())
        p = percentiles(w.latencies)

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}ms"

        return (
            f"psload [{second + 1:>4}/{duration_s:.0f}s] {workers} workers  {w.steps:>7} steps/s  "
            f"{w.bytes / GB:7.3f} GB/s  p50 {ms(p['p50_ms'])}  p95 {ms(p['p95_ms'])}  p99 {ms(p['p99_ms'])}  "
            f"errors {w.errors}"
        )

    def timeline(self, duration_s: float) -> list[dict[str, Any]]:
        """One row per second; seconds past ``duration_s`` (the last in-flight steps) are ``partial``."""
        out = []
        for second in sorted(self.windows):
            w = self.windows[second]
            out.append(
                {"second": second, "steps_per_s": w.steps, "gb_per_s": w.bytes / GB, "errors": w.errors,
                 "partial": second + 1 > duration_s, **percentiles(w.latencies)}
            )  # fmt: skip
        return out

    def all_latencies(self) -> np.ndarray:
        parts = [np.asarray(w.latencies, dtype=np.float64) for w in self.windows.values() if w.latencies]
        return np.concatenate(parts) if parts else np.zeros(0)

    def totals(self) -> tuple[int, int, int]:
        ws = self.windows.values()
        return sum(w.steps for w in ws), sum(w.bytes for w in ws), sum(w.errors for w in ws)


def write_json(path: str, result: dict[str, Any]) -> None:
    """Writes the result atomically (temp file, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def plot(path: str, result: dict[str, Any]) -> str | None:
    """Draws throughput and latency over time into a PNG; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot written (pip install 'paramserver[load]')"
    timeline = [row for row in result["timeline"] if not row["partial"]] or result["timeline"]
    t = [row["second"] + 1 for row in timeline]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    cfg = result["config"]
    fig.suptitle(
        f"psload: {cfg['workers']} workers, {cfg['num_shards']} shards, {cfg['mode']} mode, "
        f"{cfg['op']}, model {cfg['model']} ({cfg['model_bytes'] / 2**20:.1f} MiB)"
    )
    ax1.plot(t, [row["gb_per_s"] for row in timeline], color="tab:blue", marker=".", label="GB/s")
    ax1.set_ylabel("GB/s", color="tab:blue")
    ax1.set_ylim(bottom=0)
    ax1b = ax1.twinx()
    ax1b.plot(
        t,
        [row["steps_per_s"] for row in timeline],
        color="tab:orange",
        linestyle="--",
        marker="x",
        label="steps/s",
    )
    ax1b.set_ylabel("steps/s", color="tab:orange")
    ax1b.set_ylim(bottom=0)
    ax1.set_title("throughput")
    ax1.grid(alpha=0.3)
    for key, color in (("p50_ms", "tab:green"), ("p95_ms", "tab:orange"), ("p99_ms", "tab:red")):
        ax2.plot(t, [row[key] if row[key] is not None else np.nan for row in timeline], color=color,
                 marker=".", label=key.removesuffix("_ms"))  # fmt: skip
    ax2.set_ylabel("step latency (ms)")
    ax2.set_xlabel("second of the run")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylim(bottom=0)
    ax2.set_title("latency")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def format_summary(result: dict[str, Any]) -> str:
    """The text summary printed at the end of a run."""
    s, cfg, lat = result["summary"], result["config"], result["summary"]["latency"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} ms"

    lines = [
        f"psload: {cfg['workers']} workers x {s['duration_s']:.1f}s, {cfg['mode']} mode, op {cfg['op']}, "
        f"model {cfg['model']} ({cfg['model_bytes'] / 2**20:.2f} MiB), {cfg['num_shards']} shard(s)",
        f"  steps       {s['steps']} ({s['steps_per_s']:.1f} steps/s)",
        f"  throughput  {s['gb_per_s']:.3f} GB/s ({s['bytes'] / GB:.2f} GB moved)",
        f"  latency     p50 {ms(lat['p50_ms'])}  p95 {ms(lat['p95_ms'])}  p99 {ms(lat['p99_ms'])}  "
        f"max {ms(lat['max_ms'])}",
        f"  errors      {s['errors']}" + (f" {s['errors_by_type']}" if s["errors_by_type"] else ""),
        f"  per worker  steps max/min {_ratio(s.get('steps_max_over_min'))}",
        "  shards      "
        + "; ".join(
            f"{sh['index']} {sh['address']}: {sh['share']:.0%} of bytes"
            # a chaos soak restarts the processes: their counters start again
            + ("" if "chaos" in result else f", +{sh['pushes']} pushes, +{sh['pulls']} pulls")
            for sh in result["shards"]
        ),
        f"  balance     max/mean bytes per shard {result['balance']['max_over_mean']:.2f}",
    ]
    if "chaos" in result:
        lines += chaos_lines(result["chaos"])
    elif "counts" in result:
        lines.append(count_line(result["counts"]))
    if not cfg["local_cluster"]:
        lines.append(
            f"  left        {cfg['variables']} variable(s) named {cfg['prefix']}/* "
            f"({cfg['model_bytes'] / 2**20:.2f} MiB) stay on the cluster: {LEFT_ON_CLUSTER}"
        )
    return "\n".join(lines)


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def count_line(cnt: dict[str, Any]) -> str:
    """The exact counts' line (``psload --exact``; the chaos soak's ``counters``)."""
    applied = ", ".join(map(str, sorted(set(cnt["applied"].values()))))
    other = len(cnt["variables_with_other_versions"])
    verdict = "" if "ok" not in cnt else ("  [ok]" if cnt["ok"] else "  [FAIL]")
    return (
        f"  counters    {cnt['acknowledged_pushes']} {cnt.get('unit', 'pushes')} acknowledged; "
        f"counters applied {applied}: {cnt['lost']} lost, {cnt['applied_twice']} applied twice; "
        f"{other} variable(s) at another version{verdict}"
    )


def chaos_lines(chaos: dict[str, Any]) -> list[str]:
    """The chaos soak's summary lines (``psload --chaos``)."""
    rec, cnt, rss, ok = chaos["recovery"], chaos["counters"], chaos["rss"], chaos["ok"]

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    def mem(r: dict[str, Any]) -> str:
        if r["growth"] is None:
            return "-"
        base, end, peak = r["baseline_mib"], r["end_mib"], r["peak_mib"]
        return f"{base:.0f} -> {end:.0f} MiB ({r['growth']:+.1%}, peak {peak:.0f})"

    def verdict(flag: bool) -> str:
        return "ok" if flag else "FAIL"

    lines = [
        f"  chaos       {len(chaos['kills'])} kill -9 of a primary (every {chaos['kill_every_s']:g} s): "
        f"failover p50 {s(rec['failover_p50_s'])} max {s(rec['failover_max_s'])}; redundant again "
        f"p50 {s(rec['redundant_p50_s'])} max {s(rec['redundant_max_s'])}  [{verdict(ok['kills'])}]",
        f"{count_line(cnt)}  [{verdict(ok['counters'])}]",
        f"  rss         shards {mem(rss['shards'])}; workers {mem(rss['workers'])}, after "
        f"{rss['warmup_s']:g} s warm-up (limit {chaos['max_rss_growth']:+.0%})  [{verdict(ok['rss'])}]",
    ]
    if chaos["monkey_error"]:
        lines.append(f"  chaos error {chaos['monkey_error']}")
    return lines


LEFT_ON_CLUSTER = (
    "the shards have no way to delete a variable, so they go only when the shards restart (without "
    "restoring a checkpoint written since); a later run with the same --prefix and --model reuses them"
)
