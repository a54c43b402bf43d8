"""Ring collectives between workers: all-reduce, broadcast, all-gather and barrier over gRPC.

``Ring`` is the synchronous API for training loops, ``AsyncRing`` the same on
the caller's event loop. See ``protos/psproto/v1/collective.proto`` for the wire
protocol.
"""

from psclient.collective._async_ring import ALLREDUCE_DTYPES, REDUCE_OPS, AsyncRing
from psclient.collective._config import RingConfig
from psclient.collective._ring import Ring

__all__ = ["ALLREDUCE_DTYPES", "REDUCE_OPS", "AsyncRing", "Ring", "RingConfig"]
