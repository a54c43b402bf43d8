"""Network partitions on the cluster in a box: a replicated shard's primary cut off from everyone (a silent
link, not a reset), while a client on another host pushes in a loop.

The backup (``--serve-alone``) takes over once the primary's lease has surely expired; the client must
notice that its connection to the primary went silent (HTTP/2 keepalive pings on the channel, TCP
keepalive and a user timeout on data connections), not wait for its call's deadline, and go on with the
backup before the link heals. Every acknowledged push is applied exactly once (the value counts them).
Needs root, iproute2 and nftables; skips otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.netns import NetnsCluster

pytestmark = pytest.mark.timeout(120)

CLIENT = str(Path(__file__).with_name("_partition_client.py"))
CUT_S = 9.0  # the primary stays cut this long; a client that waits for its deadline makes no progress in it
RUN_S = 16.0


@pytest.mark.parametrize(
    ("wire", "deadline"),
    [
        ("grpc", 30.0),  # a deadline far longer than the cut: only noticing the silence makes progress
        ("data_port", 30.0),
        ("grpc", 3.0),  # calls that fail while the backup takes over: their errors name the silent replica
    ],
)
def test_a_client_fails_over_when_its_primary_goes_silent(
    net: NetnsCluster, wire: str, deadline: float
) -> None:
    p, b, c = net.hosts
    record = net.workdir / "partition-client.json"
    # --serve-alone: the backup serves the clients while the primary is cut off (by default it waits for a
    # backup first, and acknowledges nothing until the cut heals: test_replication_faults.py)
    primary = net.shards([p], ["--serve-alone"]).start()
    backup = net.shards([b], ["--serve-alone"], shard_args={0: ["--backup-of", primary.addresses[0]]}).start()
    try:
        client = net.popen(
            c,
            [sys.executable, CLIENT, f"{primary.addresses[0]}|{backup.addresses[0]}", str(RUN_S),
             str(deadline), "0" if wire == "data_port" else str(1 << 30), str(record)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "started"
        time.sleep(2.0)  # pushes flow through the primary
        net.cut(p)
        cut_at = time.monotonic()
        time.sleep(CUT_S)
        healed_at = time.monotonic()
        net.heal(p)
        out, _ = client.communicate(timeout=RUN_S + deadline + 30)
        assert client.returncode == 0, out
        result = json.loads(record.read_text())
    finally:
        backup.stop()
        primary.stop()
    calls = result["calls"]
    acked = sum(1 for call in calls if call["outcome"] == "ok")
    failed = [call for call in calls if call["outcome"] != "ok"]
    # Exactly once: every acknowledged push counted; a failed call may or may not have been applied.
    assert acked <= -result["value"] <= acked + len(failed), result["value"]
    during = [
        call
        for call in calls
        if cut_at < call["start"] and call["end"] < healed_at and call["outcome"] == "ok"
    ]
    first = min((call["end"] for call in during), default=None)
    assert first is not None, (
        f"no push succeeded in the {CUT_S:.0f} s the primary was cut off; calls: "
        + json.dumps([call for call in calls if call["end"] > cut_at][:5])
    )
    addresses = (primary.addresses[0], backup.addresses[0])
    for call in failed:  # every error names the shard's replicas and says which went silent or refused
        assert "the replica asked last" in call["outcome"], call
        assert any(a in call["outcome"].split("the replica asked last")[0] for a in addresses), call
    longest = max(call["end"] - call["start"] for call in calls)
    assert longest < deadline + 5.0, longest  # bounded by the deadline (and a loaded machine's slack)
    print(f"\n{wire}: a push that began after the cut succeeded {first - cut_at:.1f} s after it; "
          f"{len(failed)} calls failed; longest call {longest:.1f} s; {acked} acknowledged")  # fmt: skip
