"""ClientConfig: how a worker reaches the shards (addresses, deadlines, chunking, security)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from psclient._retry import RetryPolicy
from pscore.placement import DEFAULT_PARTITION_BYTES
from pscore.tf_config import read_tf_config

DEFAULT_TIMEOUT_S = 30.0  # per call; a first pull may wait for a shard that is still starting
DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB per streamed message
DEFAULT_UNARY_MAX_BYTES = 4 << 20  # payloads up to this go in one unary call (the fast path)
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # matches psserver's default --max-message-mib
# Per shard: smaller pulls and pushes stay on gRPC (unary calls). 0: every one goes over the data port,
# which costs less CPU than gRPC at every size (a 1 KiB push: ~0.2 ms on each side against ~0.45 ms).
DEFAULT_DATA_PORT_MIN_BYTES = 0


def default_worker_id() -> str:
    """A worker id unique to this process: ``host-pid-random``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    """Settings of a PSClient / AsyncPSClient."""

    addresses: tuple[str, ...]
    worker_id: str = field(default_factory=default_worker_id)
    auth_token: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    unary_max_bytes: int = DEFAULT_UNARY_MAX_BYTES
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # UNAVAILABLE is retried with backoff until `timeout` (RetryPolicy(enabled=False): never).
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Pulls and pushes of at least data_port_min_bytes per shard (default: all of them), and lookups,
    # go over the shard's raw-TCP data port (psclient._bulk; gRPC where the shard has none or it cannot
    # be reached); False: gRPC only.
    data_port: bool = True
    data_port_min_bytes: int = DEFAULT_DATA_PORT_MIN_BYTES
    # A push's parts of 64 KiB and more go up to their shards one at a time over the data port
    # (psclient._bulk.Uplink), taking turns with the other clients of the process: the first shards'
    # new values come down while the rest goes up, so a push_pull over k shards uses both directions
    # of the worker's link, and clients sharing a host's link get like shares. False: all at once.
    stagger_uploads: bool = True

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("need at least one shard address")
        for shard in self.addresses:
            for a in shard.split("|"):  # PRIMARY|BACKUP: a replicated shard
                host, sep, port = a.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise ValueError(f"shard address {a!r} is not HOST:PORT (or PRIMARY|BACKUP)")
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError(f"shard addresses repeat: {list(self.addresses)}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if not 1024 <= self.chunk_bytes <= self.max_message_bytes // 2:
            raise ValueError(f"chunk_bytes must be in [1 KiB, max_message_bytes/2], got {self.chunk_bytes}")
        if self.unary_max_bytes > self.max_message_bytes // 2:
            raise ValueError("unary_max_bytes must be at most max_message_bytes/2")
        if self.data_port_min_bytes < 0:
            raise ValueError(f"data_port_min_bytes must be >= 0, got {self.data_port_min_bytes}")

    @property
    def num_shards(self) -> int:
        return len(self.addresses)


def ps_addresses_from_tf_config(environ: Mapping[str, str] = os.environ) -> Sequence[str]:
    """The ``ps`` task addresses of ``TF_CONFIG``.

    Raises:
        ValueError: TF_CONFIG is unset, malformed, or has no ps tasks.
    """
    ps = read_tf_config(environ).ps
    if not ps:
        raise ValueError("TF_CONFIG's cluster has no ps tasks")
    return ps
