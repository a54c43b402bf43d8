"""Parameter-server data path vs a bare grpc.aio echo and TensorFlow's own PS runtime, side by side.

One run starts three servers on loopback and drives each from its own client
process, one system after the other:

* ``echo``: a bare grpc.aio bytes service (one process, uvloop, identity
  serializers). ``Source`` answers N bytes (the pull peer), ``Sink`` takes N
  bytes (the push peer), ``Echo`` returns what it got (the push_pull peer).
* ``ps``: a 2-shard psserver cluster (``trainer.cluster.LocalCluster``) driven by
  ``psclient.AsyncPSClient``: ``pull([v])``, ``push({v: g})``, ``push_pull({v: g})``
  of one float32 variable of N bytes (64 MiB is split over both shards by the
  client's placement rule).
* ``tf``: TensorFlow's ParameterServerStrategy runtime: two ``tf.distribute.Server``
  ps tasks; the client process joins with ``tf.config.experimental_connect_to_cluster``
  and holds ``tf.Variable``s on ``/job:ps``. pull = ``read_value()`` fetched to
  numpy in the client, push = ``assign_add(grad)`` of a numpy gradient,
  push_pull = ``assign_add(grad, read_value=True)`` fetched to numpy. Variables of
  at least 8 MiB are split in two halves on ps:0 and ps:1 (as psserver does), and
  the halves move concurrently inside one ``tf.function``.

glibc malloc (``--malloc``): ``tuned`` (default) gives every process of the run,
servers and clients of all three systems, ``pscore.memory.tune_malloc`` (big
buffers stay in the heap instead of being page-faulted in anew); ``shipped``
leaves everything as installed (psserver tunes itself at start, nothing else
is tuned: the out-of-the-box comparison); ``default`` runs every process,
psserver included, on glibc's defaults.

Every case runs for ``--seconds`` seconds (or ``--max-iters`` ops) per system,
cut into ``--rounds`` short rounds (each after a short warm-up) that alternate
between the systems in rotating order, so that load from other work on the
machine falls on all systems alike; serially (1 client) and, for 1 KiB, with
``--concurrency`` clients at once. ops/s and GB/s sum the rounds; p50 is the
median round's, p99 the worst round's. Throughput counts the model bytes N
once per op (push_pull moves 2N).

Usage:
    python bench/bench_ps.py --out bench/results/ps   # writes ps.md and ps.json
    python bench/bench_ps.py --sizes 1KiB --systems echo,ps --seconds 1   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as cm

OPS = ("pull", "push", "push_pull")
SIZES = {"1KiB": 1 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}
MAX_MESSAGE = 256 << 20
TF_SPLIT_BYTES = 8 << 20  # psclient's default partition size: bigger variables go to both ps tasks
ECHO_SERVICE = "/bench.Echo/"
CHILD_TIMEOUT_S = 900


def _parse_size(text: str) -> int:
    if text in SIZES:
        return SIZES[text]
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, mult in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def _size_name(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def _cases(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(op, nbytes, concurrency) of every case, in run order."""
    out = []
    for n in args.sizes:
        for op in args.ops:
            out.append((op, n, 1))
        if n <= args.concurrent_max_bytes and args.concurrency > 1:
            for op in args.ops:
                out.append((op, n, args.concurrency))
    return out


READY = "BENCH-READY"


def _feed() -> Iterator[tuple[str, int, int, float]]:
    """A client child's cases, one JSON line each on stdin, as the parent sends them (after READY)."""
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip() or line.strip() == "quit":
            return
        op, n, conc, seconds = json.loads(line)
        yield str(op), int(n), int(conc), float(seconds)


def _budget(args: argparse.Namespace, nbytes: int, seconds: float) -> tuple[int, float, int]:
    """(max_iters, max_seconds, warmup) of one round of a case."""
    warmup = 2 if nbytes >= 16 << 20 else 20
    return max(1, args.max_iters // args.rounds), seconds, warmup


def _grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


# -- echo server and client ------------------------------------------------------


async def _echo_server_main(ready_file: str) -> None:
    import grpc

    sources: dict[int, bytes] = {}

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    async def sink(request: bytes, context: Any) -> bytes:
        return b""

    async def source(request: bytes, context: Any) -> bytes:
        (n,) = struct.unpack("<q", request)
        data = sources.get(n)
        if data is None:
            data = sources[n] = bytes(n)
        return data

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn)
        for name, fn in (("Echo", echo), ("Sink", sink), ("Source", source))
    }
    server = grpc.aio.server(options=_grpc_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(ready_file + ".tmp", "w") as f:  # noqa: ASYNC230 - once, at start
        f.write(f"127.0.0.1:{port}\n")
    os.replace(ready_file + ".tmp", ready_file)
    await server.wait_for_termination()


async def _echo_client(args: argparse.Namespace) -> list[cm.Stat]:
    import grpc
    import numpy as np

    options = _grpc_options()
    concurrency = max(c for _, _, c in _cases(args))
    channels = [
        grpc.aio.insecure_channel(args.target, options=[*options, ("bench.channel_index", i)])
        for i in range(concurrency)
    ]
    stats = []
    try:
        for op, n, conc, budget_s in _feed():
            payload = bytes(n)
            request = struct.pack("<q", n)
            calls = {
                name: [ch.unary_unary(ECHO_SERVICE + name) for ch in channels]
                for name in ("Echo", "Sink", "Source")
            }

            async def run(
                i: int, op: str = op, payload: bytes = payload, request: bytes = request, calls: Any = calls
            ) -> None:
                if op == "pull":
                    resp = await calls["Source"][i](request, timeout=60)
                    np.frombuffer(resp, np.float32)
                elif op == "push":
                    await calls["Sink"][i](payload, timeout=60)
                else:
                    resp = await calls["Echo"][i](payload, timeout=60)
                    np.frombuffer(resp, np.float32)

            iters, seconds, warmup = _budget(args, n, budget_s)
            lat, elapsed = await cm.measure_async(
                run, concurrency=conc, max_iters=iters, max_seconds=seconds, warmup=warmup
            )
            stats.append(cm.summarize("echo", op, n, conc, lat, elapsed))
            cm.emit(stats[-1:])
    finally:
        for ch in channels:
            await ch.close()
    return stats


# -- psserver client ----------------------------------------------------------------


async def _ps_client(args: argparse.Namespace) -> list[cm.Stat]:
    import numpy as np

    import psclient

    addresses = args.target.split(",")
    concurrency = max(c for _, _, c in _cases(args))
    clients = [psclient.AsyncPSClient(addresses, worker_id=f"bench-{i}") for i in range(concurrency)]
    stats = []
    try:
        names = {}
        for n in args.sizes:
            name = f"bench/w{n}"
            await clients[0].create(name, np.zeros(n // 4, np.float32), optimizer=psclient.SGD(1e-6))
            names[n] = name
        for c in clients:  # learn placement up front (a worker that created nothing does this once)
            await c.list_variables(list(names.values()))
        for op, n, conc, budget_s in _feed():
            name = names[n]
            grad = np.full(n // 4, 1e-3, np.float32)

            async def run(i: int, op: str = op, name: str = name, grad: np.ndarray = grad) -> None:
                c = clients[i]
                if op == "pull":
                    await c.pull([name])
                elif op == "push":
                    await c.push({name: grad})
                else:
                    await c.push_pull({name: grad})

            iters, seconds, warmup = _budget(args, n, budget_s)
            lat, elapsed = await cm.measure_async(
                run, concurrency=conc, max_iters=iters, max_seconds=seconds, warmup=warmup
            )
            stats.append(cm.summarize("ps", op, n, conc, lat, elapsed))
            cm.emit(stats[-1:])
    finally:
        for c in clients:
            await c.close()
    return stats


# -- TensorFlow's PS runtime ---------------------------------------------------------


def _tf_env() -> dict[str, str]:
    return {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def _tf_ps_main(cluster: str, task: int, ready_file: str) -> None:
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(json.loads(cluster)), job_name="ps", task_index=task, protocol="grpc", start=True
    )
    Path(ready_file).write_text(server.target + "\n")
    server.join()


def _tf_client(args: argparse.Namespace) -> list[cm.Stat]:
    import numpy as np
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(json.loads(args.target))
    tf.config.experimental_connect_to_cluster(cluster, job_name="chief", protocol="grpc")
    stats = []
    variables: dict[int, list[Any]] = {}
    for op, n, conc, budget_s in _feed():
        count = n // 4
        parts = 2 if n >= TF_SPLIT_BYTES else 1
        bounds = np.linspace(0, count, parts + 1).astype(int)
        if n not in variables:
            variables[n] = []
            for p in range(parts):
                with tf.device(f"/job:ps/task:{p}"):
                    variables[n].append(tf.Variable(tf.zeros([bounds[p + 1] - bounds[p]], tf.float32)))
        shards = variables[n]
        grad = np.full(count, 1e-3, np.float32)
        grads = [grad[bounds[p] : bounds[p + 1]] for p in range(parts)]

        @tf.function
        def read(shards: list[Any] = shards) -> list[Any]:
            return [v.read_value() for v in shards]

        @tf.function
        def add(gs: list[Any], shards: list[Any] = shards) -> None:
            for v, g in zip(shards, gs, strict=True):
                v.assign_add(g, read_value=False)

        @tf.function
        def add_read(gs: list[Any], shards: list[Any] = shards) -> list[Any]:
            return [v.assign_add(g, read_value=True) for v, g in zip(shards, gs, strict=True)]

        def run(i: int, op: str = op, grads: list[np.ndarray] = grads) -> None:
            if op == "pull":
                [t.numpy() for t in read()]
            elif op == "push":
                add(grads)
            else:
                [t.numpy() for t in add_read(grads)]

        iters, seconds, warmup = _budget(args, n, budget_s)
        lat, elapsed = cm.measure_threads(
            run, concurrency=conc, max_iters=iters, max_seconds=seconds, warmup=warmup
        )
        stats.append(cm.summarize("tf", op, n, conc, lat, elapsed))
        cm.emit(stats[-1:])
    return stats


# -- orchestration -------------------------------------------------------------------


def _child_args(args: argparse.Namespace, system: str, target: str) -> list[str]:
    return [
        str(Path(__file__).resolve()), "--role", f"client-{system}", "--target", target,
        "--sizes", *(_size_name(n) for n in args.sizes), "--ops", *args.ops,
        "--seconds", str(args.seconds), "--max-iters", str(args.max_iters),
        "--concurrency", str(args.concurrency), "--concurrent-max-bytes", str(args.concurrent_max_bytes),
    ]  # fmt: skip


@contextlib.contextmanager
def _popen(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Any:
    with open(log, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, *argv], stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def _run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    from trainer.cluster import LocalCluster

    me = str(Path(__file__).resolve())
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ps-")))
        targets: dict[str, str] = {}
        if "echo" in args.systems:
            ready = work / "echo.addr"
            proc = stack.enter_context(
                _popen([me, "--role", "echo-server", "--ready-file", str(ready)], work / "echo.log")
            )
            targets["echo"] = cm.wait_for_file(ready, 30, proc)
        if "ps" in args.systems:
            cluster = stack.enter_context(LocalCluster(num_shards=2, server_args=args.ps_server_args))
            targets["ps"] = ",".join(cluster.addresses)
        if "tf" in args.systems:
            spec = json.dumps({"ps": [f"127.0.0.1:{cm.free_port()}" for _ in range(2)]})
            procs = []
            for task in range(2):
                ready = work / f"tf{task}.addr"
                procs.append(
                    (
                        ready,
                        stack.enter_context(
                            _popen(
                                [
                                    me,
                                    "--role",
                                    "tf-ps",
                                    "--target",
                                    spec,
                                    "--task",
                                    str(task),
                                    "--ready-file",
                                    str(ready),
                                ],
                                work / f"tf{task}.log",
                                _tf_env(),
                            )
                        ),
                    )
                )
            for ready, proc in procs:
                cm.wait_for_file(ready, 120, proc)
            targets["tf"] = spec
        results.extend(_interleaved(args, targets, work))
    return results


def _interleaved(args: argparse.Namespace, targets: dict[str, str], work: Path) -> list[dict[str, Any]]:
    """Runs every case on every system back to back (rotating which goes first), one client process each.

    Interleaving keeps the ratios of one case honest on a machine whose load
    drifts: the systems of a case are measured within seconds of each other.
    """
    children: dict[str, subprocess.Popen[str]] = {}
    results: list[dict[str, Any]] = []
    deadline = threading.Timer(CHILD_TIMEOUT_S, lambda: [c.kill() for c in children.values()])
    deadline.daemon = True
    try:
        for system in args.systems:
            env = {**os.environ, **(_tf_env() if system == "tf" else {})}
            log = open(work / f"client-{system}.log", "w")  # noqa: SIM115 - owned by the child
            children[system] = subprocess.Popen(
                [sys.executable, *_child_args(args, system, targets[system])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=cm.REPO,
            )  # fmt: skip
            log.close()
        deadline.start()
        for system, child in children.items():
            _read_until(child, system, work, READY)
        turn = 0
        for op, n, conc in _cases(args):
            rounds: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
            for _ in range(args.rounds):  # short rounds, rotating who goes first
                order = args.systems[turn % len(args.systems) :] + args.systems[: turn % len(args.systems)]
                turn += 1
                for system in order:
                    child = children[system]
                    assert child.stdin is not None
                    child.stdin.write(json.dumps([op, n, conc, args.seconds / args.rounds]) + "\n")
                    child.stdin.flush()
                    line = _read_until(child, system, work, cm.RESULT_PREFIX)
                    rounds[system].extend(json.loads(line[len(cm.RESULT_PREFIX) :]))
            results.extend(_merge(r) for r in rounds.values())
            print(f"  {op} {_size_name(n)} x{conc}: done", file=sys.stderr, flush=True)
    finally:
        deadline.cancel()
        for child in children.values():
            with contextlib.suppress(OSError, ValueError):
                assert child.stdin is not None
                child.stdin.write("quit\n")
                child.stdin.close()
        for child in children.values():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=30)
    return results


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's rounds as one result: ops and seconds summed; p50 the median round's, p99 the worst."""
    first = rounds[0]
    iters = sum(r["iters"] for r in rounds)
    seconds = sum(r["seconds"] for r in rounds)
    ops = iters / seconds if seconds > 0 else 0.0
    return {
        **first,
        "iters": iters,
        "seconds": round(seconds, 4),
        "ops_s": round(ops, 2),
        "gb_s": round(ops * first["nbytes"] / 1e9, 4),
        "p50_ms": sorted(r["p50_ms"] for r in rounds)[len(rounds) // 2],
        "p99_ms": max(r["p99_ms"] for r in rounds),
        "rounds": len(rounds),
    }


def _read_until(child: subprocess.Popen[str], system: str, work: Path, prefix: str) -> str:
    """The child's next stdout line starting with ``prefix``. Raises: RuntimeError if it ended first."""
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(prefix):
            return line.strip()
    log = (work / f"client-{system}.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"{system} client exited ({child.poll()}) before {prefix}:\n{log}")


# -- report ---------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def _key(r: dict[str, Any]) -> tuple[str, int, int]:
    return (r["op"], r["nbytes"], r["concurrency"])


def _goal(name: str, want: float, got: float) -> dict[str, Any]:
    return {"goal": name, "want": want, "got": round(got, 2), "met": got >= want}


def goals(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, checked against one run's results."""
    by = {(r["system"], *_key(r)): r for r in results}
    out = []

    def ratio(op: str, n: int, conc: int, peer: str) -> float | None:
        ps, other = by.get(("ps", op, n, conc)), by.get((peer, op, n, conc))
        if not ps or not other or not other["ops_s"]:
            return None
        return ps["ops_s"] / other["ops_s"]

    for op in OPS:
        for peer, want in (("tf", 1.5), ("echo", 1.0)):
            r = ratio(op, 64 << 20, 1, peer)
            if r is not None:
                out.append(_goal(f"64MiB {op} vs {peer}", want, r))
    concs = sorted({r["concurrency"] for r in results if r["nbytes"] == 1 << 10 and r["concurrency"] > 1})
    for conc in concs:
        r = ratio("push", 1 << 10, conc, "echo")
        if r is not None:
            out.append(_goal(f"1KiB push x{conc} vs echo", 0.8, r))
    return out


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = []
    for k, run in enumerate(runs, 1):
        results = run["results"]
        by = {(r["system"], *_key(r)): r for r in results}
        lines.append(
            f"### Run {k} ({run['started']}, malloc {run.get('malloc', 'tuned')}, "
            f"load before {run['machine']['loadavg_1_5_15']}, after {run['load_after']})\n"
        )
        lines.append("| size | op | clients | system | GB/s | ops/s | p50 ms | p99 ms | vs echo | vs TF |")
        lines.append("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        keys = sorted({_key(r) for r in results}, key=lambda k: (k[1], k[2], OPS.index(k[0])))
        for op, n, conc in keys:
            echo = by.get(("echo", op, n, conc))
            tf = by.get(("tf", op, n, conc))
            for system in ("ps", "echo", "tf"):
                r = by.get((system, op, n, conc))
                if r is None:
                    continue
                vs_echo = _ratio(r["ops_s"], echo and echo["ops_s"]) if system != "echo" else ""
                vs_tf = _ratio(r["ops_s"], tf and tf["ops_s"]) if system != "tf" else ""
                lines.append(
                    f"| {_size_name(n)} | {op} | {conc} | {system} | {r['gb_s']:.3f} | {r['ops_s']:.1f} | "
                    f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {vs_echo} | {vs_tf} |"
                )
        lines.append("")
        lines.append("Goals (ratios of ops/s in this run):\n")
        lines.append("| goal | want | got | met |")
        lines.append("| --- | ---: | ---: | --- |")
        for g in run["goals"]:
            lines.append(f"| {g['goal']} | >= {g['want']}x | {g['got']}x | {'yes' if g['met'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--task", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help="model sizes (default: 1KiB 1MiB 64MiB)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--systems", default="echo,ps,tf", help="comma list of echo, ps, tf (default: all)")
    p.add_argument("--seconds", type=float, default=3.0, help="time budget per case and system (default: 3)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per case (default: 3)")
    p.add_argument("--max-iters", type=int, default=3000, help="op budget per case (default: 3000)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument(
        "--concurrent-max-bytes", type=int, default=1 << 10, help="run concurrent cases up to this size"
    )
    p.add_argument("--repeat", type=int, default=1, help="whole runs, one after the other (default: 1)")
    p.add_argument("--ps-server-args", nargs="*", default=[], help="extra psserver flags")
    p.add_argument(
        "--malloc",
        choices=("tuned", "shipped", "default"),
        default="tuned",
        help="tuned: tune_malloc in every process (default); shipped: only psserver tunes itself; "
        "default: glibc defaults everywhere",
    )
    p.add_argument("--out", help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    args.sizes = [_parse_size(s) for s in args.sizes]
    args.systems = [s for s in args.systems.split(",") if s]

    if args.role != "main":
        if os.environ.get("BENCH_MALLOC", "tuned") == "tuned":
            from pscore.memory import tune_malloc

            tune_malloc()
    else:
        os.environ["BENCH_MALLOC"] = args.malloc  # inherited by every child
        if args.malloc == "default":
            os.environ["PS_MALLOC_TUNING"] = "0"  # psserver too
    if args.role == "echo-server":
        import uvloop

        uvloop.run(_echo_server_main(args.ready_file))
        return 0
    if args.role == "tf-ps":
        _tf_ps_main(args.target, args.task, args.ready_file)
        return 0
    if args.role == "client-echo":
        import uvloop

        uvloop.run(_echo_client(args))  # results go out case by case (_feed)
        return 0
    if args.role == "client-ps":
        import uvloop

        uvloop.run(_ps_client(args))
        return 0
    if args.role == "client-tf":
        _tf_client(args)
        return 0

    command = "python bench/bench_ps.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    for k in range(args.repeat):
        machine = cm.machine_note()
        busy = cm.top_processes()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"run {k + 1}/{args.repeat} (load {machine['loadavg_1_5_15']})", file=sys.stderr, flush=True)
        results = _run_all(args)
        runs.append(
            {
                "started": started,
                "malloc": args.malloc,
                "machine": machine,
                "busy_before": busy,
                "load_after": [round(x, 2) for x in os.getloadavg()],
                "results": results,
                "goals": goals(results),
            }
        )
    report = {"command": command, "runs": runs}
    text = markdown(runs)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(args.out + ".md").write_text(f"Command: `{command}`\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["asdict", "goals", "main", "markdown"]
