"""Draws the benchmark pages' figures from ``bench/results/*.json`` (run: ``python scripts/bench_plots.py``).

Writes ``docs/benchmarks/img/*.png`` and ``docs/img/throughput-vs-tf-ps.png`` (the README's figure). Every
figure names its source file, its date and its machine, so a plot never outlives its numbers silently.
Needs matplotlib (extra ``load`` or ``dev``). Not run by the tests: the committed PNGs are what the docs show.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import statistics
import subprocess
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "benchmarks" / "img"
README_FIGURE = ROOT / "docs" / "img" / "throughput-vs-tf-ps.png"
_SIZES = {1024: "1 KiB", 1048576: "1 MiB", 4194304: "4 MiB", 67108864: "64 MiB"}


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def committed(name: str) -> str:
    """The date the results file was last committed (for files that do not record their own)."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%cs", "--", f"bench/results/{name}.json"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    return out or "uncommitted"


def machine(m: dict[str, Any] | str) -> str:
    if isinstance(m, str):
        return m.split(",")[0]
    return f"{m['cpus']} CPUs ({m['cpu_model']})"


def footer(fig: Any, name: str, date: str, mach: str) -> None:
    fig.text(0.01, 0.01, f"bench/results/{name}.json, {date}, {mach}", fontsize=7, color="0.4")


def save(fig: Any, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(path.relative_to(ROOT))


def plot_ps() -> None:
    run = load("ps")["runs"][0]
    rows = [r for r in run["results"] if r["concurrency"] == 1 and r["nbytes"] in (1024, 1048576, 67108864)]
    date = run["started"][:10]
    for path, systems in ((OUT / "ps.png", ("ps", "tf", "raw", "echo")), (README_FIGURE, ("ps", "tf"))):
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.4), sharey=False)
        labels = {
            "ps": "psserver", "tf": "TensorFlow PS runtime", "raw": "raw socket", "echo": "grpc.aio echo"
        }  # fmt: skip
        for ax, op in zip(axes, ("pull", "push", "push_pull"), strict=True):
            sizes = sorted({r["nbytes"] for r in rows})
            width = 0.8 / len(systems)
            for i, system in enumerate(systems):
                vals = [
                    next(r["gb_s"] for r in rows if (r["system"], r["op"], r["nbytes"]) == (system, op, n))
                    for n in sizes
                ]
                ax.bar([x + i * width for x in range(len(sizes))], vals, width, label=labels[system])
            ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(sizes))])
            ax.set_xticklabels([_SIZES[n] for n in sizes])
            ax.set_yscale("log")
            ax.set_title(op)
            ax.set_ylabel("GB/s (log)")
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="upper right", ncol=len(systems), fontsize=8)
        fig.suptitle("One client, one shard: psserver vs TensorFlow's own PS", fontsize=10, x=0.02, ha="left")
        footer(fig, "ps", date, machine(run["machine"]))
        save(fig, path)


def plot_training() -> None:
    data, allreduce = load("training"), load("training_allreduce")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, model in zip(axes, ("mlp", "cnn"), strict=True):
        second = {f"{k} (2nd run)": v for k, v in allreduce["models"][model].items()}
        systems = {**data["models"][model], **second}
        names = [n for n in ("local", "ps-async", "ps-sync", "tf-ps", "allreduce (2nd run)") if n in systems]
        ax.barh(names, [systems[n]["steps_per_second"] for n in names], color="tab:blue")
        ax.invert_yaxis()
        ax.set_title(f"{model}: steps/s, all workers")
    fig.suptitle("Keras 3 fit, 2 workers + 2 shards on one machine", fontsize=10)
    footer(fig, "training", committed("training"), machine(data["machine"]))
    save(fig, OUT / "training.png")


def plot_allreduce() -> None:
    data = load("allreduce")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, ranks in zip(axes, (2, 4), strict=True):
        for system, label in (("ours", "psclient.collective"), ("gloo", "gloo"), ("tf", "TensorFlow RING")):
            rows = [r for r in data["rows"] if (r["system"], r["ranks"]) == (system, ranks)]
            pts = sorted((r["size_mib"], r["busbw_gb_s"]) for r in rows)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("MiB per all-reduce")
        ax.set_title(f"{ranks} ranks")
    axes[0].set_ylabel("bus bandwidth, GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle("float32 sum all-reduce, ranks as processes on one machine", fontsize=10)
    footer(fig, "allreduce", data["started"][:10], machine(data["machine"]))
    save(fig, OUT / "allreduce.png")


def plot_embedding() -> None:
    one, eight = load("embedding"), load("embedding_spe8")
    names = {"psk": "psk.Embedding", "psk-prefetch": "+ prefetch_rows", "tf-ps": "TF ParameterServerStrategy"}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.38
    for i, (data, label) in enumerate(((one, "1 step per call"), (eight, "8 steps per call"))):
        vals = {r["variant"]: r["steps_per_s"] for r in data["results"]}
        ax.bar([x + i * width for x in range(len(names))], [vals[v] for v in names], width, label=label)
    ax.set_xticks([x + width / 2 for x in range(len(names))])
    ax.set_xticklabels(list(names.values()))
    ax.set_ylabel("steps/s, 2 workers")
    ax.legend(fontsize=8)
    ax.set_title("1M x 64 embedding table, Adagrad, 2 async shards", fontsize=10)
    footer(fig, "embedding", committed("embedding"), "2 CPUs (AMD EPYC)")
    save(fig, OUT / "embedding.png")


def plot_scaling() -> None:
    data = load("scaling")
    fig, ax = plt.subplots(figsize=(7, 3.4))
    cells = data["cells"]
    for k in sorted({c["k"] for c in cells if c["system"] == "ps"}):
        pts = sorted((c["n"], c["ratio"]) for c in cells if c["system"] == "ps" and c["k"] == k)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"push_pull, {k} shard(s)")
    ring = sorted((c["n"], c["ratio"]) for c in cells if c["system"] == "ring")
    ax.plot([p[0] for p in ring], [p[1] for p in ring], marker="s", linestyle="--", label="ring all-reduce")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1)
    ax.set_xlabel("workers n")
    ax.set_ylabel("achieved / link bound")
    ax.legend(fontsize=8)
    rate, size = data["rate_mbit"], data["size_mib"]
    ax.set_title(f"Hosts as network namespaces, {rate:.0f} Mbit/s links, {size} MiB model", fontsize=10)
    footer(fig, "scaling", committed("scaling"), machine(data["machine"]))
    save(fig, OUT / "scaling.png")


# The latest runs of each cell (async, two rounds in flight, 4 MiB; each cell at a link rate where its own
# processes use under 60 % of the cores): docs/benchmarks/scaling.md's leading tables, 2026-12-07e (the
# fifth session).
SCALING_LATEST = (
    # every cell with create_many placing by the batch's plan (3135534), untraced runs; n = k = 32 at
    # 15 Mbit/s (fix_n32k32_15mbit) left out: the cell used 0.93 of the cores, over the 60 % rule
    "scaling_2026-12-07e/runs/fix_small.json",
    "scaling_2026-12-07e/runs/ab_n16k16_new_*.json",
    "scaling_2026-12-07e/runs/ab_n32k16_new_*.json",
    "scaling_2026-12-07e/runs/new_n16k8_*.json",
    "scaling_2026-12-07e/runs/new_n32k32_*.json",
)


def plot_scaling_latest() -> None:
    """Achieved / link bound of every run of the cells with k = n and k = n / 2, one dot a run, the median
    joined, against the 0.85 goal (issue 45)."""
    runs = [
        (f, json.loads(f.read_text())) for pattern in SCALING_LATEST for f in sorted(RESULTS.glob(pattern))
    ]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, of_n, marker in (
        ("k = n shards", lambda n: n, "o"),
        ("k = n / 2 shards", lambda n: n // 2, "s"),
    ):
        by_n: dict[int, list[tuple[float, float]]] = {}
        for _, data in runs:
            for c in data["cells"]:
                if c["system"] == "ps" and c["k"] == of_n(c["n"]) and c["k"] >= 1:
                    by_n.setdefault(c["n"], []).append((c["ratio"], c["rate_mbit"]))
        ns = sorted(by_n)
        line = ax.plot(ns, [statistics.median(r for r, _ in by_n[n]) for n in ns], marker=marker, label=label)
        for n in ns:
            ax.scatter(
                [n] * len(by_n[n]), [r for r, _ in by_n[n]], s=12, color=line[0].get_color(), alpha=0.5
            )
            rates = sorted({rate for _, rate in by_n[n]})
            ax.annotate("/".join(f"{r:g}" for r in rates), (n, min(r for r, _ in by_n[n])), fontsize=6,
                        textcoords="offset points", xytext=(4, -9), color=line[0].get_color())  # fmt: skip
    ax.axhline(0.85, color="0.5", linestyle=":", linewidth=1, label="goal 0.85")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0.5, 1.05)
    ax.set_xlabel("workers n (labels: link Mbit/s)")
    ax.set_ylabel("achieved / link bound")
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Async push_pull, 2 rounds in flight, 4 MiB; each cell under 60 % of 2 cores", fontsize=10)
    dates = sorted({f.parent.parent.name.split("_")[1] for f, _ in runs})
    folders = sorted({str(f.parent.relative_to(RESULTS)) for f, _ in runs})
    fig.text(0.01, 0.01, f"bench/results/: {', '.join(folders)} ({dates[-1]})", fontsize=6, color="0.4")
    save(fig, OUT / "scaling_latest.png")


def plot_replication() -> None:
    data = load("replication")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for system in ("unreplicated", "primary+backup"):
        pts = sorted((r["nbytes"], r["p50_ms"]) for r in data["stats"] if r["system"] == system)
        ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("push size, KiB")
    ax.set_ylabel("p50 push latency, ms")
    ax.legend(fontsize=8)
    ax.set_title("What a backup costs a push (one client)", fontsize=10)
    footer(fig, "replication", committed("replication"), machine(data["machine"]))
    save(fig, OUT / "replication.png")


def main() -> None:
    started = datetime.datetime.now(datetime.UTC)
    plots = (plot_ps, plot_training, plot_allreduce, plot_embedding, plot_scaling, plot_scaling_latest)
    for plot in (*plots, plot_replication):
        plot()
    print(f"done in {(datetime.datetime.now(datetime.UTC) - started).total_seconds():.1f}s")


if __name__ == "__main__":
    main()
