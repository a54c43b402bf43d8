"""Sync mode: periodic checkpoints at one step boundary on every shard; workers resume after a restore.

Counters again: SGD with learning rate 1 and gradients of -1 from both workers,
so each completed step adds 1 to every variable's value and version.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S
from _support import cut_steps, wait_until

import psclient
from psserver import ckptfile
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

COUNTERS = [f"count/{i}" for i in range(4)]


def test_sync_checkpoints_share_a_step_and_workers_resume_after_all_shards_restore(tmp_path: Path) -> None:
    args = [
        "--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "2", "--barrier-timeout", "20",
        "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.3",
    ]  # fmt: skip
    with LocalCluster(2, args) as cluster:
        with psclient.PSClient(cluster.addresses, "init", timeout=TIMEOUT_S) as c:
            c.create_many({n: np.zeros(2, np.float32) for n in COUNTERS}, optimizer=psclient.SGD(1.0))
        stop = threading.Event()
        steps = [0, 0]
        errors: list[BaseException] = []
        minus_one = {n: np.full(2, -1.0, np.float32) for n in COUNTERS}

        def work(i: int) -> None:  # a sync worker, as psclient.keras.PSWorker runs one
            try:
                with psclient.PSClient(cluster.addresses, f"w{i}", timeout=TIMEOUT_S) as c:
                    step = 0
                    while not stop.is_set():
                        if c.push(minus_one, step=step, every_shard=True):
                            step += 1
                        else:  # stale (behind), or refused by a restored shard (ahead): as PSWorker
                            shards = min(s.step for s in c.status())
                            step = shards if shards < step else max(step + 1, shards)
                        steps[i] += 1
                    # Done, as PSWorker is at the end: the barrier stops waiting for this worker. (Without
                    # it the other worker's push for the next step waits out the barrier timeout.)
                    c.leave()
            except BaseException as err:
                errors.append(err)

        workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
        for t in workers:
            t.start()
        try:
            wait_until(
                lambda: min(len(cut_steps(tmp_path, s)) for s in range(2)) >= 2,
                "two periodic checkpoints",
                timeout=60.0,
            )
            ports = [int(a.rpartition(":")[2]) for a in cluster.addresses]
            for s in range(2):  # the whole cluster dies mid-training ...
                cluster.kill_shard(s)
            before = list(steps)
            for s in range(2):  # ... and comes back from its checkpoints while the workers wait
                cluster.start_shard(s, port=ports[s])
            try:
                wait_until(
                    lambda: errors or min(steps[i] - before[i] for i in range(2)) >= 20,
                    "20 steps after the restore",
                    timeout=60.0,
                )
            except AssertionError as err:
                raise AssertionError(
                    f"{err}: steps {steps} (at the restore {before}), errors {errors!r}\n"
                    + "\n".join(cluster.log_tail(s, 60) for s in range(2))
                ) from None
        finally:
            stop.set()
            for t in workers:
                t.join(timeout=60)
        assert not errors, errors  # no barrier timeout, no failure: the workers went on
        restored = []
        for s in range(2):
            m = re.findall(r"restored \d+ tensors .* from checkpoint (\d+)", cluster.log_tail(s, 200))
            assert m, cluster.log_tail(s, 40)
            path = tmp_path / ckptfile.file_name(int(m[-1]), s, 2)
            restored.append(ckptfile.read(path))
        assert restored[0].cut is not None and restored[0].cut == restored[1].cut  # one step boundary
        assert restored[0].mode_state["step"] == restored[1].mode_state["step"] == restored[0].cut["step"]
        assert {t.version for r in restored for t in r.tensors} == {restored[0].cut["step"]}
        with psclient.PSClient(cluster.addresses, "reader", timeout=TIMEOUT_S) as c:
            values, versions = c.pull_with_versions()
        assert len(set(versions.values())) == 1, versions  # every shard applied the same steps since
        for name, value in values.items():
            np.testing.assert_array_equal(value, np.full(2, versions[name], np.float32))
        # Every periodic checkpoint was taken at the same steps on both shards (the newest may be
        # written on one shard and not yet on the other when the workers stop). Step 0 is left out: a
        # shard whose timer fires after the variables are created and before the first step completes
        # saves on its own (idle at step 0), which is one version of the model too but need not happen
        # on the other shard, whose timer runs on its own clock.
        try:
            wait_until(
                lambda: cut_steps(tmp_path, 0) - {0} == cut_steps(tmp_path, 1) - {0},
                "the same checkpoint steps",
                timeout=10.0,
            )
        except AssertionError as err:
            raise AssertionError(
                f"{err}: shard 0 {sorted(cut_steps(tmp_path, 0))}, "
                f"shard 1 {sorted(cut_steps(tmp_path, 1))}\n"
                + "\n".join(cluster.log_tail(s, 60) for s in range(2))
            ) from None
