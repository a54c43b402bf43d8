"""Integration: concurrent workers lose no update, and a pull never sees a half-applied tensor."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import psclient
from psclient import _requests as rq
from pscore.placement import plan
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster

WORKERS = 4
PUSHES = 200

# One worker process: discovers the variables by name and pushes ones PUSHES times.
_WORKER = """
import json, sys
import numpy as np
import psclient
addresses, names, worker, pushes = json.loads(sys.argv[1])
with psclient.PSClient(addresses, worker_id=worker, timeout=30) as c:
    ones = {n: np.ones(3, np.float32) for n in names}
    for _ in range(pushes):
        assert c.push(ones) is True
"""


@pytest.mark.timeout(120)
def test_ps_no_lost_updates_from_concurrent_worker_processes(cluster: LocalCluster, var_name: str) -> None:
    names = [f"{var_name}/a", f"{var_name}/b"]
    with psclient.PSClient(cluster.addresses) as c:
        c.create_many({n: np.zeros(3, np.float32) for n in names}, optimizer=psclient.SGD(learning_rate=1.0))
        assert {c._async.registry.pieces[n][0].shard for n in names} == {0, 1}  # both shards take part
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, json.dumps([cluster.addresses, names, f"w{i}", PUSHES])],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for i in range(WORKERS)
        ]
        try:
            outputs = [p.communicate(timeout=100)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, out in zip(procs, outputs, strict=True):
            assert p.returncode == 0, out
        values, versions = c.pull_with_versions(names)
    for n in names:
        np.testing.assert_array_equal(values[n], np.full(3, -WORKERS * PUSHES, np.float32))
        assert versions[n] == WORKERS * PUSHES


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mib", "partition_bytes"),
    [(2, 0), (6, 0), (2, None), (6, None)],
    ids=["unary-pull", "streamed-pull", "cut-unary-pull", "cut-streamed-pull"],
)
def test_ps_concurrent_pull_never_sees_a_half_applied_tensor(
    cluster: LocalCluster, var_name: str, mib: int, partition_bytes: int | None
) -> None:
    """A pull reads each stored tensor at one version: a variable kept whole never mixes two versions, and
    one cut over the shards (the default ``partition_bytes`` cuts both sizes) never mixes them inside a piece.

    Both sizes are above the shard's in-thread apply threshold (1 MiB), so the update runs off the event
    loop while pulls are served; 6 MiB pulls are streamed."""
    n = (mib << 20) // 4
    duration_s = 2.0
    placement = {} if partition_bytes is None else {"partition_bytes": partition_bytes}
    with (
        psclient.PSClient(cluster.addresses, worker_id="pusher", **placement) as pusher,
        psclient.PSClient(cluster.addresses, worker_id="puller") as puller,
    ):
        pusher.create(var_name, np.zeros(n, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        puller.pull([var_name])  # the puller learns the placement from the shards
        pieces = puller._async.registry.pieces[var_name]
        assert len(pieces) == (1 if partition_bytes == 0 else 2), pieces  # whole, or one piece a shard
        bounds = [(p.offset, p.offset + p.size) for p in pieces] if len(pieces) > 1 else [(0, n)]
        stop = threading.Event()
        errors: list[BaseException] = []

        def push_loop() -> None:
            ones = {var_name: np.ones(n, np.float32)}
            try:
                while not stop.is_set():
                    pusher.push(ones)
            except BaseException as err:  # reported by the main thread
                errors.append(err)

        thread = threading.Thread(target=push_loop, daemon=True)
        thread.start()
        pulls, seen = 0, set()
        try:
            deadline = time.monotonic() + duration_s
            while time.monotonic() < deadline and not errors:
                values, versions = puller.pull_with_versions([var_name])
                v = values[var_name]
                firsts = []
                for lo, hi in bounds:
                    piece = v[lo:hi]
                    assert (piece == piece[0]).all(), f"pull {pulls} mixes values {np.unique(piece)[:5]}"
                    firsts.append(int(piece[0]))
                # the variable's version is its oldest piece's: the value of the piece that applied fewest
                assert -max(firsts) == versions[var_name], (firsts, versions)
                seen.add(min(firsts))
                pulls += 1
        finally:
            stop.set()
            thread.join(timeout=30)
        assert not errors, errors
        assert not thread.is_alive()
    assert pulls >= 3 and len(seen) >= 2, (pulls, seen)  # the pulls really overlapped updates


def _create_piece(stubs: list[ps_pb2_grpc.ParameterServerStub], name: str, n: int, index: int) -> None:
    """Creates piece ``index`` of a float32 variable of ``n`` zeros cut at 64 KiB over the stubs' shards, as
    a creating client does on each shard (by itself: a creator part-way through)."""
    piece = plan({name: ((n,), np.dtype(np.float32))}, len(stubs), 64 << 10)[name][index]
    spec = ps_pb2.VariableSpec(
        name=piece.stored_name,
        dtype=ps_pb2.DTYPE_FLOAT32,
        shape=[piece.size],
        optimizer=psclient.SGD(learning_rate=1.0).to_proto(),
        partition=ps_pb2.Partition(
            variable=name, full_shape=[n], index=index, count=piece.count, offset=piece.offset
        ),
    )
    chunk = ps_pb2.TensorChunk(
        name=piece.stored_name,
        dtype=ps_pb2.DTYPE_FLOAT32,
        shape=[piece.size],
        offset=0,
        data=b"\0" * 4 * piece.size,
    )
    created = stubs[piece.shard].CreateVariables(
        iter([ps_pb2.CreateVariablesRequest(variables=[spec], values=[chunk])]), timeout=30
    )
    assert list(created.created) == [True]


@pytest.mark.timeout(60)
def test_a_worker_that_finds_part_of_a_variable_waits_for_the_rest(
    cluster: LocalCluster, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    """Every worker of a job creates the model's variables at start (idempotent) and pushes at once. A
    variable cut over the shards is created piece by piece, so a worker's listing can find part of one that
    another worker is creating: it waits for the rest instead of taking the variable as there (and then
    failing its first push with 'does not exist')."""
    n = 64 << 10  # 256 KiB of float32: one piece a shard at 64 KiB
    _create_piece(raw_stubs, var_name, n, 0)  # the other worker's first shard is done, its second not yet
    done = threading.Event()

    def worker() -> bool:
        with psclient.PSClient(cluster.addresses, worker_id="w1", partition_bytes=64 << 10) as c:
            created = c.create(var_name, np.zeros(n, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
            done.set()
            assert c.push({var_name: np.ones(n, np.float32)}) is True
            return created

    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(worker()), daemon=True)
    thread.start()
    time.sleep(0.5)  # the worker is waiting: its create cannot return with half the variable
    assert not done.is_set()
    _create_piece(raw_stubs, var_name, n, 1)  # the other worker's second shard
    thread.join(timeout=30)
    assert results == [False]  # the other worker created it; this one pushed into the whole of it
    with psclient.PSClient(cluster.addresses) as c:
        np.testing.assert_array_equal(c.pull([var_name])[var_name], np.full(n, -1.0, np.float32))


@pytest.mark.timeout(60)
def test_a_worker_that_finds_part_of_a_batch_places_the_rest_as_the_batch_plan_does(
    cluster: LocalCluster, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    """Another worker's create of the same batch is part-way: its first variable is there, the rest not yet.
    This worker creates the rest where the whole batch's plan puts them (where the other worker creates
    them), not where a plan of the rest alone would: no variable stands on two shards."""
    sizes = {"a": 4000, "b": 3000, "c": 2000, "d": 1000}  # float32 elements: not cut (under 64 KiB)
    specs = {f"{var_name}/{k}": ((n,), np.dtype(np.float32)) for k, n in sizes.items()}
    first = f"{var_name}/a"
    batch = plan(specs, len(raw_stubs), 64 << 10)
    rest = plan({n: s for n, s in specs.items() if n != first}, len(raw_stubs), 64 << 10)
    assert any(rest[n][0].shard != batch[n][0].shard for n in rest)  # the case the test is about
    piece = batch[first][0]
    created = raw_stubs[piece.shard].CreateVariables(
        iter([
            ps_pb2.CreateVariablesRequest(
                variables=[rq.spec_of(piece, psclient.SGD(learning_rate=1.0))],
                values=[ps_pb2.TensorChunk(name=first, dtype=ps_pb2.DTYPE_FLOAT32, shape=[piece.size],
                                           offset=0, data=b"\0" * 4 * piece.size)],
            )
        ]),
        timeout=30,
    )  # fmt: skip
    assert list(created.created) == [True]
    with psclient.PSClient(cluster.addresses, worker_id="w1", partition_bytes=64 << 10) as c:
        zeros = {n: np.zeros(shape, np.float32) for n, (shape, _) in specs.items()}
        created = c.create_many(zeros, optimizer=psclient.SGD(learning_rate=1.0))
        assert created == {n: n != first for n in specs}
        assert c.push({n: np.ones_like(v) for n, v in zeros.items()}) is True
    where: dict[str, list[int]] = {}
    for shard, stub in enumerate(raw_stubs):
        listed = stub.ListVariables(ps_pb2.ListVariablesRequest(names=list(specs)), timeout=30)
        for info in listed.variables:
            where.setdefault(info.spec.name, []).append(shard)
    assert where == {n: [batch[n][0].shard] for n in specs}
    with psclient.PSClient(cluster.addresses) as c:
        for name, value in c.pull(list(specs)).items():
            np.testing.assert_array_equal(value, np.full(sizes[name.rsplit("/", 1)[1]], -1.0, np.float32))


@pytest.mark.timeout(60)
def test_a_variable_left_partly_created_is_a_clear_error(
    cluster: LocalCluster, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    n = 64 << 10
    _create_piece(raw_stubs, var_name, n, 1)  # a creator that failed after one of its two shards
    with psclient.PSClient(cluster.addresses, timeout=1.0, partition_bytes=64 << 10) as c:
        for call in (lambda: c.pull([var_name]), lambda: c.create(var_name, np.zeros(n, np.float32))):
            with pytest.raises(psclient.NotFoundError, match=r"partly on the shards .* 1 of its 2 pieces"):
                call()  # after the client's timeout (the test's own bounds a hang)


@pytest.mark.timeout(60)
def test_a_variable_stored_on_two_shards_is_a_clear_error_not_two_copies(
    cluster: LocalCluster, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    """The same whole variable created on both shards (two workers that placed it apart): a client that
    finds it says so, instead of pushing into whichever copy it listed last while another worker pushes
    into the other."""
    value = np.zeros(16, np.float32)
    spec = ps_pb2.VariableSpec(
        name=var_name,
        dtype=ps_pb2.DTYPE_FLOAT32,
        shape=[16],
        optimizer=psclient.SGD(learning_rate=1.0).to_proto(),
    )
    chunk = ps_pb2.TensorChunk(name=var_name, dtype=ps_pb2.DTYPE_FLOAT32, shape=[16], offset=0,
                               data=value.tobytes())  # fmt: skip
    for stub in raw_stubs:
        request = ps_pb2.CreateVariablesRequest(variables=[spec], values=[chunk])
        assert list(stub.CreateVariables(iter([request]), timeout=30).created) == [True]
    twice = rf"{var_name!r} is stored twice: as {var_name!r} on shard 0 and as {var_name!r} on shard 1"
    with psclient.PSClient(cluster.addresses, worker_id="w0") as c:
        for call in (
            lambda: c.list_variables(),
            lambda: c.pull([var_name]),
            lambda: c.push({var_name: np.ones(16, np.float32)}),
            lambda: c.create(var_name, value, optimizer=psclient.SGD(learning_rate=1.0)),
        ):
            with pytest.raises(psclient.FailedPreconditionError, match=re.escape(twice)):
                call()
    for stub in raw_stubs:  # nothing was pushed into either copy
        pulled = stub.Pull(ps_pb2.PullRequest(names=[var_name]), timeout=30)
        assert [t.data for t in pulled.values] == [value.tobytes()]
