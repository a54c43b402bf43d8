"""Horovod's elastic run loop and ObjectState (psclient.elastic), with a recorded fake ring."""

from __future__ import annotations

from typing import Any

import pytest

from psclient.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, RendezvousError, run_fn


def _state(log: list[str], **attrs: Any) -> ObjectState:
    def bcast(obj: Any) -> Any:
        log.append("sync")
        return obj

    state = ObjectState(bcast, lambda: 0, None, **attrs)
    state.register_reset_callbacks([lambda: log.append("on_reset")])
    return state


def test_a_broken_ring_restores_the_last_commit_resets_syncs_and_runs_again() -> None:
    log: list[str] = []
    state = _state(log, epoch=0)
    failures = [HorovodInternalError("rank 1 exited", generation=1, lost_ranks=(1,))]

    def train(state: ObjectState) -> int:
        log.append("train")
        state.epoch += 1
        if state.epoch == 2 and failures:
            raise failures.pop()
        state.commit()
        return state.epoch

    run = run_fn(train, lambda: log.append("reset"), lambda err: isinstance(err, HorovodInternalError))
    state.epoch = 1
    state.commit()
    assert run(state) == 2  # epoch went 1 -> 2 (failed, restored to 1) -> 2
    assert log == ["sync", "train", "reset", "on_reset", "sync", "train"]


def test_hosts_updated_resets_without_restoring() -> None:
    log: list[str] = []
    state = _state(log, step=0)
    interrupts = [HostsUpdatedInterrupt(skip_sync=False)]

    def train(state: ObjectState) -> int:
        state.step += 1
        state.commit()
        if interrupts:
            raise interrupts.pop()
        return state.step

    assert run_fn(train, lambda: log.append("reset"), lambda err: False)(state) == 2  # not rolled back
    assert log == ["sync", "reset", "on_reset", "sync"]


@pytest.mark.parametrize("error", [ValueError("a bug"), RendezvousError("psrun ended the job")])
def test_other_errors_and_the_end_of_the_job_propagate(error: Exception) -> None:
    # RendezvousError propagates even when the ring looks broken (psrun ended the job during a reset).
    def train(state: ObjectState) -> None:
        raise error

    with pytest.raises(type(error)):
        run_fn(train, lambda: None, lambda err: isinstance(err, HorovodInternalError))(_state([]))
    with pytest.raises(RendezvousError):
        run_fn(_raise(RendezvousError("stop")), lambda: None, lambda err: True)(_state([]))


def _raise(error: Exception) -> Any:
    def train(state: ObjectState) -> None:
        raise error

    return train


def test_outside_an_elastic_job_a_broken_ring_ends_the_run() -> None:
    def train(state: ObjectState) -> None:
        raise HorovodInternalError("rank 1 exited")

    with pytest.raises(HorovodInternalError, match="generation 0 broke: rank 1 exited"):
        run_fn(train, None, lambda err: True)(_state([]))


def test_a_ring_that_breaks_in_the_reset_callbacks_is_reset_again() -> None:
    log: list[str] = []
    state = _state(log)
    breaks = [HorovodInternalError("again")]

    def on_reset() -> None:
        if breaks:
            raise breaks.pop()

    state.register_reset_callbacks([on_reset])
    calls = [HorovodInternalError("first")]

    def train(state: ObjectState) -> str:
        if calls:
            raise calls.pop()
        return "done"

    run = run_fn(train, lambda: log.append("reset"), lambda err: isinstance(err, HorovodInternalError))
    assert run(state) == "done"
    assert log.count("reset") == 2
