"""Mailboxes: frames per operation, late frames dropped, breaks fail only the operations a stream fed."""

from __future__ import annotations

import asyncio

import pytest

from psclient.collective._frame import FrameHeader
from psclient.collective._service import Mailboxes
from pscore.errors import UnavailableError


def _frame(seq: int) -> tuple[FrameHeader, bytes]:
    return FrameHeader(seq, 0, 1, 2, 1, 0, 0, 1, 0, 2), b""


async def test_frames_reach_their_operation_even_before_it_starts() -> None:
    boxes = Mailboxes()
    boxes.put(1, _frame(1))
    boxes.put(0, _frame(0))
    assert (await boxes.open(0).get())[0].seq == 0
    assert (await boxes.open(1).get())[0].seq == 1


async def test_frames_of_finished_operations_are_dropped() -> None:
    boxes = Mailboxes()
    boxes.open(0)
    boxes.close(0)
    boxes.put(0, _frame(0))  # a late frame of a failed operation
    box = boxes.open(1)
    assert box.empty()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await boxes.open(0).get()


async def test_a_break_fails_only_operations_up_to_the_last_one_the_stream_fed() -> None:
    boxes = Mailboxes()
    current, later = boxes.open(3), boxes.open(4)
    boxes.fail_open(UnavailableError("broke"), upto=3)
    assert isinstance(await current.get(), UnavailableError)
    assert later.empty()
    boxes.fail_open(UnavailableError("closed"))
    assert isinstance(await later.get(), UnavailableError)
