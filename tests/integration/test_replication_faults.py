"""Two faults in a row on the cluster in a box (issue 47): the primary's host cut from everyone for 8 s (its
backup takes over), then ``kill -9`` of the process that took over, the cut healed, and that process
restarted with its usual command (``--backup-of`` the old primary, as a supervisor would), while two
clients push and pull counters.

Before terms and the two-copies rule, the backup acknowledged pushes alone after it took over, and the old
primary then took the restarted, empty process as its backup and served its own older state: about two
thirds of the acknowledged pushes were lost, in every mode, and sync mode never acknowledged a step again.
Now the process that took over acknowledges nothing while it is the only copy, so nothing acknowledged is
lost, and the clients are acknowledged again once the restarted process has caught up as a backup. The
nemesis's checker proves the history. Needs root, iproute2 and nftables; skips otherwise. The same
schedule in the deterministic simulation: tests/unit/test_simulation.py.
"""

from __future__ import annotations

import pytest

from psload.nemesis import NemesisConfig, run_nemesis
from trainer.netns import leftovers, netns_available

pytestmark = pytest.mark.timeout(240)

ISOLATION_S = 8.0  # well past the lease (2 s): the backup has surely taken over


@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_the_primary_isolated_then_its_successor_killed_and_restarted_loses_nothing(mode: str) -> None:
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    config = NemesisConfig(
        mode=mode,
        seconds=ISOLATION_S + 4.0,  # one fault, then a gap longer than what is left: no second one
        seed=47,
        faults=("isolate_kill",),
        fault_s=(ISOLATION_S, ISOLATION_S),
        gap_s=(4.0, 4.0),
        timeout_s=6.0,
        slack_s=3.0,
    )
    result = run_nemesis(config)
    assert result["ok"], f"{mode}: {result['summary']}\ntimeline:\n{result.get('timeline')}\n" + "\n".join(
        f"log of {a}:\n{text}" for a, text in (result.get("server_logs") or {}).items()
    )
    fault = result["faults"][0]
    assert [f["kind"] for f in result["faults"]] == ["isolate_kill"], result["faults"]
    # The clients were acknowledged again after the restart (two copies again), before the run ended.
    assert fault["recovered_s"] is not None, result["summary"]
    assert result["report"]["stats"]["pushes_ok"] > 0
    assert leftovers(result["cluster"]) == []
