"""The programs that ``bench_scaling.py`` runs inside the hosts of its namespace cluster.

    python bench/_scaling_roles.py ROLE JSON

Roles: ``ps`` (a psclient worker doing push_pull rounds), ``ring`` (one rank of a
``psclient.collective.Ring`` doing all-reduces), ``raw-server`` and ``raw-worker`` (plain TCP
sockets doing the same rounds as ``ps``: the whole push, then the whole answer; or, ``streamed``,
the answer echoed chunk by chunk while the push still arrives; with ``barrier``, as a sync step: no
answer before every worker's push is in). A worker writes its ready file once
connected and warmed up, waits (bounded) for the go file, runs its rounds for ``seconds`` (and at
least ``min_rounds``) and prints
one line ``BENCH-RESULT {"rounds": R, "seconds": S, "cpu_s": C}``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH-RESULT "
_GO_TIMEOUT_S = 120.0  # the parent starts every worker of a cell before it writes the go file
_IO_TIMEOUT_S = 60.0  # one socket call of the raw peer
_CHUNK = 256 << 10  # the streamed raw peer's echo granularity


def _ready_then_go(cfg: dict[str, Any]) -> None:
    tmp = cfg["ready_file"] + ".tmp"
    Path(tmp).write_text("ready")
    os.replace(tmp, cfg["ready_file"])
    deadline = time.monotonic() + _GO_TIMEOUT_S
    while not Path(cfg["go_file"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go file {cfg['go_file']} within {_GO_TIMEOUT_S:.0f}s")
        time.sleep(0.005)


def _timed_rounds(round_fn: Callable[[], object], seconds: float, rounds: int) -> dict[str, float]:
    """Runs rounds for ``seconds`` and at least ``rounds`` of them (the ring: exactly ``rounds``)."""
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    done = 0
    while done < rounds or time.perf_counter() - t0 < seconds:
        round_fn()
        done += 1
    return {"rounds": done, "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}


def _trace_uploads(events: list[dict[str, Any]]) -> None:
    """Records each large data-port request of this process in ``events``: its shard, when it asked for its
    turn on the uplink, when its upload began and was handed to the kernel, when its delivery wait ended
    (``Turns.deliver``, slow links: "delivered", with the bytes unacknowledged then, "left"), when its answer
    began (the answer's head read) and ended (``time.monotonic()``: one clock for every namespace of the
    machine). For ``--trace``: wraps ``DataLink.request``, ``Turns.deliver`` and ``BulkConnection.send`` of
    this benchmark's process."""
    import asyncio

    from psclient import _bulk
    from pscore import bulk

    request, send = _bulk.DataLink.request, bulk.BulkConnection.send
    current: dict[Any, dict[str, Any]] = {}

    async def traced_request(self: Any, frame: Any, payload: Any, into: Any, *args: Any, **kw: Any) -> Any:
        if sum(map(len, payload)) < _bulk.STAGGER_MIN_BYTES:
            return await request(self, frame, payload, into, *args, **kw)
        event: dict[str, Any] = {"shard": self.address, "asked": time.monotonic()}
        task = asyncio.current_task()
        current[task] = event

        def answer_into(head: Any, nbytes: int) -> Any:
            event.setdefault("answer", time.monotonic())
            return into(head, nbytes) if into is not None else None

        try:
            return await request(self, frame, payload, answer_into, *args, **kw)
        finally:
            event["end"] = time.monotonic()
            current.pop(task, None)
            events.append(event)

    async def traced_send(self: Any, header: Any, payload: Any = ()) -> None:
        event = current.get(asyncio.current_task())
        if event is not None:
            event.setdefault("up", time.monotonic())
        await send(self, header, payload)
        if event is not None:
            event["sent"] = time.monotonic()

    deliver = _bulk.Turns.deliver

    async def traced_deliver(self: Any, conn: Any, deadline: float) -> None:
        event = current.get(asyncio.current_task())
        try:
            await deliver(self, conn, deadline)
        finally:
            if event is not None:
                event["delivered"] = time.monotonic()
                event["left"] = conn._conn.queued() if conn._conn is not None else -1  # reset: -1

    _bulk.Turns.deliver = traced_deliver  # type: ignore[method-assign]
    _bulk.DataLink.request = traced_request  # type: ignore[method-assign]
    bulk.BulkConnection.send = traced_send  # type: ignore[method-assign]


def role_ps(cfg: dict[str, Any]) -> dict[str, float]:
    import numpy as np

    import psclient

    events: list[dict[str, Any]] = []
    if cfg.get("trace_file"):
        _trace_uploads(events)

    n_vars = cfg["vars"]
    per_var = cfg["size_bytes"] // n_vars // 4
    grads = {f"v{i:02d}": np.zeros(per_var, np.float32) for i in range(n_vars)}
    wire: dict[str, Any] = {"data_port_min_bytes": 1 << 40} if cfg.get("wire") == "grpc" else {}
    wire["stagger_uploads"] = cfg.get("stagger", True)
    with psclient.PSClient(cfg["addresses"], worker_id=cfg["worker_id"], timeout=_IO_TIMEOUT_S, **wire) as c:
        # One call for all (placed balanced over the batch: each shard an equal share when k divides the
        # variables; created one by one, a hash places them, 5 of 32 on one of 8 shards), one ListVariables
        # per shard and worker: 32 workers creating 32 variables one by one asked each shard 1,024 times.
        c.create_many(grads, optimizer=psclient.SGD(learning_rate=0.0))
        step = [0]
        inflight = int(cfg.get("inflight", 1))
        pending: list[Any] = []

        def one_round() -> None:
            if cfg.get("sync"):  # one sync step: every worker's push, then the values (every shard)
                c.push_pull(grads, step=step[0], every_shard=True, parts=int(cfg.get("parts", 1)))
                step[0] += 1
            elif inflight > 1:  # rounds overlapped, as PSWorker(overlap=True): the next goes out meanwhile
                while len(pending) < inflight:
                    pending.append(c.push_pull_future(grads))
                pending.pop(0).result(_IO_TIMEOUT_S)
            else:
                c.push_pull(grads)

        one_round()  # warm-up: connections, data port, buffers
        _ready_then_go(cfg)
        events.clear()
        result = _timed_rounds(one_round, cfg["seconds"], cfg["min_rounds"])
        for f in pending:
            f.result(_IO_TIMEOUT_S)
        if cfg.get("trace_file"):
            Path(cfg["trace_file"]).write_text(json.dumps(events))
            ss = subprocess.run(["ss", "-tin"], capture_output=True, text=True, timeout=10, check=False)
            Path(cfg["trace_file"]).with_suffix(".ss").write_text(ss.stdout)
        c.leave()  # sync: the barrier stops waiting for this worker (the others may go one step more)
        return result


def role_ring(cfg: dict[str, Any]) -> dict[str, float]:
    import numpy as np

    from psclient.collective import Ring

    x = np.zeros(cfg["size_bytes"] // 4, np.float32)
    with Ring(cfg["addresses"], cfg["rank"], timeout=_IO_TIMEOUT_S, **cfg.get("options", {})) as ring:
        t = time.perf_counter()
        ring.allreduce(x, out=x)  # warm-up
        one = time.perf_counter() - t
        # every rank must run the same count: the largest estimate of any rank
        wanted = np.array([max(cfg["min_rounds"], math.ceil(cfg["seconds"] / max(one, 1e-3)))], np.float64)
        rounds = int(ring.allreduce(wanted, op="max")[0])
        _ready_then_go(cfg)
        return _timed_rounds(lambda: ring.allreduce(x, out=x), 0.0, rounds)


def _recv_exactly(conn: socket.socket, nbytes: int, buf: bytearray, echo: bool = False) -> bool:
    """Reads ``nbytes`` (echoing each piece back if ``echo``); False on EOF before the first byte."""
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[: min(len(buf), nbytes - got)])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"EOF after {got} of {nbytes} bytes")
        if echo:
            conn.sendall(view[:n])
        got += n
    return True


class _StepBarrier:
    """Sync mode's peer: no answer before every connected worker's push of the step is in; a worker that
    hung up is not waited for (as a psclient worker's ``leave``)."""

    def __init__(self, workers: int) -> None:
        self._cond = threading.Condition()
        self._workers, self._arrived, self._step = workers, 0, 0

    def wait(self) -> None:
        with self._cond:
            step = self._step
            self._arrived += 1
            self._release_if_complete()
            if not self._cond.wait_for(lambda: self._step != step, _IO_TIMEOUT_S):
                raise TimeoutError("the other workers' pushes did not come")

    def leave(self) -> None:
        with self._cond:
            self._workers -= 1
            self._release_if_complete()

    def _release_if_complete(self) -> None:
        if self._arrived >= self._workers > 0:
            self._arrived, self._step = 0, self._step + 1
            self._cond.notify_all()


def _serve_conn(conn: socket.socket, piece: int, streamed: bool, barrier: _StepBarrier | None = None) -> None:
    buf = bytearray(_CHUNK if streamed else piece)
    with conn:
        conn.settimeout(_IO_TIMEOUT_S)
        try:
            while _recv_exactly(conn, piece, buf, echo=streamed):
                if barrier is not None:
                    barrier.wait()
                if not streamed:
                    conn.sendall(buf)
        finally:
            if barrier is not None:
                barrier.leave()


def role_raw_server(cfg: dict[str, Any]) -> dict[str, float]:
    with socket.create_server((cfg["host"], 0), backlog=64) as srv:
        srv.settimeout(_GO_TIMEOUT_S)
        tmp = cfg["ready_file"] + ".tmp"
        Path(tmp).write_text(f"{cfg['host']}:{srv.getsockname()[1]}")
        os.replace(tmp, cfg["ready_file"])
        threads = []
        barrier = _StepBarrier(cfg["conns"]) if cfg.get("barrier") else None
        for _ in range(cfg["conns"]):
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as psclient's and gRPC's sockets
            th = threading.Thread(
                target=_serve_conn, args=(conn, cfg["piece"], cfg["streamed"], barrier), daemon=True
            )
            th.start()
            threads.append(th)
        for th in threads:
            th.join(_GO_TIMEOUT_S + cfg["seconds"] * 4)
    return {"conns": len(threads)}


def role_raw_worker(cfg: dict[str, Any]) -> dict[str, float]:
    piece, streamed = cfg["piece"], cfg["streamed"]
    conns = []
    for addr in cfg["addresses"]:
        host, _, port = addr.rpartition(":")
        conns.append(socket.create_connection((host, int(port)), timeout=_IO_TIMEOUT_S))
        conns[-1].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(piece)
    bufs = [bytearray(piece) for _ in conns]
    pool = ThreadPoolExecutor(2 * len(conns))

    def whole(i: int) -> None:
        conns[i].sendall(payload)
        _recv_exactly(conns[i], piece, bufs[i])

    def one_round() -> None:
        if streamed:
            futs = [pool.submit(c.sendall, payload) for c in conns]
            futs += [pool.submit(_recv_exactly, c, piece, b) for c, b in zip(conns, bufs, strict=True)]
        else:
            futs = [pool.submit(whole, i) for i in range(len(conns))]
        for f in futs:
            f.result()

    try:
        one_round()  # warm-up
        _ready_then_go(cfg)
        return _timed_rounds(one_round, cfg["seconds"], cfg["min_rounds"])
    finally:
        pool.shutdown()
        for c in conns:
            c.close()


ROLES: dict[str, Callable[[dict[str, Any]], dict[str, float]]] = {
    "ps": role_ps,
    "ring": role_ring,
    "raw-server": role_raw_server,
    "raw-worker": role_raw_worker,
}

if __name__ == "__main__":
    result = ROLES[sys.argv[1]](json.loads(sys.argv[2]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
