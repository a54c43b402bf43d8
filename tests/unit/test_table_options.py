"""``psclient._tables.DynamicOptions``: the one options object of a dynamic table, whose defaults are those of
every ``create_embedding`` signature, checked in one place."""

from __future__ import annotations

import inspect

import pytest

import psclient
from psclient._tables import DynamicOptions
from pscore.errors import InvalidArgumentError
from psproto.v1 import ps_pb2


def test_the_clients_defaults_are_the_options_object_defaults() -> None:
    fields = DynamicOptions().kwargs()
    for cls in (psclient.AsyncPSClient, psclient.PSClient):
        params = inspect.signature(cls.create_embedding).parameters
        assert {n: params[n].default for n in fields} == fields, cls.__name__


def test_default_options_are_a_fixed_tables_and_any_other_is_not() -> None:
    assert DynamicOptions().is_default()
    assert not DynamicOptions(min_count=2).is_default()
    assert not DynamicOptions(key_type="string").is_default()


def test_the_wire_options_carry_every_option() -> None:
    wire = DynamicOptions(
        key_type="string", capacity=10, min_count=3, eviction="lfu", ttl_steps=5, ttl_seconds=1.5
    ).proto("t", 8, ("normal", 0.5))
    assert (wire.table, wire.dim, wire.key_type) == ("t", 8, ps_pb2.KEY_TYPE_STRING)
    assert (wire.capacity, wire.min_count, wire.eviction) == (10, 3, ps_pb2.EVICTION_LFU)
    assert (wire.ttl_steps, wire.ttl_seconds) == (5, 1.5)
    assert (wire.initializer.name, list(wire.initializer.args)) == ("normal", [0.5])
    unbounded = DynamicOptions().proto("t", 8, "zeros")
    assert (unbounded.capacity, unbounded.ttl_steps, unbounded.ttl_seconds) == (0, 0, 0.0)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (DynamicOptions(key_type="bytes"), "key_type 'bytes'"),
        (DynamicOptions(eviction="fifo"), "eviction 'fifo'"),
        (DynamicOptions(capacity=0), "capacity"),
        (DynamicOptions(capacity=True), "capacity"),  # type: ignore[arg-type]
        (DynamicOptions(min_count=0), "min_count"),
        (DynamicOptions(min_count=1 << 16), "min_count"),
        (DynamicOptions(ttl_steps=2.5), "ttl_steps"),  # type: ignore[arg-type]
        (DynamicOptions(ttl_seconds=float("nan")), "ttl_seconds"),
        (DynamicOptions(ttl_seconds=0), "ttl_seconds"),
    ],
)
def test_a_bad_option_is_refused_by_name(options: DynamicOptions, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"dynamic table 'tbl': {named}"):
        options.check("tbl")
    with pytest.raises(InvalidArgumentError, match=named):
        options.proto("tbl", 4, "uniform")


def test_a_bad_initializer_is_refused_by_the_table_name() -> None:
    with pytest.raises(InvalidArgumentError, match="dynamic table 'tbl'"):
        DynamicOptions().proto("tbl", 4, "bogus")


def test_the_options_object_is_frozen() -> None:
    with pytest.raises(AttributeError):
        DynamicOptions().capacity = 3  # type: ignore[misc]
