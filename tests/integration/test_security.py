"""Token auth, TLS and mutual TLS against real shard processes: who is accepted and who is refused.

Certificates are generated at run time (``cryptography``); no key is committed.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import psclient
from pscore import codec, security
from psproto.v1 import ps_pb2, ps_pb2_grpc
from trainer.cluster import LocalCluster

pytest.importorskip("cryptography")
from _certs import Pki, make_pki  # tests/_certs.py
from _support import CALL_TIMEOUT_S as TIMEOUT_S

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-token_0123456789"
REFUSED_TIMEOUT_S = 2.0  # a refused TLS handshake is retried (UNAVAILABLE) until this deadline


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def auth_cluster(token_file: Path) -> LocalCluster:
    with LocalCluster(2, ["--auth-token-file", str(token_file)]) as cluster:
        yield cluster


# -- token auth -----------------------------------------------------------------


def test_right_token_is_accepted(auth_cluster: LocalCluster) -> None:
    with psclient.PSClient(auth_cluster.addresses, "w0", auth_token=TOKEN, timeout=TIMEOUT_S) as c:
        c.create("auth/ok", np.zeros(3, np.float32), optimizer=psclient.SGD(1.0))
        assert c.push({"auth/ok": np.ones(3, np.float32)})
        np.testing.assert_array_equal(c.pull(["auth/ok"])["auth/ok"], -1)
        assert "auth/ok" in c.list_variables()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1], " " + TOKEN])
def test_missing_or_wrong_token_is_unauthenticated(auth_cluster: LocalCluster, token: str | None) -> None:
    with psclient.PSClient(auth_cluster.addresses, "w1", auth_token=token, timeout=TIMEOUT_S) as c:
        with pytest.raises(psclient.UnauthenticatedError, match="auth token"):
            c.list_variables()
        with pytest.raises(psclient.UnauthenticatedError):
            c.create("auth/never", np.zeros(3, np.float32))


def _stubs(address: str, metadata: tuple[tuple[str, str], ...]) -> dict[str, object]:
    """One call of every RPC kind (unary, client stream, server stream, bidi) with the given metadata."""
    ch = grpc.insecure_channel(address)
    stub = ps_pb2_grpc.ParameterServerStub(ch)
    push = ps_pb2.PushRequest(
        worker_id="intruder", seq=1, grads=[codec.encode("auth/ok", np.ones(3, np.float32))]
    )
    kw = {"metadata": metadata, "timeout": TIMEOUT_S}
    calls = {
        "Pull": lambda: stub.Pull(ps_pb2.PullRequest(), **kw),
        "Push": lambda: stub.Push(push, **kw),
        "GetStatus": lambda: stub.GetStatus(ps_pb2.GetStatusRequest(), **kw),
        "SaveCheckpoint": lambda: stub.SaveCheckpoint(ps_pb2.SaveCheckpointRequest(), **kw),
        "PrepareCut": lambda: stub.PrepareCut(ps_pb2.PrepareCutRequest(cut_id="c", hold_s=60), **kw),
        "ReleaseCut": lambda: stub.ReleaseCut(ps_pb2.ReleaseCutRequest(cut_id="c"), **kw),
        "ListVariables": lambda: stub.ListVariables(ps_pb2.ListVariablesRequest(), **kw),
        "CreateVariables": lambda: stub.CreateVariables(iter([ps_pb2.CreateVariablesRequest()]), **kw),
        "PullStream": lambda: list(stub.PullStream(ps_pb2.PullRequest(), **kw)),
        "PushStream": lambda: list(stub.PushStream(iter([push]), **kw)),
        "Unknown": lambda: ch.unary_unary("/psproto.v1.ParameterServer/Nope")(b"", **kw),
        "_channel": ch,
    }
    return calls


def test_every_rpc_kind_refuses_a_missing_token_and_changes_nothing(auth_cluster: LocalCluster) -> None:
    with psclient.PSClient(auth_cluster.addresses, "w2", auth_token=TOKEN, timeout=TIMEOUT_S) as c:
        c.create("auth/ok", np.zeros(3, np.float32), optimizer=psclient.SGD(1.0))
        before = c.pull_with_versions()
        for address in auth_cluster.addresses:
            calls = _stubs(address, (("authorization", "Bearer nope"),))
            ch = calls.pop("_channel")
            try:
                for name, call in calls.items():
                    with pytest.raises(grpc.RpcError) as err:
                        call()  # type: ignore[operator]
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                    assert TOKEN not in (err.value.details() or "")
            finally:
                ch.close()  # type: ignore[attr-defined]
        after = c.pull_with_versions()
    assert before[1] == after[1]
    for n in before[0]:
        np.testing.assert_array_equal(before[0][n], after[0][n])


def test_health_checks_need_no_token(auth_cluster: LocalCluster) -> None:
    with grpc.insecure_channel(auth_cluster.addresses[0]) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="psproto.v1.ParameterServer"), timeout=TIMEOUT_S
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_interceptor_compares_the_whole_header() -> None:
    icp = security.TokenAuthInterceptor("abc")
    assert icp.authorized([("authorization", "Bearer abc")])
    assert icp.authorized([("x-other", "1"), ("Authorization", b"Bearer abc")])
    for bad in ([], [("authorization", "Bearer ab")], [("authorization", "abc")], [("x", "Bearer abc")]):
        assert not icp.authorized(bad)
    with pytest.raises(ValueError):
        security.TokenAuthInterceptor("")


@pytest.mark.parametrize("content", [b"", b"  \n", b"two words", b"\xff\xfe"])
def test_bad_token_files_are_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "token"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="auth token"):
        security.read_token_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        security.read_token_file(tmp_path / "absent")


def test_a_shard_with_an_empty_token_file_does_not_start(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    from trainer.cluster import ClusterError

    with pytest.raises(ClusterError, match="empty"):
        LocalCluster(1, ["--auth-token-file", str(tmp_path / "token")]).start()


# -- TLS ------------------------------------------------------------------------


def _tls_args(pki: Pki, *, mutual: bool = False) -> list[str]:
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    return [*args, "--tls-client-ca", str(pki.ca)] if mutual else args


def _roundtrip(addresses: list[str], **kw: object) -> None:
    with psclient.PSClient(addresses, "tls", timeout=kw.pop("timeout", TIMEOUT_S), **kw) as c:  # type: ignore[arg-type]
        c.create("tls/v", np.zeros(4, np.float32), optimizer=psclient.SGD(1.0))
        c.push({"tls/v": np.ones(4, np.float32)})
        assert c.pull(["tls/v"])["tls/v"].shape == (4,)


def test_tls_accepts_a_client_that_trusts_the_ca_and_refuses_others(pki: Pki) -> None:
    with LocalCluster(1, _tls_args(pki)) as cluster:
        _roundtrip(cluster.addresses, tls_ca=str(pki.ca))
        with pytest.raises((psclient.UnavailableError, psclient.DeadlineExceededError)):
            _roundtrip(cluster.addresses, timeout=REFUSED_TIMEOUT_S)  # plaintext client
        with pytest.raises((psclient.UnavailableError, psclient.DeadlineExceededError)):
            _roundtrip(cluster.addresses, tls_ca=str(pki.rogue_ca), timeout=REFUSED_TIMEOUT_S)


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki: Pki) -> None:
    with LocalCluster(1, _tls_args(pki, mutual=True)) as cluster:
        _roundtrip(
            cluster.addresses, tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key)
        )
        with pytest.raises((psclient.UnavailableError, psclient.DeadlineExceededError)):
            _roundtrip(cluster.addresses, tls_ca=str(pki.ca), timeout=REFUSED_TIMEOUT_S)  # no client cert
        with pytest.raises((psclient.UnavailableError, psclient.DeadlineExceededError)):
            _roundtrip(
                cluster.addresses, tls_ca=str(pki.ca), tls_cert=str(pki.rogue_client_cert),
                tls_key=str(pki.rogue_client_key), timeout=REFUSED_TIMEOUT_S,
            )  # fmt: skip


def test_tls_and_token_together(pki: Pki, token_file: Path) -> None:
    with LocalCluster(1, [*_tls_args(pki), "--auth-token-file", str(token_file)]) as cluster:
        _roundtrip(cluster.addresses, tls_ca=str(pki.ca), auth_token=TOKEN)
        with pytest.raises(psclient.UnauthenticatedError):
            _roundtrip(cluster.addresses, tls_ca=str(pki.ca), auth_token="wrong")
