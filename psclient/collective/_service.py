"""The Collective gRPC service of one rank: frames from the previous rank into per-operation mailboxes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Final

import grpc

from psclient.collective._frame import FrameError, FrameHeader, decode
from psclient.collective._tcp import DataListener
from pscore.errors import PSError, UnavailableError
from psproto.v1 import collective_pb2 as _pb

logger = logging.getLogger(__name__)

SERVICE_NAME: Final[str] = "psproto.v1.Collective"
EXCHANGE_METHOD: Final[str] = f"/{SERVICE_NAME}/Exchange"
DATA_PORT_METHOD: Final[str] = f"/{SERVICE_NAME}/DataPort"
ACCEPTED_KEY: Final[str] = "x-collective-accepted-by"  # initial metadata of an accepted stream: the rank

Delivery = tuple[FrameHeader, bytes] | PSError


class Mailboxes:
    """Frames per operation sequence number; frames of finished operations are dropped.

    Not thread-safe: used from the ring's event loop only.
    """

    def __init__(self) -> None:
        self._boxes: dict[int, asyncio.Queue[Delivery]] = {}
        self._floor = 0  # every seq below this one is finished

    def open(self, seq: int) -> asyncio.Queue[Delivery]:
        """The mailbox of operation ``seq`` (frames may have arrived before the operation started)."""
        return self._boxes.setdefault(seq, asyncio.Queue())

    def close(self, seq: int) -> None:
        """Forgets operation ``seq`` and every earlier one; their late frames are dropped."""
        self._floor = max(self._floor, seq + 1)
        for s in [s for s in self._boxes if s < self._floor]:
            del self._boxes[s]

    def put(self, seq: int, item: Delivery) -> None:
        """Delivers a frame or an error to operation ``seq``."""
        if seq >= self._floor:
            self.open(seq).put_nowait(item)

    def fail_open(self, error: PSError, upto: int | None = None) -> None:
        """Delivers ``error`` to every open operation (with ``seq <= upto`` when given).

        Operations that started after the break (their frames come on a new stream) are left alone.
        """
        for seq, box in self._boxes.items():
            if upto is None or seq <= upto:
                box.put_nowait(error)


class CollectiveService:
    """Serves ``Exchange``: the previous rank's frames, on one long-lived stream.

    Args:
        mailboxes: where frames go.
        rank: this rank.
        prev_rank: the rank that streams to this one.
        prev_address: its address (for messages).
        world: the number of ranks.
        data_plane: the raw-TCP data port of this rank (transport ``"tcp"``), or None.

    Token auth and TLS are the server's job (``pscore.security``), not this handler's.
    """

    def __init__(
        self,
        mailboxes: Mailboxes,
        *,
        rank: int,
        prev_rank: int,
        prev_address: str,
        world: int = 0,
        data_plane: DataListener | None = None,
    ) -> None:
        self._boxes = mailboxes
        self._world = world
        self._data = data_plane
        self._rank = rank
        self._prev = prev_rank
        self._prev_address = prev_address

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler to register on a ``grpc.aio`` server (raw bytes in and out)."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Exchange": grpc.stream_unary_rpc_method_handler(self.exchange),
                "DataPort": grpc.unary_unary_rpc_method_handler(
                    self.data_port,
                    request_deserializer=_pb.DataPortRequest.FromString,
                    response_serializer=_pb.DataPortReply.SerializeToString,
                ),
            },
        )

    async def data_port(
        self, request: _pb.DataPortRequest, context: grpc.aio.ServicerContext
    ) -> _pb.DataPortReply:
        """The data port of this rank and a one-time nonce for the previous rank's connection."""
        if self._data is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"rank {self._rank} runs transport 'grpc', not 'tcp': every rank must use the same transport",
            )
        if request.rank != self._prev or request.world != self._world:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {self._rank} of {self._world} takes data from rank {self._prev} only, "
                f"not from rank {request.rank} of {request.world}",
            )
        assert self._data is not None
        return _pb.DataPortReply(port=self._data.port, nonce=self._data.issue_nonce())

    async def exchange(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> bytes:
        """Receives frames into the mailboxes of their operations until the previous rank half-closes.

        Raises:
            asyncio.CancelledError: the server is stopping.
        """
        if self._data is not None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"rank {self._rank} runs transport 'tcp', not 'grpc': every rank must use the same transport",
            )
        # Tells the sender at once that the stream was accepted (auth passed): see _link.Link.write.
        await context.send_initial_metadata(((ACCEPTED_KEY, str(self._rank)),))
        seq: int | None = None
        completed = closing = False
        try:
            async for msg in request_iterator:
                try:
                    header, _ = decode(msg)
                except FrameError as err:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {self._rank}: {err}")
                if header.kind == _pb.COLLECTIVE_KIND_CLOSE:
                    closing = True
                    continue
                seq = header.seq
                self._boxes.put(seq, (header, msg))
            # NOTE: a cancelled or broken stream also just ends the iteration here (grpc aio),
            # so only the CLOSE frame tells a deliberate end from a break.
            completed = closing
        finally:
            if not completed:
                # Only operations this stream fed: after a failed operation the sender starts
                # a fresh stream, and what this rank runs next comes on that one.
                upto = -1 if seq is None else seq
                if upto >= 0:
                    self._boxes.fail_open(
                        UnavailableError(
                            f"the stream from rank {self._prev} broke (peer died, closed or aborted)",
                            address=self._prev_address,
                        ),
                        upto=upto,
                    )
        return b""
