"""Integration: every error path gets a clear status naming the variable, changes nothing, and the shard
keeps serving (the ``cluster`` fixture also fails a test whose shard died)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
from _support import CALL_TIMEOUT_S as RPC_TIMEOUT_S

import psclient
from pscore import codec
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster

pytestmark = pytest.mark.timeout(60)

F32 = ps_pb2.DTYPE_FLOAT32


def _shard_of(client: psclient.PSClient, name: str) -> int:
    client.pull([name])  # make sure the registry knows it
    (piece,) = client._async.registry.pieces[name]
    return piece.shard


def _assert_unchanged(client: psclient.PSClient, name: str, value: np.ndarray, version: int) -> None:
    values, versions = client.pull_with_versions([name])
    np.testing.assert_array_equal(values[name], value)
    assert versions[name] == version


# -- through the client ---------------------------------------------------------------------------


def test_ps_errors_unknown_names_raise_not_found(client: psclient.PSClient, var_name: str) -> None:
    with pytest.raises(psclient.NotFoundError, match=f"{var_name}/nope"):
        client.pull([f"{var_name}/nope"])
    with pytest.raises(psclient.NotFoundError, match=f"{var_name}/nope"):
        client.push({f"{var_name}/nope": np.zeros(1, np.float32)})


@pytest.mark.parametrize(
    ("grad", "match"),
    [(np.ones((3, 2), np.float32), "shape"), (np.ones((2, 3), np.float64), "dtype")],
    ids=["shape", "dtype"],
)
def test_ps_errors_client_side_shape_and_dtype_mismatch(
    client: psclient.PSClient, var_name: str, grad: np.ndarray, match: str
) -> None:
    client.create(var_name, np.ones((2, 3), np.float32))
    with pytest.raises(psclient.InvalidArgumentError, match=match) as info:
        client.push({var_name: grad})
    assert var_name in str(info.value)
    _assert_unchanged(client, var_name, np.ones((2, 3)), 0)


def test_ps_errors_an_unsupported_dtype_is_an_invalid_argument_ps_error(
    client: psclient.PSClient, var_name: str
) -> None:
    # Caught on the client, before anything is sent: a PSError like every error of a client call.
    with pytest.raises(psclient.InvalidArgumentError, match="complex64") as info:
        client.create(var_name, np.ones(2, np.complex64))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and var_name in str(info.value)
    with pytest.raises(psclient.NotFoundError):
        client.pull([var_name])  # nothing was created


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_ps_errors_non_finite_gradients_are_rejected_by_default(
    client: psclient.PSClient, var_name: str, bad: float
) -> None:
    other = f"{var_name}/other"
    client.create_many({var_name: np.ones(4, np.float32), other: np.ones(4, np.float32)})
    grad = np.array([0, bad, 0, 0], np.float32)
    with pytest.raises(psclient.InvalidArgumentError, match="non-finite") as info:
        client.push({var_name: grad})
    assert var_name in str(info.value) and "--allow-non-finite" in str(info.value)
    _assert_unchanged(client, var_name, np.ones(4), 0)
    assert client.push({other: np.zeros(4, np.float32)})  # still serving


def test_ps_errors_allow_non_finite_flag_applies_them(
    make_cluster: Callable[..., LocalCluster], var_name: str
) -> None:
    cluster = make_cluster(num_shards=1, server_args=["--allow-non-finite"])
    with psclient.PSClient(cluster.addresses) as c:
        c.create(var_name, np.ones(3, np.float32), optimizer=psclient.SGD(1.0))
        assert c.push({var_name: np.array([np.nan, np.inf, 1], np.float32)})
        value = c.pull([var_name])[var_name]
    assert np.isnan(value[0]) and value[1] == -np.inf and value[2] == 0


# -- malformed requests through the raw generated stub -------------------------------------------


def _chunk(name: str, **overrides: object) -> ps_pb2.TensorChunk:
    fields: dict[str, object] = {"name": name, "dtype": F32, "shape": [2, 3], "offset": 0, "data": b"\0" * 24}
    fields.update(overrides)
    return ps_pb2.TensorChunk(**fields)  # type: ignore[arg-type]


MALFORMED: dict[str, tuple[Callable[[str], list[ps_pb2.TensorChunk]], str]] = {
    "byte-count": (lambda n: [_chunk(n, data=b"\0" * 23)], "whole number"),
    "short": (lambda n: [_chunk(n, data=b"\0" * 20)], "received 5 of 6"),
    "unknown-dtype": (lambda n: [_chunk(n, dtype=77)], "dtype"),
    "unspecified-dtype": (lambda n: [_chunk(n, dtype=ps_pb2.DTYPE_UNSPECIFIED)], "dtype"),
    "wrong-dtype": (lambda n: [_chunk(n, dtype=ps_pb2.DTYPE_INT32)], "dtype"),
    "offset-past-end": (lambda n: [_chunk(n, offset=4, data=b"\0" * 12)], "outside"),
    "negative-offset": (lambda n: [_chunk(n, offset=-1, data=b"\0" * 4)], "outside"),
    "negative-shape": (lambda n: [_chunk(n, shape=[-2, -3])], "negative"),
    "wrong-shape": (lambda n: [_chunk(n, shape=[3, 2])], "shape"),
    "huge-shape": (lambda n: [_chunk(n, shape=[1 << 31, 1 << 31], data=b"\0" * 4)], "shape"),
    "twice": (lambda n: [_chunk(n), _chunk(n)], "more elements"),
    "overlap": (
        lambda n: [
            _chunk(n, data=b"\0" * 12),
            _chunk(n, offset=1, data=b"\0" * 8),
            _chunk(n, offset=5, data=b"\0" * 4),
        ],
        "twice",
    ),
}


def _push_unary(stub: ps_pb2_grpc.ParameterServerStub, chunks: list[ps_pb2.TensorChunk]) -> None:
    stub.Push(ps_pb2.PushRequest(worker_id="raw", seq=1, grads=chunks), timeout=RPC_TIMEOUT_S)


def _push_stream(stub: ps_pb2_grpc.ParameterServerStub, chunks: list[ps_pb2.TensorChunk]) -> None:
    """One chunk per message; the header rides on the first."""
    messages = [ps_pb2.PushRequest(worker_id="raw", seq=2, grads=chunks[:1])]
    messages += [ps_pb2.PushRequest(grads=[c]) for c in chunks[1:]]
    list(stub.PushStream(iter(messages), timeout=RPC_TIMEOUT_S))


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_ps_errors_malformed_push_is_invalid_argument_and_changes_nothing(
    client: psclient.PSClient, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str, case: str
) -> None:
    client.create(var_name, np.full((2, 3), 7, np.float32), optimizer=psclient.SGD(1.0))
    stub = raw_stubs[_shard_of(client, var_name)]
    chunks, match = MALFORMED[case]
    for call in (_push_unary, _push_stream):
        with pytest.raises(grpc.RpcError) as info:
            call(stub, chunks(var_name))
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert var_name in err.details(), err.details()
        assert match in err.details(), err.details()
    _assert_unchanged(client, var_name, np.full((2, 3), 7), 0)
    assert client.push({var_name: np.ones((2, 3), np.float32)})  # the shard keeps serving
    _assert_unchanged(client, var_name, np.full((2, 3), 6), 1)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_ps_errors_push_without_worker_id_is_invalid(
    client: psclient.PSClient, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str, stream: bool
) -> None:
    client.create(var_name, np.zeros((2, 3), np.float32))
    stub = raw_stubs[_shard_of(client, var_name)]
    request = ps_pb2.PushRequest(
        worker_id="", seq=1, grads=[codec.encode(var_name, np.ones((2, 3), np.float32))]
    )
    with pytest.raises(grpc.RpcError) as info:
        if stream:
            list(stub.PushStream(iter([request]), timeout=RPC_TIMEOUT_S))
        else:
            stub.Push(request, timeout=RPC_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "worker_id" in info.value.details()
    _assert_unchanged(client, var_name, np.zeros((2, 3)), 0)


def test_ps_errors_an_empty_push_is_a_push_and_an_empty_stream_is_invalid(
    raw_stubs: list[ps_pb2_grpc.ParameterServerStub],
) -> None:
    # A push with no gradients (a part of a push in parts, or ``every_shard``, with nothing for this shard) is
    # applied as a push that changes nothing, in every mode: claimed once, its retry a duplicate.
    first = raw_stubs[0].Push(ps_pb2.PushRequest(worker_id="raw-empty", seq=1), timeout=RPC_TIMEOUT_S)
    assert first.applied
    again = raw_stubs[0].Push(ps_pb2.PushRequest(worker_id="raw-empty", seq=1), timeout=RPC_TIMEOUT_S)
    assert not again.applied and again.reason == "duplicate"
    with pytest.raises(grpc.RpcError) as info:  # no header at all
        list(raw_stubs[0].PushStream(iter([]), timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_ps_errors_raw_pull_of_unknown_name_is_not_found(
    raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    for call in (raw_stubs[0].Pull, lambda r, **kw: list(raw_stubs[0].PullStream(r, **kw))):
        with pytest.raises(grpc.RpcError) as info:
            call(ps_pb2.PullRequest(names=[var_name]), timeout=RPC_TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert var_name in info.value.details()


def test_ps_errors_raw_create_with_garbage_is_invalid(
    client: psclient.PSClient, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    spec = ps_pb2.VariableSpec(name=var_name, dtype=F32, shape=[2, 3], optimizer=psclient.SGD().to_proto())
    cases = [
        [_chunk(var_name, data=b"\0" * 5)],
        [_chunk(var_name, shape=[-2, 3])],
        [_chunk(var_name, dtype=55)],
        [],  # no value at all
    ]
    for values in cases:
        with pytest.raises(grpc.RpcError) as info:
            raw_stubs[0].CreateVariables(
                iter([ps_pb2.CreateVariablesRequest(variables=[spec], values=values)]), timeout=RPC_TIMEOUT_S
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert var_name in info.value.details(), info.value.details()
    with pytest.raises(psclient.NotFoundError):
        client.pull([var_name])  # nothing was created


def test_ps_errors_retried_push_with_same_seq_is_applied_once(
    client: psclient.PSClient, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    client.create(var_name, np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
    stub = raw_stubs[_shard_of(client, var_name)]
    request = ps_pb2.PushRequest(
        worker_id="retry-w", seq=42, grads=[codec.encode(var_name, np.ones(4, np.float32))]
    )
    first = stub.Push(request, timeout=RPC_TIMEOUT_S)
    second = stub.Push(request, timeout=RPC_TIMEOUT_S)
    third = list(stub.PushStream(iter([request]), timeout=RPC_TIMEOUT_S))
    assert first.applied and not second.applied and second.reason == "duplicate"
    assert [r.applied for r in third] == [False]
    _assert_unchanged(client, var_name, -np.ones(4), 1)
    other = ps_pb2.PushRequest(worker_id="retry-w", seq=43, grads=request.grads)
    assert stub.Push(other, timeout=RPC_TIMEOUT_S).applied
    _assert_unchanged(client, var_name, -2 * np.ones(4), 2)


def test_ps_errors_a_failed_push_can_be_retried_with_the_same_seq(
    client: psclient.PSClient, raw_stubs: list[ps_pb2_grpc.ParameterServerStub], var_name: str
) -> None:
    client.create(var_name, np.zeros(2, np.float32), optimizer=psclient.SGD(1.0))
    stub = raw_stubs[_shard_of(client, var_name)]
    bad = ps_pb2.PushRequest(
        worker_id="w", seq=1, grads=[codec.encode(var_name, np.array([np.nan, 0], np.float32))]
    )
    with pytest.raises(grpc.RpcError):
        stub.Push(bad, timeout=RPC_TIMEOUT_S)
    good = ps_pb2.PushRequest(worker_id="w", seq=1, grads=[codec.encode(var_name, np.ones(2, np.float32))])
    assert stub.Push(good, timeout=RPC_TIMEOUT_S).applied
    _assert_unchanged(client, var_name, -np.ones(2), 1)


def test_ps_errors_all_or_nothing_across_variables_of_one_shard(
    make_cluster: Callable[..., LocalCluster], var_name: str
) -> None:
    cluster = make_cluster(num_shards=1)
    a, b = f"{var_name}/a", f"{var_name}/b"
    with psclient.PSClient(cluster.addresses) as c:
        c.create_many({a: np.zeros(2, np.float32), b: np.zeros(2, np.float32)}, optimizer=psclient.SGD(1.0))
        with pytest.raises(psclient.InvalidArgumentError, match=b):
            c.push({a: np.ones(2, np.float32), b: np.array([1, np.nan], np.float32)})
        values, versions = c.pull_with_versions([a, b])
    np.testing.assert_array_equal(values[a], 0)
    assert versions == {a: 0, b: 0}
