"""Which wire a pull, push or lookup to one shard takes: its data port, PushSession, a unary call or a stream.

The rule, for one request to one shard of ``nbytes`` (the values pulled or the
gradients pushed, per shard; a lookup's size does not matter):

1. The shard's raw-TCP data port (``psclient._bulk``), if ``config.data_port``,
   the request is a lookup or has at least ``config.data_port_min_bytes``, and
   the data port is usable now (not found unreachable lately, not refused).
2. Otherwise a pull or push of more than ``config.unary_max_bytes``: a stream
   (PullStream / PushStream, in chunks of ``config.chunk_bytes``).
3. Otherwise a push: the shard's PushSession stream, unless the shard has none
   (an older psserver); then, and for pulls and lookups: a unary call (a lookup
   is split into requests of at most ``config.unary_max_bytes`` of rows by its
   caller, so it never needs a stream).

A wire that refuses a request once it was chosen (the data port cannot be
reached, the shard has no PushSession) hands it to the next wire down the list:
``choose(..., after=refused)``. Retries and failover happen within one wire.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from psclient.config import ClientConfig


class Op(enum.Enum):
    """What a request does (each has its own RPCs and data-port frame)."""

    __hash__ = object.__hash__  # members are singletons: no Python-level Enum.__hash__ per dict lookup

    PULL = "pull"
    PUSH = "push"
    LOOKUP = "lookup"


class Wire(enum.Enum):
    """How one request travels, in order of preference."""

    __hash__ = object.__hash__  # as Op's

    DATA_PORT = "data port"  # psclient._bulk.DataLink: one frame each way on a raw-TCP connection
    SESSION = "PushSession"  # psclient._session.PushSession: one message on the shard's open stream
    UNARY = "unary"  # one gRPC call, one message each way (Pull, Push, Lookup)
    STREAM = "stream"  # one streaming gRPC call, in chunks (PullStream, PushStream)


_RANK = {wire: rank for rank, wire in enumerate(Wire)}


def _always(wire: Wire) -> bool:
    return True


def takes_data_port(op: Op, nbytes: int, config: ClientConfig) -> bool:
    """Whether rule 1 sends this request over the data port, if the data port is usable now (``choose``'s
    first rule, which the client checks first: the common case).

    >>> takes_data_port(Op.PUSH, 100, ClientConfig(addresses=("h:1",), data_port_min_bytes=1024))
    False
    """
    return config.data_port and (op is Op.LOOKUP or nbytes >= config.data_port_min_bytes)


def choose(
    op: Op,
    nbytes: int,
    config: ClientConfig,
    available: Callable[[Wire], bool] = _always,
    *,
    after: Wire | None = None,
) -> Wire:
    """The wire of one ``op`` request of ``nbytes`` to one shard (see the module docstring).

    >>> cfg = ClientConfig(addresses=("h:1",), data_port_min_bytes=1024)
    >>> choose(Op.PUSH, 100, cfg), choose(Op.PUSH, 4096, cfg), choose(Op.LOOKUP, 0, cfg)
    (<Wire.SESSION: 'PushSession'>, <Wire.DATA_PORT: 'data port'>, <Wire.DATA_PORT: 'data port'>)
    >>> choose(Op.PUSH, 4096, cfg, after=Wire.DATA_PORT)
    <Wire.SESSION: 'PushSession'>

    Args:
        op: pull, push or lookup.
        nbytes: the request's tensor bytes for this shard (a lookup's are not looked at).
        config: ``data_port``, ``data_port_min_bytes`` and ``unary_max_bytes`` are read.
        available: whether the shard can take ``Wire.DATA_PORT`` / ``Wire.SESSION`` now (its data
            port was not found unreachable lately; it has PushSession). Asked only about a wire the
            rule would pick, in order, so that it may set up what it checks on first use.
        after: the wire that refused this request: only wires after it in ``Wire`` are picked.
    """

    if after is None and takes_data_port(op, nbytes, config) and available(Wire.DATA_PORT):  # the common case
        return Wire.DATA_PORT
    if op is not Op.LOOKUP and nbytes > config.unary_max_bytes:
        return Wire.STREAM
    if op is Op.PUSH and (after is None or _RANK[after] < _RANK[Wire.SESSION]) and available(Wire.SESSION):
        return Wire.SESSION
    return Wire.UNARY
