"""Keras training on a namespace cluster with shaped links: the parameter server against the ring.

A real Keras job, ``pstrain demo``'s MLP (784-256-256-10, 269,322 float32 parameters: M = 1.08 MB of dense
weights, so each step moves about 1 MB each way through a worker's link while its compute takes ~15 ms),
trained on scikit-learn's digits upscaled to 28x28 (nearest neighbour; written as a keras ``mnist.npz``
so ``--data mnist`` reads it: a learnable task, nothing downloaded). Every shard and every worker runs in
a host of its own, a network namespace of a ``trainer.netns.NetnsCluster`` whose link is shaped to
``--rate-mbit`` each way. The workers are ``pstrain worker`` processes with the command lines the demo
itself launches (``trainer.demo.worker_command``, ``trainer.allreduce_loop.rank_command``), so their
flags, learning-rate scaling and result files are the demo's. Runs:

- the parameter server, ``--modes`` (async, sync) x ``--shards`` k, n workers each (``--workers``);
- the ring all-reduce (``--mode allreduce``: ``psclient.collective.Ring`` over the workers' hosts);
- the same training flags locally (``pstrain local``, no network) for the accuracy to compare with.

Per run: the steps/s of each worker over a window from the end of its first epoch to the end of its last
(the first epoch holds TensorFlow's tracing and the connections' warm-up), the bytes per step on the
worker's link each way (the link's qdisc counters over the same window), achieved / bound with the bound
of a step as in ``bench_scaling.py`` (PS: ``max(M/B, n M/(k B))``; ring: ``2 (n-1)/n x M/B``), the test
accuracy (PS: a fresh model loaded from the shards by an evaluator on worker 0's host; ring: rank 0's
replica) and final training loss against the local run, and the CPU: the machine's busy % over the window
(other tenants included), the cores the run's own processes used, and its busiest process's.

    sudo python bench/bench_keras_netns.py --quick
    sudo python bench/bench_keras_netns.py --workers 2 --shards 1,2 --modes async,sync --ring 2 \\
        --rate-mbit 100 --epochs 8 --out bench/results/keras_netns

Needs root, iproute2 and nftables (``trainer.netns.netns_available``). Every wait is bounded; the cluster
removes what it made on every exit (``trainer.netns.leftovers`` is checked and reported).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm

from trainer import allreduce_loop, demo, options
from trainer.__main__ import build_parser
from trainer.cluster import cpu_seconds
from trainer.netns import Host, NetnsCluster, leftovers

PS_MODES = ("async", "sync")
_RING_PORT = 7000  # inside a namespace this run made: nothing else can hold it
_RUN_TIMEOUT_S = (
    900.0  # one run: TF start-up of every worker (tens of seconds on 2 loaded cores) and training
)
_EVAL_TIMEOUT_S = 300.0
_POLL_S = 0.05  # how often the workers' logs are read for their epoch lines
_IMAGE = 28  # the digits' 8x8 upscaled to MNIST's size: the MLP's 784-wide input


def write_digits28(path: Path) -> None:
    """scikit-learn's digits (the demo's split) upscaled to 28x28 by nearest neighbour, as a keras
    ``mnist.npz`` (``x_train``, ``y_train``, ``x_test``, ``y_test``; images in [0, 1])."""
    import numpy as np

    from trainer.data import load_digits

    split = load_digits()
    idx = np.arange(_IMAGE) * split.x_train.shape[1] // _IMAGE

    def up(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[:, idx][:, :, idx][..., 0])

    np.savez(
        path, x_train=up(split.x_train), y_train=split.y_train, x_test=up(split.x_test), y_test=split.y_test
    )


def demo_args(bench: argparse.Namespace, mode: str, n: int, k: int, data_path: Path) -> argparse.Namespace:
    """The ``pstrain demo`` flags of one run, parsed by pstrain's own parser (its defaults and checks)."""
    argv = ["demo", "--mode", mode, "--workers", str(n), "--shards", str(k), "--model", bench.model,
            "--data", "mnist", "--data-path", str(data_path), "--epochs", str(bench.epochs),
            "--batch-size", str(bench.batch_size), "--learning-rate", str(bench.learning_rate)]  # fmt: skip
    if getattr(bench, "partition_bytes", None) is not None:
        argv += ["--partition-bytes", str(bench.partition_bytes)]
    if mode == "sync" and getattr(bench, "sync_parts", 1) != 1:
        argv += ["--sync-parts", str(bench.sync_parts)]
    argv += ["--overlap", getattr(bench, "overlap", "auto")]
    args = build_parser().parse_args(argv)
    options.resolve_model_defaults(args)
    return args


def model_bytes(model: str) -> int:
    """M: the bytes of the model's trainable weights (float32), what a step's gradients and values weigh."""
    from trainer import models

    with demo.native_stderr_held():  # TensorFlow's start-up lines
        m = models.build(model, (_IMAGE, _IMAGE, 1))
    return sum(int(v.numpy().nbytes) for v in m.trainable_variables)


@dataclass
class Window:
    """One worker's measured window: from the end of its first epoch to the end of its last."""

    t: list[float] = field(default_factory=list)
    egress: list[int] = field(default_factory=list)
    ingress: list[int] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # the worker process's CPU time


class Run:
    """One training run on the cluster's hosts: the shards (PS modes) and n workers, each in its own host."""

    def __init__(self, net: NetnsCluster, bench: argparse.Namespace, name: str) -> None:
        self.net, self.bench, self.name = net, bench, name
        self.dir = net.workdir / name
        self.dir.mkdir()
        self.env = {"PYTHONPATH": str(cm.REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
        self.workers: list[subprocess.Popen[bytes]] = []
        self.hosts: list[Host] = []
        self.servers: list[int] = []  # the shards' pids
        self.shard_hosts: list[Host] = []
        self.steps_per_epoch = 0  # per worker

    def log(self, i: int) -> Path:
        return self.net.workdir / f"{self.name}-w{i}.log"

    def start(self, hosts: list[Host], commands: list[list[str]]) -> None:
        self.hosts = hosts
        for i, (host, cmd) in enumerate(zip(hosts, commands, strict=True)):
            self.workers.append(self.net.popen(host, cmd, log_name=f"{self.name}-w{i}", env=self.env))

    def measure(self, epochs: int) -> dict[str, Any]:
        """Waits for every worker to finish (bounded), snapshotting each one's link counters, the time and
        the CPU at the end of its first and of its last epoch; returns the window's measurements.

        Raises:
            RuntimeError: a worker failed or the run timed out.
        """
        marks = (f"epoch 1/{epochs}:", f"epoch {epochs}/{epochs}:")
        windows = [Window() for _ in self.workers]
        # (time, the shards' CPU s, the machine's busy and total jiffies, each shard link's bytes each way)
        cpu: list[tuple[float, list[float], tuple[int, int], list[tuple[int, int]]]] = []
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        while any(p.poll() is None for p in self.workers) or any(len(w.t) < 2 for w in windows):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not finished within {_RUN_TIMEOUT_S:.0f}s")
            for i, (w, proc) in enumerate(zip(windows, self.workers, strict=True)):
                if len(w.t) == 2:
                    continue
                text = self.log(i).read_text(errors="replace")
                if marks[len(w.t)] in text:
                    stats = self.net.link_stats(self.hosts[i])
                    w.t.append(time.monotonic())
                    w.egress.append(stats["egress"]["bytes"])
                    w.ingress.append(stats["ingress"]["bytes"])
                    w.cpu_s.append(cpu_seconds(proc.pid))  # ip netns exec execs: the pid is python's
                    # the CPU window: from the first worker's first mark to the last worker's last
                    if not cpu or all(len(x.t) == 2 for x in windows):
                        links = [self.net.link_stats(h) for h in self.shard_hosts]
                        cpu.append((
                            time.monotonic(), [cpu_seconds(p) for p in self.servers], cm.machine_cpu(),
                            [(s["egress"]["bytes"], s["ingress"]["bytes"]) for s in links],
                        ))  # fmt: skip
                elif proc.poll() is not None:
                    raise RuntimeError(f"{self.name}: worker {i} exited {proc.returncode}:\n{self.tail(i)}")
            time.sleep(_POLL_S)
        for i, proc in enumerate(self.workers):
            if proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"{self.name}: worker {i} exited {proc.returncode}:\n{self.tail(i)}")
        (t0, c0, m0, l0), (t1, c1, m1, l1) = cpu[0], cpu[-1]
        rate = self.net.rate_mbit * 1e6 / 8 if self.net.rate_mbit else float("nan")  # bytes/s
        shard_busy = [
            max(b[0] - a[0], b[1] - a[1]) / (t1 - t0) / rate for a, b in zip(l0, l1, strict=True)
        ]  # the busier direction of each shard's link, as a share of its rate
        cores = [(w.cpu_s[1] - w.cpu_s[0]) / (w.t[1] - w.t[0]) for w in windows]
        cores += [(b - a) / (t1 - t0) for a, b in zip(c0, c1, strict=True)]
        cores = [c for c in cores if c == c]  # NaN: a process gone before its mark was read
        steps = [(epochs - 1) * self.steps_per_epoch] * len(windows)
        per_worker = [
            {
                "steps_per_s": s / (w.t[1] - w.t[0]),
                "up_bytes_per_step": (w.egress[1] - w.egress[0]) / s,
                "down_bytes_per_step": (w.ingress[1] - w.ingress[0]) / s,
            }
            for w, s in zip(windows, steps, strict=True)
        ]
        results = [json.loads((self.dir / f"worker{i}.json").read_text()) for i in range(len(self.workers))]
        return {
            "window_steps_per_worker": steps[0],
            "steps_per_s": sum(p["steps_per_s"] for p in per_worker) / len(per_worker),
            "up_bytes_per_step": sum(p["up_bytes_per_step"] for p in per_worker) / len(per_worker),
            "down_bytes_per_step": sum(p["down_bytes_per_step"] for p in per_worker) / len(per_worker),
            "per_worker": per_worker,
            "machine_cpu_pct": round(100 * (m1[0] - m0[0]) / max(1, m1[1] - m0[1]), 1),
            "shard_link_busy_pct": [round(100 * b, 1) for b in shard_busy],
            "run_cores": round(sum(cores), 2),
            "busiest_proc_cores": round(max(cores, default=float("nan")), 2),
            "worker_results": results,
            "final_loss": sum(r["final_loss"] for r in results) / len(results),
        }

    def tail(self, i: int, lines: int = 30) -> str:
        return "\n".join(self.log(i).read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def _num_train() -> int:
    from trainer.data import load_digits

    return len(load_digits().y_train)


def _steps_per_epoch(num_train: int, batch_size: int, n: int) -> int:
    from trainer.data import steps_per_epoch

    return steps_per_epoch(num_train, batch_size, n)


def evaluate_on(net: NetnsCluster, host: Host, args: argparse.Namespace, addresses: list[str]) -> float:
    """The test accuracy of a fresh model loaded from the shards, by an evaluator process on ``host``.

    Raises:
        RuntimeError: the evaluator failed.
    """
    cmd = [sys.executable, __file__, "_evaluate", ",".join(addresses), *options.train_flags(args)]
    proc = net.popen(
        host, cmd, env={"PYTHONPATH": str(cm.REPO), "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = proc.communicate(timeout=_EVAL_TIMEOUT_S)
    line = next((x for x in out.decode().splitlines() if x.startswith(cm.RESULT_PREFIX)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"evaluator exited {proc.returncode}: {err.decode()[-2000:]}")
    return float(json.loads(line[len(cm.RESULT_PREFIX) :])["test_accuracy"])


def run_ps(
    net: NetnsCluster, bench: argparse.Namespace, mode: str, n: int, k: int, m_bytes: int, data_path: Path
) -> dict[str, Any]:
    shard_hosts, worker_hosts = net.hosts[: bench.max_shards], net.hosts[bench.max_shards :]
    args = demo_args(bench, mode, n, k, data_path)
    run = Run(net, bench, f"{mode}-n{n}-k{k}")
    run.steps_per_epoch = _steps_per_epoch(bench.num_train, bench.batch_size, n)
    server_args = options.server_args(mode, n, barrier_timeout=args.barrier_timeout)
    shards = net.shards(shard_hosts[:k], server_args, env=run.env).start()
    try:
        run.servers = [p.pid for p in shards.procs if p is not None]
        run.shard_hosts = shard_hosts[:k]
        cmds = [demo.worker_command(args, i, shards.addresses, run.dir / f"worker{i}.json") for i in range(n)]
        run.start(worker_hosts[:n], cmds)
        out = run.measure(bench.epochs)
        out["test_accuracy"] = evaluate_on(net, worker_hosts[0], args, shards.addresses)
    finally:
        run.close()
        shards.stop()
    out["stale_steps"] = sum(r.get("stale_steps", 0) for r in out.pop("worker_results"))
    bound = max(m_bytes, n * m_bytes / k) / (bench.rate_mbit * 1e6 / 8)
    return {
        "system": f"ps-{mode}",
        "n": n,
        "k": k,
        "bound_s": bound,
        "ratio": bound * out["steps_per_s"],
        **out,
    }


def run_ring(
    net: NetnsCluster, bench: argparse.Namespace, n: int, m_bytes: int, data_path: Path
) -> dict[str, Any]:
    hosts = net.hosts[bench.max_shards : bench.max_shards + n]
    addresses = [f"{h.address}:{_RING_PORT}" for h in hosts]
    args = demo_args(bench, "allreduce", n, 1, data_path)
    run = Run(net, bench, f"ring-n{n}")
    run.steps_per_epoch = _steps_per_epoch(bench.num_train, bench.batch_size, n)
    cmds = [allreduce_loop.rank_command(args, r, addresses, run.dir / f"worker{r}.json") for r in range(n)]
    try:
        run.start(hosts, cmds)
        out = run.measure(bench.epochs)
    finally:
        run.close()
    results = out.pop("worker_results")
    out["test_accuracy"] = results[0]["test_accuracy"]
    out["in_sync"] = all(r["in_sync"] for r in results)
    bound = 2 * (n - 1) / n * m_bytes / (bench.rate_mbit * 1e6 / 8)
    return {"system": "ring", "n": n, "k": 0, "bound_s": bound, "ratio": bound * out["steps_per_s"], **out}


def run_local(bench: argparse.Namespace, data_path: Path, workdir: Path) -> dict[str, Any]:
    """``pstrain local`` with the same training flags (no network): the accuracy to compare with."""
    args = demo_args(bench, "local", 1, 1, data_path)
    result = workdir / "local.json"
    cmd = [sys.executable, "-m", "trainer", "local", *options.train_flags(args), "--result-json", str(result)]
    env = {**os.environ, "PYTHONPATH": str(cm.REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    busy0, total0 = cm.machine_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_RUN_TIMEOUT_S, check=False)
    busy1, total1 = cm.machine_cpu()
    if proc.returncode != 0:
        raise RuntimeError(f"local run exited {proc.returncode}: {proc.stderr[-2000:]}")
    out = json.loads(result.read_text())
    out["machine_cpu_pct"] = round(100 * (busy1 - busy0) / max(1, total1 - total0), 1)
    return out


def render(
    bench: argparse.Namespace, runs: list[dict[str, Any]], local: dict[str, Any], info: dict[str, Any]
) -> str:
    note = info["machine"]
    window = ", ".join(
        sorted({f"{r['window_steps_per_worker']} steps per worker at n={r['n']}" for r in runs})
    )
    lines = [
        "# Keras training on a namespace cluster with shaped links (bench/bench_keras_netns.py)",
        "",
        f"Command: `{info['command']}`",
        "",
        f"Date {info['date']}. Machine: {note['cpus']} x {note['cpu_model']}, {note['mem_gib']} GiB, "
        f"load before {note['loadavg_1_5_15']}, after {info['loadavg_after']} (shared with other "
        "engineers' test runs: CPU is contended, see the CPU columns).",
        "",
        f"Model: `pstrain demo --model {bench.model}` ({info['params']:,} float32 parameters, "
        f"M = {info['model_bytes'] / 1e6:.2f} MB), Adam {bench.learning_rate:g} (sync and all-reduce: "
        f"x n, as the demo scales it), async with `--overlap {getattr(bench, 'overlap', 'on')}`, "
        f"batch {bench.batch_size} per worker, {bench.epochs} epochs of "
        f"scikit-learn's digits upscaled to 28x28 ({bench.num_train} training images, split between the "
        "workers). Every shard and worker in a network namespace of its own, each link shaped to "
        f"{bench.rate_mbit:g} Mbit/s each way ({info.get('links', 'htb')}).",
        "",
        "Steps/s: per worker, over the window from the end of its first epoch to the end of its last "
        f"({window}). Bytes: per step on the worker's link (its qdisc counters over the window), up "
        "(worker to network) and down. Bound of a step: PS max(M/B, n M/(k B)); ring 2 (n-1)/n x M/B; "
        "achieved / bound = bound x steps/s. Shard links busy: the busier direction of each shard's link "
        "over the window, as a share of its rate. Placement bound: the PS bound with the largest shard's "
        "measured share s of the traffic in place of 1/k, max(M/B, n s M/B) (variables are placed whole "
        "below 8 MiB, so k shards need not split M evenly). Test accuracy: PS, a fresh model loaded from "
        "the shards; ring, rank 0's replica. CPU over the window: the machine's busy % (both cores, "
        "other tenants included), the run's own processes (workers and shards) in cores, and its "
        "busiest process.",
        "",
        "| run | n | k | steps/s per worker | examples/s, all workers | KB/step up | KB/step down | bound ms "
        "| step ms | achieved / bound | shard links busy % | largest shard's share | placement bound ms "
        "| achieved / placement bound | test accuracy | final train loss "
        "| machine CPU % | run cores | busiest process, cores |",
        "|" + " --- |" * 19,
    ]
    m_over_b = info["model_bytes"] / (bench.rate_mbit * 1e6 / 8)  # seconds
    for r in runs:
        busy = r.get("shard_link_busy_pct") or []
        share = max(busy) / sum(busy) if r["k"] and sum(busy) > 0 else float("nan")
        placed = max(m_over_b, r["n"] * share * m_over_b)
        placement = (
            f"{share:.2f} | {placed * 1e3:.0f} | {placed * r['steps_per_s']:.2f}" if r["k"] else "- | - | -"
        )
        lines.append(
            f"| {r['system']} | {r['n']} | {r['k'] or '-'} | {r['steps_per_s']:.2f} | "
            f"{r['steps_per_s'] * r['n'] * bench.batch_size:.0f} | {r['up_bytes_per_step'] / 1e3:.0f} | "
            f"{r['down_bytes_per_step'] / 1e3:.0f} | {r['bound_s'] * 1e3:.0f} | "
            f"{1e3 / r['steps_per_s']:.0f} | "
            f"{r['ratio']:.2f} | {', '.join(f'{b:.0f}' for b in busy) or '-'} | {placement} | "
            f"{r['test_accuracy']:.4f} | {r['final_loss']:.4f} | {r['machine_cpu_pct']} | "
            f"{r['run_cores']} | {r['busiest_proc_cores']} |"
        )
    if local:
        lines.append(
            f"| local (no network) | 1 | - | {local['steps_per_second']:.2f} | "
            f"{local['steps_per_second'] * bench.batch_size:.0f} | - | - | - | "
            f"{1e3 / local['steps_per_second']:.0f} | - | - | - | - | - | {local['test_accuracy']:.4f} | "
            f"{local['final_loss']:.4f} | {local['machine_cpu_pct']} | - | - |"
        )
    lines += [
        "",
        "Left behind after the cluster closed (`trainer.netns.leftovers`): "
        f"{info.get('leftovers') or 'nothing'}.",
    ]
    return "\n".join(lines) + "\n"


def evaluate_main(argv: list[str]) -> int:
    """``_evaluate ADDRESSES TRAIN-FLAGS...``: the evaluator process (inside a host)."""
    from trainer.train import evaluate_from_ps

    parser = argparse.ArgumentParser(prog="bench_keras_netns.py _evaluate")
    parser.add_argument("addresses")
    options.add_train_flags(parser)
    args = parser.parse_args(argv)
    options.resolve_model_defaults(args)
    accuracy = evaluate_from_ps(options.train_config(args), args.addresses.split(","))
    print(cm.RESULT_PREFIX + json.dumps({"test_accuracy": accuracy}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_evaluate"]:
        return evaluate_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Needs root, iproute2 and nftables. Results: OUT.md (the table, the command) and OUT.json.",
    )
    parser.add_argument("--workers", type=cm.ints, default=cm.ints("2"), help="n values (default 2)")
    parser.add_argument("--shards", type=cm.ints, default=cm.ints("1,2"), help="k values (default 1,2)")
    parser.add_argument("--modes", default="async,sync", help="parameter-server modes (default async,sync)")
    parser.add_argument("--ring", type=cm.ints, default=cm.ints("2"), help="ring ranks (default 2; '' skips)")
    parser.add_argument(
        "--model", choices=("mlp", "cnn"), default="mlp", help="the demo's model (default mlp)"
    )
    parser.add_argument("--epochs", type=int, default=8, help="(default 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's (default 1e-3)")
    parser.add_argument("--rate-mbit", type=float, default=100, help="every link, each way (default 100)")
    parser.add_argument(
        "--partition-bytes",
        type=int,
        help="the workers' partition_bytes (pstrain --partition-bytes; default: the client's)",
    )
    parser.add_argument(
        "--sync-parts", type=int, default=1, help="sync runs: a step in N parts (pstrain --sync-parts)"
    )
    parser.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="async runs: pstrain --overlap (default auto: on up to 4 workers; runs before 2026-12-07e: on)",
    )
    cm.add_link_args(parser)
    parser.add_argument("--no-local", action="store_true", help="skip the local run")
    parser.add_argument("--quick", action="store_true", help="async k=1 and the ring, n=2, 3 epochs")
    parser.add_argument("--out", help="write OUT.md and OUT.json (e.g. bench/results/keras_netns)")
    parser.add_argument(
        "--render", metavar="JSON", help="no run: render an earlier run's JSON again (to OUT.md)"
    )
    bench = parser.parse_args(argv)
    if bench.render:
        saved = json.loads(Path(bench.render).read_text())
        old = parser.parse_args(shlex.split(saved["command"])[2:])
        old.num_train = saved.get("num_train") or _num_train()
        text = render(old, saved["runs"], saved["local"], saved)
        if bench.out:
            Path(f"{bench.out}.md").write_text(text)
        print(text)
        return 0
    if bench.quick:
        bench.workers, bench.shards, bench.modes, bench.ring, bench.epochs = [2], [1], "async", [2], 3
    if bench.epochs < 2:
        parser.error("--epochs must be >= 2 (the window runs from the end of the first epoch to the last)")
    modes = [m for m in bench.modes.split(",") if m]
    if unknown := set(modes) - set(PS_MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    if cm.netns_missing("bench_keras_netns.py"):
        return 2
    bench.max_shards = max(bench.shards) if modes else 0
    info: dict[str, Any] = {
        "command": cm.command_line("bench_keras_netns.py", argv),
        "machine": cm.machine_note(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="keras-netns-") as tmp:
        data_path = Path(tmp) / "digits28.npz"
        write_digits28(data_path)
        import numpy as np

        with np.load(data_path) as f:
            bench.num_train = len(f["y_train"])
        local = {} if bench.no_local else run_local(bench, data_path, Path(tmp))
        if local:
            print(
                f"local: test accuracy {local['test_accuracy']:.4f}, {local['steps_per_second']:.1f} steps/s",
                file=sys.stderr,
                flush=True,
            )
        m_bytes = model_bytes(bench.model)
        info.update(model_bytes=m_bytes, params=m_bytes // 4, links=cm.link_text(bench))
        num_hosts = bench.max_shards + max([*bench.workers, *bench.ring])
        with NetnsCluster(
            num_hosts, rate_mbit=bench.rate_mbit, workdir=Path(tmp) / "net", **cm.link_options(bench)
        ) as net:
            suffix = net.suffix
            plan = [("ps", m, n, k) for n in bench.workers for k in bench.shards for m in modes]
            plan += [("ring", "allreduce", n, 0) for n in bench.ring]
            for kind, mode, n, k in plan:
                r = (
                    run_ps(net, bench, mode, n, k, m_bytes, data_path)
                    if kind == "ps"
                    else run_ring(net, bench, n, m_bytes, data_path)
                )
                runs.append(r)
                save(bench, runs, local, {**info, "leftovers": "(the cluster is still up)"})
                print(
                    f"{r['system']:9s} n={n} k={k}: {r['steps_per_s']:.2f} steps/s, "
                    f"{r['ratio']:.2f} of bound "
                    f"({1e3 / r['steps_per_s']:.0f} ms vs {r['bound_s'] * 1e3:.0f} ms), "
                    f"{r['up_bytes_per_step'] / 1e3:.0f}/{r['down_bytes_per_step'] / 1e3:.0f} KB up/down "
                    "per step, "
                    f"test accuracy {r['test_accuracy']:.4f}, CPU {r['machine_cpu_pct']} %, "
                    f"run {r['run_cores']} cores, busiest {r['busiest_proc_cores']}",
                    file=sys.stderr,
                    flush=True,
                )
        info["leftovers"] = leftovers(suffix)
    text = save(bench, runs, local, info)
    print(text)
    return 1 if info["leftovers"] else 0


def save(
    bench: argparse.Namespace, runs: list[dict[str, Any]], local: dict[str, Any], info: dict[str, Any]
) -> str:
    """Renders the table and writes OUT.md and OUT.json (after every run: a later failure keeps the
    earlier runs); returns the text."""
    info["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    text = render(bench, runs, local, info)
    results = {
        **info,
        "rate_mbit": bench.rate_mbit,
        "model": bench.model,
        "epochs": bench.epochs,
        "batch_size": bench.batch_size,
        "learning_rate": bench.learning_rate,
        "num_train": bench.num_train,
        "runs": runs,
        "local": local,
        "top_processes_after": cm.top_processes(),
    }
    cm.write_results(bench.out, text, results)
    return text


if __name__ == "__main__":
    sys.exit(main())
