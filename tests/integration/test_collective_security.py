"""Token auth, TLS and mutual TLS on the ring's Collective service (AsyncRing ranks on one event loop).

A refused rank must fail with a typed error within its deadline, never hang.
Certificates are generated at run time (``tests/_certs.py``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _rings import async_rings

from pscore.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    PSError,
    UnauthenticatedError,
    UnavailableError,
)

pytest.importorskip("cryptography")
from _certs import Pki, make_pki  # tests/_certs.py

pytestmark = pytest.mark.timeout(120)

REFUSED_TIMEOUT_S = 2.0  # a refused handshake is retried until the operation's deadline
REFUSED = (DeadlineExceededError, UnavailableError)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("ring-pki"))


def tls(pki: Pki, *, mutual: bool = False) -> dict[str, Any]:
    """A rank's TLS options: the loopback server pair is also each rank's client certificate."""
    opts: dict[str, Any] = {
        "tls_ca": str(pki.ca),
        "tls_cert": str(pki.server_cert),
        "tls_key": str(pki.server_key),
    }
    return {**opts, "tls_client_ca": str(pki.ca)} if mutual else opts


async def run_ops(rings: list[Any]) -> list[Any]:
    """One all-reduce and one all-gather on every rank; results or exceptions."""
    outs = await asyncio.gather(
        *(ring.allreduce(np.full(3, r + 1.0, np.float32)) for r, ring in enumerate(rings)),
        return_exceptions=True,
    )
    if any(isinstance(o, BaseException) for o in outs):
        return list(outs)
    gathered = await asyncio.gather(*(ring.allgather(np.array([r])) for r, ring in enumerate(rings)))
    for g in gathered:
        np.testing.assert_array_equal(g, np.arange(len(rings)))
    return list(outs)


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
@pytest.mark.parametrize("mutual", [False, True])
async def test_tls_ring_works(pki: Pki, mutual: bool, transport: str) -> None:
    async with asyncio.timeout(30), async_rings(3, transport=transport, **tls(pki, mutual=mutual)) as rings:
        assert all(ring.config.tls for ring in rings)
        outs = await run_ops(rings)
    for out in outs:
        np.testing.assert_array_equal(out, np.full(3, 6.0, np.float32))


async def test_tls_and_token_together(pki: Pki) -> None:
    async with asyncio.timeout(30), async_rings(2, auth_token="s3cret", **tls(pki, mutual=True)) as rings:
        outs = await run_ops(rings)
    for out in outs:
        np.testing.assert_array_equal(out, np.full(3, 3.0, np.float32))


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_matching_auth_token_works(transport: str) -> None:
    async with asyncio.timeout(30), async_rings(2, auth_token="s3cret", transport=transport) as rings:
        outs = await asyncio.gather(*(ring.allgather(np.array([r])) for r, ring in enumerate(rings)))
    for out in outs:
        np.testing.assert_array_equal(out, [0, 1])


@pytest.mark.parametrize(
    ("token", "transport"), [(None, "grpc"), ("other", "grpc"), ("s3cret ", "grpc"), ("other", "tcp")]
)
async def test_wrong_or_missing_auth_token_is_unauthenticated(token: str | None, transport: str) -> None:
    per_rank = [{"auth_token": token}, {"auth_token": "s3cret"}]
    async with (
        asyncio.timeout(30),
        async_rings(2, timeout=REFUSED_TIMEOUT_S, per_rank=per_rank, transport=transport) as rings,
    ):
        results = await asyncio.gather(*(ring.barrier() for ring in rings), return_exceptions=True)
    # Rank 0 sends to rank 1, which refuses it; rank 0's error names rank 1.
    assert isinstance(results[0], UnauthenticatedError), results
    assert "on rank 0" in str(results[0]) and "rank 1 " in str(results[0]), results[0]
    assert "s3cret" not in str(results[0])
    assert isinstance(results[1], PSError), results


async def test_wrong_and_missing_token_with_tls(pki: Pki) -> None:
    per_rank = [{"auth_token": "wrong"}, {}]
    async with (
        asyncio.timeout(30),
        async_rings(
            2, timeout=REFUSED_TIMEOUT_S, auth_token="s3cret", per_rank=per_rank, **tls(pki)
        ) as rings,
    ):
        results = await asyncio.gather(*(ring.barrier() for ring in rings), return_exceptions=True)
    assert isinstance(results[0], UnauthenticatedError), results
    assert isinstance(results[1], PSError), results


def _refused(results: list[Any]) -> None:
    """Every rank fails with a typed error (no hang, no success); each names its own rank."""
    for r, res in enumerate(results):
        assert isinstance(res, PSError), (r, results)
        assert f"on rank {r}" in str(res), (r, res)
    assert any(isinstance(res, REFUSED) for res in results), results


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_rank_trusting_the_wrong_ca_fails_in_time(pki: Pki, transport: str) -> None:
    per_rank = [{"tls_ca": str(pki.rogue_ca)}, {}, {}]
    async with (
        asyncio.timeout(30),
        async_rings(
            3, timeout=REFUSED_TIMEOUT_S, per_rank=per_rank, transport=transport, **tls(pki)
        ) as rings,
    ):
        results = await run_ops(rings)
    _refused(results)
    # Rank 0 cannot verify rank 1's certificate, so it never gets its stream to rank 1 going.
    assert isinstance(results[0], REFUSED) and "rank 1" in str(results[0]), results[0]


async def test_plaintext_rank_in_a_mutual_tls_ring_fails_in_time(pki: Pki) -> None:
    per_rank = [{"tls_ca": None, "tls_cert": None, "tls_key": None, "tls_client_ca": None}, {}, {}]
    async with (
        asyncio.timeout(30),
        async_rings(3, timeout=REFUSED_TIMEOUT_S, per_rank=per_rank, **tls(pki, mutual=True)) as rings,
    ):
        results = await run_ops(rings)
    _refused(results)
    assert isinstance(results[0], REFUSED) and "rank 1" in str(results[0]), results[0]


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_rank_with_a_certificate_from_another_ca_is_refused_under_mutual_tls(
    pki: Pki, transport: str
) -> None:
    rogue = {"tls_cert": str(pki.rogue_client_cert), "tls_key": str(pki.rogue_client_key)}
    async with (
        asyncio.timeout(30),
        async_rings(
            3,
            timeout=REFUSED_TIMEOUT_S,
            per_rank=[rogue, {}, {}],
            transport=transport,
            **tls(pki, mutual=True),
        ) as rings,
    ):
        results = await run_ops(rings)
    _refused(results)
    # Rank 1 refuses rank 0's client certificate; rank 2 refuses rank 0's server certificate.
    assert isinstance(results[0], REFUSED) and "rank 1" in str(results[0]), results[0]
    assert isinstance(results[2], REFUSED) and "rank 0" in str(results[2]), results[2]


async def test_unreadable_tls_file_is_a_value_error_before_binding(tmp_path: Path, pki: Pki) -> None:
    opts = {**tls(pki), "tls_key": str(tmp_path / "absent.key")}
    with pytest.raises(ValueError, match="cannot read TLS key"):
        async with async_rings(1, **opts):
            pass


async def test_tcp_data_port_refuses_a_connection_without_a_nonce_from_the_token_guarded_call() -> None:
    async with asyncio.timeout(30), async_rings(2, auth_token="s3cret", transport="tcp") as rings:
        data = rings[1]._data  # private: the data port is advertised only by the DataPort call
        assert data is not None
        port = data.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"PSRING1\n" + bytes(16) + (0).to_bytes(4, "little"))  # a forged nonce, rank 0
        await writer.drain()
        assert await asyncio.wait_for(reader.read(1), 10.0) == b""  # closed without the ack
        writer.close()
        outs = await run_ops(rings)  # the ring itself is unaffected
    for out in outs:
        np.testing.assert_array_equal(out, np.full(3, 3.0, np.float32))


async def test_tcp_data_port_of_a_tls_ring_speaks_only_tls(pki: Pki) -> None:
    import ssl

    async with asyncio.timeout(60), async_rings(2, transport="tcp", timeout=10.0, **tls(pki)) as rings:
        data = rings[1]._data  # private: the data port is advertised only by the DataPort call
        assert data is not None
        hello = b"PSRING1\n"
        # A plaintext hello, even with a valid nonce, is not TLS: closed without the ack.
        reader, writer = await asyncio.open_connection("127.0.0.1", data.port)
        writer.write(hello + data.issue_nonce() + (0).to_bytes(4, "little"))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(1), 10.0) == b""
        writer.close()
        # The same over TLS (verifying the rank's certificate) is acknowledged.
        context = ssl.create_default_context(cafile=str(pki.ca))
        reader, writer = await asyncio.open_connection("127.0.0.1", data.port, ssl=context)
        writer.write(hello + data.issue_nonce() + (0).to_bytes(4, "little"))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(1), 10.0) == b"\x01"
        writer.close()  # it took the place of rank 0's connection, and is gone: rank 1 waits for the next
        outs = await run_ops(rings)
    for out in outs:
        np.testing.assert_array_equal(out, np.full(3, 3.0, np.float32))


async def test_tcp_ring_goes_on_when_its_data_connection_is_replaced_and_closed() -> None:
    """A data connection that ends between frames is replaced by the previous rank's next one.

    Before this was handled, rank 1 failed at once on the stale connection while rank 0 timed out,
    and the two stayed out of step: every later operation failed too.
    """
    async with asyncio.timeout(60), async_rings(2, transport="tcp", timeout=10.0) as rings:
        data = rings[1]._data  # private: the data port is advertised only by the DataPort call
        assert data is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", data.port)
        writer.write(b"PSRING1\n" + data.issue_nonce() + (0).to_bytes(4, "little"))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(1), 10.0) == b"\x01"  # rank 1's current connection
        writer.close()  # and gone: rank 1 waits for rank 0's
        for _ in range(3):
            outs = await run_ops(rings)
            for out in outs:
                np.testing.assert_array_equal(out, np.full(3, 3.0, np.float32))


async def test_mixed_transports_fail_with_a_typed_error_naming_the_transport() -> None:
    per_rank = [{"transport": "tcp"}, {"transport": "grpc"}]
    async with asyncio.timeout(30), async_rings(2, timeout=REFUSED_TIMEOUT_S, per_rank=per_rank) as rings:
        results = await asyncio.gather(*(ring.barrier() for ring in rings), return_exceptions=True)
    assert all(isinstance(r, PSError) for r in results), results
    for r in results:
        assert isinstance(r, FailedPreconditionError) and "same transport" in str(r), results
