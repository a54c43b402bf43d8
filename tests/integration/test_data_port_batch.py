"""Small requests that meet in one process share data-port frames (``psclient._bulk.DataLink``, BATCH
frames), with real shard processes: each request gets its own answer or its own typed error, and is
applied exactly once; a bad request fails none of its neighbours and is applied in no part.

The clients of one event loop with the same credentials share their data links (``_bulk.shared_link``);
with more small requests at once than ``SMALL_IN_FLIGHT``, the others wait and leave in one frame. A
``gather`` of requests starts them all in one turn of the loop, so that those after the first
``SMALL_IN_FLIGHT`` are batched every time (asserted by the link's count of BATCH frames).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable

import numpy as np
import pytest
from _support import CALL_TIMEOUT_S

import psclient
from psclient import _bulk
from pscore import bulk, codec
from pscore.errors import DeadlineExceededError
from psproto.v1 import ps_pb2
from trainer.cluster import LocalCluster, backups_of

pytestmark = pytest.mark.timeout(120)

CALLERS = 24  # clients on one loop (more than SMALL_IN_FLIGHT, so most requests are batched)
ROUNDS = 4
WIRE = {"data_port_min_bytes": 0, "timeout": CALL_TIMEOUT_S}


def _links(clients: list[psclient.AsyncPSClient]) -> set[_bulk.DataLink]:
    """The data links the clients use (private: not part of the API)."""
    return {data for c in clients for link in c._shards for data in link.data_links.values()}


async def _clients(addresses: list[str], n: int, names: list[str]) -> list[psclient.AsyncPSClient]:
    clients = [psclient.AsyncPSClient(addresses, f"b{i}", **WIRE) for i in range(n)]
    for c in clients:
        await c.list_variables(names)
    return clients


async def _one_shard_callers(
    make_cluster: Callable[..., LocalCluster], prefix: str, n: int
) -> tuple[list[str], list[psclient.AsyncPSClient]]:
    """One shard holding ``n`` variables ``prefix/i`` (8 float32 zeros, SGD 1.0), and a client each."""
    cluster = make_cluster(num_shards=1)
    names = [f"{prefix}/{i}" for i in range(n)]
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as setup:
        await setup.create_many({k: np.zeros(8, np.float32) for k in names}, optimizer=psclient.SGD(1.0))
    return names, await _clients(cluster.addresses, n, names)


async def test_concurrent_small_requests_share_frames_and_each_gets_its_own_answer(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    names, clients = await _one_shard_callers(make_cluster, "own", CALLERS)
    try:
        for r in range(1, ROUNDS + 1):
            async with asyncio.timeout(CALL_TIMEOUT_S):
                # Each caller pushes its own gradient and reads its own variable back in the same frame
                # as the others' (push_pull), then pulls it alone among the others' pulls.
                got = await asyncio.gather(
                    *(
                        c.push_pull({n: np.full(8, i + 1.0, np.float32)})
                        for i, (c, n) in enumerate(zip(clients, names, strict=True))
                    )
                )
                pulled = await asyncio.gather(*(c.pull([n]) for c, n in zip(clients, names, strict=True)))
            for i, n in enumerate(names):
                np.testing.assert_array_equal(got[i][n], np.full(8, -r * (i + 1.0), np.float32))
                np.testing.assert_array_equal(pulled[i][n], got[i][n])
        (link,) = _links(clients)  # one link, shared by every client of the loop
        # The push_pulls and the pulls of a round meet in frames, but not always every round: a request
        # whose answer is already in when it reads (its task preempted between sending and reading, on a
        # loaded machine) ends without waiting, and the next caller then goes alone too (CI saw 7 of 8).
        assert link.batches >= 1
        values, versions = await clients[0].pull_with_versions(names)
    finally:
        for c in clients:
            await c.close()
    for i, n in enumerate(names):
        np.testing.assert_array_equal(values[n], np.full(8, -ROUNDS * (i + 1.0), np.float32))
        assert versions[n] == ROUNDS  # each push applied exactly once


async def test_many_waiting_requests_leave_in_two_frames_each_applied_once(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """From ``BATCH_SPLIT_MIN`` waiting requests on, a turn's requests leave in two frames at least (the
    shard serves one while the client takes the other's answers); each push is applied once."""
    callers = _bulk.SMALL_IN_FLIGHT + 2 * _bulk.BATCH_SPLIT_MIN
    names, clients = await _one_shard_callers(make_cluster, "split", callers)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            applied = await asyncio.gather(
                *(
                    c.push({n: np.full(8, i + 1.0, np.float32)})
                    for i, (c, n) in enumerate(zip(clients, names, strict=True))
                )
            )
        assert all(applied)
        (link,) = _links(clients)
        assert link.batches >= 2  # one turn's waiting requests: in one frame they would have been one
        values, versions = await clients[0].pull_with_versions(names)
    finally:
        for c in clients:
            await c.close()
    for i, n in enumerate(names):
        np.testing.assert_array_equal(values[n], np.full(8, -(i + 1.0), np.float32))
        assert versions[n] == 1


async def test_concurrent_lookups_share_frames_and_each_gets_its_own_rows(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Small lookups of many callers in one process to one shard meet in BATCH frames, as pushes do (their
    rows' bytes are known: ``ShardLink.request`` 's ``nbytes``); each caller gets the rows of its own ids,
    in its order, the same as a lookup alone reads."""
    cluster = make_cluster(num_shards=1)
    clients = [psclient.AsyncPSClient(cluster.addresses, f"l{i}", **WIRE) for i in range(CALLERS)]
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 512, size=8 + i) for i in range(CALLERS)]  # 256-992 bytes of rows each
    try:
        await clients[0].create_embedding("emb", 512, 8, initializer=("uniform", -1.0, 1.0))
        table = await clients[0].lookup("emb", np.arange(512))  # alone
        async with asyncio.timeout(CALL_TIMEOUT_S):
            await asyncio.gather(
                *(c.lookup("emb", i) for c, i in zip(clients, ids, strict=True))
            )  # placement
            (link,) = _links(clients)
            before = link.batches
            for _ in range(ROUNDS):
                got = await asyncio.gather(*(c.lookup("emb", i) for c, i in zip(clients, ids, strict=True)))
                for want, rows in zip(ids, got, strict=True):
                    np.testing.assert_array_equal(rows, table[want])
        # In a round's turn the first SMALL_IN_FLIGHT go alone, the others wait and leave in frames (not in
        # every round for sure: see the first test of this file).
        assert link.batches > before
    finally:
        for c in clients:
            await c.close()


async def test_a_batch_frame_holds_at_most_its_bytes_the_rest_leave_in_the_next(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    n = _bulk.BATCH_MAX_BYTES // 4 - 256  # float32s: each push just below the bound of a small request
    per_frame = _bulk.BATCH_FRAME_BYTES // (4 * n)
    # Waiting: over 2 frames' worth even if a frame's worth more go alone (a request whose answer is in
    # when it reads ends at once, and the next caller then goes alone too).
    callers = _bulk.SMALL_IN_FLIGHT + 3 * per_frame + 1
    cluster = make_cluster(num_shards=1)
    names = [f"big/{i}" for i in range(callers)]
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as setup:
        await setup.create_many({k: np.zeros(n, np.float32) for k in names}, optimizer=psclient.SGD(1.0))
    clients = await _clients(cluster.addresses, callers, names)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            got = await asyncio.gather(
                *(
                    c.push_pull({k: np.full(n, i + 1.0, np.float32)})
                    for i, (c, k) in enumerate(zip(clients, names, strict=True))
                )
            )
        (link,) = _links(clients)
        assert link.batches >= 3  # the waiting requests did not fit in two frames
    finally:
        for c in clients:
            await c.close()
    for i, k in enumerate(names):
        np.testing.assert_array_equal(got[i][k], np.full(n, -(i + 1.0), np.float32))


async def test_a_bad_request_in_a_batch_gets_its_typed_error_and_the_others_apply_once(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(num_shards=1)
    names = [f"own/{i}" for i in range(CALLERS)]
    bad = CALLERS // 2  # after the first SMALL_IN_FLIGHT: in a batch
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as setup:
        await setup.create_many(
            {n: np.zeros(8, np.float32) for n in [*names, "shared"]}, optimizer=psclient.SGD(1.0)
        )
    clients = await _clients(cluster.addresses, CALLERS, [*names, "shared"])
    nan = np.full(8, np.nan, np.float32)

    async def push(i: int) -> bool:
        grads = {names[i]: np.ones(8, np.float32)}
        if i == bad:  # its own variable and a non-finite gradient: the shard refuses the whole push
            grads["shared"] = nan
        return await clients[i].push(grads)

    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            results = await asyncio.gather(*(push(i) for i in range(CALLERS)), return_exceptions=True)
        (link,) = _links(clients)
        assert link.batches >= 1
        values, versions = await clients[0].pull_with_versions([*names, "shared"])
    finally:
        for c in clients:
            await c.close()
    err = results[bad]
    assert isinstance(err, psclient.InvalidArgumentError), err
    assert "non-finite" in str(err) and "shared" in str(err)
    assert results[:bad] + results[bad + 1 :] == [True] * (CALLERS - 1)
    for i, n in enumerate(names):
        np.testing.assert_array_equal(values[n], np.full(8, 0.0 if i == bad else -1.0, np.float32))
        assert versions[n] == (0 if i == bad else 1)
    np.testing.assert_array_equal(values["shared"], np.zeros(8, np.float32))  # nothing half-applied
    assert versions["shared"] == 0


async def test_sync_mode_pushes_in_one_batch_meet_at_the_barrier(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """The shard serves a batch's requests at once: pushes waiting at the sync barrier for one another
    in the same frame are not served one after the other (they would wait for each other forever)."""
    workers = 6
    cluster = make_cluster(
        num_shards=1,
        server_args=["--mode", "sync", "--replicas-to-aggregate", str(workers), "--total-replicas",
                     str(workers), "--barrier-timeout", "30"],
    )  # fmt: skip
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as setup:
        await setup.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
    clients = await _clients(cluster.addresses, workers, ["v"])
    try:
        for step in range(2):
            async with asyncio.timeout(CALL_TIMEOUT_S):
                applied = await asyncio.gather(
                    *(
                        c.push({"v": np.full(4, i + 1.0, np.float32)}, step=step)
                        for i, c in enumerate(clients)
                    )
                )
            assert applied == [True] * workers
        (link,) = _links(clients)
        assert link.batches >= 2
        values, versions = await clients[0].pull_with_versions(["v"])
    finally:
        for c in clients:
            await c.close()
    assert versions == {"v": 2}
    np.testing.assert_array_equal(
        values["v"], np.full(4, -2 * np.mean(np.arange(1, workers + 1)), np.float32)
    )


def test_batched_pushes_to_a_replicated_shard_reach_the_backup_each_once() -> None:
    """With a backup attached the shard serves a batch's pushes at once (each waits for the backup's
    acknowledgement); after failover the backup holds every push exactly once."""
    names = [f"r/{i}" for i in range(CALLERS)]

    async def push_all(addresses: list[str]) -> tuple[dict[str, np.ndarray], dict[str, int], int]:
        async with psclient.AsyncPSClient(addresses, "setup", **WIRE) as setup:
            await setup.create_many({n: np.zeros(8, np.float32) for n in names}, optimizer=psclient.Adam(0.1))
        clients = await _clients(addresses, CALLERS, names)
        try:
            for _ in range(ROUNDS):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    assert all(
                        await asyncio.gather(
                            *(
                                c.push({n: np.full(8, i + 1.0, np.float32)})
                                for i, (c, n) in enumerate(zip(clients, names, strict=True))
                            )
                        )
                    )
            (link,) = _links(clients)
            values, versions = await clients[0].pull_with_versions(names)
        finally:
            for c in clients:
                await c.close()
        return values, versions, link.batches

    async def pull_all(addresses: list[str]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        async with psclient.AsyncPSClient(addresses, "reader", **WIRE) as c:
            return await c.pull_with_versions(names)

    with LocalCluster(1) as primary, backups_of(primary, ["--serve-alone"]) as backup:
        addresses = [f"{primary.addresses[0]}|{backup.addresses[0]}"]
        on_primary, versions, batches = asyncio.run(push_all(addresses))
        primary.kill_shard(0)
        on_backup, backup_versions = asyncio.run(pull_all(addresses))  # fails over to the backup
    assert batches >= ROUNDS
    assert backup_versions == versions == dict.fromkeys(names, ROUNDS)
    for n in names:
        np.testing.assert_array_equal(on_backup[n], on_primary[n])


def test_threads_sharing_one_client_each_get_their_own_answers(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(num_shards=1)
    threads, pushes = 12, 25
    names = [f"t/{i}" for i in range(threads)]
    with psclient.PSClient(cluster.addresses, "threads", **WIRE) as c:
        c.create_many({n: np.zeros(4, np.float32) for n in names}, optimizer=psclient.SGD(1.0))
        errors: list[BaseException] = []
        seen: list[list[float]] = [[] for _ in range(threads)]

        def work(i: int) -> None:
            try:
                for _ in range(pushes):
                    seen[i].append(
                        float(c.push_pull({names[i]: np.full(4, i + 1.0, np.float32)})[names[i]][0])
                    )
            except BaseException as err:  # reported below
                errors.append(err)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=CALL_TIMEOUT_S * 2)
        assert not any(t.is_alive() for t in ts)
        assert not errors, errors
        values = c.pull(names)
    for i, n in enumerate(names):
        assert seen[i] == [-(k + 1) * (i + 1.0) for k in range(pushes)]  # each its own value, in order
        np.testing.assert_array_equal(values[n], np.full(4, -pushes * (i + 1.0), np.float32))


async def test_a_shard_that_serves_no_batches_gets_every_request_alone(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """A shard of before batches leaves ``batches`` unset in its DataPort answer (it would drop a BATCH
    frame as garbage): its clients send each request in a frame of its own. Played here by a DataPort
    answer with the flag cleared on its way to the clients."""
    names, clients = await _one_shard_callers(make_cluster, "own", CALLERS)
    (link,) = {c._shards[0].data_link() for c in clients}
    assert link is not None
    negotiate = link._data_port

    async def older(timeout: float) -> ps_pb2.ShardDataPortResponse:
        reply = await negotiate(timeout)
        reply.batches = False
        return reply

    link._data_port = older
    try:
        for _ in range(2):
            async with asyncio.timeout(CALL_TIMEOUT_S):
                assert all(
                    await asyncio.gather(
                        *(c.push({n: np.ones(8, np.float32)}) for c, n in zip(clients, names, strict=True))
                    )
                )
        values = await clients[0].pull(names)
    finally:
        for c in clients:
            await c.close()
    assert link.batches == 0
    for n in names:
        np.testing.assert_array_equal(values[n], np.full(8, -2.0, np.float32))


async def test_a_batched_request_fails_at_its_own_deadline_while_its_neighbours_wait_on(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """The requests that wait in a link share one timer for their deadlines (``DataLink._expire_waiting``):
    a request with a short timeout, in the same BATCH frame as one with a long timeout, fails at its own
    deadline (DEADLINE_EXCEEDED) while its shard is stopped; the others wait on and are applied once the
    shard goes on."""
    cluster = make_cluster(num_shards=1)
    names = ["long/0", "long/1", "short", "long/2"]
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as setup:
        await setup.create_many({n: np.zeros(4, np.float32) for n in names}, optimizer=psclient.SGD(1.0))
    clients = [
        psclient.AsyncPSClient(cluster.addresses, f"t{i}", data_port_min_bytes=0, timeout=timeout)
        for i, timeout in enumerate([CALL_TIMEOUT_S, CALL_TIMEOUT_S, 1.0, CALL_TIMEOUT_S])
    ]
    grads = [{n: np.ones(4, np.float32)} for n in names]
    pid = cluster.procs[0].pid
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):  # data connections open, placement known
            await asyncio.gather(*(c.push(g) for c, g in zip(clients, grads, strict=True)))
        (link,) = _links(clients)
        # Three open connections (two requests alone, one BATCH frame), so that none below has to connect: a
        # connect asks the stopped shard for its data port, and the batch would count only once connected.
        for _ in range(20):
            if len(link._idle) >= 3:
                break
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await asyncio.gather(
                    *(c.push({n: np.zeros(4, np.float32)}) for c, n in zip(clients, names, strict=True))
                )
        assert len(link._idle) >= 3, f"the link keeps {len(link._idle)} connections"
        batches = link.batches
        os.kill(pid, signal.SIGSTOP)
        try:
            # The first SMALL_IN_FLIGHT go alone; "short" and "long/2" wait and leave in one BATCH frame.
            tasks = [asyncio.ensure_future(c.push(g)) for c, g in zip(clients, grads, strict=True)]
            done, _ = await asyncio.wait([tasks[2]], timeout=CALL_TIMEOUT_S / 2)
            assert done, "the short request is still waiting"
            assert not any(t.done() for i, t in enumerate(tasks) if i != 2)  # the others wait on
            assert link.batches == batches + 1
        finally:
            os.kill(pid, signal.SIGCONT)
        with pytest.raises(DeadlineExceededError):
            await tasks[2]
        async with asyncio.timeout(CALL_TIMEOUT_S):
            assert all(await asyncio.gather(*(tasks[i] for i in (0, 1, 3))))
        values = await clients[0].pull(names)
    finally:
        for c in clients:
            await c.close()
    for n in ("long/0", "long/1", "long/2"):
        np.testing.assert_array_equal(values[n], np.full(4, -2.0, np.float32))  # each push applied once
    assert values["short"][0] in (-1.0, -2.0)  # its second push may or may not have been applied


async def test_a_lone_request_fails_at_its_own_deadline_before_an_earlier_ones(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """The requests in flight alone share one timer as well (``DataLink._expire_alone``), armed for the
    earliest deadline: with the shard stopped, a request with a short timeout that went alone after one with
    a long timeout fails at its own deadline (DEADLINE_EXCEEDED); the other waits on and is applied once."""
    cluster = make_cluster(num_shards=1)
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as setup:
        await setup.create_many(
            {n: np.zeros(4, np.float32) for n in ("long", "short")}, optimizer=psclient.SGD(1.0)
        )
    clients = {
        name: psclient.AsyncPSClient(cluster.addresses, name, data_port_min_bytes=0, timeout=timeout)
        for name, timeout in (("long", CALL_TIMEOUT_S), ("short", 1.0))
    }
    pid = cluster.procs[0].pid
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):  # data connections open, placement known
            await asyncio.gather(*(c.push({n: np.ones(4, np.float32)}) for n, c in clients.items()))
        (link,) = _links(list(clients.values()))
        for _ in range(20):  # two open connections, so that neither request below has to connect (a connect
            if len(link._idle) >= 2:  # to a stopped shard fails at the short timeout by itself)
                break
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await asyncio.gather(*(c.push({n: np.zeros(4, np.float32)}) for n, c in clients.items()))
        assert len(link._idle) >= 2, "the link keeps one connection"
        for _ in range(500):  # the timer the warm-up's requests armed has fired (bounded: 5 s), so "long"
            if link._alone_timer is None:  # arms it below for its own deadline
                break
            await asyncio.sleep(0.01)
        assert link._alone_timer is None, "the link's timer is still armed after its requests ended"
        batches = link.batches
        os.kill(pid, signal.SIGSTOP)
        try:  # both alone (SMALL_IN_FLIGHT), "long" first: the timer armed for its deadline, then "short"'s
            tasks = {"long": asyncio.ensure_future(clients["long"].push({"long": np.ones(4, np.float32)}))}
            for _ in range(500):  # "long" in flight before "short" leaves (bounded: 5 s)
                if link._alone or tasks["long"].done():
                    break
                await asyncio.sleep(0.01)
            assert len(link._alone) == 1 and not tasks["long"].done(), "the long request is not in flight"
            tasks["short"] = asyncio.ensure_future(clients["short"].push({"short": np.ones(4, np.float32)}))
            done, _ = await asyncio.wait([tasks["short"]], timeout=CALL_TIMEOUT_S / 2)
            assert done, "the short request is still waiting"
            assert not tasks["long"].done()
            assert link.batches == batches
        finally:
            os.kill(pid, signal.SIGCONT)
        with pytest.raises(DeadlineExceededError, match="no answer from the data port within 1 s"):
            await tasks["short"]
        async with asyncio.timeout(CALL_TIMEOUT_S):
            assert await tasks["long"]
        values = await clients["long"].pull(["long"])
    finally:
        for c in clients.values():
            await c.close()
    np.testing.assert_array_equal(values["long"], np.full(4, -2.0, np.float32))  # applied once


# -- the frame by hand ------------------------------------------------------------------------


async def test_a_batch_frame_by_hand_is_answered_entry_by_entry(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(num_shards=1)
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as c:
        await c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        link = c._shards[0].data_link()
        assert link is not None
        conn = await link._connect(CALL_TIMEOUT_S)
        try:
            ones = np.ones(4, np.float32)
            good = ps_pb2.PushRequest(worker_id="h", seq=1, session=3, grads=[bulk.describe("v", ones)])
            wrong = ps_pb2.PushRequest(
                worker_id="h", seq=2, session=3, grads=[bulk.describe("v", np.ones(5, np.float32))]
            )
            items = bulk.entries(
                [
                    (0, bulk.Frame(bulk.PUSH, good), bulk.payload_of([ones])),
                    (1, bulk.Frame(bulk.PUSH, wrong), bulk.payload_of([np.ones(5, np.float32)])),
                    (2, bulk.Frame(bulk.PULL, ps_pb2.PullRequest(names=["nope"], worker_id="h")), ()),
                    (3, bulk.Frame(bulk.PUSHED, ps_pb2.PushResponse()), ()),  # not a request
                    (4, bulk.Frame(bulk.PUSH, good), bulk.payload_of([ones])),  # the same push again
                ]
            )
            # Entry 5: a head that does not parse (a PushRequest's field 1 announcing more bytes than follow).
            items += [bulk._ENTRY.pack(5, bulk.PUSH, 2, 0), b"\x0a\x09"]
            answers: dict[int, bulk.Frame | codec.CodecError] = {}
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await conn.send(bulk.Frame(bulk.BATCH, ps_pb2.DataPortBatch(count=6)), items)
                while len(answers) < 6:
                    frame, view = await conn.recv()
                    assert frame.kind == bulk.BATCHED
                    for index, item, _ in bulk.read_entries(view, frame.head.count, bulk.ANSWERS):
                        assert index not in answers
                        answers[index] = item
                # The connection serves on: a lone pull after the batch.
                await conn.send(bulk.Frame(bulk.PULL, ps_pb2.PullRequest(names=["v"], worker_id="h")))
                pulled, payload = await conn.recv()
            assert pulled.kind == bulk.PULLED
            np.testing.assert_array_equal(np.frombuffer(bytes(payload), np.float32), -ones)  # applied once
            assert list(pulled.head.versions) == [1]
        finally:
            conn.reset()
    kinds = {i: a.kind for i, a in answers.items() if isinstance(a, bulk.Frame)}
    assert kinds == {i: bulk.PUSHED if i in (0, 4) else bulk.ERROR for i in range(6)}
    assert answers[0].head.applied and not answers[4].head.applied  # the retry: not applied twice
    codes = {i: answers[i].head.code for i in (1, 2, 3, 5)}
    assert codes == {1: 3, 2: 5, 3: 3, 5: 3}  # INVALID_ARGUMENT, NOT_FOUND, INVALID_ARGUMENT x2
    assert "shape" in answers[1].head.message
    assert "nope" in answers[2].head.message


async def test_a_batch_whose_entries_do_not_fill_it_drops_the_connection_and_the_shard_serves_on(
    cluster: LocalCluster, var_name: str
) -> None:
    async with psclient.AsyncPSClient(cluster.addresses, "setup", **WIRE) as c:
        await c.create(var_name, np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        shard = c.registry.pieces[var_name][0].shard
        link = c._shards[shard].data_link()
        assert link is not None
        conn = await link._connect(CALL_TIMEOUT_S)
        pull = bulk.entries([(0, bulk.Frame(bulk.PULL, ps_pb2.PullRequest(names=[var_name])), ())])
        async with asyncio.timeout(CALL_TIMEOUT_S):
            await conn.send(bulk.Frame(bulk.BATCH, ps_pb2.DataPortBatch(count=2)), pull)  # one entry of 2
            with pytest.raises(psclient.UnavailableError):
                await conn.recv()
        values = await c.pull([var_name])  # the shard serves on
    np.testing.assert_array_equal(values[var_name], np.zeros(4, np.float32))
