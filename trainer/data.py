"""Training data: scikit-learn's digits (shipped, no download), synthetic images, or a local MNIST ``.npz``.

The numpy loaders import no TensorFlow; ``make_dataset`` builds the ``tf.data``
pipeline, sharded per worker and prefetched.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("digits", "synthetic", "mnist")


@dataclass(frozen=True, slots=True)
class Split:
    """Images (N, H, W, 1) float32 in [0, 1] and integer labels (N,)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int = 10

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 handwritten digits: images ``(1797, 8, 8)`` (float64, 16 grey levels, 0-16) and
    labels ``(1797,)`` (int64), as ``sklearn.datasets.load_digits`` gives them.

    Read with numpy from the file scikit-learn ships them in (``sklearn/datasets/data/digits.csv.gz``),
    found without importing scikit-learn: ``import sklearn`` takes about 0.9 s of CPU (it imports
    ``scipy.stats``), most of a small job's start-up and once in every worker process. Where that file is
    not where it has been since scikit-learn 0.x, this calls ``load_digits``.

    Raises:
        ImportError: scikit-learn is not installed (``pip install paramserver[tf]``).
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or ():
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")  # 64 pixels, then the label, a row per image
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, test)``: ``ceil(test_fraction * n)`` examples in the test part, each label's share of
    them in proportion to its examples (the largest remainders get the rounding), each part in a random
    order; the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    n_test = math.ceil(len(labels) * test_fraction)
    quota = counts * n_test / len(labels)
    k = np.floor(quota).astype(np.int64)
    k[np.argsort(k - quota, kind="stable")[: n_test - int(k.sum())]] += 1  # the largest remainders
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label, n_test in zip(classes, k, strict=True):
        members = rng.permutation(np.flatnonzero(labels == label))
        test.append(members[:n_test])
        train.append(members[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels; ``digits``), split stratified and
    reproducibly (``stratified_split``): 1,437 training and 360 test images at the default fraction.

    Raises:
        ImportError: scikit-learn is not installed (``pip install paramserver[tf]``).
    """
    images, labels = digits()
    x = (images / 16.0).astype(np.float32)[..., None]
    train, test = stratified_split(labels, test_fraction, seed)
    return Split(x[train], labels[train], x[test], labels[test])


def load_synthetic(num_train: int = 4096, num_test: int = 512, image_size: int = 28, seed: int = 0) -> Split:
    """Random images with random labels, any size (for throughput benchmarks; nothing to learn)."""
    rng = np.random.default_rng(seed)
    shape = (image_size, image_size, 1)
    return Split(
        rng.random((num_train, *shape), dtype=np.float32),
        rng.integers(0, 10, num_train),
        rng.random((num_test, *shape), dtype=np.float32),
        rng.integers(0, 10, num_test),
    )


def load_mnist_npz(path: str) -> Split:
    """A local MNIST file in ``keras.datasets.mnist`` format (``x_train, y_train, x_test, y_test``).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file lacks one of the four arrays.
    """
    with np.load(path) as f:
        missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)} (expected keras mnist.npz layout)")
        xs = [f[k] for k in ("x_train", "y_train", "x_test", "y_test")]

    def images(a: np.ndarray) -> np.ndarray:
        a = a.astype(np.float32)
        if a.max(initial=0) > 1.0:
            a /= 255.0
        return a[..., None] if a.ndim == 3 else a

    return Split(images(xs[0]), xs[1].astype(np.int64), images(xs[2]), xs[3].astype(np.int64))


def load(name: str, *, path: str | None = None, num_train: int = 4096, image_size: int = 28) -> Split:
    """Loads a dataset by name: ``digits``, ``synthetic`` or ``mnist`` (needs ``path``).

    Raises:
        ValueError: unknown name, or ``mnist`` without a path.
    """
    if name == "digits":
        return load_digits()
    if name == "synthetic":
        return load_synthetic(num_train=num_train, image_size=image_size)
    if name == "mnist":
        if not path:
            raise ValueError("--data mnist needs --data-path FILE.npz (keras mnist.npz layout; no download)")
        return load_mnist_npz(path)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def steps_per_epoch(n: int, batch_size: int, num_workers: int = 1) -> int:
    return math.ceil((n // num_workers) / batch_size)


def make_dataset(
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int,
    num_workers: int = 1,
    worker_index: int = 0,
    shuffle: bool = True,
    seed: int = 0,
) -> Any:
    """A ``tf.data`` pipeline over this worker's shard: shuffled each epoch, batched, prefetched.

    Every worker gets the same number of examples (and so of steps), which the
    sync and ssp modes rely on.
    """
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y))  # x: an array, or a dict of them (named inputs)
    n = (len(y) // num_workers) * num_workers
    ds = ds.take(n).shard(num_workers, worker_index)
    if shuffle:
        ds = ds.shuffle(max(1, n // num_workers), seed=seed + worker_index, reshuffle_each_iteration=True)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)
