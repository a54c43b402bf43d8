"""MNIST-shaped data without a download: scikit-learn's 8x8 digits, scaled 3x and padded to 28x28.

``load_data()`` returns what ``keras.datasets.mnist.load_data()`` returns (uint8 images of
shape (n, 28, 28), uint8 labels), so the Horovod examples change one line for their data:
1,500 training and 297 test images.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_TRAIN = 1500  # of sklearn's 1,797 digits; the rest are the test split


def load_data(path: str = "mnist.npz") -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """``((x_train, y_train), (x_test, y_test))`` like ``mnist.load_data`` (``path`` is accepted, unused)."""
    from trainer.data import digits  # scikit-learn's, read without importing scikit-learn (~0.9 s of CPU)

    images, labels = digits()
    images = np.kron(images, np.ones((3, 3)))  # 8x8 -> 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))  # -> 28x28, as MNIST's centered digits
    images = np.round(images * (255.0 / 16.0)).astype(np.uint8)
    labels = labels.astype(np.uint8)
    return (images[:_TRAIN], labels[:_TRAIN]), (images[_TRAIN:], labels[_TRAIN:])
