"""ServerConfig: everything one psserver shard needs, from flags, environment and TF_CONFIG."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pscore.tf_config import read_tf_config
from psserver.lease import DEFAULT_LEASE_S
from psserver.tier import DEFAULT_DISK_BYTES, DEFAULT_STORE, TierConfig

MODES = ("async", "sync", "ssp")
DEFAULT_INLINE_APPLY_BYTES = 1 << 20  # an update's larger computations and disk work run in a worker thread
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # 64 MiB: clients cut payloads into chunks well below this


class ConfigError(ValueError):
    """The shard's configuration is invalid; the message says which setting and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Configuration of one parameter-server shard (one process)."""

    shard: int
    num_shards: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    ready_file: str | None = None
    mode: str = "async"
    replicas_to_aggregate: int | None = None
    total_replicas: int | None = None
    staleness: int = 0
    barrier_timeout_s: float = 60.0
    allow_non_finite: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    inline_apply_bytes: int = DEFAULT_INLINE_APPLY_BYTES
    grace_s: float = 10.0
    checkpoint_dir: str | None = None
    checkpoint_every_s: float | None = None
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_ca: str | None = None  # trusted when this process dials another shard (replication)
    metrics_port: int | None = None
    backup_of: str | None = None  # HOST:PORT of the primary this process backs up (psserver.replication)
    backup_at: str | None = None  # a primary's backup: if it has taken over, start as its backup instead
    replication_timeout_s: float = 30.0
    data_port: int | None = 0  # the raw-TCP data port (psserver.dataport): 0 ephemeral, None: none
    lease_s: float = DEFAULT_LEASE_S  # a replicated primary serves only while its backup renews this lease
    # A promoted backup (or a primary whose backup resigned) serves before a backup confirms: what it
    # acknowledges then is on one process only (availability before durability; default: it refuses).
    serve_alone: bool = False
    # The disk tier of dynamic tables (psserver.tier): the in-memory budget of each piece's hot rows
    # (None: every row in memory), the directory of the cold rows, and each piece's limit on disk.
    table_memory_bytes: int | None = None
    table_dir: str | None = None
    table_disk_bytes: int = DEFAULT_DISK_BYTES
    table_tier_store: str = DEFAULT_STORE  # how a piece keeps its cold rows: log or lmdb (psserver.tier)

    @property
    def tier(self) -> TierConfig | None:
        """The disk tier's settings, or None without ``--table-memory``."""
        if self.table_memory_bytes is None:
            return None
        assert self.table_dir is not None
        return TierConfig(
            directory=self.table_dir,
            memory_bytes=self.table_memory_bytes,
            disk_bytes=self.table_disk_bytes,
            owner=f"shard{self.shard}" + ("-backup" if self.backup_of else ""),
            store=self.table_tier_store,
        )

    @property
    def peer_ca(self) -> str | None:
        """The CA trusted when this process dials another shard: ``--tls-ca``, else ``--tls-client-ca``."""
        return self.tls_ca or self.tls_client_ca

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ConfigError(f"--num-shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard < self.num_shards:
            raise ConfigError(f"--shard must be in [0, {self.num_shards}), got {self.shard}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.data_port is not None and not 0 <= self.data_port <= 65535:
            raise ConfigError(f"--data-port must be in [0, 65535], got {self.data_port}")
        if self.data_port and self.data_port == self.port:
            raise ConfigError(f"--data-port and --port must differ, both are {self.port}")
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}")
        if self.mode == "sync":
            n, m = self.replicas_to_aggregate, self.total_replicas
            if n is None or m is None:
                raise ConfigError("--mode sync needs --replicas-to-aggregate N and --total-replicas M")
            if not 1 <= n <= m:
                raise ConfigError(f"need 1 <= --replicas-to-aggregate ({n}) <= --total-replicas ({m})")
        if self.mode == "ssp" and self.total_replicas is None:
            raise ConfigError("--mode ssp needs --total-replicas M (the number of workers)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.checkpoint_every_s is not None and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")
        if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
            raise ConfigError(f"--checkpoint-every must be > 0 seconds, got {self.checkpoint_every_s}")
        if self.backup_of is not None and self.backup_at is not None:
            raise ConfigError(
                "--backup-of (this is a backup) and --backup-at (this is a primary) exclude each other"
            )
        for flag, address in (("--backup-of", self.backup_of), ("--backup-at", self.backup_at)):
            if address is None:
                continue
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"{flag} must be HOST:PORT, got {address!r}")
            if self.tls_cert and not self.peer_ca:
                raise ConfigError(
                    f"{flag} with TLS needs --tls-ca (or --tls-client-ca) to verify the other shard"
                )
        if not self.replication_timeout_s > 0:
            raise ConfigError(f"--replication-timeout must be > 0 seconds, got {self.replication_timeout_s}")
        if not self.lease_s > 0:
            raise ConfigError(f"--lease must be > 0 seconds, got {self.lease_s}")
        if (self.table_memory_bytes is None) != (self.table_dir is None):
            raise ConfigError("--table-memory and --table-dir go together (the disk tier needs both)")
        try:
            _ = self.tier
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.max_message_bytes < 1 << 20:
            raise ConfigError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")


@dataclass(frozen=True, slots=True)
class TFConfigTask:
    """This process's place in a TF_CONFIG cluster."""

    shard: int
    num_shards: int
    host: str
    port: int


def ps_task_from_tf_config(environ: Mapping[str, str] = os.environ) -> TFConfigTask:
    """Reads the shard index and address of a ``ps`` task from ``TF_CONFIG``.

    Raises:
        ConfigError: TF_CONFIG is missing, malformed, or not a ``ps`` task.
    """
    try:
        cfg = read_tf_config(environ, unset_hint="and no --shard was given")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if cfg.task_type is None or cfg.task_index is None:
        raise ConfigError("TF_CONFIG is malformed: it has no task {type, index}")
    if cfg.task_type != "ps":
        raise ConfigError(f"TF_CONFIG task type is {cfg.task_type!r}; psserver runs 'ps' tasks")
    ps, index = cfg.ps, cfg.task_index
    if not 0 <= index < len(ps):
        raise ConfigError(
            f"TF_CONFIG is malformed: task ps:{index} is not in the cluster's {len(ps)} ps task(s)"
        )
    address = ps[index]
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"TF_CONFIG ps address {address!r} (task {index}) is not HOST:PORT")
    return TFConfigTask(shard=index, num_shards=len(ps), host=host or "0.0.0.0", port=int(port))
