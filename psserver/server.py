"""Runs one shard: the grpc.aio server with health checking and reflection, until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pscore import security, transport
from pscore.errors import UnavailableError
from pscore.loopwatch import LoopWatch, dump_tasks_on
from psproto.v1 import ps_pb2
from psserver.backup import Backup
from psserver.checkpoint import Checkpointer
from psserver.config import ServerConfig
from psserver.cut import StepCuts
from psserver.dataport import DataPortServer
from psserver.metrics import ShardMetrics
from psserver.modes import Mode, SyncMode, make_mode
from psserver.replication import Primary, has_taken_over, peer_status
from psserver.service import ShardService
from psserver.servicer import ParameterServerServicer, add_to_server
from psserver.store import Store

log = logging.getLogger(__name__)

_PEER_CHECK_TIMEOUT_S = 3.0
SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options shared by the shard's server and the clients' channels."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # Clients ping every second to notice a silent link (psclient's KEEPALIVE_*): allowed, never a
        # "too many pings" GOAWAY.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def write_ready_file(path: str, address: str) -> None:
    """Writes ``HOST:PORT`` to ``path`` atomically (temp file, fsync, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ready-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(address + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class HealthServicer(health.aio.HealthServicer):
    """grpc's health service, whose ``Watch`` streams end once the shard shuts down.

    A client with gRPC's client-side health checking holds a ``Watch`` stream
    open for as long as it is connected; the stock servicer sends it
    NOT_SERVING on shutdown but keeps the stream, so ``server.stop(grace)``
    would wait out the whole grace period for it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._watches: set[asyncio.Task[Any]] = set()
        self._closing = False

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._watches.add(task)
        try:
            await super().Watch(request, context)
        except asyncio.CancelledError:
            if not self._closing:  # the call itself was cancelled
                raise
            task.uncancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is shutting down")
        finally:
            self._watches.discard(task)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING (sent to watchers), then every ``Watch`` stream ends (UNAVAILABLE)."""
        await super().enter_graceful_shutdown()
        await asyncio.sleep(0)  # let the watchers send NOT_SERVING first
        self._closing = True
        for task in list(self._watches):
            task.cancel()


@dataclass
class Shard:
    """A running shard: its server, store and mode (what tests and hooks reach into)."""

    config: ServerConfig
    server: grpc.aio.Server
    store: Store
    mode: Mode
    health: HealthServicer
    address: str
    port: int
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    metrics: ShardMetrics | None = None
    checkpointer: Checkpointer | None = None
    primary: Primary | None = None
    backup: Backup | None = None
    service: ShardService | None = None
    servicer: ParameterServerServicer | None = None
    data_port: DataPortServer | None = None
    # Set when this process's backup took over while it held no lease (``Primary.on_taken_over``):
    # ``serve`` restarts it as that one's backup. Its state is dropped (no final checkpoint).
    taken_over_by: str = ""
    taken_over: asyncio.Event = field(default_factory=asyncio.Event)

    def hand_over(self, peer: str) -> None:
        """``peer`` took over: this process is to restart as its backup (``serve`` does it)."""
        self.taken_over_by = peer
        self.taken_over.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking new work, finishes in-flight calls (up to ``grace_s``), runs shutdown hooks.

        Long-lived streams that are idle (clients' ``PushSession``, a backup's
        ``Replicate``, health ``Watch``) end at once with UNAVAILABLE
        (``ParameterServerServicer.drain``, ``HealthServicer``), so an idle shard
        stops in about a second whatever the grace.
        """
        grace = self.config.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.create_task(self.server.stop(grace))  # refuses new calls from now on
        data_port = asyncio.create_task(self.data_port.stop(grace)) if self.data_port is not None else None
        if self.servicer is not None:
            await self.servicer.drain(grace)
        await stopping
        if data_port is not None:
            await data_port
        for hook in self.on_shutdown:
            await hook()


def peer_credentials(config: ServerConfig) -> grpc.ChannelCredentials | None:
    """How this shard dials another (replication): with TLS, ``--tls-ca`` and its own certificate."""
    if not config.tls_cert:
        return None
    return security.channel_credentials(config.peer_ca, config.tls_cert, config.tls_key)


def peer_channel(config: ServerConfig, address: str) -> grpc.aio.Channel:
    """A channel from this shard to another one at ``address``."""
    options = channel_options(config.max_message_bytes)
    credentials = peer_credentials(config)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def _token(config: ServerConfig) -> str | None:
    return security.read_token_file(config.auth_token_file) if config.auth_token_file else None


async def starting_config(config: ServerConfig, connect: Callable[[str], grpc.aio.Channel]) -> ServerConfig:
    """What this process starts as: a primary whose backup (``--backup-at``) took over while it was down
    (or is about to) starts as that one's backup instead (its own checkpoint is older)."""
    if config.backup_at and await _took_over(config, connect):
        log.warning(
            "shard %d: %s took over as primary while this process was down: starting as its backup",
            config.shard, config.backup_at,
        )  # fmt: skip
        return dataclasses.replace(config, backup_of=config.backup_at, backup_at=None)
    return config


async def _took_over(config: ServerConfig, connect: Callable[[str], grpc.aio.Channel]) -> bool:
    """Whether this primary's backup (``--backup-at``) has taken over (or is about to) while we were down."""
    assert config.backup_at is not None
    try:
        status = await peer_status(connect, config.backup_at, _token(config), _PEER_CHECK_TIMEOUT_S)
    except grpc.RpcError as err:
        log.info(
            "shard %d: backup %s not reachable (%s): starting as a primary that serves once its backup "
            "confirms", config.shard, config.backup_at, err.code().name,
        )  # fmt: skip
        return False
    return has_taken_over(status, config.shard, 0)  # a process starting holds no term yet


async def start(config: ServerConfig, *, term: int = 0) -> Shard:
    """Builds and starts a shard on the running event loop.

    ``term``: the newest replication term this process has seen (a restart in
    the same process as its peer's backup keeps it).

    A primary started with ``--backup-at`` whose backup took over while it was
    down starts as that backup's backup instead (its own checkpoint is older).
    If the backup has not noticed yet, this primary starts without a lease: it
    serves nothing until its backup confirms it, and restarts as the backup's
    backup once that one takes over (``Primary.on_taken_over``, ``serve``).
    """
    config = await starting_config(config, functools.partial(peer_channel, config))
    tier = config.tier
    tier_lock = tier.open() if tier is not None else None  # TierDirError: before anything else starts
    service = await assemble(config, term=term, connect=functools.partial(peer_channel, config))
    store, mode, checkpointer = service.store, service.mode, service.checkpointer
    primary, backup = service.primary, service.backup
    assert primary is not None
    metrics = ShardMetrics(config.shard, store, mode.name)
    interceptors: list[grpc.aio.ServerInterceptor] = [
        security.MalformedRequestInterceptor(),  # bytes that do not parse: INVALID_ARGUMENT
        metrics.interceptor(),
    ]
    if config.auth_token_file:  # first: an unauthenticated call reaches nothing else
        token = security.read_token_file(config.auth_token_file)
        interceptors.insert(0, security.TokenAuthInterceptor(token))
    credentials = (
        security.server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        if config.tls_cert and config.tls_key
        else None
    )
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[*channel_options(config.max_message_bytes), ("grpc.so_reuseport", 0)],
    )
    metrics.attach(
        checkpointer=checkpointer,
        checkpoint_every_s=config.checkpoint_every_s,
        primary=primary,
        backup=backup,
    )
    mode.listener = metrics  # times the waits in the mode, names who waits
    servicer = ParameterServerServicer(service)
    # ps_pb2_grpc.add_ParameterServerServicer_to_server with zero-copy tensor framing
    add_to_server(servicer, server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    port = security.add_port(server, f"{config.host}:{config.port}", credentials)
    data_port = None
    if config.data_port is not None:
        data_tls = None
        if config.tls_cert and config.tls_key:  # the same certificates and client checks as gRPC
            data_tls = transport.server_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        data_port = DataPortServer(service, metrics, host=config.host, port=config.data_port, tls=data_tls)
        try:
            await data_port.start()
        except OSError as err:
            bind = f"{config.host}:{config.data_port}"
            why = "address already in use" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
            raise security.BindError(err.errno or 0, f"cannot bind --data-port {bind}: {why}") from err
        servicer.data_port = data_port
    await server.start()
    host = config.host if config.host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
    address = f"{host}:{port}"
    shard = Shard(config, server, store, mode, health_servicer, address, port, metrics=metrics)
    shard.checkpointer = checkpointer
    shard.primary, shard.backup = primary, backup
    shard.service, shard.servicer = service, servicer
    shard.data_port = data_port
    primary.on_taken_over = shard.hand_over
    primary.start()
    shard.on_shutdown.insert(0, primary.stop)
    if backup is not None:
        backup.address = address
        backup.start()
        shard.on_shutdown.insert(0, backup.stop)
    if checkpointer is not None:
        shard.on_shutdown.append(_checkpoint_hooks(shard, checkpointer, service.step_cuts))
    if config.metrics_port is not None:
        try:
            metrics_port = metrics.serve(config.host, config.metrics_port)
        except OSError as err:
            await server.stop(0)
            bind = f"{config.host}:{config.metrics_port}"
            why = "address already in use" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
            raise security.BindError(err.errno or 0, f"cannot bind --metrics-port {bind}: {why}") from err
        shard.on_shutdown.append(metrics.aclose)
        log.info("shard %d: metrics on http://%s:%d/metrics", config.shard, host, metrics_port)
    if tier_lock is not None:
        shard.on_shutdown.append(functools.partial(_close_tier, store, tier_lock))  # last: after the save
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return shard


async def assemble(
    config: ServerConfig, *, term: int = 0, connect: Callable[[str], grpc.aio.Channel] | None = None
) -> ShardService:
    """A shard's transport-free parts, wired together: store, mode, checkpoints (restored), replication.

    What ``start`` serves over gRPC and the data port, and what the replication
    simulation (``psload.simulation``) runs over its own network. ``term``: as
    ``start``'s; ``connect``: opens a channel to the other process of the shard.
    """
    store = Store(
        allow_non_finite=config.allow_non_finite,
        inline_apply_bytes=config.inline_apply_bytes,
        tier=config.tier,
    )
    mode = make_mode(
        config.mode,
        store,
        replicas_to_aggregate=config.replicas_to_aggregate,
        total_replicas=config.total_replicas,
        staleness=config.staleness,
        barrier_timeout_s=config.barrier_timeout_s,
    )
    checkpointer = None
    if config.checkpoint_dir:
        checkpointer = Checkpointer(
            config.checkpoint_dir, store, mode, shard=config.shard, num_shards=config.num_shards
        )
        if not config.backup_of:  # a backup starts empty and takes its primary's state
            await checkpointer.restore()  # before serving: no request sees a half-restored shard
    primary = Primary(
        store,
        mode,
        shard=config.shard,
        num_shards=config.num_shards,
        ack_timeout_s=config.replication_timeout_s,
        lease_s=config.lease_s,
        required=bool(config.backup_at),  # replicated: serves nothing until its backup confirms
        peer=config.backup_at or config.backup_of or "",
        connect=connect,
        auth_token=_token(config),
        serve_alone=config.serve_alone,
        term=term if config.backup_of else max(term, 1),  # a backup takes its primary's with the snapshot
    )
    mode.lease_check = functools.partial(primary.check, "the update")
    primary.on_lease_lost = lambda why: mode.interrupt(UnavailableError(why))
    if isinstance(mode, SyncMode):
        mode.replicate_step = primary.send_step
    backup = None
    if config.backup_of:
        backup = Backup(
            config.backup_of,
            store,
            mode,
            shard=config.shard,
            auth_token=_token(config),
            connect=connect,
            term=term,
        )
        backup.on_promoted = primary.promoted
    service = ShardService(
        store,
        mode,
        shard=config.shard,
        num_shards=config.num_shards,
        checkpointer=checkpointer,
        primary=primary,
        backup=backup,
    )
    if checkpointer is not None and isinstance(mode, SyncMode):
        service.step_cuts = StepCuts(mode, store, checkpointer, shard=config.shard)
    return service


async def _close_tier(store: Store, lock_fd: int) -> None:
    """Closes the disk tiers and releases ``--table-dir`` (a restart as a backup claims it again)."""
    store.close()
    os.close(lock_fd)


def _checkpoint_hooks(
    shard: Shard, checkpointer: Checkpointer, step_cuts: StepCuts | None
) -> Callable[[], Awaitable[None]]:
    """Starts periodic checkpoints (``--checkpoint-every``); returns the shutdown hook (stop them, save).

    In sync mode the periodic checkpoints are at one step boundary on every shard (``StepCuts``).
    """
    every = shard.config.checkpoint_every_s
    run = step_cuts.run_periodic if step_cuts is not None else checkpointer.run_periodic
    periodic = asyncio.create_task(run(every)) if every else None

    async def on_shutdown() -> None:
        if periodic is not None:
            periodic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await periodic
        if not shard.taken_over.is_set():  # a state its backup superseded is not worth keeping
            await checkpointer.save()  # after the server stopped: nothing changes any more

    return on_shutdown


async def serve(config: ServerConfig, *, stop: asyncio.Event | None = None) -> None:
    """Runs a shard until SIGTERM/SIGINT (or ``stop`` is set), then shuts down gracefully.

    A primary whose backup took over while it held no lease restarts in this
    process as that backup's backup, on the same port (``Shard.taken_over``).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        dump_tasks_on(loop)  # kill -USR2: every task and where it awaits, for a call that hangs
    watch = LoopWatch(f"shard {config.shard}")  # a blocked loop is logged with its stack, not silent
    watch.start()
    try:
        await _serve_shard(config, stop, watch)
    finally:
        watch.stop()


async def _serve_shard(config: ServerConfig, stop: asyncio.Event, watch: LoopWatch) -> None:
    shard = await start(config)
    while True:
        watch.on_stall = shard.metrics.on_loop_stall if shard.metrics is not None else None
        _announce(shard)
        watcher = asyncio.create_task(shard.metrics.watch_stalls()) if shard.metrics is not None else None
        try:
            await _first(stop.wait(), shard.taken_over.wait())
            if stop.is_set():
                log.info("shard %d: shutting down (grace %.1fs)", config.shard, config.grace_s)
        finally:
            if watcher is not None:
                watcher.cancel()
            if stop.is_set() or not shard.taken_over.is_set():
                await shard.stop()
        if stop.is_set():
            break
        peer = shard.taken_over_by
        await shard.stop(grace_s=min(config.grace_s, 1.0))  # it serves nothing: in-flight calls fail
        config = dataclasses.replace(shard.config, backup_of=peer, backup_at=None, port=shard.port)
        log.warning("shard %d: restarting on port %d as the backup of %s", config.shard, shard.port, peer)
        shard = await start(config, term=shard.service.term if shard.service is not None else 0)
    log.info("shard %d: stopped", config.shard)


def _announce(shard: Shard) -> None:
    """Logs ``listening on`` and writes the ready files."""
    config = shard.config
    log.info(
        "shard %d/%d (%s mode) listening on %s%s",
        config.shard, config.num_shards, config.mode, shard.address,
        f" as the backup of {config.backup_of}" if config.backup_of else "",
    )  # fmt: skip
    if shard.data_port is not None:
        data_host = shard.address.rpartition(":")[0]
        log.info("shard %d: data port on %s:%d (raw TCP)", config.shard, data_host, shard.data_port.port)
    if config.ready_file:
        if shard.metrics is not None and shard.metrics.port is not None:  # for tools: before the ready file
            write_ready_file(
                config.ready_file + ".metrics", f"{shard.address.rpartition(':')[0]}:{shard.metrics.port}"
            )
        write_ready_file(config.ready_file, shard.address)


async def _first(*waits: Awaitable[Any]) -> None:
    """Waits until the first of ``waits`` completes; cancels the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
