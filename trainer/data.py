"""Training data: scikit-learn's digits (shipped, no download), synthetic images, or a local MNIST ``.npz``.

The numpy loaders import no TensorFlow; ``make_dataset`` builds the ``tf.data``
pipeline, sharded per worker and prefetched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels), split stratified and reproducibly.

    Raises:
        ImportError: scikit-learn is not installed (``pip install paramserver[tf]``).
    """
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[..., None]
    y = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Split(x_train, y_train, x_test, y_test)


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
