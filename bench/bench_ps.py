"""Parameter-server data path vs raw sockets, a bare grpc.aio echo and TensorFlow's own PS runtime.

One run starts the servers on loopback and drives each from its own client
process, one system after the other:

* ``raw``: the physical limit: a raw Python loopback socket (blocking sockets,
  a thread per connection) moving the same bytes into a reused buffer. pull:
  the server sends N bytes from a buffer, the client ``recv_into`` s a reused
  one; push: the other way, answered by one byte; push_pull: both.
* ``echo``: a bare grpc.aio bytes service (one process, uvloop, identity
  serializers). ``Source`` answers N bytes (the pull peer), ``Sink`` takes N
  bytes (the push peer), ``Echo`` returns what it got (the push_pull peer).
* ``ps``: a 2-shard psserver cluster (``trainer.cluster.LocalCluster``) driven by
  ``psclient.AsyncPSClient`` as shipped (every transfer over the shards'
  raw-TCP data port): ``pull([v])``, ``push({v: g})``,
  ``push_pull({v: g})`` of one float32 variable of N bytes (64 MiB is split over
  both shards by the client's placement rule).
* ``ps_grpc``: the same cluster and calls with ``ClientConfig(data_port=False)``:
  everything over gRPC (what the data port replaced).
* ``tf``: TensorFlow's ParameterServerStrategy runtime: two ``tf.distribute.Server``
  ps tasks; the client process joins with ``tf.config.experimental_connect_to_cluster``
  and holds ``tf.Variable``s on ``/job:ps``. pull = ``read_value()`` fetched to
  numpy in the client, push = ``assign_add(grad)`` of a numpy gradient,
  push_pull = ``assign_add(grad, read_value=True)`` fetched to numpy. Variables of
  at least 8 MiB are split in two halves on ps:0 and ps:1 (as psserver does), and
  the halves move concurrently inside one ``tf.function``.

``--ops lookup`` (not in the default ops): an embedding lookup of N bytes of rows,
``N / 32`` ids of a table of dim 8 (float32), each client its own ids. ``ps`` and
``ps_grpc``: ``lookup(table, ids)`` (the ids split over both shards); ``tf``:
``tf.gather`` of the ids from a ``[rows, 8]`` variable on ps:0, fetched to numpy;
``raw`` and ``echo`` answer N bytes, as for pull. With ``--concurrency`` clients,
psclient's concurrent small lookups to one shard share frames (``psclient._bulk``).

glibc malloc (``--malloc``): ``tuned`` (default) gives every process of the run,
servers and clients of all three systems, ``pscore.memory.tune_malloc`` (big
buffers stay in the heap instead of being page-faulted in anew); ``shipped``
leaves everything as installed (psserver tunes itself at start, nothing else
is tuned: the out-of-the-box comparison); ``default`` runs every process,
psserver included, on glibc's defaults.

Server CPU: each round reads the CPU time (user + system, /proc) of the system's
server processes (both shards for ``ps``); the report gives it per MiB moved
(per op, N bytes; push_pull counts N once). Shard memory: the shards' RSS when
they start (empty), at the end, and their peak, next to the state they hold
(the bench variables: float32, SGD without momentum, so no slots).

Every case runs for ``--seconds`` seconds (or ``--max-iters`` ops) per system,
cut into ``--rounds`` short rounds (each after a short warm-up) that alternate
between the systems in rotating order, so that load from other work on the
machine falls on all systems alike; serially (1 client) and, for 1 KiB, with
``--concurrency`` clients at once. ops/s and GB/s sum the rounds; p50 is the
median round's, p99 the worst round's. Throughput counts the model bytes N
once per op (push_pull moves 2N).

Usage:
    python bench/bench_ps.py --out bench/results/ps   # writes ps.md and ps.json
    python bench/bench_ps.py --sizes 64MiB --systems raw,ps,ps_grpc --seconds 1   # a quick look
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

OPS = ("pull", "push", "push_pull")  # the default ops
ALL_OPS = (*OPS, "lookup")
LOOKUP_DIM = 8  # a lookup's table: float32 rows of this dim (32 bytes), N / 32 ids
SIZES = {"1KiB": 1 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20, "64MiB": 64 << 20}
SYSTEMS = ("raw", "echo", "ps", "ps_grpc", "tf")
_RAW_OPS = {"pull": 1, "push": 2, "push_pull": 3, "lookup": 1}  # a lookup's peer: N bytes answered
_RAW_HEAD = struct.Struct("<BQ")  # op, bytes
MAX_MESSAGE = 256 << 20
ECHO_SERVICE = "/bench.Echo/"
CHILD_TIMEOUT_S = 900


def _lookup_shape(nbytes: int) -> tuple[int, int]:
    """A lookup of ``nbytes`` of rows: (ids per lookup, rows of its table)."""
    k = max(1, nbytes // (4 * LOOKUP_DIM))
    return k, max(4 * k, 4096)


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


# -- raw sockets: the physical limit ------------------------------------------------


def _recv_into(sock: Any, view: memoryview) -> bool:
    """Fills ``view`` from a blocking socket; False if the peer closed first."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            return False
        got += k
    return True


def _raw_server_main(ready_file: str) -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def serve(conn: Any) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(_RAW_HEAD.size)
        buf = bytearray()
        with conn:
            while _recv_into(conn, memoryview(head)):
                op, n = _RAW_HEAD.unpack(head)
                if len(buf) < n:
                    buf = bytearray(n)
                view = memoryview(buf)[:n]
                if op != _RAW_OPS["pull"] and not _recv_into(conn, view):
                    return
                conn.sendall(view if op != _RAW_OPS["push"] else b"\x01")

    with open(ready_file + ".tmp", "w") as f:
        f.write(f"127.0.0.1:{listener.getsockname()[1]}\n")
    os.replace(ready_file + ".tmp", ready_file)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _raw_client(args: argparse.Namespace) -> list[cm.Stat]:
    import socket

    host, _, port = args.target.rpartition(":")
    concurrency = max(c for _, _, c in _cases(args))
    conns = []
    for _ in range(concurrency):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(s)
    stats = []
    try:
        for op, n, conc, budget_s in _feed():
            out = memoryview(bytearray(n))
            into = [memoryview(bytearray(max(n, 1))) for _ in range(conc)]
            head = _RAW_HEAD.pack(_RAW_OPS[op], n)

            def run(
                i: int, op: str = op, out: memoryview = out, head: bytes = head, into: list[memoryview] = into
            ) -> None:
                s = conns[i]
                s.sendall(head)
                if _RAW_OPS[op] != _RAW_OPS["pull"]:  # a lookup's peer sends its head only, as pull
                    s.sendall(out)
                _recv_into(s, into[i][: len(out) if op != "push" else 1])

            iters, seconds, warmup = _budget(args, n, budget_s)
            lat, elapsed = cm.measure_threads(
                run, concurrency=conc, max_iters=iters, max_seconds=seconds, warmup=warmup
            )
            stats.append(cm.summarize("raw", op, n, conc, lat, elapsed))
            cm.emit(stats[-1:])
    finally:
        for s in conns:
            s.close()
    return stats


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
                if op in ("pull", "lookup"):
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


async def _ps_client(args: argparse.Namespace, system: str) -> list[cm.Stat]:
    import numpy as np

    import psclient

    addresses = args.target.split(",")
    concurrency = max(c for _, _, c in _cases(args))
    options = {"data_port": False} if system == "ps_grpc" else {}
    clients = [
        psclient.AsyncPSClient(addresses, worker_id=f"bench-{system}-{i}", **options)
        for i in range(concurrency)
    ]
    stats = []
    try:
        names = {}
        tables: dict[int, tuple[str, list[np.ndarray]]] = {}  # size -> table, each client's ids
        rng = np.random.default_rng(0)
        for n in args.sizes:
            name = f"bench/w{n}"
            await clients[0].create(name, np.zeros(n // 4, np.float32), optimizer=psclient.SGD(1e-6))
            names[n] = name
            if "lookup" in args.ops:
                k, rows = _lookup_shape(n)
                await clients[0].create_embedding(f"bench/e{n}", rows, LOOKUP_DIM, initializer="zeros")
                tables[n] = (f"bench/e{n}", [rng.integers(0, rows, k) for _ in clients])
        for c in clients:  # learn placement up front (a worker that created nothing does this once)
            await c.list_variables([*names.values(), *(t for t, _ in tables.values())])
        for op, n, conc, budget_s in _feed():
            name = names[n]
            grad = np.full(n // 4, 1e-3, np.float32)

            async def run(
                i: int, op: str = op, name: str = name, grad: np.ndarray = grad, n: int = n
            ) -> None:
                c = clients[i]
                if op == "pull":
                    await c.pull([name])
                elif op == "lookup":
                    table, ids = tables[n]
                    await c.lookup(table, ids[i])
                elif op == "push":
                    await c.push({name: grad})
                else:
                    await c.push_pull({name: grad})

            iters, seconds, warmup = _budget(args, n, budget_s)
            lat, elapsed = await cm.measure_async(
                run, concurrency=conc, max_iters=iters, max_seconds=seconds, warmup=warmup
            )
            stats.append(cm.summarize(system, op, n, conc, lat, elapsed))
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

    from pscore.placement import DEFAULT_PARTITION_BYTES

    cluster = tf.train.ClusterSpec(json.loads(args.target))
    tf.config.experimental_connect_to_cluster(cluster, job_name="chief", protocol="grpc")
    stats = []
    variables: dict[int, list[Any]] = {}
    tables: dict[int, tuple[Any, np.ndarray]] = {}  # size -> a lookup's table variable and ids
    for op, n, conc, budget_s in _feed():
        count = n // 4
        parts = 2 if n >= DEFAULT_PARTITION_BYTES else 1  # as psclient cuts them over its 2 shards
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

        if op == "lookup" and n not in tables:
            k, rows = _lookup_shape(n)
            with tf.device("/job:ps/task:0"):
                table = tf.Variable(tf.zeros([rows, LOOKUP_DIM], tf.float32))
            tables[n] = (table, np.random.default_rng(0).integers(0, rows, k))

        @tf.function
        def gather(ids: Any, table: Any = tables[n][0] if n in tables else None) -> Any:
            return tf.gather(table, ids)

        def run(i: int, op: str = op, grads: list[np.ndarray] = grads, n: int = n) -> None:
            if op == "pull":
                [t.numpy() for t in read()]
            elif op == "lookup":
                gather(tables[n][1]).numpy()
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


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def _memory_mib(pid: int) -> dict[str, float]:
    """A process's resident set now (VmRSS) and at its peak (VmHWM), MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss_mib" if key == "VmRSS" else "peak_mib"] = round(int(value.split()[0]) / 1024, 1)
    return out


def _run_all(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Runs every case on every system; returns the results and the shards' memory (empty without ps)."""
    from trainer.cluster import LocalCluster

    me = str(Path(__file__).resolve())
    results: list[dict[str, Any]] = []
    memory: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ps-")))
        targets: dict[str, str] = {}
        pids: dict[str, list[int]] = {}
        for system in ("raw", "echo"):
            if system in args.systems:
                ready = work / f"{system}.addr"
                proc = stack.enter_context(
                    _popen(
                        [me, "--role", f"{system}-server", "--ready-file", str(ready)], work / f"{system}.log"
                    )
                )
                targets[system] = cm.wait_for_file(ready, 30, proc)
                pids[system] = [proc.pid]
        shards: list[int] = []
        if "ps" in args.systems or "ps_grpc" in args.systems:
            cluster = stack.enter_context(LocalCluster(num_shards=2, server_args=args.ps_server_args))
            shards = [p.pid for p in cluster.procs if p is not None]
            memory["start"] = [_memory_mib(pid) for pid in shards]
            for system in ("ps", "ps_grpc"):
                targets[system] = ",".join(cluster.addresses)
                pids[system] = shards
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
            pids["tf"] = [proc.pid for _, proc in procs]
        results.extend(_interleaved(args, targets, pids, work))
        if shards:
            memory["end"] = [_memory_mib(pid) for pid in shards]
            memory["state_mib"] = round(sum(args.sizes) / (1 << 20), 3)  # one float32 variable per size
    return results, memory


def _interleaved(
    args: argparse.Namespace, targets: dict[str, str], pids: dict[str, list[int]], work: Path
) -> list[dict[str, Any]]:
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
                    cpu = _cpu_s(pids[system])
                    child.stdin.write(json.dumps([op, n, conc, args.seconds / args.rounds]) + "\n")
                    child.stdin.flush()
                    line = _read_until(child, system, work, cm.RESULT_PREFIX)
                    (stat,) = json.loads(line[len(cm.RESULT_PREFIX) :])
                    # The round's warm-up ops are included: a few % more per timed op.
                    stat["server_cpu_s"] = _cpu_s(pids[system]) - cpu
                    rounds[system].append(stat)
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
    cpu = sum(r.get("server_cpu_s", 0.0) for r in rounds)
    mib = iters * first["nbytes"] / (1 << 20)
    return {
        **first,
        "iters": iters,
        "seconds": round(seconds, 4),
        "ops_s": round(ops, 2),
        "gb_s": round(ops * first["nbytes"] / 1e9, 4),
        "p50_ms": sorted(r["p50_ms"] for r in rounds)[len(rounds) // 2],
        "p99_ms": max(r["p99_ms"] for r in rounds),
        "rounds": len(rounds),
        "server_cpu_s": round(cpu, 3),
        "server_cpu_ms_per_mib": round(cpu * 1e3 / mib, 3) if mib else None,
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
        for peer, want in (("tf", 1.5), ("raw", 0.5)):
            r = ratio(op, 64 << 20, 1, peer)
            if r is not None:
                out.append(_goal(f"64MiB {op} vs {peer}", want, r))
    r = ratio("push", 4 << 20, 1, "echo")
    if r is not None:
        out.append(_goal("4MiB push vs echo", 1.0, r))
    concs = sorted({r["concurrency"] for r in results if r["nbytes"] == 1 << 10 and r["concurrency"] > 1})
    for conc in concs:
        r = ratio("push", 1 << 10, conc, "echo")
        if r is not None:  # 0.83-0.86x before the data port (bench/results/ps.md): no worse than that
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
        lines.append(
            "| size | op | clients | system | GB/s | ops/s | p50 ms | p99 ms | server CPU ms/MiB "
            "| vs raw | vs echo | vs TF |"
        )
        lines.append("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        keys = sorted({_key(r) for r in results}, key=lambda k: (k[1], k[2], ALL_OPS.index(k[0])))
        for op, n, conc in keys:
            raw = by.get(("raw", op, n, conc))
            echo = by.get(("echo", op, n, conc))
            tf = by.get(("tf", op, n, conc))
            for system in ("ps", "ps_grpc", "raw", "echo", "tf"):
                r = by.get((system, op, n, conc))
                if r is None:
                    continue
                vs_raw = _ratio(r["ops_s"], raw and raw["ops_s"]) if system != "raw" else ""
                vs_echo = _ratio(r["ops_s"], echo and echo["ops_s"]) if system != "echo" else ""
                vs_tf = _ratio(r["ops_s"], tf and tf["ops_s"]) if system != "tf" else ""
                cpu = r.get("server_cpu_ms_per_mib")
                lines.append(
                    f"| {_size_name(n)} | {op} | {conc} | {system} | {r['gb_s']:.3f} | {r['ops_s']:.1f} | "
                    f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {'-' if cpu is None else f'{cpu:.2f}'} | "
                    f"{vs_raw} | {vs_echo} | {vs_tf} |"
                )
        lines.append("")
        memory = run.get("shard_memory") or {}
        if memory.get("end"):
            start = " + ".join(str(m["rss_mib"]) for m in memory["start"])
            rss = " + ".join(str(m["rss_mib"]) for m in memory["end"])
            peak = " + ".join(str(m["peak_mib"]) for m in memory["end"])
            base = sum(m["rss_mib"] for m in memory["start"])
            state = memory["state_mib"]
            above = (sum(m["rss_mib"] for m in memory["end"]) - base) / state
            above_peak = (sum(m["peak_mib"] for m in memory["end"]) - base) / state
            lines.append(
                f"Shard memory (2 shards): state {state:.1f} MiB; RSS at start {start} MiB, at the end {rss} "
                f"MiB, peak {peak} MiB: {above:.2f} MiB of RSS above the empty shards per MiB of state "
                f"(peak: {above_peak:.2f}).\n"
            )
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
    p.add_argument(
        "--sizes", nargs="+", default=list(SIZES), help=f"model sizes (default: {' '.join(SIZES)})"
    )
    p.add_argument(
        "--ops", nargs="+", default=list(OPS), choices=ALL_OPS, help="default: pull push push_pull"
    )
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)} (default: all)"
    )
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
    if args.role == "raw-server":
        _raw_server_main(args.ready_file)
        return 0
    if args.role == "client-raw":
        _raw_client(args)
        return 0
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
    if args.role in ("client-ps", "client-ps_grpc"):
        import uvloop

        uvloop.run(_ps_client(args, args.role.removeprefix("client-")))
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
        results, memory = _run_all(args)
        runs.append(
            {
                "started": started,
                "malloc": args.malloc,
                "machine": machine,
                "busy_before": busy,
                "load_after": [round(x, 2) for x in os.getloadavg()],
                "results": results,
                "shard_memory": memory,
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
