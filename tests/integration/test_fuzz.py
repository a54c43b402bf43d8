"""Fuzzing every RPC of a real shard with malformed messages and tensors (hypothesis, bounded).

Two kinds of input per RPC: random bytes as the serialized request (the shard
must parse or refuse them), and well-formed protobufs with hostile contents
(unknown dtypes, negative or huge shapes and offsets, byte counts that do not
match, NaN, unknown optimizers, partitions out of range, duplicate names).

After every call: the shard still serves, the status is one of the documented
codes (never UNKNOWN, which would be an unhandled exception), and, when the
call was refused, every variable's value, version and spec is unchanged.
Every RPC of the service gets random bytes (the list comes from its
descriptor); Push, Pull, CreateVariables, Lookup, row pushes, Assign and
UpdateOptimizer also get hostile protobufs. Bounded: about 440 examples in
all, no deadline per example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as TIMEOUT_S
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import psclient
from pscore import embedding, rpc
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples on every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
# Request bytes that do not parse are INVALID_ARGUMENT (pscore.security.MalformedRequestInterceptor).
ALLOWED_RAW = ALLOWED
# Consistent cuts: ABORTED for a cut the shard does not hold (or another one holds it).
ALLOWED_BY_METHOD = {"PrepareCut": {grpc.StatusCode.ABORTED}, "CommitCut": {grpc.StatusCode.ABORTED}}
# Every RPC of the service, from its descriptor: a new RPC is fuzzed without a change here.
# (Replicate: a fuzzed "backup" is attached, sent the snapshot, detached at half-close.)
METHODS = {m.name: m.kind for m in rpc.methods()}
TABLE = "fz/emb"
TABLE_PIECE = "fz/emb/rows_0"
KNOWN = [
    "fz/a", "fz/b", "fz/big/part_0", "fz/big/part_1", "fz/big", TABLE, TABLE_PIECE,
    embedding.ids_name(TABLE_PIECE), embedding.values_name(TABLE_PIECE),
]  # fmt: skip


class Shard:
    """A 1-shard cluster with known variables, a raw channel, and a view of its state."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.channel = grpc.insecure_channel(cluster.addresses[0])
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        self.baseline = self.state()

    def state(self) -> dict[str, tuple[bytes, int, bytes]]:
        """name -> (value bytes, version, spec bytes): everything a refused call must leave alone."""
        listed = self.stub.ListVariables(
            ps_pb2.ListVariablesRequest(), timeout=TIMEOUT_S, wait_for_ready=True
        )
        pulled = self.stub.Pull(ps_pb2.PullRequest(), timeout=TIMEOUT_S)
        values = {c.name: c.data for c in pulled.values}
        return {
            i.spec.name: (values[i.spec.name], i.version, i.spec.SerializeToString(deterministic=True))
            for i in listed.variables
        }

    def call(self, method: str, request: Any) -> grpc.StatusCode:
        """Sends ``request`` (a message, a list of messages, or raw bytes) and returns the status code."""
        kind = METHODS[method]
        path = f"/psproto.v1.ParameterServer/{method}"
        raw = isinstance(request, bytes) or (
            isinstance(request, list) and request and isinstance(request[0], bytes)
        )
        ser = None if raw else (lambda m: m.SerializeToString())
        rpc = getattr(self.channel, kind)(path, request_serializer=ser, response_deserializer=None)
        try:
            if kind == "unary_unary":
                rpc(request, timeout=TIMEOUT_S)
            elif kind == "unary_stream":
                for _ in rpc(request, timeout=TIMEOUT_S):
                    pass
            elif kind == "stream_unary":
                rpc(iter(request), timeout=TIMEOUT_S)
            else:
                for _ in rpc(iter(request), timeout=TIMEOUT_S):
                    pass
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    def check(self, method: str, code: grpc.StatusCode, allowed: set[grpc.StatusCode]) -> None:
        assert self.cluster.procs[0].poll() is None, f"shard died on {method}:\n{self.cluster.log_tail(0)}"
        assert code in allowed, f"{method} answered {code}:\n{self.cluster.log_tail(0)}"
        now = self.state()
        if code == grpc.StatusCode.OK:
            self.baseline = now  # an accepted call may change state
            return
        assert now == self.baseline, f"refused {method} ({code.name}) changed the shard's state"


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    ck = tmp_path_factory.mktemp("fuzz-ck")
    with LocalCluster(1, ["--checkpoint-dir", str(ck)]) as cluster:
        with psclient.PSClient(cluster.addresses, "setup", timeout=TIMEOUT_S, partition_bytes=1024) as c:
            c.create_many(
                {"fz/a": np.arange(12, dtype=np.float32).reshape(3, 4), "fz/b": np.ones(5, np.float64)},
                optimizer=psclient.Adam(1e-3),
            )
            c.create("fz/big", np.zeros(600, np.float32), optimizer=psclient.SGD(0.1, momentum=0.9))
            c.create_embedding(TABLE, 10, 4, optimizer=psclient.Adagrad(0.1))
        s = Shard(cluster)
        assert len(s.baseline) == 4 and TABLE_PIECE in s.baseline
        try:
            yield s
        finally:
            s.channel.close()


# -- strategies -------------------------------------------------------------------

names = st.one_of(st.sampled_from(KNOWN), st.text(max_size=12), st.just(""), st.just("\x00"))
dtypes = st.integers(min_value=-2, max_value=12)
dims = st.one_of(st.integers(-3, 16), st.sampled_from([600, 2**31, 2**40, 2**62, -(2**63)]))
shapes = st.lists(dims, max_size=4)
offsets = st.one_of(st.integers(-5, 700), st.sampled_from([2**40, 2**63 - 1, -(2**63)]))
special = st.sampled_from(
    [
        b"",
        np.full(3, np.nan, np.float32).tobytes(),
        np.full(12, np.inf, np.float32).tobytes(),
        np.ones(12, np.float32).tobytes()[:-1],
        np.ones(5, np.float64).tobytes(),
    ]
)
datas = st.one_of(st.binary(max_size=64), special)


@st.composite
def chunks(draw: Callable[..., Any]) -> ps_pb2.TensorChunk:
    return ps_pb2.TensorChunk(
        name=draw(names), dtype=draw(dtypes), shape=draw(shapes), offset=draw(offsets), data=draw(datas)
    )


@st.composite
def push_requests(draw: Callable[..., Any]) -> ps_pb2.PushRequest:
    return ps_pb2.PushRequest(
        worker_id=draw(st.one_of(st.just("fuzz"), st.text(max_size=8))),
        seq=draw(st.integers(0, 2**64 - 1)),
        step=draw(st.integers(-(2**63), 2**63 - 1)),
        grads=draw(st.lists(chunks(), max_size=3)),
        return_values=draw(st.booleans()),
    )


@st.composite
def pull_requests(draw: Callable[..., Any]) -> ps_pb2.PullRequest:
    return ps_pb2.PullRequest(
        names=draw(st.lists(names, max_size=3)),
        worker_id=draw(st.text(max_size=8)),
        step=draw(st.integers(-(2**63), 2**63 - 1)),
        max_chunk_bytes=draw(st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, 1, 7, 4096]))),
    )


@st.composite
def specs(draw: Callable[..., Any]) -> ps_pb2.VariableSpec:
    spec = ps_pb2.VariableSpec(
        name=draw(names),
        dtype=draw(dtypes),
        shape=draw(shapes),
        optimizer=ps_pb2.OptimizerSpec(
            name=draw(st.sampled_from(["sgd", "adam", "adagrad", "rmsprop", "", "lion"])),
            params=draw(
                st.dictionaries(
                    st.sampled_from(["learning_rate", "momentum", "beta_1", "epsilon", "rho", "bogus"]),
                    st.floats(allow_nan=True, allow_infinity=True),
                    max_size=3,
                )
            ),
        ),
    )
    if draw(st.booleans()):
        spec.partition.CopyFrom(
            ps_pb2.Partition(
                variable=draw(names),
                full_shape=draw(shapes),
                index=draw(st.integers(-2, 3)),
                count=draw(st.integers(-1, 3)),
                offset=draw(offsets),
            )
        )
    return spec


@st.composite
def create_streams(draw: Callable[..., Any]) -> list[ps_pb2.CreateVariablesRequest]:
    return draw(
        st.lists(
            st.builds(
                lambda v, c: ps_pb2.CreateVariablesRequest(variables=v, values=c),
                st.lists(specs(), max_size=2),
                st.lists(chunks(), max_size=2),
            ),
            max_size=3,
        )
    )


id_datas = st.one_of(
    datas,
    st.sampled_from(
        [
            np.array([0, 3, 9], np.int64).tobytes(),
            np.array([-1], np.int64).tobytes(),
            np.array([10], np.int32).tobytes(),
            np.array([2**62], np.int64).tobytes(),
            np.array([1.5], np.float32).tobytes(),
        ]
    ),
)


@st.composite
def id_chunks(draw: Callable[..., Any]) -> ps_pb2.TensorChunk:
    """Ids of a table piece: mostly its name and an integer dtype, hostile in any field."""
    return ps_pb2.TensorChunk(
        name=draw(st.one_of(st.just(TABLE_PIECE), names)),
        dtype=draw(st.one_of(st.sampled_from([ps_pb2.DTYPE_INT64, ps_pb2.DTYPE_INT32]), dtypes)),
        shape=draw(st.one_of(st.just([3]), st.just([1]), shapes)),
        offset=draw(st.one_of(st.just(0), offsets)),
        data=draw(id_datas),
    )


@st.composite
def optimizer_updates(draw: Callable[..., Any]) -> ps_pb2.UpdateOptimizerRequest:
    request = ps_pb2.UpdateOptimizerRequest(
        names=draw(st.lists(names, max_size=3)),
        params=draw(
            st.dictionaries(
                st.sampled_from(["learning_rate", "momentum", "beta_1", "epsilon", "bogus", ""]),
                st.floats(allow_nan=True, allow_infinity=True),
                max_size=3,
            )
        ),
        reset=draw(st.booleans()),
    )
    if draw(st.booleans()):
        request.optimizer.CopyFrom(draw(specs()).optimizer)
    return request


def _check_raw(shard: Shard, method: str, payload: Any) -> None:
    shard.check(method, shard.call(method, payload), ALLOWED_RAW | ALLOWED_BY_METHOD.get(method, set()))
    if method == "PrepareCut" and isinstance(payload, bytes):  # a hold that parsed: end it, as its
        try:  # coordinator would (the shard also ends it by itself, after up to 300 s)
            cut_id = ps_pb2.PrepareCutRequest.FromString(payload).cut_id
        except Exception:  # protobuf's DecodeError: nothing was held
            return
        shard.stub.ReleaseCut(ps_pb2.ReleaseCutRequest(cut_id=cut_id), timeout=TIMEOUT_S)


# -- the fuzz runs ------------------------------------------------------------------


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(max_size=256), n=st.integers(1, 3))
def test_fuzz_raw_bytes_to_every_rpc(shard: Shard, method: str, payload: bytes, n: int) -> None:
    streaming_request = METHODS[method].startswith("stream")
    _check_raw(shard, method, [payload] * n if streaming_request else payload)


@FUZZ
@given(request=push_requests(), streamed=st.booleans())
def test_fuzz_push(shard: Shard, request: ps_pb2.PushRequest, streamed: bool) -> None:
    if streamed:
        rest = [ps_pb2.PushRequest(grads=[g]) for g in request.grads[1:]]
        del request.grads[1:]
        shard.check("PushStream", shard.call("PushStream", [request, *rest]), ALLOWED)
    else:
        shard.check("Push", shard.call("Push", request), ALLOWED)


@FUZZ
@given(request=pull_requests(), streamed=st.booleans())
def test_fuzz_pull(shard: Shard, request: ps_pb2.PullRequest, streamed: bool) -> None:
    method = "PullStream" if streamed else "Pull"
    shard.check(method, shard.call(method, request), ALLOWED)


@FUZZ
@given(stream=create_streams())
def test_fuzz_create_variables(shard: Shard, stream: list[ps_pb2.CreateVariablesRequest]) -> None:
    shard.check("CreateVariables", shard.call("CreateVariables", stream), ALLOWED)


@settings(FUZZ, max_examples=20)
@given(
    names_=st.lists(names, max_size=4),
    which=st.sampled_from(["ListVariables", "GetStatus", "SaveCheckpoint"]),
)
def test_fuzz_list_status_save(shard: Shard, names_: list[str], which: str) -> None:
    request = {
        "ListVariables": ps_pb2.ListVariablesRequest(names=names_),
        "GetStatus": ps_pb2.GetStatusRequest(),
        "SaveCheckpoint": ps_pb2.SaveCheckpointRequest(),
    }[which]
    shard.check(which, shard.call(which, request), ALLOWED)


@FUZZ
@given(
    ids=st.lists(id_chunks(), max_size=3), worker=st.text(max_size=8), step=st.integers(-(2**63), 2**63 - 1)
)
def test_fuzz_lookup(shard: Shard, ids: list[ps_pb2.TensorChunk], worker: str, step: int) -> None:
    request = ps_pb2.LookupRequest(ids=ids, worker_id=worker, step=step)
    shard.check("Lookup", shard.call("Lookup", request), ALLOWED)


@FUZZ
@given(ids=id_chunks(), values=chunks(), seq=st.integers(0, 2**64 - 1))
def test_fuzz_row_push(shard: Shard, ids: ps_pb2.TensorChunk, values: ps_pb2.TensorChunk, seq: int) -> None:
    # A row gradient travels as two tensors named by embedding.ids_name / values_name of the piece.
    if ids.name == TABLE_PIECE:
        ids.name = embedding.ids_name(TABLE_PIECE)
    if values.name in (TABLE, TABLE_PIECE):
        values.name = embedding.values_name(TABLE_PIECE)
    request = ps_pb2.PushRequest(worker_id="fuzz-rows", seq=seq, grads=[ids, values])
    shard.check("Push", shard.call("Push", request), ALLOWED)


assigns = st.builds(lambda c: ps_pb2.AssignRequest(values=c), st.lists(chunks(), max_size=2))


@FUZZ
@given(stream=st.lists(assigns, max_size=3))
def test_fuzz_assign(shard: Shard, stream: list[ps_pb2.AssignRequest]) -> None:
    shard.check("Assign", shard.call("Assign", stream), ALLOWED)


@FUZZ
@given(request=optimizer_updates())
def test_fuzz_update_optimizer(shard: Shard, request: ps_pb2.UpdateOptimizerRequest) -> None:
    shard.check("UpdateOptimizer", shard.call("UpdateOptimizer", request), ALLOWED)


def test_fuzzed_shard_still_trains(shard: Shard) -> None:
    with psclient.PSClient(shard.cluster.addresses, "after-fuzz", timeout=TIMEOUT_S) as c:
        # A fuzzed UpdateOptimizer may have legitimately set any optimizer or a rate of 0: start over.
        c.replace_optimizer(psclient.SGD(0.5), ["fz/a"])
        before = c.pull(["fz/a"])["fz/a"]
        assert c.push({"fz/a": np.ones((3, 4), np.float32)})
        assert not np.array_equal(c.pull(["fz/a"])["fz/a"], before)
    assert "Traceback" not in shard.cluster.log_tail(0, 10_000)
