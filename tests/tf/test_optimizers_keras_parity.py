"""Parity of psserver.optimizers with keras.optimizers (Keras 3) on the same seeded gradients, float32."""

from __future__ import annotations

import numpy as np
import pytest

from psclient import optimizers as specs
from psserver import optimizers as server

pytestmark = pytest.mark.tf

STEPS = 10
SHAPE = (6, 5)

VARIANTS: list[tuple[str, dict]] = [
    ("SGD", {}),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("Adagrad", {}),
    ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.01, "epsilon": 1e-6}),
    ("Adam", {}),
    ("Adam", {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6}),
    ("Adam", {"learning_rate": 0.01, "amsgrad": True}),
    ("RMSprop", {}),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.9}),
    ("RMSprop", {"learning_rate": 0.01, "rho": 0.8, "centered": True}),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True}),
]


@pytest.fixture(scope="module")
def keras():
    pytest.importorskip("tensorflow")
    return pytest.importorskip("keras")


@pytest.mark.parametrize(("class_name", "kwargs"), VARIANTS, ids=[f"{c}{k}" for c, k in VARIANTS])
def test_matches_keras_step_by_step(keras, class_name: str, kwargs: dict) -> None:
    keras_opt = getattr(keras.optimizers, class_name)(**kwargs)
    spec = specs.optimizer_from_config(class_name, keras_opt.get_config())
    assert spec == getattr(specs, class_name)(**kwargs)
    ours = server.from_spec(spec.to_proto())

    rng = np.random.default_rng(1234)
    initial = rng.standard_normal(SHAPE).astype(np.float32)
    variable = keras.Variable(initial, dtype="float32")
    value = initial.copy()
    slots = ours.init_slots(value)
    for step in range(STEPS):
        # Gradients of varying scale and sign, some exact zeros.
        grad = (rng.standard_normal(SHAPE) * rng.choice([0.0, 0.1, 1.0, 3.0], SHAPE)).astype(np.float32)
        keras_opt.apply_gradients([(keras.ops.convert_to_tensor(grad), variable)])
        value = ours.apply(value, grad, slots, step)
        np.testing.assert_allclose(
            value, np.asarray(variable.numpy()), rtol=1e-5, atol=1e-7, err_msg=f"step {step + 1}"
        )
    assert int(keras_opt.iterations.numpy()) == STEPS


def test_keras_defaults_match_the_specs(keras) -> None:
    for class_name in ("SGD", "Adagrad", "Adam", "RMSprop"):
        config = getattr(keras.optimizers, class_name)().get_config()
        assert specs.optimizer_from_config(class_name, config) == getattr(specs, class_name)()
