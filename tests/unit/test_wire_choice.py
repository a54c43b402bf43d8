"""Unit tests of psclient._wire.choose: which wire a pull, push or lookup to one shard takes."""

from __future__ import annotations

import pytest

from psclient._wire import Op, Wire, choose
from psclient.config import ClientConfig

UNARY_MAX = 4096  # config.unary_max_bytes in these tests
MIN = 1024  # config.data_port_min_bytes where set

DP, SESSION, UNARY, STREAM = Wire.DATA_PORT, Wire.SESSION, Wire.UNARY, Wire.STREAM
PULL, PUSH, LOOKUP = Op.PULL, Op.PUSH, Op.LOOKUP


def _config(data_port: bool = True, min_bytes: int = 0) -> ClientConfig:
    return ClientConfig(
        addresses=("h:1",), unary_max_bytes=UNARY_MAX, data_port=data_port, data_port_min_bytes=min_bytes
    )


# (op, nbytes, data_port, data_port_min_bytes, the data port usable, PushSession supported) -> wire
CASES = [
    # The default (data_port, min 0): every size of every operation over the data port.
    (PULL, 0, True, 0, True, True, DP),
    (PULL, UNARY_MAX + 1, True, 0, True, True, DP),
    (PUSH, 0, True, 0, True, True, DP),
    (PUSH, 10 * UNARY_MAX, True, 0, True, True, DP),
    (LOOKUP, 0, True, 0, True, True, DP),
    # data_port_min_bytes: smaller pulls and pushes over gRPC; lookups over the data port at any size.
    (PULL, MIN - 1, True, MIN, True, True, UNARY),
    (PULL, MIN, True, MIN, True, True, DP),
    (PUSH, MIN - 1, True, MIN, True, True, SESSION),
    (PUSH, MIN - 1, True, MIN, True, False, UNARY),
    (PUSH, MIN, True, MIN, True, True, DP),
    (LOOKUP, 0, True, MIN, True, True, DP),
    (LOOKUP, MIN - 1, True, MIN, True, True, DP),
    # data_port=False: gRPC by size (up to unary_max_bytes in one message, else a stream).
    (PULL, 0, False, 0, True, True, UNARY),
    (PULL, UNARY_MAX, False, 0, True, True, UNARY),
    (PULL, UNARY_MAX + 1, False, 0, True, True, STREAM),
    (PUSH, 0, False, 0, True, True, SESSION),
    (PUSH, UNARY_MAX, False, 0, True, True, SESSION),
    (PUSH, UNARY_MAX, False, 0, True, False, UNARY),
    (PUSH, UNARY_MAX + 1, False, 0, True, True, STREAM),
    (PUSH, UNARY_MAX + 1, False, 0, True, False, STREAM),
    (LOOKUP, 0, False, 0, True, True, UNARY),
    (LOOKUP, 10 * UNARY_MAX, False, 0, True, True, UNARY),  # split by its caller: never a stream
    # A data port found unreachable lately (or a shard without one): as data_port=False.
    (PULL, 100, True, 0, False, True, UNARY),
    (PULL, UNARY_MAX + 1, True, 0, False, True, STREAM),
    (PUSH, 100, True, 0, False, True, SESSION),
    (PUSH, 100, True, 0, False, False, UNARY),
    (PUSH, UNARY_MAX + 1, True, 0, False, True, STREAM),
    (LOOKUP, 100, True, 0, False, True, UNARY),
    # Large messages with data_port_min_bytes above unary_max_bytes: a stream below the bound.
    (PULL, UNARY_MAX + 1, True, 2 * UNARY_MAX, True, True, STREAM),
    (PUSH, UNARY_MAX + 1, True, 2 * UNARY_MAX, True, True, STREAM),
    (PUSH, 2 * UNARY_MAX, True, 2 * UNARY_MAX, True, True, DP),
]


@pytest.mark.parametrize(("op", "nbytes", "data_port", "min_bytes", "port_ok", "session_ok", "wire"), CASES)
def test_choose_picks_the_wire_of_each_operation_size_and_config(
    op: Op, nbytes: int, data_port: bool, min_bytes: int, port_ok: bool, session_ok: bool, wire: Wire
) -> None:
    usable = {DP: port_ok, SESSION: session_ok}
    assert choose(op, nbytes, _config(data_port, min_bytes), usable.__getitem__) is wire


@pytest.mark.parametrize(
    ("op", "nbytes", "after", "wire"),
    [
        # The data port refused (it cannot be reached): what gRPC would take.
        (PULL, 100, DP, UNARY),
        (PULL, UNARY_MAX + 1, DP, STREAM),
        (PUSH, 100, DP, SESSION),
        (PUSH, UNARY_MAX + 1, DP, STREAM),
        (LOOKUP, 100, DP, UNARY),
        # The shard has no PushSession: a unary Push, and not the data port again.
        (PUSH, 100, SESSION, UNARY),
    ],
)
def test_choose_after_a_refusal_takes_the_next_wire_down(
    op: Op, nbytes: int, after: Wire, wire: Wire
) -> None:
    assert choose(op, nbytes, _config(), after=after) is wire


@pytest.mark.parametrize(
    ("op", "nbytes", "data_port", "min_bytes", "asked"),
    [
        (PUSH, 100, True, 0, [DP]),  # taken: PushSession is not looked at
        (PUSH, 100, True, MIN, [SESSION]),  # too small for the data port: its link is not looked at
        (PUSH, 100, False, 0, [SESSION]),  # data_port=False: no link is made
        (PUSH, UNARY_MAX + 1, False, 0, []),  # a stream: PushSession does not matter
        (PULL, 100, False, 0, []),  # pulls have no PushSession
        (LOOKUP, 100, False, 0, []),
    ],
)
def test_choose_asks_only_about_the_wires_it_would_take(
    op: Op, nbytes: int, data_port: bool, min_bytes: int, asked: list[Wire]
) -> None:
    seen: list[Wire] = []

    def available(wire: Wire) -> bool:
        seen.append(wire)
        return True

    choose(op, nbytes, _config(data_port, min_bytes), available)
    assert seen == asked
