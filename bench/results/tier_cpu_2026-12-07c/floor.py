"""What a tiered step cannot do without, on this machine: for ``--n`` random ids on disk a step (the ~384
cold ids of ``bench_tier_push.py``'s steps), the log store's read of their records (``ColdTier.read`` with
the piece's places as hints, its piece-index lookup included; and the bare log-index lookup + gather) and
their write back (``LogTier.write``: every step, as an update where the rows lie would write, against one
write of 6x as many every 6 steps, as today's spills do). A piece of ``--rows`` ids x 32 (Adagrad) in a 40
MiB budget, filled as the bench fills it. Thread CPU, us a step, median of 3 passes over ``--steps`` steps.

Usage: python floor.py [--rows 1000000] [--n 384] [--steps 600]   (run under flock /tmp/bench.lock)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pscore.optimizers import Adagrad
from psproto.v1 import ps_pb2
from psserver import tables
from psserver.rows.tiering import disk_places
from psserver.store import Store
from psserver.tier import TierConfig, parse_bytes


async def main(args: argparse.Namespace, d: str) -> dict[str, float]:
    store = Store(tier=TierConfig(str(Path(d) / "t"), parse_bytes("40MiB"), store="log"))
    spec = ps_pb2.VariableSpec(
        name="t/rows_0", dtype=ps_pb2.DTYPE_FLOAT32, shape=[0, 32], optimizer=Adagrad(0.1).to_proto()
    )
    spec.dynamic.CopyFrom(
        ps_pb2.DynamicTable(
            table="t", dim=32, index=0, count=1,
            initializer=ps_pb2.RowInitializer(name="uniform", args=[-1.0, 1.0]),
        )
    )  # fmt: skip
    store.create([spec], {})
    dyn = store.get(spec.name).dyn
    assert dyn is not None
    for s in range(0, args.rows, 16384):
        ids = np.arange(s, min(args.rows, s + 16384), dtype=np.int64)
        grads = {spec.name: tables.RowGrad(ids, np.zeros((ids.size, 32), np.float32))}
        await store.apply(store.validate_grads(grads), 1.0)
    tier, index = dyn.tier, dyn.index
    assert tier is not None
    on_disk = index.keys[(index.vals <= -2) & (index.keys >= 0)]
    rng = np.random.default_rng(1)
    batches = [np.sort(rng.choice(on_disk, args.n, replace=False)) for _ in range(args.steps)]
    records = [tier.get(ids)[1] for ids in batches]
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], None]) -> None:
        runs = []
        for _ in range(3):
            t = time.thread_time()
            fn()
            runs.append(1e6 * (time.thread_time() - t) / args.steps)
        out[name] = round(statistics.median(runs), 1)

    def read_hinted() -> None:
        for ids in batches:
            tier.read(ids, places=disk_places(index.vals[index.positions(ids)]))

    def read_bare() -> None:
        for ids in batches:
            tier._gather(np.take(tier._index.vals, tier._index.positions(ids)))

    def write_each() -> None:
        for ids, recs in zip(batches, records, strict=True):
            tier.write(ids, recs)

    def write_batched() -> None:
        for i in range(0, len(batches), 6):
            ids, first = np.unique(np.concatenate(batches[i : i + 6]), return_index=True)
            tier.write(ids, np.concatenate(records[i : i + 6])[first])

    timed("ColdTier.read, hinted (the piece's index lookup included)", read_hinted)
    timed("bare: the log's index lookup + gather", read_bare)
    write_each()
    write_batched()  # warm: the log's index may grow once before the timed passes
    timed(f"LogTier.write of {args.n} records every step", write_each)
    timed(f"LogTier.write of 6 x {args.n} every 6 steps (per step)", write_batched)
    dyn.close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--n", type=int, default=384)
    ap.add_argument("--steps", type=int, default=600)
    cli = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for name, us in asyncio.run(main(cli, tmp)).items():
            print(f"{us:8.1f} us/step  {name}")
