"""Tensor fusion plans: grouping by dtype, the threshold, and pack/unpack round trips."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from psclient.collective._fusion import pack, plan_buckets, unpack

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


def _arrays(specs: list[tuple[int, int]]) -> list[np.ndarray]:
    return [np.arange(n).astype(DTYPES[d]) for d, n in specs]


@given(
    specs=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 300)), max_size=30),
    threshold=st.integers(1, 2000),
)
def test_every_tensor_in_exactly_one_bucket_within_threshold(
    specs: list[tuple[int, int]], threshold: int
) -> None:
    arrays = _arrays(specs)
    buckets = plan_buckets(arrays, threshold)
    members = sorted(i for b in buckets for i in b.members)
    assert members == list(range(len(arrays)))
    for b in buckets:
        assert all(arrays[i].dtype == b.dtype for i in b.members)
        assert b.total == sum(b.sizes)
        if len(b.members) > 1:
            assert b.total * b.dtype.itemsize <= threshold
        # members keep their input order inside a bucket
        assert list(b.members) == sorted(b.members)


def test_small_tensors_fuse_and_large_ones_travel_alone() -> None:
    arrays = [np.zeros(10, np.float32), np.zeros(1000, np.float32), np.zeros(10, np.float32)]
    buckets = plan_buckets(arrays, threshold_bytes=400)
    assert [b.members for b in buckets] == [(1,), (0, 2)]


def test_threshold_zero_means_no_fusion() -> None:
    arrays = [np.zeros(3, np.float32), np.zeros(3, np.float32)]
    assert [b.members for b in plan_buckets(arrays, 0)] == [(0,), (1,)]


@given(specs=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 50)), max_size=12))
def test_pack_unpack_roundtrip(specs: list[tuple[int, int]]) -> None:
    arrays = [a.reshape(-1, 1) if a.size % 2 else a for a in _arrays(specs)]
    out: list[np.ndarray | None] = [None] * len(arrays)
    for bucket in plan_buckets(arrays, 256):
        unpack(pack(arrays, bucket), bucket, [a.shape for a in arrays], out)
    for a, b in zip(arrays, out, strict=True):
        assert b is not None and b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(a, b)


def test_pack_copies_so_inputs_are_untouched() -> None:
    a = np.ones(4, np.float32)
    bucket = plan_buckets([a], 1 << 20)[0]
    buf = pack([a], bucket)
    buf += 1
    np.testing.assert_array_equal(a, 1)
