"""Runs a load test: creates the model's variables, starts W worker processes, collects and reports.

Example:
    result = run_load(LoadConfig(workers=4, model=ModelSpec.parse("8x1MiB"), duration_s=10))
    print(result["summary"]["gb_per_s"])
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue as queue_mod
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from psload import report
from psload.spec import ModelSpec
from psload.worker import WorkerArgs
from psload.worker import main as worker_main

log = logging.getLogger(__name__)

OPS = ("push_pull", "push", "pull")
MODES = ("async", "sync", "ssp")
_READY_TIMEOUT_S = 120.0  # spawning W interpreters on a loaded 2-core machine is slow
_STOP_GRACE_S = 30.0  # after the duration: in-flight steps, and sync/ssp stragglers reaching the stop step
_FOREVER = 2**62
_PROGRESS_LAG_S = 0.3  # a second's live line waits this long for the workers' last reports of it


class LoadError(RuntimeError):
    """The load test could not run (no cluster, workers failed to start); the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConfig:
    """One load test.

    Args:
        workers: W, worker processes.
        clients_per_worker: C, simulated workers per worker process (one ``AsyncPSClient`` each, all on
            the process's event loop): W x C simulated workers in all, each with a worker id of its own
            (sync/ssp modes count W x C replicas).
        model: the variables pushed each step.
        duration_s: how long workers run (sync/ssp: then all finish the same step).
        addresses: shards of a running cluster; empty: start a local cluster of ``local_shards``.
        local_shards: shard count of the local cluster.
        mode: async, sync (N = M = W x C) or ssp (M = W x C); for a running cluster, its shards' mode is used.
        staleness: ssp: S of the local cluster.
        op: each step does ``push_pull`` (one round trip), ``push`` only, or ``pull`` only.
        timeout_s: per-call deadline of the workers.
        prefix: variable name prefix.
        auth_token: for secured clusters.
        server_args: extra psserver flags for the local cluster.
        client_options: extra ``ClientConfig`` fields (chunk_bytes, unary_max_bytes, ...).
        chaos_every_s: chaos soak (``psload.chaos``): the local cluster is replicated (a primary and a
            backup process per shard, in ``mode``) and a primary is ``kill -9``-ed every this many
            seconds and restarted; implies ``exact``.
        exact: every push also carries exact counters (one per shard, SGD with learning rate 1 and a
            gradient of -1), checked at the end with every variable's version against the acknowledged
            pushes (sync mode: every step adds 1 once; async and ssp: every push adds 1): the result's
            ``counts``. A running cluster keeps the counters (``PREFIX/counter_<i>``), so run this on a
            fresh one.
        warm_up: every simulated worker pulls the model once before the clock starts, which opens its
            data connections (the first use of each costs a ``DataPort`` call; with many workers starting
            at once some of those took seconds); off: the run includes the start.
        worker_netns: network namespaces (``trainer.netns.Host.netns``) of the worker processes: process
            ``p`` runs in ``worker_netns[p % len]``; empty: the runner's own.
        max_rss_growth: chaos soak: the largest accepted growth of shard and worker memory (RSS) from
            the end of the warm-up (a fifth of the run, at least 5 s) to the end (0.10: 10 %).
    """

    workers: int = 2
    clients_per_worker: int = 1
    model: ModelSpec = field(default_factory=lambda: ModelSpec.parse("8x1MiB"))
    duration_s: float = 10.0
    addresses: tuple[str, ...] = ()
    local_shards: int = 2
    mode: str | None = None
    staleness: int = 1
    op: str = "push_pull"
    timeout_s: float = 60.0
    prefix: str = "psload"
    auth_token: str | None = None
    server_args: tuple[str, ...] = ()
    client_options: dict[str, Any] = field(default_factory=dict)
    chaos_every_s: float | None = None
    max_rss_growth: float = 0.10
    exact: bool = False
    warm_up: bool = False
    worker_netns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.clients_per_worker < 1:
            raise ValueError(f"clients per worker must be >= 1, got {self.clients_per_worker}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {self.op!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.local_shards < 1:
            raise ValueError(f"local shards must be >= 1, got {self.local_shards}")
        if self.mode in ("sync", "ssp") and self.op == "pull":
            raise ValueError(f"{self.mode} mode advances on pushes: use op push_pull or push")
        if self.chaos_every_s is not None and not self.chaos_every_s > 0:
            raise ValueError(f"the kill interval must be > 0 seconds, got {self.chaos_every_s}")
        if (self.exact or self.chaos_every_s is not None) and self.op == "pull":
            raise ValueError("exact counts (--exact, --chaos) count pushes: use op push_pull or push")

    @property
    def simulated_workers(self) -> int:
        """W x C: every simulated worker of the run."""
        return self.workers * self.clients_per_worker


def _local_server_args(config: LoadConfig, mode: str) -> list[str]:
    args = ["--mode", mode]
    n = str(config.simulated_workers)
    if mode == "sync":
        args += ["--replicas-to-aggregate", n, "--total-replicas", n]
    elif mode == "ssp":
        args += ["--total-replicas", n, "--staleness", str(config.staleness)]
    return [*args, *config.server_args]


async def _prepare(config: LoadConfig, names: list[str]) -> tuple[list[Any], int]:
    """Creates the variables (idempotent); returns the shards' status and the sync start step."""
    import psclient
    from psclient.admin import cluster_status

    values = {n: np.zeros(s, np.float32) for n, s in zip(names, config.model.shapes(), strict=True)}
    async with psclient.AsyncPSClient(
        list(config.addresses), worker_id=f"psload-setup-{uuid.uuid4().hex[:6]}", timeout=config.timeout_s,
        auth_token=config.auth_token, **config.client_options,
    ) as client:  # fmt: skip
        await client.create_many(values, optimizer=psclient.SGD(learning_rate=1e-6))
        _, versions = await client.pull_with_versions(names)
        statuses = await cluster_status(config.addresses, timeout=config.timeout_s, client=client)
    return statuses, max(versions.values(), default=0)


def _status(config: LoadConfig, timeout_s: float | None = None) -> list[Any]:
    from psclient.admin import cluster_status

    timeout = config.timeout_s if timeout_s is None else timeout_s
    return asyncio.run(cluster_status(config.addresses, timeout=timeout, auth_token=config.auth_token))


def run_load(config: LoadConfig, *, progress: TextIO | None = sys.stderr) -> dict[str, Any]:
    """Runs the load test (starting a local cluster when no addresses are given); returns the result.

    Raises:
        LoadError: the cluster is unreachable, or the workers did not start.
        ValueError: chaos asked for on a running cluster (it starts and kills its own).
        psclient.PSError: creating the variables failed.
    """
    if config.addresses and config.chaos_every_s is not None:
        raise ValueError("--chaos starts (and kills) its own local cluster: give no addresses")
    if config.addresses:
        return _run(config, progress)
    if config.chaos_every_s is not None:
        from psload.chaos import ChaosCluster

        mode = config.mode or "async"
        with ChaosCluster(config.local_shards, _local_server_args(config, mode)) as chaos:
            local = LoadConfig(**{**_fields(config), "addresses": tuple(chaos.addresses), "mode": mode})
            result = _run(local, progress, chaos)
            result["config"]["local_cluster"] = True
            return result
    from trainer.cluster import LocalCluster

    mode = config.mode or "async"
    with LocalCluster(config.local_shards, server_args=_local_server_args(config, mode)) as cluster:
        local = LoadConfig(**{**_fields(config), "addresses": tuple(cluster.addresses), "mode": mode})
        result = _run(local, progress)
        result["config"]["local_cluster"] = True
        return result


def _fields(config: LoadConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def _run(config: LoadConfig, progress: TextIO | None, chaos: Any = None) -> dict[str, Any]:
    names = config.model.names(config.prefix)
    bad = [s for s in _status(config, timeout_s=min(config.timeout_s, 10.0)) if not s.ok]
    if bad:
        raise LoadError(
            "cluster is unreachable or unhealthy: "
            + "; ".join(f"shard {s.index} at {s.address}: {s.health} {s.error or ''}".rstrip() for s in bad)
        )
    statuses_before, start_step = asyncio.run(_prepare(config, names))
    counters: list[str] = []
    probes: dict[int, str] = {}
    if chaos is not None or config.exact:
        counters, probes = asyncio.run(_prepare_counters(config))
    modes = {s.mode for s in statuses_before if s.mode}
    mode = modes.pop() if len(modes) == 1 else (config.mode or "async")
    if config.mode is not None and config.mode != mode:
        raise LoadError(f"asked for {config.mode} mode, but the cluster's shards run in {mode} mode")
    coordinated = mode in ("sync", "ssp")
    run_id = uuid.uuid4().hex[:6]

    ctx = mp.get_context("spawn")
    per = config.clients_per_worker
    total = config.simulated_workers
    shared = _Shared(ctx, total)
    results: Any = ctx.Queue()
    procs = []
    for w in range(config.workers):
        netns = config.worker_netns[w % len(config.worker_netns)] if config.worker_netns else None
        args = WorkerArgs(
            index=w * per, worker_id=f"psload-{run_id}-w{w}", addresses=tuple(config.addresses),
            names=tuple(names), shapes=tuple(config.model.shapes()), op=config.op, coordinated=coordinated,
            start_step=start_step, duration_s=config.duration_s, timeout_s=config.timeout_s,
            auth_token=config.auth_token, client_options=dict(config.client_options),
            counters=tuple(counters), clients=per, netns=netns, warm_up=config.warm_up,
        )  # fmt: skip
        p = ctx.Process(target=worker_main, args=(args, results, shared), name=f"psload-w{w}", daemon=True)
        p.start()
        procs.append(p)

    collector = report.Collector()
    done: dict[int, tuple[int, dict[str, int], dict[str, str], str | None]] = {}
    monkey = sampler = None
    try:
        _wait_ready(results, procs, done, total, per)
        shared.start.value = time.time()
        t_start = time.monotonic()
        if chaos is not None:
            from psload.chaos import Monkey, RssSampler, probe_read

            def probe(shard: int) -> None:
                asyncio.run(probe_read(config.addresses, shard, probes[shard]))

            monkey = Monkey(chaos, config.chaos_every_s, probe, t_start)
            sampler = RssSampler(chaos.pids, lambda: [p.pid for p in procs if p.is_alive()], t_start)
            monkey.start()
            sampler.start()
        next_tick = 1.0
        stop_set = False
        hard_deadline = t_start + config.duration_s + _STOP_GRACE_S + config.timeout_s
        while len(done) < total:
            now = time.monotonic()
            if now >= hard_deadline:
                log.warning("psload: workers did not finish in time; terminating them")
                break
            if coordinated and not stop_set and now - t_start >= config.duration_s:
                with shared.lock:
                    shared.stop_at.value = start_step + max(shared.progress) + 1
                stop_set = True
            if sampler is not None and now - t_start >= config.duration_s:
                sampler.stop()  # before the workers exit: the end window is the run's
            if progress is not None and now - t_start >= next_tick + _PROGRESS_LAG_S:
                second = int(next_tick) - 1
                if second < config.duration_s:
                    print(collector.progress_line(second, config.duration_s, total), file=progress,
                          flush=True)  # fmt: skip
                next_tick += 1.0
            _drain(results, collector, done, timeout=0.05)
            for w, p in enumerate(procs):  # a worker process that died without reporting
                lost = [i for i in range(w * per, (w + 1) * per) if i not in done]
                if lost and not p.is_alive() and p.exitcode not in (None, 0):
                    _drain(results, collector, done, timeout=0.2)
                    for i in lost:
                        done.setdefault(i, (0, {}, {}, f"worker process exited with code {p.exitcode}"))
        elapsed = time.monotonic() - t_start
        _drain(results, collector, done, timeout=0.05)
        while progress is not None and next_tick <= config.duration_s:  # the seconds not printed yet
            line = collector.progress_line(int(next_tick) - 1, config.duration_s, total)
            print(line, file=progress, flush=True)
            next_tick += 1.0
    finally:
        if monkey is not None:
            monkey.stop()
        if sampler is not None:
            sampler.stop()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if not coordinated:
        elapsed = min(elapsed, config.duration_s)  # the tail after the deadline is one in-flight step
    statuses_after = _status(config)
    result = _result(config, mode, names, collector, done, elapsed, statuses_before, statuses_after)
    if counters:
        result["counts"] = _count_check(config, names, counters, result)
    if chaos is not None:
        result["chaos"] = _chaos_result(config, result, monkey, sampler)
    return result


async def _prepare_counters(config: LoadConfig) -> tuple[list[str], dict[int, str]]:
    """Chaos: one exact counter per shard (SGD, learning rate 1, every push adds 1); a small variable per
    shard for the failover probe."""
    import psclient

    counters = [f"{config.prefix}/counter_{i}" for i in range(len(config.addresses))]
    async with psclient.AsyncPSClient(
        list(config.addresses), worker_id="psload-setup-counters", timeout=config.timeout_s,
        auth_token=config.auth_token,
    ) as client:  # fmt: skip
        await client.create_many(
            {n: np.zeros(1, np.float32) for n in counters}, optimizer=psclient.SGD(learning_rate=1.0)
        )
        listed = await client.list_variables()
    probes: dict[int, tuple[int, str]] = {}
    for name, infos in listed.items():
        for info in infos:
            shard = next(p.shard for p in client.registry.pieces[name] if p.stored_name == info.spec.name)
            size = int(np.prod(info.spec.shape))
            if shard not in probes or size < probes[shard][0]:
                probes[shard] = (size, name)
    return counters, {shard: name for shard, (_, name) in probes.items()}


def _count_check(
    config: LoadConfig, names: list[str], counters: list[str], result: dict[str, Any]
) -> dict[str, Any]:
    """Counters and versions against the acknowledged pushes (sync mode: steps); ``ok`` when exact."""
    import psclient

    async def read() -> tuple[dict[str, Any], dict[str, int]]:
        async with psclient.AsyncPSClient(
            list(config.addresses), worker_id="psload-count-check", timeout=config.timeout_s,
            auth_token=config.auth_token,
        ) as client:  # fmt: skip
            return await client.pull_with_versions([*names, *counters])

    values, versions = asyncio.run(read())
    s = result["summary"]
    if result["config"]["mode"] == "sync":  # a step adds the mean of the workers' -1s once
        acknowledged = max((int(n) for n in s["steps_per_worker"].values()), default=0)
    else:  # every push adds 1
        acknowledged = int(s["steps"])
    applied = {n: round(float(values[n][0])) for n in counters}
    wrong_versions = {n: v for n, v in versions.items() if v != acknowledged}
    lost = max((acknowledged - v for v in applied.values()), default=0)
    doubled = max((v - acknowledged for v in applied.values()), default=0)
    return {
        "acknowledged_pushes": acknowledged,  # sync mode: steps (each acknowledged to every worker)
        "unit": "steps" if result["config"]["mode"] == "sync" else "pushes",
        "applied": applied,
        "lost": max(lost, 0),
        "applied_twice": max(doubled, 0),
        "variables_with_other_versions": wrong_versions,
        "ok": lost == 0 and doubled == 0 and not wrong_versions,
    }


def _chaos_result(config: LoadConfig, result: dict[str, Any], monkey: Any, sampler: Any) -> dict[str, Any]:
    """The soak's verdict: the exact counts (``_count_check``), recovery times, RSS."""
    from psload.chaos import kills_json, recovery, rss_growth

    s = result["summary"]
    warmup = max(5.0, config.duration_s / 5)
    rss = {
        "shards": rss_growth(sampler.samples, "shards_mib", warmup, config.duration_s),
        "workers": rss_growth(sampler.samples, "workers_mib", warmup, config.duration_s),
        "warmup_s": warmup,
        "samples": sampler.samples,
    }
    growths = [g["growth"] for g in (rss["shards"], rss["workers"]) if g["growth"] is not None]
    rss_ok = bool(growths) and max(growths) < config.max_rss_growth
    counters = {k: v for k, v in result["counts"].items() if k != "ok"}
    workers_ok = s["errors"] == 0 and not s["failed_workers"]
    return {
        "kill_every_s": config.chaos_every_s,
        "kills": kills_json(monkey.kills),
        "monkey_error": repr(monkey.error) if monkey.error is not None else None,
        "recovery": recovery(monkey.kills),
        "counters": counters,
        "rss": rss,
        "max_rss_growth": config.max_rss_growth,
        "ok": {
            "counters": result["counts"]["ok"],
            "workers": workers_ok,
            "rss": rss_ok,
            "kills": bool(monkey.kills) and monkey.error is None,
        },
    }


class _Shared:
    """Values shared with the workers (picklable to spawned children as constructor args)."""

    def __init__(self, ctx: Any, workers: int) -> None:
        self.lock = ctx.Lock()
        self.start = ctx.Value("d", 0.0, lock=False)
        self.stop_at = ctx.Value("q", _FOREVER, lock=False)
        self.progress = ctx.Array("q", workers, lock=False)
        self.finished = ctx.Array("b", workers, lock=False)


def _wait_ready(results: Any, procs: list[Any], done: dict[int, Any], workers: int, per: int = 1) -> None:
    ready: set[int] = set()
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while len(ready) < workers:
        if time.monotonic() > deadline:
            raise LoadError(f"only {len(ready)} of {workers} workers started within {_READY_TIMEOUT_S:.0f}s")
        try:
            msg = results.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [
                w
                for w, p in enumerate(procs)
                if not p.is_alive() and not ready >= set(range(w * per, (w + 1) * per))
            ]
            if dead:
                raise LoadError(f"worker(s) {dead} exited before starting") from None
            continue
        if msg[0] == "ready":
            ready.add(msg[1])
        elif msg[0] == "done":
            raise LoadError(f"worker {msg[1]} failed to start: {msg[5]}")


def _drain(results: Any, collector: report.Collector, done: dict[int, Any], timeout: float) -> None:
    try:
        msg = results.get(timeout=timeout)
    except queue_mod.Empty:
        return
    while True:
        if msg[0] == "win":
            _, _, second, steps, nbytes, errors, latencies = msg
            collector.add(second, steps, nbytes, errors, latencies)
        elif msg[0] == "done":
            done[msg[1]] = msg[2:]
        try:
            msg = results.get_nowait()
        except queue_mod.Empty:
            return


def _result(
    config: LoadConfig,
    mode: str,
    names: list[str],
    collector: report.Collector,
    done: dict[int, tuple[int, dict[str, int], dict[str, str], str | None]],
    elapsed: float,
    before: list[Any],
    after: list[Any],
) -> dict[str, Any]:
    steps, nbytes, errors = collector.totals()
    by_type: Counter[str] = Counter()
    messages: dict[str, str] = {}
    fatal = {}
    for w, (_, errs, first, why) in sorted(done.items()):
        by_type.update(errs)
        for k, v in first.items():
            messages.setdefault(k, v)
        if why:
            fatal[str(w)] = why
    missing = [w for w in range(config.workers) if w not in done]
    for w in missing:
        fatal[str(w)] = "did not finish in time (terminated)"
    wanted = set(names)
    shard_bytes = [sum(t.nbytes for t in s.tensors if t.variable in wanted) for s in before]
    total = sum(shard_bytes) or 1
    shards = []
    for s0, s1, b in zip(before, after, shard_bytes, strict=True):
        shards.append(
            {"index": s0.index, "address": s0.address, "health": s1.health, "model_bytes": b,
             "share": b / total, "pushes": max(0, s1.pushes - s0.pushes),
             "pulls": max(0, s1.pulls - s0.pulls)}
        )  # fmt: skip
    mean = total / max(1, len(shard_bytes))
    duration = max(elapsed, 1e-9)
    return {
        "tool": "psload",
        "version": 1,
        "time": time.time(),
        "config": {
            "workers": config.simulated_workers,
            "worker_processes": config.workers,
            "mode": mode,
            "op": config.op,
            "model": config.model.describe(),
            "model_bytes": config.model.total_bytes,
            "variables": len(names),
            "duration_s": config.duration_s,
            "num_shards": len(config.addresses),
            "addresses": list(config.addresses),
            "timeout_s": config.timeout_s,
            "local_cluster": False,
            "prefix": config.prefix,  # the variables stay on a running cluster (the shards have no delete)
            "variable_names": list(names),
        },
        "summary": {
            "duration_s": elapsed,
            "steps": steps,
            "steps_per_s": steps / duration,
            "bytes": nbytes,
            "gb_per_s": nbytes / report.GB / duration,
            "latency": report.percentiles(collector.all_latencies()),
            "errors": errors,
            "errors_by_type": dict(by_type),
            "error_examples": messages,
            "failed_workers": fatal,
            "steps_per_worker": {str(w): d[0] for w, d in sorted(done.items())},
            "steps_max_over_min": _spread([d[0] for d in done.values()]),
        },
        "shards": shards,
        "balance": {"max_over_mean": max(shard_bytes, default=0) / mean if mean else 0.0},
        "timeline": collector.timeline(config.duration_s),
    }


def _spread(steps: list[int]) -> float | None:
    """Most over fewest steps of any simulated worker (None when one did none): the step-rate spread."""
    return max(steps) / min(steps) if steps and min(steps) > 0 else None
