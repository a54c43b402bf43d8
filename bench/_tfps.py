"""TensorFlow's ParameterServerStrategy as a benchmark peer: its ps and worker server processes.

``cluster(num_ps, num_workers)`` starts one ``tf.distribute.Server`` process per
task on loopback ports (``python bench/_tfps.py --task ps:0 --cluster SPEC
--ready FILE``), waits until each serves, and yields the cluster spec (JSON) that
a coordinator process passes to ``SimpleClusterResolver``; the tasks are
killed on exit, after their peak RSS is read (``Cluster.peak_rss_mib``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as cm

_START_TIMEOUT_S = 120  # a TF task imports TensorFlow first (5-20 s on a busy 2-core machine)


@dataclass
class Cluster:
    """A running TF cluster: its spec (JSON) and, filled at exit, each task's peak RSS."""

    spec: str
    procs: dict[str, subprocess.Popen[bytes]]
    peak_rss_mib: dict[str, float] = field(default_factory=dict)


def _peak_rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        return int(next(line.split()[1] for line in status if line.startswith("VmHWM"))) / 1024
    return float("nan")


@contextlib.contextmanager
def cluster(num_ps: int, num_workers: int, env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """Starts ``num_ps`` ps and ``num_workers`` worker tasks; see the module docs."""
    spec = {
        "ps": [f"127.0.0.1:{cm.free_port()}" for _ in range(num_ps)],
        "worker": [f"127.0.0.1:{cm.free_port()}" for _ in range(num_workers)],
    }
    text = json.dumps(spec)
    running = Cluster(text, {})
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ready = {}
            for job, addresses in spec.items():
                for i in range(len(addresses)):
                    task = f"{job}:{i}"
                    ready[task] = Path(tmp) / f"{job}{i}.ready"
                    cmd = [sys.executable, __file__, "--task", task, "--cluster", text]
                    cmd += ["--ready", str(ready[task])]
                    running.procs[task] = subprocess.Popen(
                        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
                    )
            for task, p in running.procs.items():
                cm.wait_for_file(ready[task], _START_TIMEOUT_S, p)
            yield running
        finally:
            for task, p in running.procs.items():
                running.peak_rss_mib[task] = _peak_rss_mib(p.pid)
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)


def _task_main(task: str, spec: str, ready: str) -> None:
    import tensorflow as tf

    job, index = task.split(":")
    server = tf.distribute.Server(
        tf.train.ClusterSpec(json.loads(spec)), job_name=job, task_index=int(index), protocol="grpc"
    )
    tmp = ready + ".tmp"
    Path(tmp).write_text(server.target + "\n")
    os.replace(tmp, ready)
    server.join()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="one task of a TF ParameterServerStrategy cluster")
    ap.add_argument("--task", required=True, help="JOB:INDEX, e.g. ps:0")
    ap.add_argument("--cluster", required=True, help="the cluster spec, JSON")
    ap.add_argument("--ready", required=True, help="file written once the server serves")
    a = ap.parse_args()
    _task_main(a.task, a.cluster, a.ready)
