"""RingTransport: how one rank's frames reach the next rank and arrive from the previous one.

The ring's algorithms (``_async_ring``) see only this interface, a
``pscore.transport.FrameTransport`` of ring frames plus the operation's
bracket (``begin`` / ``end``). Two implementations, chosen by
``RingConfig.transport``:

- ``GrpcTransport`` (``_link``): frames on the long-lived ``Exchange`` stream to
  the next rank; the previous rank's frames arrive in per-operation mailboxes.
- ``TcpTransport`` (``_tcp``): frames on a raw TCP connection to the next rank's
  data port; the previous rank's are read from this rank's data port when the
  operation asks for them, straight into the operation's array where it can.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from psclient.collective._frame import FrameHeader
from pscore.errors import PSError
from pscore.transport import FrameTransport


class RingTransport(FrameTransport[FrameHeader]):
    """Frames of the ring's operations: sent to the next rank, received from the previous one.

    One operation at a time: ``begin``, then any ``connect`` / ``send`` / ``recv``
    (concurrently: one sender, one receiver), then ``end``; after a failure
    ``abort`` (which resets) before ``end``. ``recv`` returns the frames of the
    current operation only.
    """

    name: ClassVar[str]

    def begin(self, seq: int, deadline: float, *, sends: bool) -> asyncio.Future[PSError] | None:
        """Starts operation ``seq`` (``sends``: whether this rank sends frames in it).

        Returns a future that resolves, with the error, if the next rank ends the
        outgoing link during the operation; None where the transport cannot tell
        before the next write.
        """
        return None

    def end(self, seq: int) -> None:
        """Ends operation ``seq``: its late frames are dropped."""

    async def connect(self, deadline: float) -> None:
        """Makes the outgoing link ready to send (before the first ``send`` of an operation).

        Raises:
            PSError: the next rank refused or cannot be reached (names it).
        """

    async def close(self, grace_s: float) -> None:
        """Closes the links, letting the last frames reach the next rank for up to ``grace_s``."""
