"""Tensor fusion: packing many small tensors into few flat buffers, one collective per buffer.

Like Horovod's tensor fusion (``HOROVOD_FUSION_THRESHOLD``), tensors are taken
in order, grouped by dtype, and appended to the open buffer of their dtype
until adding the next one would pass the threshold; a tensor at least as large
as the threshold travels alone. Every rank computes the same plan from the same
list of shapes and dtypes.

>>> import numpy as np
>>> arrays = [np.ones(3, np.float32), np.ones(2, np.int64), np.ones(5, np.float32)]
>>> [(b.dtype.name, b.members, b.total) for b in plan_buckets(arrays, threshold_bytes=1024)]
[('float32', (0, 2), 8), ('int64', (1,), 2)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Bucket:
    """One fused buffer: which tensors (indices into the input list) sit where.

    Attributes:
        dtype: element type of every member.
        members: indices of the member tensors in the input list, in buffer order.
        offsets: flat element offset of each member in the buffer.
        sizes: element count of each member.
        total: elements in the buffer.
    """

    dtype: np.dtype
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int


def plan_buckets(arrays: Sequence[np.ndarray], threshold_bytes: int) -> list[Bucket]:
    """Groups ``arrays`` into fusion buckets of at most ``threshold_bytes`` each (see module doc).

    Buckets come out in the order in which they were closed, which is the same on
    every rank for the same shapes and dtypes.
    """
    open_: dict[np.dtype, tuple[list[int], list[int], list[int], int]] = {}
    done: list[Bucket] = []

    def close(dt: np.dtype) -> None:
        members, offsets, sizes, total = open_.pop(dt)
        done.append(Bucket(dt, tuple(members), tuple(offsets), tuple(sizes), total))

    for i, arr in enumerate(arrays):
        dt = arr.dtype
        nbytes = arr.size * dt.itemsize
        if nbytes >= threshold_bytes:
            done.append(Bucket(dt, (i,), (0,), (arr.size,), arr.size))
            continue
        if dt in open_ and (open_[dt][3] * dt.itemsize + nbytes > threshold_bytes):
            close(dt)
        members, offsets, sizes, total = open_.setdefault(dt, ([], [], [], 0))
        members.append(i)
        offsets.append(total)
        sizes.append(arr.size)
        open_[dt] = (members, offsets, sizes, total + arr.size)
    for dt in list(open_):
        close(dt)
    return done


def pack(arrays: Sequence[np.ndarray], bucket: Bucket) -> np.ndarray:
    """Copies the bucket's members into one new flat buffer."""
    if len(bucket.members) == 1:
        return np.array(arrays[bucket.members[0]], dtype=bucket.dtype, order="C").reshape(-1)
    buf = np.empty(bucket.total, bucket.dtype)
    for i, off, n in zip(bucket.members, bucket.offsets, bucket.sizes, strict=True):
        buf[off : off + n] = np.asarray(arrays[i]).reshape(-1)
    return buf


def unpack(
    buf: np.ndarray, bucket: Bucket, shapes: Sequence[tuple[int, ...]], out: list[np.ndarray | None]
) -> None:
    """Stores views of ``buf`` shaped like the bucket's members into ``out`` (indexed like the input)."""
    for i, off, n in zip(bucket.members, bucket.offsets, bucket.sizes, strict=True):
        out[i] = buf[off : off + n].reshape(shapes[i])
