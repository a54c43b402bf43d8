"""RingConfig validation (no sockets)."""

from __future__ import annotations

import pytest

from psclient.collective import RingConfig

ADDRS = ("127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003")


def test_neighbours() -> None:
    cfg = RingConfig(addresses=ADDRS, rank=0)
    assert (cfg.world, cfg.prev_rank, cfg.next_rank) == (3, 2, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"addresses": ()},
        {"addresses": ("127.0.0.1:0",)},
        {"addresses": ("nohost",)},
        {"addresses": (ADDRS[0], ADDRS[0])},
        {"rank": 3},
        {"rank": -1},
        {"timeout": 0},
        {"compression": "int8"},
        {"chunk_bytes": 10},
        {"chunk_bytes": 1 << 30},
        {"max_message_bytes": 100},
        {"fusion_threshold_bytes": -1},
        {"auth_token": ""},
        {"tls_cert": "c.pem"},
        {"tls_key": "k.pem"},
        {"tls_ca": "ca.pem"},
        {"tls_client_ca": "ca.pem"},
        {"transport": "udp"},
    ],
)
def test_rejects(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"addresses": ADDRS, "rank": 0, **kwargs}
    with pytest.raises(ValueError):
        RingConfig(**args)  # type: ignore[arg-type]


def test_tls_settings() -> None:
    assert not RingConfig(addresses=ADDRS, rank=0).tls
    cfg = RingConfig(addresses=ADDRS, rank=0, tls_cert="c.pem", tls_key="k.pem", tls_client_ca="ca.pem")
    assert cfg.tls and cfg.tls_ca is None


def test_transports() -> None:
    assert RingConfig(addresses=ADDRS, rank=0, transport="tcp").transport == "tcp"
    assert RingConfig(addresses=ADDRS, rank=0).transport == "tcp"  # the default: measured faster
    cfg = RingConfig(addresses=ADDRS, rank=0, transport="tcp", tls_cert="c.pem", tls_key="k.pem")
    assert cfg.tls  # the tcp data plane does TLS too
