"""psrun as a process: prefixed output, a failing rank's status, the others stopped, the timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support import free_addresses

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def _psrun(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer.psrun", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(
        "import json, os, sys, time\nrank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n" + body
    )
    return str(path)


def test_psrun_prefixes_each_rank_stream_like_horovodrun(tmp_path: Path) -> None:
    script = _script(tmp_path, "print('out', rank)\nprint('err', rank, file=sys.stderr)\n")
    proc = _psrun("-np", "2", sys.executable, script)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]<stdout>:out 0", "[1]<stdout>:out 1"]
    assert sorted(proc.stderr.splitlines()) == ["[0]<stderr>:err 0", "[1]<stderr>:err 1"]


def test_psrun_returns_the_failing_rank_status_and_stops_the_others_within_seconds(tmp_path: Path) -> None:
    script = _script(tmp_path, "if rank == 1:\n    time.sleep(1)\n    sys.exit(7)\ntime.sleep(120)\n")
    t0 = time.monotonic()
    proc = _psrun("-np", "3", sys.executable, script)
    assert proc.returncode == 7
    assert time.monotonic() - t0 < 20
    assert "worker 1 exited with status 7" in proc.stderr


def test_psrun_stops_a_job_that_runs_past_timeout(tmp_path: Path) -> None:
    script = _script(tmp_path, "time.sleep(120)\n")
    t0 = time.monotonic()
    proc = _psrun("--timeout", "2", "-np", "2", sys.executable, script)
    assert proc.returncode == 124
    assert time.monotonic() - t0 < 20


def test_psrun_without_command_or_with_remote_hosts_explains(tmp_path: Path) -> None:
    proc = _psrun("-np", "2")
    assert proc.returncode == 2 and "give the command" in proc.stderr
    proc = _psrun("-np", "2", "-H", "h1:1,h2:1", "python", "x.py")
    assert proc.returncode == 2 and "start one psrun per host" in proc.stderr


def test_psrun_one_per_host_with_host_index_forms_one_ring(tmp_path: Path) -> None:
    # Two "hosts" on loopback (127.0.0.1 and 127.0.0.2), one psrun each, as on two machines.
    script = _script(
        tmp_path,
        "from psclient.collective import Ring\n"
        "from pscore.tf_config import read_tf_config\n"
        "cfg = read_tf_config()\n"
        "with Ring(cfg.workers, cfg.worker_rank(), timeout=30) as ring:\n"
        "    print('sum', ring.allreduce([rank + 1.0], op='sum').tolist())\n",
    )
    base_port = free_addresses(1)[0].rpartition(":")[2]
    args = ["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", "--base-port", base_port]
    cmds = [[sys.executable, "-m", "trainer.psrun", *args, "--host-index", str(i), sys.executable, script]
            for i in range(2)]  # fmt: skip
    procs = [
        subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0].strip() == "[0]<stdout>:sum [3.0]"
    assert outs[1][0].strip() == "[1]<stdout>:sum [3.0]"
