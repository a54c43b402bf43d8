"""What the blocking PSClient adds to one push_pull, against AsyncPSClient on its own loop.

One ``push_pull`` of the MLP's gradients (784x256, 256x256, 256x10 and biases:
1.03 MiB of float32, Adam on the shards) over a 2-shard ``LocalCluster``, driven
three ways, interleaved call by call so that load from other work on the
machine hits them alike:

* ``async``: ``await AsyncPSClient.push_pull`` on the caller's own uvloop loop.
* ``blocking``: ``PSClient.push_pull`` (the call hops to the client's loop
  thread and back).
* ``future``: ``PSClient.push_pull_future(...).result()`` (what the Keras glue
  does each step).
* ``pool-hop``: ``PSClient.push_pull`` handed to a one-thread pool, as the Keras
  glue did before ``push_pull_future`` (one more thread between caller and loop).

``--busy`` adds a thread that holds the GIL like Keras's ``fit`` loop does
(pure-Python bursts with short releases), so thread hand-offs pay for GIL
switches (``sys.getswitchinterval()``, 5 ms by default); ``--switch-interval``
changes that interval for this process. The process CPU per call is printed
too (with ``--busy`` it includes the busy thread).

Usage::

    python bench/bench_client_overhead.py [--calls 300] [--busy] [--switch-interval 0.005]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psclient
from psclient._loop import BackgroundLoop
from trainer.cluster import LocalCluster

SHAPES = {
    "d1/kernel": (784, 256), "d1/bias": (256,), "d2/kernel": (256, 256), "d2/bias": (256,),
    "d3/kernel": (256, 10), "d3/bias": (10,),
}  # fmt: skip


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        s = 0
        for i in range(20_000):  # ~0.5-1 ms of pure Python: holds the GIL
            s += i
        time.sleep(0.0005)  # a short release, like a TensorFlow op


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="measured calls per mode")
    p.add_argument("--busy", action="store_true", help="run a GIL-holding thread alongside")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for this run")
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    grads = {n: np.full(s, 1e-3, np.float32) for n, s in SHAPES.items()}
    with LocalCluster(2, server_args=["--mode", "async"]) as cluster:
        client = psclient.PSClient(cluster.addresses, worker_id="bench-sync")
        init = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
        client.create_many(init, optimizer=psclient.Adam(1e-3))
        own = BackgroundLoop("bench-async")  # stands for the caller's own loop: the call runs on it
        aclient = psclient.AsyncPSClient(cluster.addresses, worker_id="bench-async")
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool-hop")

        async def async_calls(n: int) -> list[float]:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                await aclient.push_pull(grads)
                out.append(time.perf_counter() - t)
            return out

        modes: dict[str, Callable[[], object]] = {
            "blocking": lambda: client.push_pull(grads),
            "future": lambda: client.push_pull_future(grads).result(client.wait_timeout),
            "pool-hop": lambda: pool.submit(client.push_pull, grads).result(client.wait_timeout),
        }
        stop = threading.Event()
        if args.busy:
            threading.Thread(target=_busy, args=(stop,), daemon=True).start()
        lat: dict[str, list[float]] = {m: [] for m in ["async", *modes]}
        cpu = dict.fromkeys(lat, 0.0)
        try:
            own.run(async_calls(20))
            for fn in modes.values():
                for _ in range(20):
                    fn()
            for _ in range(args.calls // 10):  # rounds of 10 calls per mode, interleaved
                c0 = time.process_time()
                lat["async"] += own.run(async_calls(10))
                cpu["async"] += time.process_time() - c0
                for name, fn in modes.items():
                    c0 = time.process_time()
                    for _ in range(10):
                        t = time.perf_counter()
                        fn()
                        lat[name].append(time.perf_counter() - t)
                    cpu[name] += time.process_time() - c0
        finally:
            stop.set()
            pool.shutdown()
            own.run(aclient.close())
            own.close()
            client.close()
    nbytes = sum(g.nbytes for g in grads.values())
    print(
        f"push_pull of {nbytes / 2**20:.2f} MiB over 2 shards, {'busy' if args.busy else 'idle'} GIL, "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms"
    )
    print("| mode | p50 ms | mean ms | p90 ms | process CPU ms/call |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, values in lat.items():
        ms = np.array(values) * 1e3
        print(
            f"| {name} | {np.median(ms):.2f} | {ms.mean():.2f} | {np.percentile(ms, 90):.2f} | "
            f"{cpu[name] * 1e3 / len(ms):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
