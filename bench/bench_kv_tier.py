"""Which embedded key-value store holds the disk tier's cold rows: LMDB (``lmdb``) or RocksDB (``rocksdict``).

The disk tier's workload (issue 21): records of one float32 row and its Adagrad
slot (``2 x dim x 4`` bytes) plus 24 bytes of bookkeeping, keyed by an 8-byte id;
spilled in batches (one write transaction / write batch each), filled back and read in
batches of distinct random ids. Both stores are configured as the tier uses them:
no durability (the tier is rebuilt from a checkpoint after a restart, so LMDB runs
with ``sync=False``, RocksDB without its write-ahead log), compression off
(float32 rows of random bits do not compress). ``lmdb-writemap`` is LMDB as the tier
opens it now (``writemap=True``: pages written in place in the map, a commit copies
none; its data file is sparse, as large as the map: disk bytes count allocated blocks).

Per store and dim (16, 64, 128), after ``--rows`` records written in random order in
batches of ``--batch`` and then rewritten once (a second spill of every row):

* random-read latency of a batch of ``--read-batch`` distinct ids (median and p99,
  and per row), with the store's files in the page cache (this process wrote them;
  a cold-cache read is a device read and is not measured here);
* bytes on disk (the directory's allocated blocks, after the store is closed) over
  the logical bytes of the records;
* write amplification: bytes passed to ``write`` calls by the process (``wchar`` of
  ``/proc/self/io``, all threads: RocksDB's flushes and compactions included) over
  the logical bytes written (both passes), and the same for ``write_bytes`` (bytes
  the kernel sent to the block device, where the filesystem reports it).

Usage:
    python bench/bench_kv_tier.py --out bench/results/kv_tier      # kv_tier.md / .json (about a minute)
    python bench/bench_kv_tier.py --rows 20000 --dims 16           # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

_META_BYTES = 24  # last_step, hits (int64) and last_time (float64) beside each row


def _io() -> dict[str, int]:
    with open("/proc/self/io", encoding="ascii") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _du(path: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in path.rglob("*") if p.is_file())


def _key(ids: np.ndarray) -> list[bytes]:
    return [int(i).to_bytes(8, "big") for i in ids]


class _Lmdb:
    def __init__(self, path: Path, writemap: bool = False) -> None:
        import lmdb

        self.env = lmdb.open(
            str(path), map_size=1 << 36, sync=False, metasync=False, readahead=False, writemap=writemap
        )

    def put(self, keys: list[bytes], vals: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            cur = txn.cursor()
            cur.putmulti(zip(keys, vals, strict=True))

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin(buffers=False) as txn:
            return [txn.get(k) for k in keys]

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()


class _Rocks:
    def __init__(self, path: Path) -> None:
        import rocksdict

        opts = rocksdict.Options(raw_mode=True)
        opts.set_compression_type(rocksdict.DBCompressionType.none())
        self.db = rocksdict.Rdict(str(path), opts)
        wo = rocksdict.WriteOptions()
        wo.disable_wal = True
        self.wo = wo
        self.rocksdict = rocksdict

    def put(self, keys: list[bytes], vals: list[bytes]) -> None:
        wb = self.rocksdict.WriteBatch(raw_mode=True)
        for k, v in zip(keys, vals, strict=True):
            wb.put(k, v)
        self.db.write(wb, self.wo)

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return self.db.get(keys)

    def close(self) -> None:
        self.db.flush()
        self.db.close()


class _Tier:
    """A disk tier store as a shard uses it (``tier-lmdb``: ``psserver.tier.DiskTier``, ``tier-log``:
    ``psserver.logtier.LogTier``): numpy records of the tier's own dtype, written and read in batches."""

    def __init__(self, path: Path, kind: str, dim: int) -> None:
        from psserver.tier import TierConfig, record_dtype

        self.record = record_dtype(dim, np.dtype(np.float32), {"accumulator": np.dtype(np.float32)})
        config = TierConfig(str(path), 1 << 20, store=kind)
        self.tier = config.open_piece("t", self.record, "t")

    def put(self, ids: np.ndarray, payload: np.ndarray) -> None:
        self.tier.write(ids, payload.view(self.record).reshape(-1))

    def get(self, ids: np.ndarray) -> np.ndarray:
        found, records = self.tier.get(ids)
        assert found.all()
        return records

    def close(self) -> None:
        self.tier.close(remove=False)


def run_one(
    store: str, dim: int, rows: int, batch: int, read_batch: int, reads: int, seed: int
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(1 << 40, rows, replace=False)
    rec = 2 * dim * 4 + _META_BYTES
    tmp = Path(tempfile.mkdtemp(prefix=f"kvtier-{store}-", dir=os.environ.get("BENCH_DIR")))
    try:
        if store.startswith("tier-"):  # the tier's own store, in its own terms (ids and records)
            db: Any = _Tier(tmp, store.removeprefix("tier-"), dim)
            put, get = db.put, db.get
        else:  # a key-value store: keys and values as bytes
            db = _Rocks(tmp) if store == "rocksdict" else _Lmdb(tmp, writemap=store == "lmdb-writemap")

            def put(chunk: np.ndarray, payload: np.ndarray) -> None:
                db.put(_key(chunk), [r.tobytes() for r in payload])

            def get(want: np.ndarray) -> None:
                got = db.get(_key(want))
                assert all(g is not None and len(g) == rec for g in got)

        io0 = _io()
        t0 = time.perf_counter()
        for _ in range(2):  # the first spill, then every row spilled again
            order = rng.permutation(rows)
            for s in range(0, rows, batch):
                chunk = ids[order[s : s + batch]]
                put(chunk, rng.standard_normal((chunk.size, rec // 4), dtype=np.float32))
        write_s = time.perf_counter() - t0
        lat = []
        for _ in range(reads):
            want = rng.choice(ids, read_batch, replace=False)
            t = time.perf_counter()
            get(want)
            lat.append(time.perf_counter() - t)
        db.close()
        io1 = _io()
        logical = 2 * rows * (rec + 8)
        disk = _du(tmp)
        lat.sort()
        return {
            "store": store,
            "dim": dim,
            "rows": rows,
            "record_bytes": rec,
            "write_rows_per_s": 2 * rows / write_s,
            "read_batch_median_ms": statistics.median(lat) * 1e3,
            "read_batch_p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
            "read_us_per_row": statistics.median(lat) / read_batch * 1e6,
            "disk_bytes": disk,
            "disk_over_logical": disk / (rows * (rec + 8)),
            "write_amp_wchar": (io1["wchar"] - io0["wchar"]) / logical,
            "write_amp_device": (io1["write_bytes"] - io0["write_bytes"]) / logical,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000, help="records per store and dim")
    ap.add_argument("--dims", default="16,64,128")
    ap.add_argument("--batch", type=int, default=4096, help="records per spill (one write transaction)")
    ap.add_argument("--read-batch", type=int, default=256, help="distinct ids per batched read")
    ap.add_argument("--reads", type=int, default=300, help="batched reads timed")
    ap.add_argument("--stores", default="lmdb,lmdb-writemap,rocksdict")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every store, interleaved (medians)")
    ap.add_argument("--out", help="write OUT.md and OUT.json")
    args = ap.parse_args()
    runs = []
    for dim in (int(d) for d in args.dims.split(",")):
        for rep in range(args.repeats):
            for store in args.stores.split(","):
                r = run_one(store, dim, args.rows, args.batch, args.read_batch, args.reads, args.seed + rep)
                runs.append(r)
                print(json.dumps(r), flush=True)
    results = _medians(runs)
    lines = [
        "# Disk tier store: LMDB, RocksDB (rocksdict), and the tier's own stores (log, LMDB)",
        "",
        f"`python bench/bench_kv_tier.py {shlex.join(sys.argv[1:])}` "
        f"({args.rows:,} records per store and dim, spilled twice in batches of {args.batch}, "
        f"read back in batches of {args.read_batch} distinct random ids; page cache warm; "
        f"{os.cpu_count()} CPUs, loaded by other jobs: timings are noisy; medians of {args.repeats} "
        f"rounds, the stores interleaved in each; load average {os.getloadavg()[0]:.1f} at the end). "
        "`tier-lmdb` and `tier-log`: the shard's `DiskTier` and `LogTier` (`--table-tier-store`), "
        "with their records (bookkeeping, row, Adagrad slot) and all their own work per batch.",
        "",
        "| store | dim | record B | read batch ms (p50 / p99) | us per row | write rows/s "
        "| disk / logical | write amp (wchar) | write amp (device) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['store']} | {r['dim']} | {r['record_bytes']} | {r['read_batch_median_ms']:.2f} / "
            f"{r['read_batch_p99_ms']:.2f} | {r['read_us_per_row']:.2f} | {r['write_rows_per_s']:,.0f} | "
            f"{r['disk_over_logical']:.2f} | {r['write_amp_wchar']:.2f} | {r['write_amp_device']:.2f} |"
        )
    lines += [
        "",
        "Write amp (wchar): bytes the process passed to `write` calls per logical byte. LMDB without "
        "writemap copies every page a transaction dirtied (4 KiB for a row of 152-1048 bytes) at commit; "
        "with writemap it writes nothing through `write` (0.00): the kernel writes the dirty pages of "
        "the map back. Write amp (device): bytes the kernel sent to the block device per logical byte.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
        record = {"args": vars(args), "results": results, "runs": runs}
        Path(args.out + ".json").write_text(json.dumps(record, indent=1))


def _medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per store and dim: the median of each figure over its rounds."""
    out: list[dict[str, Any]] = []
    for key in dict.fromkeys((r["store"], r["dim"]) for r in runs):
        mine = [r for r in runs if (r["store"], r["dim"]) == key]
        row = dict(mine[0])
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = statistics.median(r[k] for r in mine)
        row["rounds"] = len(mine)
        out.append(row)
    return out


if __name__ == "__main__":
    main()
