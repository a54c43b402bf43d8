"""The wide_deep demo's synthetic click log, its AUC, and the CLI's per-model defaults (no TF)."""

from __future__ import annotations

import numpy as np
import pytest

from trainer import clicks
from trainer.__main__ import build_parser
from trainer.options import resolve_model_defaults


def test_the_click_log_is_deterministic_power_law_and_keyed_by_wide_ids() -> None:
    a = clicks.generate(num_train=20_000, num_test=5_000, num_users=50_000, num_items=5_000, seed=3)
    b = clicks.generate(num_train=20_000, num_test=5_000, num_users=50_000, num_items=5_000, seed=3)
    for k in a.train:
        np.testing.assert_array_equal(a.train[k], b.train[k])
    users, counts = np.unique(a.train["user_index"], return_counts=True)
    assert counts.max() > 100 and np.mean(counts == 1) > 0.5  # a head, and a long tail seen once
    assert a.train["user"].dtype == np.int64 and a.train["user"].min() >= 0 and a.train["user"].max() > 2**60
    # one raw id per user (the local baseline's index and the dynamic table's key agree)
    assert np.unique(a.train["user"]).size == users.size
    assert a.train["category"].dtype.kind == "U" and np.unique(a.train["category"]).size <= 100
    assert 0.1 < a.y_train.mean() < 0.4
    assert 0.75 < a.best_auc < 0.85


def test_auc_matches_the_pairwise_definition_with_ties() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    s = np.round(rng.random(300), 1)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert clicks.auc(y, s) == pytest.approx(pairs)
    with pytest.raises(ValueError, match="both positive and negative"):
        clicks.auc(np.ones(3), np.arange(3.0))


def test_wide_deep_gets_its_defaults_and_refuses_mismatched_flags() -> None:
    args = build_parser().parse_args(["demo", "--model", "wide_deep"])
    resolve_model_defaults(args)
    assert (args.data, args.synthetic_size, args.epochs, args.batch_size, args.learning_rate) == (
        "clicks", 500_000, 1, 256, 0.1,
    )  # fmt: skip
    args = build_parser().parse_args(["demo"])
    resolve_model_defaults(args)
    assert (args.data, args.epochs, args.batch_size, args.learning_rate) == ("digits", 10, 32, 1e-3)
    for argv, message in [
        (["demo", "--model", "wide_deep", "--data", "digits"], "only it does"),
        (["demo", "--data", "clicks"], "only it does"),
        (["demo", "--model", "wide_deep", "--mode", "allreduce"], "--mode async, sync, ssp or local"),
        (["demo", "--model", "wide_deep", "--table-capacity", "0"], "--table-capacity must be >= 1"),
        (["demo", "--model", "wide_deep", "--min-count", "0"], "--min-count must be >= 1"),
    ]:
        args = build_parser().parse_args(argv)
        with pytest.raises(ValueError, match=message):
            resolve_model_defaults(args)
