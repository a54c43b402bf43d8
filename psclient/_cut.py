"""The coordinator of a consistent save (``AsyncPSClient.save_checkpoint(consistent=True)``).

The shards' side, and why the result is one version of the whole model, is in
``psserver.cut``. Here:

1. ``GetStatus`` on every shard (a shard that is down fails the save before
   anything is held; a replicated one fails over to its backup).
2. ``PrepareCut`` on every shard at once: each holds new updates back and
   reports its sync step and the pushes it applied that went to other shards.
3. ``CommitCut`` on every shard at once, with the pushes the others applied
   that went to it, the largest sync step and the largest next checkpoint id:
   each lets those updates through, snapshots, releases and writes.

Any failure, or the deadline, aborts: ``ReleaseCut(discard=True)`` on every
shard (release the hold, delete a file already written) and
``ConsistentCutError``. Each shard's hold also ends by itself shortly after the
deadline, so a coordinator that dies mid-way leaves nothing held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from pscore.errors import ConsistentCutError, DeadlineExceededError, PSError
from psproto.v1 import ps_pb2

if TYPE_CHECKING:
    from psclient._async_client import AsyncPSClient

log = logging.getLogger(__name__)

_HOLD_MARGIN_S = 1.0  # a shard's hold outlives the coordinator's deadline by this much
_RELEASE_TIMEOUT_S = 2.0  # the abort's own calls (a live shard answers at once; a dead one holds nothing)
_STATUS_TIMEOUT_S = 10.0  # a shard that does not answer GetStatus within this fails the save, unheld


async def consistent_save(client: AsyncPSClient, timeout: float) -> list[ps_pb2.SaveCheckpointResponse]:
    """Takes one consistent cut of every shard and writes it; see ``AsyncPSClient.save_checkpoint``.

    Raises:
        ConsistentCutError: aborted (every hold released, files of the cut deleted).
        PSError: a shard without ``--checkpoint-dir`` (FailedPreconditionError), or a bad setting.
    """
    from psclient._fanout import gather

    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    cut_id = secrets.token_hex(8)
    deadline = time.monotonic() + timeout
    n = client.num_shards
    phase = "GetStatus"

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0.05:
            raise DeadlineExceededError(f"consistent save {cut_id}: no time left for {phase}")
        return remaining

    async def call(shard: int, method: str, request: object, limit: float | None = None) -> object:
        timeout = left() if limit is None else min(left(), limit)
        try:
            return await _call(client, shard, method, request, timeout)
        except PSError as err:
            err.shard = shard  # type: ignore[attr-defined]
            raise

    try:
        statuses = await gather(
            call(s, "GetStatus", ps_pb2.GetStatusRequest(), _STATUS_TIMEOUT_S) for s in range(n)
        )
        modes = {st.mode for st in statuses}  # type: ignore[attr-defined]
        phase = "PrepareCut"
        hold_s = left() + _HOLD_MARGIN_S
        prepare = ps_pb2.PrepareCutRequest(cut_id=cut_id, hold_s=hold_s)
        reports: list[ps_pb2.PrepareCutResponse] = await gather(  # type: ignore[assignment]
            call(s, "PrepareCut", prepare) for s in range(n)
        )
        phase = "CommitCut"
        include: list[list[ps_pb2.PushKeys]] = [[] for _ in range(n)]
        for report in reports:
            for keys in report.applied:
                for target in keys.shards:
                    if target != report.shard and 0 <= target < n:
                        include[target].append(keys)
        step = max(r.step for r in reports) if modes == {"sync"} else 0
        checkpoint_id = max(r.next_checkpoint_id for r in reports)
        replies: list[ps_pb2.SaveCheckpointResponse] = await gather(  # type: ignore[assignment]
            call(
                s,
                "CommitCut",
                ps_pb2.CommitCutRequest(
                    cut_id=cut_id, include=include[s], step=step, checkpoint_id=checkpoint_id
                ),
            )
            for s in range(n)
        )
    except (PSError, asyncio.CancelledError) as err:
        await _abort(client, cut_id)
        if isinstance(err, asyncio.CancelledError):
            raise
        shard = getattr(err, "shard", None)
        where = "the coordinator" if shard is None else f"shard {shard} ({client.config.addresses[shard]})"
        if isinstance(err, ConsistentCutError) or err.code.name == "FAILED_PRECONDITION":
            raise
        raise ConsistentCutError(
            f"consistent save {cut_id} aborted in {phase}: {where}: {err.details}; every shard's hold was "
            "released and no file of it was kept",
            shard=shard,
            method=err.method,
            address=err.address,
        ) from err
    log.info(
        "consistent save %s: checkpoint %d on %d shard(s)%s",
        cut_id, checkpoint_id, n, f" at sync step {step}" if step else "",
    )  # fmt: skip
    return replies


async def _call(client: AsyncPSClient, shard: int, method: str, request: object, timeout: float) -> object:
    """One RPC of the cut, retried (and failed over) on UNAVAILABLE within ``timeout``."""

    link = client._shards[shard]

    def attempt() -> Any:
        # wait_for_ready=False: a shard that is down fails the save now, not at the deadline
        return getattr(link.stub(), method)(request, **link.kw(wait_for_ready=False))

    return await link.call(method, attempt, timeout=timeout)


async def _abort(client: AsyncPSClient, cut_id: str) -> None:
    """Releases the cut on every shard and deletes its files there (best effort, bounded)."""
    request = ps_pb2.ReleaseCutRequest(cut_id=cut_id, discard=True)

    async def one(shard: int) -> None:
        with contextlib.suppress(PSError):
            await _call(client, shard, "ReleaseCut", request, _RELEASE_TIMEOUT_S)

    with contextlib.suppress(Exception):
        async with asyncio.timeout(_RELEASE_TIMEOUT_S + 1):
            await asyncio.gather(*(one(s) for s in range(client.num_shards)))
