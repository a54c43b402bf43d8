"""The replicated shard's protocol in the deterministic simulation (``psload.simulation``).

The real shard code (``psserver.server.assemble``: store, modes, ``Primary``, ``Backup``) runs on virtual
time over a simulated network; the nemesis's checker proves each history. These tests run a few hundred
fault-seeds, the schedule that lost acknowledged pushes (issue 47), and check that a seed replays exactly.
"""

from __future__ import annotations

import json
import random

import pytest

from psload import simulation
from psload.simulation import ISOLATE_THEN_KILL_THE_SURVIVOR, Options, run_seed

SEEDS = 100  # per mode: about 8 s each on one core


def _after(result: simulation.Result, t: float) -> int:
    return sum(1 for op in result.ops if op.f == "push" and op.ok and op.invoke > t)


@pytest.mark.parametrize("mode", simulation.MODES)
def test_the_primary_isolated_then_its_successor_killed_loses_no_acknowledged_push(mode: str) -> None:
    result = run_seed(1, Options(mode=mode, seconds=20.0, schedule=ISOLATE_THEN_KILL_THE_SURVIVOR))
    assert result.ok, result.summary()
    # Two copies again once the killed process is back as the old primary's backup: the clients go on.
    restarted_at = max(f.start + f.duration for f in ISOLATE_THEN_KILL_THE_SURVIVOR)
    assert _after(result, restarted_at + 2 * 2.0) > 10, result.summary()


@pytest.mark.parametrize("mode", simulation.MODES)
def test_with_serve_alone_that_schedule_loses_what_the_survivor_acknowledged_alone(mode: str) -> None:
    # The trade --serve-alone makes, and the simulation's teeth: the same schedule, with a promoted backup
    # acknowledging on its own (what every shard did before terms and the two-copies rule), loses pushes.
    options = Options(mode=mode, seconds=20.0, schedule=ISOLATE_THEN_KILL_THE_SURVIVOR, serve_alone=True)
    result = run_seed(1, options)
    assert not result.ok
    assert "lost" in result.report.kinds(), result.summary()


@pytest.mark.parametrize("mode", simulation.MODES)
def test_fault_seeds_show_no_anomaly(mode: str) -> None:
    failed = [r for r in (run_seed(seed, Options(mode=mode)) for seed in range(SEEDS)) if not r.ok]
    assert not failed, "\n\n".join(r.summary() for r in failed[:3])


def test_every_fault_kind_is_drawn() -> None:
    kinds = {f.kind for seed in range(SEEDS) for f in simulation.plan(random.Random(seed), Options())}
    assert kinds == set(simulation.FAULT_KINDS)


def test_a_seed_replays_bit_for_bit() -> None:
    def history(seed: int) -> str:
        result = run_seed(seed, Options(mode="sync"))
        return json.dumps([op.to_json() for op in result.ops], sort_keys=True)

    first = history(7)
    assert history(7) == first
    assert history(8) != first


def test_the_command_line_reports_a_clean_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulation.main(["--seeds", "3", "--mode", "ssp"]) == 0
    assert "3 runs (ssp), 0 with anomalies" in capsys.readouterr().out
