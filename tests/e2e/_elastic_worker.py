"""A TF-free elastic worker for psrun's tests: Horovod's run loop over psclient.elastic, numpy state.

Each step adds 1 to every element of ``state.w`` on this rank, then checks with an all-reduce that
every rank holds the same ``w`` (so a rank that failed to restore its last commit is caught), then
commits. Prints one ``RESULT`` JSON line at the end. Environment:

- ``STEPS``: steps to train (default 40); ``STEP_S``: seconds of "work" per step (default 0.05).
- ``MIN_WORLD``: train on (past ``STEPS``, at most 100 times as many) until the ring has this many ranks,
  so a test that adds a rank does not depend on how fast it starts.
- ``MARK_FILE``: created after the first commit (a discovery script can wait for training to run).
- ``KILL_WORKER`` / ``KILL_AT``: that worker id SIGKILLs itself during the all-reduce of that step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from psclient.collective import Ring
from psclient.elastic import (
    ElasticSession,
    HorovodInternalError,
    ObjectState,
    RendezvousClient,
    broadcast_object,
    run_fn,
)


def main() -> None:
    steps = int(os.environ.get("STEPS", "40"))
    step_s = float(os.environ.get("STEP_S", "0.05"))
    client = RendezvousClient.from_env()
    assert client is not None, "run under psrun --min-np"
    victim = os.environ.get("KILL_WORKER") == client.worker
    kill_at = int(os.environ.get("KILL_AT", "-1"))
    min_world = int(os.environ.get("MIN_WORLD", "1"))
    mark = os.environ.get("MARK_FILE")
    session = ElasticSession(client, lambda addresses, rank: Ring(addresses, rank, timeout=60.0))
    ring = session.start()
    bcast = lambda obj: broadcast_object(ring, obj, 0)  # noqa: E731
    state = ObjectState(bcast, lambda: ring.rank, session.hosts_updated, step=0, w=np.zeros(3))
    worlds: list[int] = []

    def train(state: ObjectState) -> None:
        worlds.append(ring.world)
        while state.step < steps or ring.world < min_world:  # the same decision on every rank
            if state.step >= 100 * steps:
                raise AssertionError(f"the ring never reached {min_world} ranks")
            state.w = state.w + 1.0
            if victim and state.step == kill_at:
                threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGKILL)).start()
            mean = ring.allreduce(state.w, "mean")
            if not np.array_equal(mean, state.w):
                raise AssertionError(f"rank {ring.rank}: w {state.w} differs from the ranks' mean {mean}")
            time.sleep(step_s)
            state.step += 1
            state.commit()
            if mark:
                Path(mark).touch()

    run = run_fn(train, session.reset, lambda err: isinstance(err, HorovodInternalError) or ring.broken)
    run(state)
    result = {"worker": client.worker, "rank": ring.rank, "world": ring.world, "step": state.step,
              "w": state.w.tolist(), "generation": ring.generation, "worlds": worlds}  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    ring.close()
    session.close()


if __name__ == "__main__":
    main()
