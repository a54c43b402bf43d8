"""The worker command lines the demo launches (``demo.worker_command``, ``allreduce_loop.rank_command``),
which ``bench/bench_keras_netns.py`` runs inside namespace hosts: pstrain's own parser reads them back as
the worker the demo meant."""

from __future__ import annotations

import argparse

import pytest

from trainer import allreduce_loop, demo, options
from trainer.__main__ import build_parser


def _demo(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["demo", *argv])
    options.resolve_model_defaults(args)
    return args


def _worker(cmd: list[str]) -> argparse.Namespace:
    assert cmd[1:4] == ["-m", "trainer", "worker"]
    args = build_parser().parse_args(cmd[3:])
    options.resolve_model_defaults(args)
    return args


def test_worker_command_is_a_ps_worker_of_the_demo() -> None:
    args = _demo("--mode", "sync", "--workers", "3", "--model", "mlp", "--epochs", "4", "--no-overlap")
    w = _worker(demo.worker_command(args, 2, ["10.0.0.1:5000", "10.0.0.2:5000"], "/tmp/w2.json"))
    assert (w.mode, w.ps, w.worker_index, w.num_workers) == ("sync", "10.0.0.1:5000,10.0.0.2:5000", 2, 3)
    assert (w.model, w.epochs, w.result_json, w.overlap) == ("mlp", 4, "/tmp/w2.json", "off")
    assert w.learning_rate == 3e-3  # sync: the demo's linear scaling, x workers
    assert w.partition_bytes is None  # the client's default
    assert w.evaluate_json is None  # only worker 0 scores the model, when the demo asks it to


def test_the_demos_worker_0_scores_the_model_for_it() -> None:
    args = _demo("--mode", "async", "--model", "mlp")
    w = _worker(demo.worker_command(args, 0, ["10.0.0.1:5000"], "/tmp/w0.json", "/tmp/scores.json"))
    assert (w.worker_index, w.result_json, w.evaluate_json) == (0, "/tmp/w0.json", "/tmp/scores.json")


def test_partition_bytes_goes_to_every_worker_and_a_negative_one_is_refused() -> None:
    args = _demo("--mode", "async", "--model", "mlp", "--partition-bytes", "262144")
    w = _worker(demo.worker_command(args, 0, ["10.0.0.1:5000"], "/tmp/w0.json"))
    assert w.partition_bytes == 262144
    with pytest.raises(SystemExit):
        _demo("--partition-bytes", "-1")


@pytest.mark.parametrize(
    ("flags", "workers", "mode", "passed", "overlaps"),
    [
        ((), 2, "async", "auto", True),  # the demo's default cluster keeps overlapping
        ((), 4, "ssp", "auto", True),
        ((), 5, "async", "auto", False),  # 2n - 1 = 9 updates stale with it: past what trained
        ((), 8, "sync", "auto", False),  # sync never overlaps
        (("--overlap", "on"), 8, "async", "on", True),
        (("--no-overlap",), 2, "async", "off", False),
        (("--overlap", "off"), 2, "async", "off", False),
    ],
)
def test_overlap_auto_stops_where_the_staleness_it_adds_would_hurt(
    flags: tuple[str, ...], workers: int, mode: str, passed: str, overlaps: bool
) -> None:
    args = _demo("--mode", mode, "--workers", str(workers), "--model", "mlp", *flags)
    w = _worker(demo.worker_command(args, 0, ["10.0.0.1:5000"], "/tmp/w0.json"))
    assert w.overlap == passed  # the worker decides "auto" itself, from its own --num-workers
    assert options.overlap(w.overlap, w.mode, w.num_workers) is overlaps


def test_rank_command_is_a_ring_rank_of_the_demo() -> None:
    args = _demo("--mode", "allreduce", "--workers", "2", "--compression", "fp16")
    ring = ["10.0.0.3:7000", "10.0.0.4:7000"]
    w = _worker(allreduce_loop.rank_command(args, 1, ring, "/tmp/r1.json"))
    assert (w.mode, w.ring, w.worker_index, w.compression) == ("allreduce", ",".join(ring), 1, "fp16")
    assert w.learning_rate == 1e-3  # the rank scales it itself (train_rank), unless --no-lr-scaling
