"""A sync push in parts (``push_pull(..., parts=P)``) on real shards: each part is a sync step of its own,
applied once as the mean of every worker's gradients, answered only once all of them are in, and the
values after N steps are those of whole pushes, bit for bit (issue 45)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _support import cut_steps
from _workers import CALL_TIMEOUT_S, close_all, worker_clients

import psclient

_SIZE = 32 << 10  # float32 elements a variable: 128 KiB, over the data port, in the uplink's turns


def _sync_args(n: int) -> list[str]:
    return ["--mode", "sync", "--replicas-to-aggregate", str(n), "--total-replicas", str(n),
            "--barrier-timeout", "20"]  # fmt: skip


def _gradients(
    steps: int, workers: int, shapes: dict[str, tuple[int, ...]]
) -> list[list[dict[str, np.ndarray]]]:
    """Per step, per worker: integer-valued gradients whose sum over the workers is a multiple of their
    count, so that each step's mean is exact in float32, whatever order a shard adds them in."""
    rng = np.random.default_rng(45)
    out = []
    for _ in range(steps):
        per_worker: list[dict[str, np.ndarray]] = [{} for _ in range(workers)]
        for name, shape in shapes.items():
            grads = rng.integers(-8, 9, size=(workers - 1, *shape)).astype(np.float32)
            mean = rng.integers(-4, 5, size=shape).astype(np.float32)
            last = workers * mean - grads.sum(axis=0)
            for w in range(workers):
                per_worker[w][name] = grads[w] if w < workers - 1 else last
        out.append(per_worker)
    return out


@pytest.mark.parametrize("parts", [1, 3])
async def test_n_sync_steps_in_parts_end_where_whole_pushes_do(make_cluster, parts: int) -> None:
    """3 workers, 2 shards, 7 variables (one shard holds fewer than ``parts`` of them in some placements:
    its empty parts still count), 3 steps of push_pull: every worker reads, after each step, the
    expected values exactly; the shards completed 3 x parts steps."""
    workers, steps = 3, 3
    cluster = make_cluster(num_shards=2, server_args=_sync_args(workers))
    clients = worker_clients(cluster, workers)
    try:
        shapes = {f"v{i}": (_SIZE,) for i in range(6)} | {"small": (3, 5)}
        init = {name: np.full(shape, 100.0, np.float32) for name, shape in shapes.items()}
        await clients[0].create_many(init, optimizer=psclient.SGD(learning_rate=1.0))
        grads = _gradients(steps, workers, shapes)
        expected = {name: value.copy() for name, value in init.items()}
        for step in range(steps):
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(c.push_pull(grads[step][w], step=step, parts=parts) for w, c in enumerate(clients))
                ),
                CALL_TIMEOUT_S,
            )
            for name in shapes:
                total = np.zeros(shapes[name], np.float32)
                for w in range(workers):
                    total += grads[step][w][name]
                expected[name] = expected[name] - total / np.float32(workers)
            for values in answers:
                assert values.applied
                for name in shapes:
                    np.testing.assert_array_equal(values[name], expected[name])
        values, versions = await clients[1].pull_with_versions()
        for name in shapes:
            np.testing.assert_array_equal(values[name], expected[name])
        assert set(versions.values()) == {steps}  # each variable updated once a step, not once a push
        assert [s.step for s in await clients[0].status()] == [steps * parts] * 2
    finally:
        await close_all(clients)


async def test_a_part_is_answered_only_once_every_workers_part_is_in(make_cluster) -> None:
    """Two workers, one shard, two variables, two parts (``a`` then ``b``). While w1 has pushed nothing,
    w0's push_pull waits and nothing is applied; once w1's part with ``a`` is in, ``a`` holds the mean of
    both gradients (not w0's alone) and ``b`` is untouched, and w0 still waits; w1's part with ``b``
    completes the step, and w0 reads the means."""
    cluster = make_cluster(num_shards=1, server_args=_sync_args(2))
    w0, w1 = clients = worker_clients(cluster, 2)
    try:
        zeros = np.zeros(_SIZE, np.float32)
        await w0.create_many({"a": zeros, "b": zeros}, optimizer=psclient.SGD(learning_rate=1.0))
        one, three = np.ones(_SIZE, np.float32), np.full(_SIZE, 3.0, np.float32)
        pushing = asyncio.create_task(w0.push_pull({"a": one, "b": one}, step=0, parts=2))
        done, _ = await asyncio.wait([pushing], timeout=0.5)
        assert not done  # both parts wait for w1
        values = await w1.pull()
        np.testing.assert_array_equal(values["a"], zeros)
        np.testing.assert_array_equal(values["b"], zeros)
        # w1's first part (the shard's step 0 of 2 x 0 + 0): "a" only
        assert await asyncio.wait_for(w1.push({"a": three}, step=0), CALL_TIMEOUT_S)
        values = await w1.pull()
        np.testing.assert_array_equal(values["a"], np.full(_SIZE, -2.0, np.float32))
        np.testing.assert_array_equal(values["b"], zeros)
        done, _ = await asyncio.wait([pushing], timeout=0.5)
        assert not done  # "b" still waits for w1's gradient of it
        assert await asyncio.wait_for(w1.push({"b": three}, step=1), CALL_TIMEOUT_S)
        answer = await asyncio.wait_for(pushing, CALL_TIMEOUT_S)
        assert answer.applied
        np.testing.assert_array_equal(answer["a"], np.full(_SIZE, -2.0, np.float32))
        np.testing.assert_array_equal(answer["b"], np.full(_SIZE, -2.0, np.float32))
    finally:
        await close_all(clients)


async def test_bad_parts_are_refused_before_anything_is_sent(make_cluster) -> None:
    cluster = make_cluster(num_shards=1, server_args=_sync_args(1))
    (w0,) = clients = worker_clients(cluster, 1)
    try:
        await w0.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        for parts in (0, -1, 1.5, True):
            with pytest.raises(psclient.InvalidArgumentError, match="parts"):
                await w0.push_pull({"v": np.ones(4, np.float32)}, step=0, parts=parts)  # type: ignore[arg-type]
        assert [s.step for s in await w0.status()] == [0]
        np.testing.assert_array_equal((await w0.pull())["v"], np.zeros(4, np.float32))
    finally:
        await close_all(clients)


async def test_periodic_checkpoints_fall_at_whole_steps_of_a_step_in_parts(make_cluster, tmp_path) -> None:
    """A shard counts each part as a step of its own; its periodic checkpoints (cut at one boundary on every
    shard) fall only where a worker's whole step ends: at shard steps that are multiples of ``parts``
    (``PushRequest.parts``), never between two parts of a step. A run of 3 parts a step takes at least
    three checkpoints a shard (a boundary picked with no regard for parts would be a multiple of 3 by chance
    in one case of three)."""
    parts, workers = 3, 2
    args = [*_sync_args(workers), "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.2"]
    cluster = make_cluster(num_shards=2, server_args=args)
    clients = worker_clients(cluster, workers)
    try:
        shapes = {f"v{i}": (256,) for i in range(4)}
        await clients[0].create_many(
            {n: np.zeros(s, np.float32) for n, s in shapes.items()}, optimizer=psclient.SGD(1.0)
        )
        grads = {n: np.ones(s, np.float32) for n, s in shapes.items()}
        cuts: list[set[int]] = [set(), set()]
        for step in range(400):  # bounded: ~10 ms a step; stops once every shard cut 3 checkpoints
            await asyncio.wait_for(
                asyncio.gather(*(c.push_pull(grads, step=step, parts=parts) for c in clients)), CALL_TIMEOUT_S
            )
            if step % 10 == 9:
                cuts = [cut_steps(tmp_path, s) for s in range(2)]
                if min(map(len, cuts)) >= 3:
                    break
        assert min(map(len, cuts)) >= 3, cuts
        for shard, steps in enumerate(cuts):
            assert all(s % parts == 0 for s in steps), f"shard {shard} cut between parts: {sorted(steps)}"
        values = await clients[0].pull(list(shapes))
        np.testing.assert_array_equal(values["v0"], np.full(256, -(step + 1), np.float32))  # every step once
    finally:
        await close_all(clients)


@pytest.mark.parametrize("mode", ["async", "ssp"])
async def test_a_push_in_parts_on_async_and_ssp_shards_applies_every_part(make_cluster, mode: str) -> None:
    """``parts`` on shards that do not run sync steps: each part is a push of its own, applied as it comes,
    and a shard holding fewer tensors than ``parts`` gets empty parts it answers (nothing to apply), not
    a refused push. 2 shards, 3 variables (so a shard has empty parts), 4 parts, 3 steps: the values are
    those of 3 whole pushes, and every step is applied."""
    args = ["--mode", mode, "--total-replicas", "1"] if mode == "ssp" else []
    cluster = make_cluster(num_shards=2, server_args=args)
    (w0,) = clients = worker_clients(cluster, 1)
    try:
        shapes = {"a": (_SIZE,), "b": (8,), "c": (4, 4)}
        await w0.create_many(
            {n: np.zeros(s, np.float32) for n, s in shapes.items()}, optimizer=psclient.SGD(1.0)
        )
        pieces = sum(len(infos) for infos in (await w0.list_variables()).values())
        assert pieces < 2 * 4, pieces  # a shard with empty parts
        grads = {n: np.ones(s, np.float32) for n, s in shapes.items()}
        for step in range(3):
            answer = await asyncio.wait_for(w0.push_pull(grads, step=step, parts=4), CALL_TIMEOUT_S)
            assert answer.applied
            for name, shape in shapes.items():
                np.testing.assert_array_equal(answer[name], np.full(shape, -(step + 1.0), np.float32))
        values = await w0.pull()
        assert sorted(values) == sorted(shapes)
        np.testing.assert_array_equal(values["b"], np.full(8, -3.0, np.float32))
    finally:
        await close_all(clients)
