"""``trainer.demo.native_stderr_held``: native fd-2 noise is held back, and replayed when the block fails."""

from __future__ import annotations

import os

import pytest

from trainer.demo import native_stderr_held


def test_native_stderr_is_held_back_when_the_block_succeeds(capfd: pytest.CaptureFixture[str]) -> None:
    with native_stderr_held():
        os.write(2, b"I0000 start-up noise\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_native_stderr_is_replayed_when_the_block_fails(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="boom"), native_stderr_held():
        os.write(2, b"E0000 the reason it failed\n")
        raise RuntimeError("boom")
    assert "E0000 the reason it failed" in capfd.readouterr().err
