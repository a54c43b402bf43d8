"""Python function calls per operation, in the client process and in the shard process, counted apart.

A count of calls does not move with a noisy machine the way a time does, and every call costs the
interpreter about 0.5-1 us here: it says how much Python an operation walks through.

How it counts: ``sys.setprofile`` (and ``threading.setprofile`` for threads started later) in both
processes, counting ``call`` events only (a Python function entered, or a coroutine or generator
resumed; C functions are not counted). The client is a blocking ``PSClient`` in this process: its
caller's thread and its event loop's thread. The shard is ``psserver`` (one shard, defaults) run in a
child process by this script, whose counter is switched on and off over a pipe read by a thread of
its own that is not counted. For each operation: a few warm-up calls, then the shard's counter on,
the client's on, ``--ops`` operations one after the other, the client's off, the shard's off; each
count divided by ``--ops``. What the shard does on its own meanwhile (timers) is counted too: at
``--ops 200`` it is below one call per operation.

Operations (one shard; async mode unless said):

* ``push 1KiB``: ``push`` of one variable of 256 float32 (SGD).
* ``push 1KiB x64``: that push by 64 ``AsyncPSClient`` s at once on the client's event loop (psload's
  simulated workers, the 64-caller case of ``bench_ps.py --concurrency 64``), counted per push: where
  concurrent small requests share frames, the calls per push fall.
* ``pull 1KiB``: ``pull`` of that variable.
* ``push_pull 1KiB``: ``push_pull`` of it.
* ``push_pull 1MiB``: ``push_pull`` of 4 variables of 256 KiB (SGD).
* ``embedding step``: ``lookup`` of 1,024 ids of a table of dim 32 (Adagrad), then ``push`` of their
  ``Rows``.
* ``sync step``: ``push_pull`` of the 1 KiB variable with the worker's step, on a shard in sync mode
  (``--replicas-to-aggregate 1 --total-replicas 1``).

Usage::

    python bench/bench_calls.py [--ops 200] [--only push,pull] [--top 30] [--out bench/results/calls]

``--top N`` also prints the N functions called most per operation (with their callers), on each side
(for profiling the path: which layers a request walks).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 60.0


class _Count:
    """The counter of one process: off until ``on``; ``top`` also counts per function."""

    on = False
    calls = 0
    top = False
    per_code: ClassVar[collections.Counter[Any]] = collections.Counter()


def _profile(frame: Any, event: str, arg: Any) -> None:
    if event == "call" and _Count.on:
        _Count.calls += 1
        if _Count.top:
            back = frame.f_back
            _Count.per_code[frame.f_code, back.f_code if back is not None else None] += 1


def install() -> None:
    """Counts in this thread and in every thread started from now on (while ``_Count.on``)."""
    threading.setprofile(_profile)
    sys.setprofile(_profile)


def _begin() -> None:
    _Count.calls = 0
    _Count.per_code.clear()
    _Count.on = True


def _end() -> tuple[int, list[tuple[str, int]]]:
    _Count.on = False
    top = [(f"{_where(code)} <- {_where(caller)}", n) for (code, caller), n in _Count.per_code.most_common()]
    return _Count.calls, top


def _where(code: Any) -> str:
    if code is None:
        return "-"
    path = Path(code.co_filename)
    with contextlib.suppress(ValueError):
        path = path.relative_to(REPO)
    return f"{path}:{code.co_firstlineno}({code.co_name})"


# -- the shard's side: psserver in a child process ------------------------------------------------------


def _control(fd_in: int, fd_out: int) -> None:
    """The child's control thread (not counted): ``on`` / ``off`` lines in, answers out."""
    sys.setprofile(None)
    with open(fd_in, "rb", buffering=0) as cmds, open(fd_out, "wb", buffering=0) as out:
        for line in cmds:
            word = line.decode().split()
            if word[0] == "on":
                _Count.top = word[1] == "1"
                _begin()
                out.write(b"ok\n")
            elif word[0] == "off":
                calls, top = _end()
                out.write((json.dumps({"calls": calls, "top": top[:200]}) + "\n").encode())


def shard_child(fd_in: int, fd_out: int, argv: list[str]) -> int:
    """Runs ``psserver argv`` in this process, its calls counted on command (see ``_control``)."""
    install()
    thread = threading.Thread(target=_control, args=(fd_in, fd_out), name="bench-calls", daemon=True)
    thread.start()
    from psserver.__main__ import main

    return main(argv)


class Shard:
    """A psserver shard in a child process whose calls this process switches on and off."""

    def __init__(self, workdir: Path, name: str, args: list[str]) -> None:
        ready = workdir / f"{name}.addr"
        self._log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        to_child, self._cmd = os.pipe()
        self._ans, from_child = os.pipe()
        argv = ["--shard", "0", "--num-shards", "1", "--host", "127.0.0.1", "--port", "0"]
        argv += ["--ready-file", str(ready), *args]
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--shard-child", str(to_child), str(from_child), "--", *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(to_child, from_child),
            cwd=REPO,
        )
        os.close(to_child)
        os.close(from_child)
        self._answers = os.fdopen(self._ans, "rb", buffering=0)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (ready.exists() and ready.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"shard {name} did not start: see {workdir / name}.log")
            time.sleep(0.05)
        self.address = ready.read_text().strip()

    def _ask(self, line: str) -> bytes:
        os.write(self._cmd, line.encode())
        answer = self._answers.readline()
        if not answer:
            raise RuntimeError("the shard's counter did not answer (the shard exited?)")
        return answer

    def on(self, top: bool) -> None:
        self._ask(f"on {int(top)}\n")

    def off(self) -> tuple[int, list[tuple[str, int]]]:
        got = json.loads(self._ask("off\n"))
        return got["calls"], [tuple(t) for t in got["top"]]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._cmd)
        self._answers.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


# -- the client's side ---------------------------------------------------------------------------------


def _operations(async_addr: str, sync_addr: str) -> Iterator[tuple[str, Callable[[], Any], Any]]:
    """(name, one operation, the client to close) for each operation, its variables created."""
    import psclient

    client = psclient.PSClient([async_addr], worker_id="calls-w0")
    rng = np.random.default_rng(0)
    small = np.full(256, 1e-3, np.float32)
    client.create("v1k", np.zeros(256, np.float32), optimizer=psclient.SGD(0.01))
    big = {f"m{i}": np.full(65_536, 1e-3, np.float32) for i in range(4)}
    client.create_many({n: np.zeros_like(g) for n, g in big.items()}, optimizer=psclient.SGD(0.01))
    client.create_embedding("emb", 100_000, 32, optimizer=psclient.Adagrad(0.01))
    batches = [rng.integers(0, 100_000, 1024) for _ in range(4)]
    row_grads = np.full((1024, 32), 1e-3, np.float32)
    turn = [0]

    def embedding_step() -> None:
        ids = batches[turn[0] % len(batches)]
        turn[0] += 1
        client.lookup("emb", ids)
        client.push({"emb": psclient.Rows(ids, row_grads)})

    yield "push 1KiB", lambda: client.push({"v1k": small}), None
    yield "push 1KiB x64", _concurrent_pushes(client, async_addr, small), None
    yield "pull 1KiB", lambda: client.pull(["v1k"]), None
    yield "push_pull 1KiB", lambda: client.push_pull({"v1k": small}), None
    yield "push_pull 1MiB", lambda: client.push_pull(big), None
    yield "embedding step", embedding_step, client

    worker = psclient.PSClient([sync_addr], worker_id="calls-sync0")
    worker.create("v1k", np.zeros(256, np.float32), optimizer=psclient.SGD(0.01))
    step = [0]

    def sync_step() -> None:
        worker.push_pull({"v1k": small}, step=step[0])
        step[0] += 1

    yield "sync step", sync_step, worker


def _concurrent_pushes(client: Any, address: str, grad: np.ndarray) -> Callable[[], Any]:
    """``push 1KiB x64``: one operation is a round of ``CONCURRENT`` pushes of ``v1k`` at once, one by each of
    as many ``AsyncPSClient`` s on the client's event loop (psload's simulated workers; counted per push).
    The clients are made on first use and closed with ``client``."""
    import psclient

    clients: list[Any] = []

    async def start() -> None:
        for i in range(CONCURRENT):
            c = psclient.AsyncPSClient([address], worker_id=f"calls-c{i}")
            await c.list_variables(["v1k"])
            clients.append(c)

    async def close() -> None:
        for c in clients:
            await c.close()

    async def round_() -> None:
        await asyncio.gather(*(c.push({"v1k": grad}) for c in clients))

    def op() -> None:
        if not clients:
            client._loop.run(start())
            _CLOSERS.append(lambda: client._loop.run(close()))
        client._loop.run(round_())

    return op


CONCURRENT = 64  # callers of ``push 1KiB x64``
_PER_OP = {"push 1KiB x64": CONCURRENT}  # pushes in one of its operations
_CLOSERS: list[Callable[[], Any]] = []  # run before the client they use closes

OPS = (
    "push 1KiB",
    "push 1KiB x64",
    "pull 1KiB",
    "push_pull 1KiB",
    "push_pull 1MiB",
    "embedding step",
    "sync step",
)


def measure(ops: int, only: list[str] | None = None, top: int = 0, warmup: int = 20) -> list[dict[str, Any]]:
    """Counts every operation (or those named in ``only``); a row per operation."""
    install()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-calls-") as tmp:
        sync = ["--mode", "sync", "--replicas-to-aggregate", "1", "--total-replicas", "1"]
        shards = [Shard(Path(tmp), "async", []), Shard(Path(tmp), "sync", sync)]
        try:
            for name, op, done in _operations(shards[0].address, shards[1].address):
                if only is None or name in only:
                    shard = shards[1] if name == "sync step" else shards[0]
                    rows.append(_count(name, op, shard, ops, top, warmup))
                if done is not None:
                    while _CLOSERS:
                        _CLOSERS.pop()()
                    done.close()
        finally:
            for shard in shards:
                shard.close()
    return rows


def _count(name: str, op: Callable[[], Any], shard: Shard, ops: int, top: int, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        op()
    _Count.top = bool(top)
    shard.on(bool(top))
    _begin()
    for _ in range(ops):
        op()
    client_calls, client_top = _end()
    shard_calls, shard_top = shard.off()
    ops *= _PER_OP.get(name, 1)
    row = {
        "op": name,
        "client": round(client_calls / ops),
        "shard": round(shard_calls / ops),
    }
    row["total"] = row["client"] + row["shard"]
    if top:
        row["client_top"] = [(w, round(n / ops, 2)) for w, n in client_top[:top]]
        row["shard_top"] = [(w, round(n / ops, 2)) for w, n in shard_top[:top]]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| operation | client calls | shard calls | total |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['op']} | {r['client']} | {r['shard']} | {r['total']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--shard-child"]:
        return shard_child(int(argv[1]), int(argv[2]), argv[4:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=200, help="operations counted per row (the count is a mean)")
    p.add_argument("--warmup", type=int, default=20, help="operations before counting")
    p.add_argument("--only", default=None, help=f"comma-separated operations among: {', '.join(OPS)}")
    p.add_argument("--top", type=int, default=0, help="also print the N functions called most, per side")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    only = args.only.split(",") if args.only else None
    if only is not None and set(only) - set(OPS):
        p.error(f"unknown operations: {sorted(set(only) - set(OPS))}")
    rows = measure(args.ops, only, args.top, args.warmup)
    print(table(rows))
    for r in rows if args.top else ():
        for side in ("client", "shard"):
            print(f"\n{r['op']}: {side}, calls per operation by function")
            for where, n in r[f"{side}_top"]:
                print(f"  {n:8.2f}  {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.out:
        command = "python bench/bench_calls.py " + " ".join(argv)
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
        Path(args.out + ".md").write_text(
            f"# Python calls per operation\n\n`{command}` ({when}, Python {platform.python_version()}, "
            f"{args.ops} operations a row after {args.warmup} warm-up ones)\n\n{table(rows)}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
