"""Supervising the processes a launcher starts: stop them, wait for all, relay their output. No TensorFlow."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

_write_lock = threading.Lock()


def _relay(label: str, stream_name: str, source: IO[str], sink: IO[str]) -> None:
    """Copies ``source`` to ``sink`` line by line, prefixed ``[label]<stream>:`` (horovodrun's format)."""
    for line in source:
        with _write_lock:
            sink.write(f"[{label}]<{stream_name}>:{line}")
            sink.flush()


def start_prefixed(
    cmd: Sequence[str], env: Mapping[str, str], label: str
) -> tuple[subprocess.Popen[str], list[threading.Thread]]:
    """Starts ``cmd``; relays its stdout and stderr to ours, each line prefixed ``[label]<stdout>:`` etc.

    Returns:
        The process and its two relay threads (daemons; they end with the process's output).
    """
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", env=dict(env))  # fmt: skip
    threads = []
    for name, source, sink in (("stdout", proc.stdout, sys.stdout), ("stderr", proc.stderr, sys.stderr)):
        t = threading.Thread(target=_relay, args=(label, name, source, sink), daemon=True)
        t.start()
        threads.append(t)
    return proc, threads


def stop(procs: Sequence[subprocess.Popen[str]], grace_s: float = 10.0) -> None:
    """SIGTERM to every process still running, then SIGKILL to any still running ``grace_s`` later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> int:
    """Waits for every process; on the first failure (or the deadline) stops the rest."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            print(f"launch: worker {i} exited with status {code}; stopping the others", file=sys.stderr)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            return int(code or 1)
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            print(f"launch: workers still running after {timeout:.0f}s; stopping them", file=sys.stderr)
            return 124
        time.sleep(0.2)


def relay_worker_lines(proc: subprocess.Popen[str], tail: list[str]) -> None:
    """Prints ``proc``'s ``[worker ...]`` progress lines as they come; keeps its last 40 lines in ``tail``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        del tail[:-40]
        if line.startswith("[worker"):
            print(line, end="", flush=True)
