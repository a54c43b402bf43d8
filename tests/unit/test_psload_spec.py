"""psload's model spec and statistics (pure)."""

from __future__ import annotations

import pytest

from psload import report
from psload.runner import LoadConfig
from psload.spec import ModelSpec, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("64KiB", 65536), ("1MiB", 1 << 20), ("2.5MB", 2_500_000), ("1k", 1000)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "abc", "1XB", "-4", "1.2.3MiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_model_spec() -> None:
    spec = ModelSpec.parse("2x1MiB, 3x64KiB,16")
    assert spec.sizes == (1 << 20, 1 << 20, 65536, 65536, 65536, 16)
    assert spec.total_bytes == 2 * (1 << 20) + 3 * 65536 + 16
    assert spec.shapes()[0] == ((1 << 20) // 4,)
    assert spec.names("p")[0] == "p/v0_262144"
    assert len(set(spec.names())) == 6
    assert spec.describe() == "2x1MiB,3x64KiB,1x16B"


@pytest.mark.parametrize("text", ["0x1MiB", "2x2", "x", "3y4KiB", ""])
def test_model_spec_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        ModelSpec.parse(text)


def test_load_config_validates() -> None:
    with pytest.raises(ValueError, match="workers"):
        LoadConfig(workers=0)
    with pytest.raises(ValueError, match="op"):
        LoadConfig(op="fly")
    with pytest.raises(ValueError, match="push"):
        LoadConfig(mode="sync", op="pull")


def test_collector_timeline_and_percentiles() -> None:
    c = report.Collector()
    c.add(0, 2, 200, 0, [0.001, 0.003])
    c.add(0, 1, 100, 1, [0.002])
    c.add(1, 1, 100, 0, [0.010])
    c.add(2, 1, 100, 0, [0.010])  # past a 2 s run: the last in-flight step
    rows = c.timeline(duration_s=2.0)
    assert [r["steps_per_s"] for r in rows] == [3, 1, 1]
    assert [r["partial"] for r in rows] == [False, False, True]
    assert rows[0]["p50_ms"] == pytest.approx(2.0)
    assert rows[0]["errors"] == 1
    assert c.totals() == (5, 500, 1)
    assert report.percentiles([])["p99_ms"] is None
    assert "3 steps/s" in " ".join(c.progress_line(0, 2.0, 2).split())
