"""``trainer.data``: scikit-learn's digits read without importing scikit-learn, and their stratified split."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from trainer import data


def test_digits_are_scikit_learns_and_read_without_importing_it() -> None:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    images, labels = data.digits()
    bunch = sklearn_datasets.load_digits()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)
    assert images.dtype == bunch.images.dtype and labels.dtype == np.int64
    probe = "import sys; from trainer import data; data.load_digits(); print('sklearn' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.25, 0.5])
def test_the_split_holds_each_labels_share_and_repeats_by_seed(fraction: float) -> None:
    labels = np.repeat(np.arange(4), [5, 7, 9, 30])
    train, test = data.stratified_split(labels, fraction, seed=3)
    assert len(test) == int(np.ceil(fraction * len(labels))) and len(train) + len(test) == len(labels)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(labels)))  # each index once
    share = np.bincount(labels[test], minlength=4)
    assert np.all(np.abs(share - fraction * np.bincount(labels)) < 1 + 1e-9)  # each label's share, rounded
    again = data.stratified_split(labels, fraction, seed=3)
    np.testing.assert_array_equal(again[0], train)
    np.testing.assert_array_equal(again[1], test)
    assert not np.array_equal(data.stratified_split(labels, fraction, seed=4)[1], test)


def test_load_digits_is_the_whole_set_in_two_disjoint_parts() -> None:
    split = data.load_digits()
    assert split.x_train.shape == (1437, 8, 8, 1) and split.x_test.shape == (360, 8, 8, 1)
    assert split.x_train.dtype == np.float32 and split.x_train.min() >= 0.0 and split.x_train.max() <= 1.0
    assert np.bincount(split.y_test).min() >= 35  # every digit in the test part, ~36 each
    images, _ = data.digits()
    flat = {row.tobytes() for row in (images / 16.0).astype(np.float32).reshape(len(images), -1)}
    ours = {row.tobytes() for row in np.concatenate([split.x_train, split.x_test]).reshape(1797, -1)}
    assert ours == flat
