"""The nemesis on the cluster in a box (issue 23): 20 s of faults in each of async, sync and ssp modes while
two clients (one over gRPC, one over the data port) push and pull counters on a replicated shard; the
checker (``psload.checker``) must find no anomaly in the history: every acknowledged push applied once, no
read behind an acknowledged push, every call bounded, every error naming a replica, no two primaries at
once. The clients' deadline is 6 s (a call may return 3 s past it). The three runs share out the nine fault
kinds (every kind in at least one mode; the kill, the pause and the isolation in two). The isolation
followed by the kill of the process that took over, alone and longer: test_replication_faults.py. Sync mode
runs with a process spinning on a core (a loaded machine). Needs root, iproute2
and nftables; skips otherwise. The 10-minute soak with every fault mixed: ``bench/bench_nemesis.py``.
"""

from __future__ import annotations

import pytest

from psload.nemesis import FAULTS, NemesisConfig, run_nemesis
from trainer.netns import leftovers, netns_available

pytestmark = pytest.mark.timeout(240)

SECONDS = 20.0
TIMEOUT_S = 6.0  # the clients' deadline: shorter than a failover plus backoff, so some calls fail (outcome
# unknown) and the checker sees errors; longer than most faults, so most calls ride through them
PLAN = {
    "async": ("cut_pair", "isolate", "kill", "drop", "isolate_kill"),
    "sync": ("cut_clients", "pause", "flap", "kill"),
    "ssp": ("cut_client", "isolate", "pause", "flap_all"),
}

BURNERS = {"async": 0, "sync": 1, "ssp": 0}  # sync on a loaded machine: where step 37 was lost (issue 47)


def test_the_plan_covers_every_fault() -> None:
    assert {f for kinds in PLAN.values() for f in kinds} == set(FAULTS)


@pytest.mark.parametrize("mode", list(PLAN))
def test_no_anomaly_under_the_nemesis(mode: str) -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    config = NemesisConfig(
        mode=mode, seconds=SECONDS, seed=23, faults=PLAN[mode], fault_s=(2.0, 4.0), gap_s=(0.5, 1.5),
        timeout_s=TIMEOUT_S, slack_s=3.0, burners=BURNERS[mode],
    )  # fmt: skip
    result = run_nemesis(config)
    faults = ", ".join(
        f"{f['kind']} {f['target']} ({f['end_s'] - f['start_s']:.1f} s)" for f in result["faults"]
    )
    assert result["ok"], (
        f"{mode}: {result['summary']}\nfaults: {faults}\ntimeline:\n{result.get('timeline')}\n"
        + "\n".join(f"log of {a}:\n{text}" for a, text in (result.get("server_logs") or {}).items())
    )
    assert {f["kind"] for f in result["faults"]} == set(PLAN[mode]), faults
    stats = result["report"]["stats"]
    assert stats["pushes_ok"] > 0 and stats["pulls_ok"] > 0, result["summary"]
    assert leftovers(result["cluster"]) == []
    print(f"\n{mode}: {result['elapsed_s']} s; {faults}\n{result['summary']}")
