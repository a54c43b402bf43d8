"""What every test shares: how long to wait, where to listen, and how to wait for a condition.

One place for these, so that a slow CI machine is handled by changing one number:

- ``CALL_TIMEOUT_S``: the deadline of one unit of I/O-bound test work (an RPC, a
  client's call with its retries, a shard restart). Barrier timeouts set in tests
  are shorter, so a test that waits on a barrier fails with the barrier's diagnosis.
- ``RUN_TIMEOUT_S``: the wall-clock bound of one TensorFlow subprocess run (a
  ``pstrain`` command, a worker script): TensorFlow alone takes ~5 s to import.
- ``free_addresses(n)``: loopback ``HOST:PORT`` s nobody listens on (for rings and
  for "nothing listens there" checks).
- ``wait_until(predicate, what)``: a bounded poll that fails naming what it waited for.
- ``small_disk(path, size)``: a tmpfs of that size mounted there, a disk that fills (root only).
- ``pythonpath(*dirs)``: a child's ``PYTHONPATH`` with ``dirs`` first, keeping the suite's own
  (``tests/_site``, which ``tests/conftest.py`` puts there for every process the suite starts).

Imported as ``from _support import ...`` (pytest puts ``tests/`` on the path).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from trainer.cluster import reserve_ports

CALL_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 300.0


def free_addresses(n: int = 1) -> list[str]:
    """``n`` distinct ``127.0.0.1:PORT`` addresses nobody listens on (``reserve_ports``: below the kernel's
    ephemeral range where it can, so no other socket takes one before the test binds it)."""
    return reserve_ports(n)


def pythonpath(*dirs: str | Path) -> str:
    """A ``PYTHONPATH`` for a child process: ``dirs`` first, then this process's (which holds ``tests/_site``,
    whose ``sitecustomize`` keeps JAX out of the suite's TensorFlow processes)."""
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([*(str(d) for d in dirs), *([inherited] if inherited else [])])


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    return int(free_addresses(1)[0].rpartition(":")[2])


T = TypeVar("T")


def in_threads(work: Callable[[int], T], count: int, timeout: float = 300.0) -> dict[int, T]:
    """Runs ``work(i)`` for ``i`` in ``range(count)``, each in a thread of its own (workers of one process);
    returns the results by ``i``. Fails with the threads' errors, or naming those still running after
    ``timeout`` seconds (each join is bounded)."""
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(deadline - time.monotonic(), 0.0))
    assert not errors, errors
    unfinished = sorted(set(range(count)) - set(results))
    assert not unfinished, f"threads {unfinished} still running after {timeout} s"
    return results


def wait_until(
    predicate: Callable[[], object], what: str, *, timeout: float = CALL_TIMEOUT_S, interval: float = 0.05
) -> object:
    """Polls ``predicate`` until it returns something truthy, and returns that; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def table_stats(client: Any, name: str) -> dict[str, int]:
    """A dynamic table's counters (``DynamicStats``) summed over its shards."""
    out: dict[str, int] = {}
    for info in client.list_variables([name])[name]:
        for field, value in info.dynamic.ListFields():
            out[field.name] = out.get(field.name, 0) + int(value)
    return out


@contextlib.contextmanager
def small_disk(path: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (made if missing) while the block runs: a disk that fills.
    Skips the test where it cannot be mounted (not root, no mount); unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if os.geteuid() != 0 or subprocess.run(cmd, capture_output=True, timeout=10).returncode:
        pytest.skip(f"needs root and mount (a {size} tmpfs)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=10)


def cut_steps(directory: Path, shard: int) -> set[int]:
    """The steps of ``shard`` 's periodic sync checkpoints in ``directory`` (their manifests' cut)."""
    from psserver import ckptfile

    steps = set()
    for f in ckptfile.list_files(directory):
        if f.shard == shard:
            try:
                cut = ckptfile.read_manifest(f.path).get("cut") or {}
            except ckptfile.CheckpointError:  # pruned while read
                continue
            if "step" in cut:
                steps.add(int(cut["step"]))
    return steps
