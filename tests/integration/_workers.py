"""Simulated workers for mode tests: one AsyncPSClient per worker id (``w0``, ``w1``, ...)."""

from __future__ import annotations

from _support import CALL_TIMEOUT_S

import psclient
from trainer.cluster import LocalCluster


def worker_clients(cluster: LocalCluster, count: int) -> list[psclient.AsyncPSClient]:
    """``count`` clients of ``cluster`` with worker ids ``w0`` .. ``w{count-1}``."""
    return [
        psclient.AsyncPSClient(cluster.addresses, worker_id=f"w{i}", timeout=CALL_TIMEOUT_S)
        for i in range(count)
    ]


async def close_all(clients: list[psclient.AsyncPSClient]) -> None:
    for c in clients:
        await c.close()
