"""Unit tests of pscore.placement: deterministic, byte-balanced placement and row partitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pscore.placement import partition_name, plan, split

MIB = 1 << 20


def _specs(seed: int, n: int) -> dict[str, tuple[tuple[int, ...], str]]:
    rng = np.random.default_rng(seed)
    return {
        f"layer{i}/kernel": (tuple(int(d) for d in rng.integers(1, 300, size=rng.integers(0, 3))), "float32")
        for i in range(n)
    }


def test_placement_is_deterministic_and_independent_of_dict_order() -> None:
    specs = _specs(0, 40)
    reordered = dict(reversed(list(specs.items())))
    a = plan(specs, num_shards=3)
    b = plan(reordered, num_shards=3)
    assert {n: [(p.stored_name, p.shard) for p in ps] for n, ps in a.items()} == {
        n: [(p.stored_name, p.shard) for p in ps] for n, ps in b.items()
    }


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_placement_balances_bytes_within_the_largest_piece(num_shards: int) -> None:
    specs = _specs(1, 60)
    placed = plan(specs, num_shards=num_shards)
    load = [0] * num_shards
    for pieces in placed.values():
        for p in pieces:
            assert 0 <= p.shard < num_shards
            load[p.shard] += p.nbytes
    largest = max(p.nbytes for ps in placed.values() for p in ps)
    assert max(load) - min(load) <= largest


def test_placement_small_variable_stays_whole() -> None:
    (piece,) = plan({"b": ((10,), "float32")}, num_shards=4)["b"]
    assert piece.stored_name == "b" and not piece.partitioned
    assert piece.stored_shape == (10,) and piece.size == 10 and piece.offset == 0


def test_placement_large_variable_is_cut_into_contiguous_partitions_on_distinct_shards() -> None:
    shape = (1000, 3000)  # 12 MB of float32
    pieces = plan({"emb": (shape, "float32")}, num_shards=4, partition_bytes=4 * MIB)["emb"]
    nbytes = math.prod(shape) * 4
    assert len(pieces) == min(4, math.ceil(nbytes / (4 * MIB)))
    assert [p.stored_name for p in pieces] == [partition_name("emb", i) for i in range(len(pieces))]
    assert len({p.shard for p in pieces}) == len(pieces)
    offset = 0
    for i, p in enumerate(pieces):
        assert (p.index, p.count, p.offset) == (i, len(pieces), offset)
        assert p.full_shape == shape and p.stored_shape == (p.size,)
        offset += p.size
    assert offset == math.prod(shape)
    sizes = [p.size for p in pieces]
    assert max(sizes) - min(sizes) <= 1


def test_placement_partition_count_is_capped_by_shards() -> None:
    pieces = split("v", (1 << 20,), "float64", num_shards=2, partition_bytes=1024)
    assert len(pieces) == 2


def test_placement_single_shard_never_partitions() -> None:
    assert len(split("v", (1 << 22,), "float32", num_shards=1, partition_bytes=1024)) == 1


@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (1,)])
def test_placement_scalar_and_empty_variables_are_one_piece(shape: tuple[int, ...]) -> None:
    (piece,) = plan({"s": (shape, "float32")}, num_shards=3, partition_bytes=1)["s"]
    assert piece.full_shape == shape and piece.stored_shape == shape and not piece.partitioned
    assert piece.size == math.prod(shape)


def test_placement_spreads_single_variable_creates_by_hash() -> None:
    shards = {plan({f"v{i}": ((4,), "float32")}, num_shards=4)[f"v{i}"][0].shard for i in range(64)}
    assert shards == {0, 1, 2, 3}


def test_placement_rejects_non_positive_shard_counts() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        plan({"a": ((1,), "float32")}, num_shards=0)


def test_placement_keeps_the_variables_named_whole_whatever_their_size() -> None:
    specs = {"cut": ((1000,), "float32"), "kept": ((1000,), "float32")}
    placed = plan(specs, 4, partition_bytes=400, whole={"kept"})
    assert len(placed["cut"]) == 4 and [p.partitioned for p in placed["kept"]] == [False]
