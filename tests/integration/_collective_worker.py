"""One rank of a test ring, run as its own process by ``test_collective.py``.

Usage: ``python _collective_worker.py SCENARIO RANK ADDR,ADDR,... TIMEOUT [TRANSPORT]``. Prints
JSON lines on stdout: ``{"event": "ready"}`` once the ring serves, optionally
``{"event": "progress"}``, then one ``{"event": "done", ...}`` with the failures
found or the error raised. Exit status 3 means the address could not be bound
(the parent retries with other ports).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from psclient.collective import Ring
from pscore.errors import PSError, UnavailableError

DTYPES = ("float16", "float32", "float64", "int32", "int64")
SIZES = (0, 1, 7, 1_000_003)
OPS = ("sum", "mean", "min", "max")


def emit(**kw: Any) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def inputs(seed: int, world: int, dtype: str, size: int) -> list[np.ndarray]:
    """Every rank's input for one case (each rank can compute all of them)."""
    out = []
    for r in range(world):
        rng = np.random.default_rng([seed, r])
        if dtype.startswith("int"):
            out.append(rng.integers(-1000, 1000, size).astype(dtype))
        else:
            out.append((rng.standard_normal(size) * 4).astype(dtype))
    return out


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    st = np.stack(xs)
    if op == "sum":
        return st.sum(axis=0, dtype=np.float64 if st.dtype.kind == "f" else st.dtype)
    if op == "mean":
        s = st.sum(axis=0, dtype=np.float64 if st.dtype.kind == "f" else st.dtype)
        return s / len(xs) if st.dtype.kind == "f" else (s / len(xs)).astype(st.dtype)
    return st.min(axis=0) if op == "min" else st.max(axis=0)


def close(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    if dtype.startswith("int"):
        return bool(np.array_equal(got, want))
    tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    return bool(np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 10))


def matrix(ring: Ring, rank: int, world: int) -> list[str]:
    failures: list[str] = []
    case = 0
    for dtype in DTYPES:
        for size in SIZES:
            for op in OPS:
                case += 1
                xs = inputs(case, world, dtype, size)
                before = xs[rank].copy()
                got = ring.allreduce(xs[rank], op)
                want = reference(xs, op)
                if got.dtype != np.dtype(dtype) or got.shape != (size,) or not close(got, want, dtype):
                    failures.append(f"allreduce {op} {dtype} size {size}")
                if not np.array_equal(xs[rank], before):
                    failures.append(f"allreduce {op} {dtype} size {size} modified its input")
    # In place, multi-dimensional.
    x = np.full((3, 5), rank + 1, np.float32)
    if ring.allreduce(x, out=x) is not x or not np.all(x == world * (world + 1) / 2):
        failures.append("allreduce out=x")
    for dtype in DTYPES:
        for size in (0, 7, 100_003):
            case += 1
            xs = inputs(case, world, dtype, size)
            for root in range(world):
                got = ring.broadcast(xs[rank], root=root)
                if not np.array_equal(got, xs[root]):
                    failures.append(f"broadcast {dtype} size {size} root {root}")
            # Unequal lengths along axis 0, rank order.
            parts = [x[: (r * 3 + size) % (size + 1)].reshape(-1, 1) for r, x in enumerate(xs)]
            got = ring.allgather(parts[rank])
            if not np.array_equal(got, np.concatenate(parts)):
                failures.append(f"allgather {dtype} size {size}")
    ring.barrier()
    many = {f"v{i}": np.full((i + 1, 2), rank + i, np.float32 if i % 2 else np.int64) for i in range(20)}
    got_many = ring.allreduce_many(many, op="sum")
    assert isinstance(got_many, dict)
    for k, v in many.items():
        want = sum(np.full_like(v, r + int(k[1:])) for r in range(world))
        if got_many[k].dtype != v.dtype or not np.array_equal(got_many[k], want):
            failures.append(f"allreduce_many {k}")
    ring.barrier()
    return failures


def until_error(ring: Ring) -> None:
    x = np.ones(1 << 20, np.float32)
    for i in range(10_000):
        ring.allreduce(x, op="mean", out=x)
        if i == 2:
            emit(event="progress")
    raise AssertionError("no error after 10000 all-reduces")


def main() -> int:
    scenario, rank, addrs, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), float(sys.argv[4])
    transport = sys.argv[5] if len(sys.argv) > 5 else "grpc"
    try:
        ring = Ring(addrs, rank, timeout=timeout, transport=transport)
    except UnavailableError as err:
        emit(event="bind_failed", message=str(err))
        return 3
    emit(event="ready")
    start = time.monotonic()
    try:
        with ring:
            if scenario == "matrix":
                emit(event="done", failures=matrix(ring, rank, len(addrs)))
            elif scenario == "until_error":
                until_error(ring)
            else:
                raise SystemExit(f"unknown scenario {scenario}")
    except PSError as err:
        emit(
            event="done",
            error=type(err).__name__,
            message=str(err),
            code=err.code.name,
            elapsed=time.monotonic() - start,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
