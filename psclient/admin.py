"""Cluster inspection for tools (``psctl``, ``psload``): each shard's health, status and variables.

Unlike the training calls, these never wait for a shard to come up: a shard
that does not answer within the timeout is reported as unreachable, with the
reason, instead of failing the whole inspection.

Example:
    statuses = asyncio.run(psclient.admin.cluster_status(["127.0.0.1:50051"], timeout=5.0))
    for s in statuses:
        print(s.address, s.health, s.pushes)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psclient._async_client import AsyncPSClient
from pscore import codec
from psproto.v1 import ps_pb2

SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor stored on a shard (a whole variable or one partition of one)."""

    name: str
    variable: str  # the user-visible variable name
    dtype: str
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]  # the whole variable's shape (= shape unless a partition)
    nbytes: int
    version: int
    optimizer: str
    partition: tuple[int, int] | None  # (index, count) of a partition
    # A dynamic table piece's counters (``ps_pb2.DynamicStats`` fields: rows, capacity, admitted, ...).
    dynamic: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class ShardStatus:
    """What one shard reports about itself (``error`` set, counters zero, when unreachable)."""

    index: int
    address: str
    health: str  # SERVING, NOT_SERVING, SERVICE_UNKNOWN, or UNREACHABLE
    error: str | None = None
    mode: str = ""
    num_shards: int = 0
    num_variables: int = 0
    total_bytes: int = 0
    pushes: int = 0
    pulls: int = 0
    uptime_s: float = 0.0
    role: str = "primary"  # or "backup"/"orphaned" (psserver --backup-of): a standby lists no variables
    peer: str = ""  # a backup's primary, or a primary's attached backup
    # A replicated primary: seconds left on the lease its backup renews (0: it refuses client calls);
    # -1: none needed; 0 for a backup (GetStatus.lease_s).
    lease_s: float = -1.0
    term: int = 0  # the replication term of the history it holds (GetStatus.term; each takeover raises it)
    unprotected: bool = False  # a primary serving alone after a failover (psserver --serve-alone)
    sampled_at: float = 0.0  # time.monotonic() of the status call
    tensors: tuple[StoredTensor, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.health == "SERVING" and self.error is None


def _tensor(info: ps_pb2.VariableInfo) -> StoredTensor:
    spec = info.spec
    try:
        dtype = codec.numpy_dtype(spec.dtype)
        name, itemsize = dtype.name, dtype.itemsize
    except codec.CodecError:
        name, itemsize = ps_pb2.DType.Name(spec.dtype), 0
    shape = tuple(int(d) for d in spec.shape)
    part = spec.partition if spec.HasField("partition") else None
    variable, full_shape, nbytes = spec.name, shape, math.prod(shape) * itemsize
    dynamic = None
    if part is not None:
        variable, full_shape = part.variable, tuple(int(d) for d in part.full_shape)
    elif spec.HasField("table"):  # one shard's rows of a table
        variable, full_shape = spec.table.table, (int(spec.table.num_rows), int(spec.table.dim))
    elif spec.HasField("dynamic"):  # its rows come and go: (0, dim); its size is its rows'
        variable = spec.dynamic.table
        dynamic = {f.name: int(getattr(info.dynamic, f.name)) for f in ps_pb2.DynamicStats.DESCRIPTOR.fields}
        nbytes = dynamic["rows"] * int(spec.dynamic.dim) * itemsize
    return StoredTensor(
        name=spec.name,
        variable=variable,
        dtype=name,
        shape=shape,
        full_shape=full_shape,
        nbytes=nbytes,
        version=int(info.version),
        optimizer=spec.optimizer.name,
        partition=(int(part.index), int(part.count)) if part is not None else None,
        dynamic=dynamic,
    )


async def _one(client: AsyncPSClient, index: int, timeout: float, variables: bool) -> ShardStatus:
    address = client.config.addresses[index]
    link = client._shards[index]
    stub = link.stub()
    channel = link.channel()
    kw: dict[str, Any] = {"timeout": timeout, "metadata": link.metadata()}
    try:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), **kw
        )
        health_name = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
        sampled = time.monotonic()
        status = await stub.GetStatus(ps_pb2.GetStatusRequest(), **kw)
        # A standby, or a replicated primary without its lease: it refuses client calls, listing included.
        standby = status.role not in ("", "primary") or status.lease_s == 0
        listing = (
            await stub.ListVariables(ps_pb2.ListVariablesRequest(), **kw)
            if variables and not standby
            else None
        )
    except grpc.RpcError as err:
        code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
        name = code.name if code is not None else "ERROR"
        health_name = "UNREACHABLE" if code == grpc.StatusCode.UNAVAILABLE else name
        detail = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        return ShardStatus(index=index, address=address, health=health_name, error=f"{name}: {detail}")
    return ShardStatus(
        index=index,
        address=address,
        health=health_name,
        mode=status.mode,
        num_shards=status.num_shards,
        num_variables=status.num_variables,
        total_bytes=status.total_bytes,
        pushes=status.pushes,
        pulls=status.pulls,
        uptime_s=status.uptime_s,
        role=status.role or "primary",
        peer=status.peer,
        lease_s=status.lease_s,
        term=status.term,
        unprotected=status.unprotected,
        sampled_at=sampled,
        tensors=tuple(_tensor(i) for i in listing.variables) if listing is not None else (),
    )


async def cluster_status(
    addresses: Sequence[str],
    *,
    timeout: float = 5.0,
    variables: bool = True,
    auth_token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    client: AsyncPSClient | None = None,
) -> list[ShardStatus]:
    """Health, status and (with ``variables``) stored tensors of every shard, in shard order.

    Args:
        addresses: ``HOST:PORT`` of every shard.
        timeout: deadline of each call, seconds.
        variables: also list each shard's stored tensors.
        auth_token, tls_ca, tls_cert, tls_key: as ``AsyncPSClient``.
        client: reuse this client's channels instead (its addresses win).

    Raises:
        ValueError: malformed addresses or TLS settings.
    """
    own = client is None
    if client is None:
        client = AsyncPSClient(
            list(addresses), worker_id="psctl", auth_token=auth_token, timeout=timeout,
            tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
        )  # fmt: skip
    try:
        return list(
            await asyncio.gather(*(_one(client, i, timeout, variables) for i in range(client.num_shards)))
        )
    finally:
        if own:
            await client.close()
