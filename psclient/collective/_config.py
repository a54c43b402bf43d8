"""Configuration of one rank of a ring (validated once, immutable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from psclient.collective._frame import HEADER_BYTES

DEFAULT_CHUNK_BYTES: Final[int] = 2 << 20  # measured: 2-4 MiB best at 16-256 MiB on 2 ranks
DEFAULT_FUSION_THRESHOLD_BYTES: Final[int] = 64 << 20
DEFAULT_MAX_MESSAGE_BYTES: Final[int] = 64 << 20
COMPRESSIONS: Final[tuple[str, ...]] = ("none", "fp16")
TRANSPORTS: Final[tuple[str, ...]] = ("grpc", "tcp")


@dataclass(frozen=True, slots=True, kw_only=True)
class RingConfig:
    """Settings of one rank (see :class:`psclient.collective.Ring` for their meaning).

    ``grpc_options`` are extra gRPC channel and server arguments (for tuning, e.g.
    ``(("grpc.http2.lookahead_bytes", 1 << 24),)``). ``tune_malloc`` applies
    :func:`pscore.memory.tune_malloc` to the whole process.

    Security, as on every service (see :mod:`pscore.security`): ``auth_token``
    is required on every stream a rank accepts and sent on every stream it opens.
    TLS is all or nothing across a ring, because every rank both serves and
    connects: ``tls_cert``/``tls_key`` (PEM paths) are this rank's certificate,
    served to the previous rank and presented to the next one as a client
    certificate; ``tls_ca`` is the CA that the next rank's certificate must chain
    to (default: the system roots); ``tls_client_ca`` makes this rank require a
    client certificate signed by it (mutual TLS). The names match
    ``PSClient(tls_ca=, tls_cert=, tls_key=)`` and ``psserver --tls-client-ca``.

    ``transport`` carries the frames: ``"tcp"`` (default: 1.7-2.5x the gRPC
    transport's bandwidth at 2 and 4 ranks, bench/results/allreduce_tcp.md) on a
    raw TCP connection per link to an ephemeral data port that each rank
    advertises through the authenticated ``DataPort`` call, or ``"grpc"`` on the
    ``Exchange`` stream (where only the ring's own port may be reached); every
    rank must use the same one.
    With TLS settings, ``"tcp"`` data connections are TLS too (same certificates).

    Raises:
        ValueError: an inconsistent or out-of-range setting.
    """

    addresses: tuple[str, ...]
    rank: int
    timeout: float = 60.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES
    compression: str = "none"
    auth_token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grpc_options: tuple[tuple[str, int | str], ...] = ()
    tune_malloc: bool = True
    transport: str = "tcp"

    def __post_init__(self) -> None:
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty (use None for no token auth)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_cert is None and (self.tls_ca is not None or self.tls_client_ca is not None):
            raise ValueError(
                "tls_ca and tls_client_ca need tls_cert and tls_key: every rank of a TLS ring serves TLS"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.addresses:
            raise ValueError("a ring needs at least one address")
        for a in self.addresses:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) == 0:
                raise ValueError(f"address {a!r} is not HOST:PORT with a fixed non-zero port")
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError(f"addresses must be distinct: {list(self.addresses)}")
        if not 0 <= self.rank < len(self.addresses):
            raise ValueError(f"rank {self.rank} is not in [0, {len(self.addresses)})")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if self.fusion_threshold_bytes < 0:
            raise ValueError("fusion_threshold_bytes must be >= 0")
        if self.max_message_bytes < HEADER_BYTES + 1024:
            raise ValueError(f"max_message_bytes must be at least {HEADER_BYTES + 1024}")
        if not 1024 <= self.chunk_bytes <= self.max_message_bytes - HEADER_BYTES:
            raise ValueError(
                f"chunk_bytes must be in [1024, max_message_bytes - {HEADER_BYTES}], got {self.chunk_bytes}"
            )

    @property
    def tls(self) -> bool:
        """Whether the ring's streams use TLS."""
        return self.tls_cert is not None

    @property
    def world(self) -> int:
        """Number of ranks."""
        return len(self.addresses)

    @property
    def next_rank(self) -> int:
        """The rank this rank sends to."""
        return (self.rank + 1) % self.world

    @property
    def prev_rank(self) -> int:
        """The rank this rank receives from."""
        return (self.rank - 1) % self.world
