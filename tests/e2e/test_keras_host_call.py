"""The TensorFlow adapter's host call (``host_call``: a ``tf.numpy_function`` in ``fit``'s graph): its small
outputs of one dtype leave the host function in one flat array and are split again in the graph (TensorFlow
converts each output of a ``numpy_function`` in Python, ~24 calls an output; issue 42). Checked here: the
values, dtypes and static shapes come back as declared, in order, with fewer outputs on the graph's op, and an
output of the wrong dtype or size fails the step with a clear error instead of being cast or cut."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.e2e]

tf = pytest.importorskip("tensorflow")
pytest.importorskip("keras")

from psclient.keras._tf_adapter import Adapter  # noqa: E402
from psclient.keras._tf_host import PACK_MAX_BYTES, Packing  # noqa: E402

BIG = PACK_MAX_BYTES // 4 + 1  # float32 elements: one more than the packing takes
SPECS: list[tuple[tuple[int | None, ...], str]] = [
    ((3, 4), "float32"),
    ((5,), "float32"),
    ((None,), "int64"),  # its size is known only when it runs: alone
    ((2,), "int64"),
    ((), "float32"),
    ((BIG,), "float32"),  # too large to copy: alone
    ((2, 2), "int64"),
    ((1,), "float64"),  # the only one of its dtype: alone
]


def _values(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype in SPECS:
        shape = tuple(7 if d is None else d for d in shape)
        out.append((rng.standard_normal(shape) * 100).astype(dtype))
    return out


def _traced(fn: Any) -> tuple[Any, Any, Any]:
    """``fn`` staged by the adapter's host call in a ``tf.function``: the function, its graph's outputs and
    its host call op."""

    @tf.function
    def step(x: Any) -> list[Any]:
        return Adapter().host_call(fn, [x], SPECS, "ps_test")

    concrete = step.get_concrete_function(tf.TensorSpec([], tf.int64))
    (op,) = [o for o in concrete.graph.get_operations() if o.type in ("PyFunc", "EagerPyFunc")]
    return step, concrete.structured_outputs, op


def test_small_outputs_leave_in_one_array_per_dtype_and_come_back_as_declared() -> None:
    step, staged, op = _traced(lambda seed: _values(int(seed)))
    # float32 (3, 4), (5,), () in one; int64 (2,), (2, 2) in one; (None,), the big one and float64 alone
    assert len(op.outputs) == 5
    assert [t.shape.as_list() for t in staged] == [list(shape) for shape, _ in SPECS]  # static, as declared
    for seed in (1, 2):
        got = step(tf.constant(seed, tf.int64))
        want = _values(seed)
        assert len(got) == len(SPECS)
        for tensor, expected, (_, dtype) in zip(got, want, SPECS, strict=True):
            assert tensor.dtype == tf.as_dtype(dtype)
            assert tensor.shape == expected.shape
            np.testing.assert_array_equal(tensor.numpy(), expected)


def test_no_packing_without_two_small_outputs_of_one_dtype() -> None:
    assert Packing.of([((3,), "float32"), ((None,), "float32"), ((2,), "int64")], "x") is None
    assert Packing.of([((PACK_MAX_BYTES // 4 + 1,), "float32"), ((2,), "float32")], "x") is None
    packing = Packing.of([((3,), "float32"), ((2,), "float32")], "x")
    assert packing is not None and packing.alone == []
    packing = Packing.of([(None, "float32"), ((2,), "float32"), ((3,), "float32")], "x")  # rank unknown
    assert packing is not None and packing.alone == [0]


@pytest.mark.parametrize(
    ("index", "bad", "message"),
    [
        (1, np.zeros(5, np.float64), "ps_test: output 1 is float64, not float32"),
        (0, np.zeros((4, 4), np.float32), r"ps_test: output 0 has shape \(4, 4\), not \(3, 4\)"),
        (3, np.zeros(3, np.int64), r"ps_test: output 3 has shape \(3,\), not \(2,\)"),
    ],
)
def test_an_output_of_the_wrong_dtype_or_size_fails_the_step(
    index: int, bad: np.ndarray, message: str
) -> None:
    def fn(seed: np.ndarray) -> list[np.ndarray]:
        values = _values(int(seed))
        values[index] = bad
        return values

    step, _, _ = _traced(fn)
    with pytest.raises(tf.errors.OpError, match=message):
        step(tf.constant(1, tf.int64))


def test_a_host_function_with_a_missing_output_fails_the_step() -> None:
    step, _, _ = _traced(lambda seed: _values(int(seed))[:-1])
    with pytest.raises(tf.errors.OpError, match="ps_test: the host function gave 7 outputs, not 8"):
        step(tf.constant(1, tf.int64))
