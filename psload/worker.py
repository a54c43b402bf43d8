"""One simulated worker process: pushes gradients and reads values in a loop, reporting per-second windows.

Started by the runner with the ``spawn`` start method. One process runs ``clients``
simulated workers (one ``AsyncPSClient`` each, with a worker id of its own) on one
event loop; simulated worker ``w`` (``index`` to ``index + clients - 1``) talks to the
runner through a queue (``("ready", w)``, ``("win", w, second, steps, bytes,
errors, latencies)``, ``("done", w, steps, errors, first_messages, fatal)``)
and shared values (the start time, and in sync/ssp modes the coordinated
stop step, so no worker is left waiting in a barrier its peers have quit).
With ``netns`` the process first enters that network namespace (a host of a
``trainer.netns.NetnsCluster``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_FLUSH_S = 0.2  # a worker reports what it did at least this often


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a worker process needs (picklable).

    ``index`` is its first simulated worker's; simulated worker ``index + j`` has worker id
    ``f"{worker_id}-c{j}"`` when ``clients > 1``, else ``worker_id``.
    """

    index: int
    worker_id: str
    addresses: tuple[str, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    op: str  # push_pull | push | pull
    coordinated: bool  # sync/ssp: stop at the agreed step, not at the deadline
    start_step: int
    duration_s: float
    timeout_s: float
    auth_token: str | None
    client_options: dict[str, Any]
    counters: tuple[str, ...] = ()  # exact counters every push adds 1 to (SGD, rate 1)
    clients: int = 1  # simulated workers in this process
    netns: str | None = None  # network namespace to run in (Linux, root)
    warm_up: bool = False  # one pull before the clock starts

    def worker_ids(self) -> list[str]:
        if self.clients == 1:
            return [self.worker_id]
        return [f"{self.worker_id}-c{j}" for j in range(self.clients)]


def main(args: WorkerArgs, queue: Any, shared: Any) -> None:
    """Process entry point: runs the load loop and always reports ``done``."""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s psload[worker={args.worker_id}] %(name)s: %(message)s",
    )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        runner = asyncio.run
    try:
        if args.netns is not None:
            from trainer.netns import enter_netns

            enter_netns(args.netns)
        runner(_run_all(args, queue, shared))
    except BaseException as err:  # report, never hang the runner
        for j in range(args.clients):
            queue.put(("done", args.index + j, 0, {}, {}, f"{type(err).__name__}: {err}"))


def _should_stop(args: WorkerArgs, index: int, shared: Any, done: int) -> bool:
    if not args.coordinated:
        return time.time() >= shared.start.value + args.duration_s
    with shared.lock:
        shared.progress[index] = done
        return args.start_step + done >= shared.stop_at.value


async def _run_all(args: WorkerArgs, queue: Any, shared: Any) -> None:
    """Runs the process's simulated workers; one that fails reports ``done`` with why, the rest go on."""

    async def one(j: int, worker_id: str) -> None:
        try:
            await _run(args, args.index + j, worker_id, queue, shared)
        except Exception as err:  # reported to the runner
            queue.put(("done", args.index + j, 0, {}, {}, f"{type(err).__name__}: {err}"))

    await asyncio.gather(*(one(j, wid) for j, wid in enumerate(args.worker_ids())))


async def _run(args: WorkerArgs, index: int, worker_id: str, queue: Any, shared: Any) -> None:
    import psclient

    rng = np.random.default_rng(index)
    grads = {
        n: (rng.standard_normal(s) * 1e-6).astype(np.float32)
        for n, s in zip(args.names, args.shapes, strict=True)
    }
    nbytes = sum(g.nbytes for g in grads.values())
    grads.update({n: np.full(1, -1.0, np.float32) for n in args.counters})
    step_bytes = {"push_pull": 2 * nbytes, "push": nbytes, "pull": nbytes}[args.op]
    errors: Counter[str] = Counter()
    first: dict[str, str] = {}
    done = 0
    async with psclient.AsyncPSClient(
        list(args.addresses), worker_id=worker_id, auth_token=args.auth_token, timeout=args.timeout_s,
        **args.client_options,
    ) as client:  # fmt: skip
        await client.list_variables(list(args.names))  # learn placement before the clock starts
        if args.warm_up:  # and open the data connections (a DataPort call each): their first use is slow
            await client.pull(list(args.names))
        queue.put(("ready", index))
        deadline = time.monotonic() + 120.0
        while shared.start.value == 0.0 and time.monotonic() < deadline:  # noqa: ASYNC110 - another process sets it
            await asyncio.sleep(0.005)
        start = shared.start.value
        window, w_steps, w_bytes, w_errors, w_lat = 0, 0, 0, 0, []
        flushed = start
        while not _should_stop(args, index, shared, done):
            step = args.start_step + done
            t0 = time.perf_counter()
            ok = True
            try:
                if args.op == "push_pull":
                    await client.push_pull(grads, step=step)
                elif args.op == "push":
                    await client.push(grads, step=step)
                else:
                    await client.pull(list(args.names), step=step)
            except psclient.PSError as err:
                ok = False
                name = type(err).__name__
                errors[name] += 1
                first.setdefault(name, str(err)[:500])
                await asyncio.sleep(0.05)  # do not spin on a failing cluster
            latency = time.perf_counter() - t0
            now = time.time()
            second = int(now - start)
            if second != window or now >= flushed + _FLUSH_S:  # partial windows keep the live lines current
                queue.put(("win", index, window, w_steps, w_bytes, w_errors, w_lat))
                window, w_steps, w_bytes, w_errors, w_lat = second, 0, 0, 0, []
                flushed = now
            if ok:
                done += 1
                w_steps += 1
                w_bytes += step_bytes
                w_lat.append(latency)
            else:
                w_errors += 1
                if args.coordinated and args.op != "pull":
                    # a failed sync step would desynchronise the workers: give up cleanly
                    break
        queue.put(("win", index, window, w_steps, w_bytes, w_errors, w_lat))
    with shared.lock:
        shared.progress[index] = done
        shared.finished[index] = 1
    queue.put(("done", index, done, dict(errors), first, None))
