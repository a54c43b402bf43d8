"""Unit tests of the optimizer specs (pscore.optimizers) and update rules (psserver.optimizers)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pscore import optimizers as specs
from psproto.v1 import ps_pb2
from psserver import optimizers as server

ALL_VARIANTS: list[specs.Optimizer] = [
    specs.SGD(),
    specs.SGD(learning_rate=0.1, momentum=0.9),
    specs.SGD(learning_rate=0.1, momentum=0.9, nesterov=True),
    specs.Adagrad(),
    specs.Adagrad(learning_rate=0.05, initial_accumulator_value=0.5, epsilon=1e-6),
    specs.Adam(),
    specs.Adam(learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6, amsgrad=True),
    specs.RMSprop(),
    specs.RMSprop(learning_rate=0.01, momentum=0.5),
    specs.RMSprop(learning_rate=0.01, rho=0.8, centered=True),
    specs.RMSprop(learning_rate=0.01, momentum=0.9, centered=True),
]


def _ids(opt: specs.Optimizer) -> str:
    return repr(opt)


# ---------------------------------------------------------------------------
# Independent reference: the Keras 3 formulas, element by element, in Python floats.
# ---------------------------------------------------------------------------


def _reference_step(opt: specs.Optimizer, w: float, g: float, s: dict[str, float], t: int) -> float:
    """One step on one element; ``t`` is the 0-based iteration. Updates ``s`` in place."""
    if isinstance(opt, specs.SGD):
        if opt.momentum == 0:
            return w - opt.learning_rate * g
        s["momentum"] = opt.momentum * s["momentum"] - opt.learning_rate * g
        if opt.nesterov:
            return w + opt.momentum * s["momentum"] - opt.learning_rate * g
        return w + s["momentum"]
    if isinstance(opt, specs.Adagrad):
        s["accumulator"] += g * g
        return w - opt.learning_rate * g / math.sqrt(s["accumulator"] + opt.epsilon)
    if isinstance(opt, specs.Adam):
        step = t + 1
        s["momentum"] = opt.beta_1 * s["momentum"] + (1 - opt.beta_1) * g
        s["velocity"] = opt.beta_2 * s["velocity"] + (1 - opt.beta_2) * g * g
        v = s["velocity"]
        if opt.amsgrad:
            s["velocity_hat"] = max(s["velocity_hat"], v)
            v = s["velocity_hat"]
        alpha = opt.learning_rate * math.sqrt(1 - opt.beta_2**step) / (1 - opt.beta_1**step)
        return w - s["momentum"] * alpha / (math.sqrt(v) + opt.epsilon)
    if isinstance(opt, specs.RMSprop):
        s["velocity"] = opt.rho * s["velocity"] + (1 - opt.rho) * g * g
        if opt.centered:
            s["average_gradient"] = opt.rho * s["average_gradient"] + (1 - opt.rho) * g
            denominator = s["velocity"] - s["average_gradient"] ** 2 + opt.epsilon
        else:
            denominator = s["velocity"] + opt.epsilon
        increment = opt.learning_rate * g / math.sqrt(denominator)
        if opt.momentum > 0:
            s["momentum"] = opt.momentum * s["momentum"] + increment
            return w - s["momentum"]
        return w - increment
    raise AssertionError(opt)


def _reference_run(opt: specs.Optimizer, w0: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
    """Runs the reference over whole arrays; returns the value after each step (float64)."""
    initial = {name: 0.0 for name in server.from_config(opt).slot_names()}
    if isinstance(opt, specs.Adagrad):
        initial["accumulator"] = opt.initial_accumulator_value
    flat_w = [float(x) for x in w0.reshape(-1)]
    states = [dict(initial) for _ in flat_w]
    history = []
    for t, grad in enumerate(grads):
        flat_g = [float(x) for x in grad.reshape(-1)]
        flat_w = [_reference_step(opt, w, g, s, t) for w, g, s in zip(flat_w, flat_g, states, strict=True)]
        history.append(np.array(flat_w, dtype=np.float64).reshape(w0.shape))
    return history


def _run(opt: specs.Optimizer, w0: np.ndarray, grads: list[np.ndarray], first_iteration: int = 0):
    impl = server.from_config(opt)
    slots = impl.init_slots(w0)
    value = w0
    history = []
    for i, grad in enumerate(grads):
        value = impl.apply(value, grad, slots, first_iteration + i)
        history.append(value)
    return history, slots


# ---------------------------------------------------------------------------
# Hand-computed values
# ---------------------------------------------------------------------------


ONES = np.ones(3, dtype=np.float64)


@pytest.mark.parametrize(
    ("opt", "expected"),
    [
        (specs.SGD(learning_rate=0.1), [0.9, 0.8, 0.7]),
        (specs.SGD(learning_rate=0.1, momentum=0.9), [0.9, 0.71, 0.439]),
        (specs.SGD(learning_rate=0.1, momentum=0.9, nesterov=True), [0.81, 0.539, 0.1951]),
        (
            specs.Adagrad(learning_rate=0.1, initial_accumulator_value=0.1, epsilon=0.0),
            [
                1 - 0.1 / math.sqrt(1.1),
                1 - 0.1 / math.sqrt(1.1) - 0.1 / math.sqrt(2.1),
                1 - 0.1 / math.sqrt(1.1) - 0.1 / math.sqrt(2.1) - 0.1 / math.sqrt(3.1),
            ],
        ),
        # A constant gradient and epsilon 0: bias-corrected Adam moves by exactly lr.
        (specs.Adam(learning_rate=0.1, epsilon=0.0), [0.9, 0.8, 0.7]),
        (specs.Adam(learning_rate=0.1, epsilon=0.0, amsgrad=True), [0.9, 0.8, 0.7]),
        (
            specs.RMSprop(learning_rate=0.01, rho=0.9, epsilon=0.0),
            [1 - 0.01 / math.sqrt(0.1), 1 - 0.01 / math.sqrt(0.1) - 0.01 / math.sqrt(0.19)],
        ),
        (
            specs.RMSprop(learning_rate=0.01, rho=0.9, epsilon=0.0, centered=True),
            # v = 0.1, a = 0.1, d = 0.1 - 0.01 = 0.09; then v = 0.19, a = 0.19, d = 0.19 - 0.0361
            [1 - 0.01 / 0.3, 1 - 0.01 / 0.3 - 0.01 / math.sqrt(0.19 - 0.0361)],
        ),
        (
            specs.RMSprop(learning_rate=0.01, rho=0.9, epsilon=0.0, momentum=0.5),
            # m = inc1; then m = 0.5 * inc1 + inc2
            [
                1 - 0.01 / math.sqrt(0.1),
                1 - 0.01 / math.sqrt(0.1) - (0.5 * 0.01 / math.sqrt(0.1) + 0.01 / math.sqrt(0.19)),
            ],
        ),
    ],
    ids=_ids,
)
def test_hand_computed_values(opt: specs.Optimizer, expected: list[float]) -> None:
    history, _ = _run(opt, ONES, [ONES] * len(expected))
    for step, (got, want) in enumerate(zip(history, expected, strict=True)):
        np.testing.assert_allclose(got, np.full(3, want), rtol=1e-12, err_msg=f"step {step + 1}")


def test_adam_amsgrad_keeps_the_largest_second_moment() -> None:
    opt = specs.Adam(learning_rate=0.1, epsilon=0.0, amsgrad=True)
    grads = [np.array([1.0]), np.array([0.0])]
    history, slots = _run(opt, np.array([1.0]), grads)
    # step 2: m = 0.09, v = 0.000999 < vhat = 0.001
    assert slots["velocity"][0] == pytest.approx(0.000999)
    assert slots["velocity_hat"][0] == pytest.approx(0.001)
    alpha = 0.1 * math.sqrt(1 - 0.999**2) / (1 - 0.9**2)
    assert history[1][0] == pytest.approx(0.9 - 0.09 * alpha / math.sqrt(0.001), rel=1e-12)


def test_adam_bias_correction_uses_the_iteration() -> None:
    opt = specs.Adam(learning_rate=0.1, epsilon=0.0)
    impl = server.from_config(opt)
    slots = {"momentum": np.array([0.5]), "velocity": np.array([0.25])}
    new = impl.apply(np.array([1.0]), np.array([0.5]), slots, iteration=4)
    alpha = 0.1 * math.sqrt(1 - 0.999**5) / (1 - 0.9**5)
    assert new[0] == pytest.approx(1 - 0.5 * alpha / 0.5, rel=1e-12)


# ---------------------------------------------------------------------------
# Against the independent reference, random data, several steps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ALL_VARIANTS, ids=_ids)
def test_matches_reference_float64(opt: specs.Optimizer) -> None:
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((4, 5))
    grads = [rng.standard_normal((4, 5)) for _ in range(3)]
    history, _ = _run(opt, w0, grads)
    for step, (got, want) in enumerate(zip(history, _reference_run(opt, w0, grads), strict=True)):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"step {step + 1}")


@pytest.mark.parametrize("opt", ALL_VARIANTS, ids=_ids)
def test_float16_is_computed_in_float32_and_rounded_back(opt: specs.Optimizer) -> None:
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(50).astype(np.float16)
    grads = [rng.standard_normal(50).astype(np.float16) for _ in range(3)]
    history, slots = _run(opt, w0, grads)
    reference = _reference_run(opt, w0.astype(np.float64), [g.astype(np.float64) for g in grads])
    for got, want in zip(history, reference, strict=True):
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2, atol=1e-2)
    assert all(s.dtype == np.float16 for s in slots.values())


@pytest.mark.parametrize("opt", ALL_VARIANTS, ids=_ids)
def test_blocks_give_the_same_result_as_one_pass(opt: specs.Optimizer, monkeypatch) -> None:
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal((7, 9)).astype(np.float32)
    grads = [rng.standard_normal((7, 9)).astype(np.float32) for _ in range(3)]
    whole, whole_slots = _run(opt, w0, grads)
    monkeypatch.setattr(server, "BLOCK_ELEMENTS", 5)
    blocked, blocked_slots = _run(opt, w0, grads)
    for a, b in zip(whole, blocked, strict=True):
        np.testing.assert_array_equal(a, b)
    for name in whole_slots:
        np.testing.assert_array_equal(whole_slots[name], blocked_slots[name])


# ---------------------------------------------------------------------------
# apply's contract
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ALL_VARIANTS, ids=_ids)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_apply_returns_a_new_array_and_leaves_the_value_alone(opt: specs.Optimizer, dtype) -> None:
    rng = np.random.default_rng(5)
    value = rng.standard_normal((3, 4)).astype(dtype)
    before = value.copy()
    value.flags.writeable = False
    grad = np.frombuffer(rng.standard_normal(12).astype(dtype).tobytes(), dtype=dtype).reshape(3, 4)
    impl = server.from_config(opt)
    slots = impl.init_slots(value)
    new = impl.apply(value, grad, slots, 0)
    np.testing.assert_array_equal(value, before)
    assert new.dtype == value.dtype
    assert new.shape == value.shape
    assert new.flags.c_contiguous and new.flags.writeable
    assert not np.shares_memory(new, value)
    assert not np.array_equal(new, value)


def test_gradient_of_another_dtype_is_cast_to_the_variable_dtype() -> None:
    impl = server.from_config(specs.SGD(learning_rate=0.5))
    value = np.ones(4, dtype=np.float32)
    new = impl.apply(value, np.full(4, 2.0, dtype=np.float64), {}, 0)
    assert new.dtype == np.float32
    np.testing.assert_array_equal(new, np.zeros(4, dtype=np.float32))


def test_scalar_and_empty_variables() -> None:
    impl = server.from_config(specs.Adam())
    scalar = np.ones((), dtype=np.float32)
    new = impl.apply(scalar, np.ones((), dtype=np.float32), impl.init_slots(scalar), 0)
    assert new.shape == ()
    assert new < 1.0
    empty = np.zeros((0, 3), dtype=np.float32)
    assert impl.apply(empty, empty, impl.init_slots(empty), 0).shape == (0, 3)


def test_non_contiguous_slots_are_updated() -> None:
    impl = server.from_config(specs.SGD(learning_rate=0.1, momentum=0.9))
    value = np.ones((3, 2))
    slots = {"momentum": np.zeros((2, 3)).T}
    assert not slots["momentum"].flags.c_contiguous
    impl.apply(value, np.ones((3, 2)), slots, 0)
    np.testing.assert_allclose(slots["momentum"], np.full((3, 2), -0.1))


def test_nan_gradients_propagate_without_warnings() -> None:
    impl = server.from_config(specs.Adam())
    value = np.ones(2, dtype=np.float32)
    new = impl.apply(value, np.array([np.nan, 1.0], dtype=np.float32), impl.init_slots(value), 0)
    assert np.isnan(new[0]) and np.isfinite(new[1])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_non_float_variables_are_not_trainable(dtype) -> None:
    impl = server.from_config(specs.Adam())
    value = np.zeros(3, dtype=dtype)
    assert impl.init_slots(value) == {}
    with pytest.raises(TypeError, match="not trainable"):
        impl.apply(value, np.zeros(3, dtype=np.float32), {}, 0)


def test_apply_rejects_bad_arguments() -> None:
    impl = server.from_config(specs.Adam(amsgrad=True))
    value = np.zeros(3, dtype=np.float32)
    slots = impl.init_slots(value)
    with pytest.raises(TypeError, match="gradient dtype"):
        impl.apply(value, np.zeros(3, dtype=np.int32), slots, 0)
    with pytest.raises(ValueError, match="shape"):
        impl.apply(value, np.zeros(4, dtype=np.float32), slots, 0)
    with pytest.raises(ValueError, match="iteration"):
        impl.apply(value, value, slots, -1)
    with pytest.raises(ValueError, match="velocity_hat"):
        impl.apply(value, value, {"momentum": slots["momentum"], "velocity": slots["velocity"]}, 0)
    with pytest.raises(ValueError, match="slot 'momentum' has shape"):
        impl.apply(value, value, {**slots, "momentum": np.zeros(2, dtype=np.float32)}, 0)
    readonly = slots["velocity"].copy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        impl.apply(value, value, {**slots, "velocity": readonly}, 0)


@pytest.mark.parametrize(
    ("opt", "expected"),
    [
        (specs.SGD(), {}),
        (specs.SGD(momentum=0.9), {"momentum": 0.0}),
        (specs.Adagrad(initial_accumulator_value=0.25), {"accumulator": 0.25}),
        (specs.Adam(), {"momentum": 0.0, "velocity": 0.0}),
        (specs.Adam(amsgrad=True), {"momentum": 0.0, "velocity": 0.0, "velocity_hat": 0.0}),
        (specs.RMSprop(), {"velocity": 0.0}),
        (
            specs.RMSprop(momentum=0.9, centered=True),
            {"velocity": 0.0, "momentum": 0.0, "average_gradient": 0.0},
        ),
    ],
    ids=_ids,
)
def test_init_slots(opt: specs.Optimizer, expected: dict[str, float]) -> None:
    impl = server.from_config(opt)
    value = np.full((2, 3), 5.0, dtype=np.float16)
    slots = impl.init_slots(value)
    assert tuple(slots) == impl.slot_names() == tuple(expected)
    for name, fill in expected.items():
        assert slots[name].dtype == np.float16
        assert slots[name].shape == (2, 3)
        assert slots[name].flags.c_contiguous
        np.testing.assert_array_equal(slots[name], np.full((2, 3), fill, dtype=np.float16))
        assert not np.shares_memory(slots[name], value)


# ---------------------------------------------------------------------------
# Specs: round trip, defaults, validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ALL_VARIANTS, ids=_ids)
def test_spec_round_trip_client_proto_server(opt: specs.Optimizer) -> None:
    wire = ps_pb2.OptimizerSpec.FromString(opt.to_proto().SerializeToString())
    assert wire.name == opt.name
    assert specs.optimizer_from_proto(wire) == opt
    assert type(opt).from_proto(wire) == opt
    assert specs.Optimizer.from_proto(wire) == opt
    impl = server.from_spec(wire)
    assert impl.name == opt.name
    assert impl.config == opt
    assert impl.spec == opt.to_proto()


def test_booleans_travel_as_zero_or_one() -> None:
    params = specs.Adam(amsgrad=True).to_proto().params
    assert params["amsgrad"] == 1.0
    assert specs.SGD().to_proto().params["nesterov"] == 0.0
    assert specs.RMSprop(centered=True).to_proto().params["centered"] == 1.0


def test_defaults_are_keras_3_defaults() -> None:
    assert specs.SGD() == specs.SGD(learning_rate=0.01, momentum=0.0, nesterov=False)
    assert specs.Adagrad() == specs.Adagrad(learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7)
    assert specs.Adam() == specs.Adam(
        learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False
    )
    assert specs.RMSprop() == specs.RMSprop(
        learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False
    )


def test_missing_params_take_defaults() -> None:
    assert specs.optimizer_from_proto(ps_pb2.OptimizerSpec(name="adam")) == specs.Adam()
    spec = ps_pb2.OptimizerSpec(name="SGD", params={"momentum": 0.5})
    assert server.from_spec(spec).config == specs.SGD(momentum=0.5)


def test_specs_are_frozen_hashable_and_canonical() -> None:
    opt = specs.SGD(learning_rate=1)
    assert isinstance(opt.learning_rate, float)
    assert opt == specs.SGD(learning_rate=1.0)
    assert hash(opt) == hash(specs.SGD(learning_rate=1.0))
    assert opt != specs.Adam(learning_rate=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.learning_rate = 2.0  # type: ignore[misc]
    assert not hasattr(opt, "__dict__")
    assert specs.SGD(learning_rate=np.float32(0.5)).learning_rate == 0.5


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: specs.SGD(learning_rate=-1.0), "`learning_rate` must be >= 0"),
        (lambda: specs.SGD(learning_rate=math.nan), "`learning_rate` must be finite"),
        (lambda: specs.Adam(learning_rate=math.inf), "`learning_rate` must be finite"),
        (lambda: specs.SGD(learning_rate="0.1"), "`learning_rate` must be a number"),
        (lambda: specs.SGD(learning_rate=True), "`learning_rate` must be a number"),
        (lambda: specs.SGD(momentum=1.0), r"`momentum` must be in \[0, 1\)"),
        (lambda: specs.SGD(momentum=-0.1), r"`momentum` must be in \[0, 1\)"),
        (lambda: specs.SGD(nesterov=1), "`nesterov` must be a bool"),
        (lambda: specs.Adagrad(initial_accumulator_value=-1.0), "`initial_accumulator_value` must be >= 0"),
        (lambda: specs.Adagrad(epsilon=-1e-7), "`epsilon` must be >= 0"),
        (lambda: specs.Adagrad(initial_accumulator_value=0.0, epsilon=0.0), "cannot both be 0"),
        (lambda: specs.Adam(beta_1=1.0), r"`beta_1` must be in \[0, 1\)"),
        (lambda: specs.Adam(beta_2=-0.5), r"`beta_2` must be in \[0, 1\)"),
        (lambda: specs.Adam(amsgrad="yes"), "`amsgrad` must be a bool"),
        (lambda: specs.RMSprop(rho=1.5), r"`rho` must be in \[0, 1\)"),
        (lambda: specs.RMSprop(momentum=1.0), r"`momentum` must be in \[0, 1\)"),
        (lambda: specs.RMSprop(centered=None), "`centered` must be a bool"),
    ],
)
def test_spec_validation(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (ps_pb2.OptimizerSpec(name="adamq"), "unknown optimizer 'adamq'"),
        (ps_pb2.OptimizerSpec(name="muon"), "Muon is not supported server-side"),
        (ps_pb2.OptimizerSpec(name=""), "unknown optimizer"),
        (ps_pb2.OptimizerSpec(name="sgd", params={"beta_1": 0.9}), "no parameter 'beta_1'"),
        (ps_pb2.OptimizerSpec(name="adam", params={"amsgrad": 0.5}), "`amsgrad` must be 0 or 1"),
        (ps_pb2.OptimizerSpec(name="rmsprop", params={"rho": 2.0}), r"`rho` must be in \[0, 1\)"),
        (ps_pb2.OptimizerSpec(name="adagrad", params={"learning_rate": -1.0}), "`learning_rate` must be >="),
    ],
)
def test_bad_wire_specs(spec: ps_pb2.OptimizerSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        specs.optimizer_from_proto(spec)
    with pytest.raises(ValueError, match=match):
        server.from_spec(spec)


def test_from_proto_on_a_subclass_checks_the_name() -> None:
    with pytest.raises(ValueError, match="expected 'sgd'"):
        specs.SGD.from_proto(specs.Adam().to_proto())


# ---------------------------------------------------------------------------
# optimizer_from_config: Keras 3 get_config() dictionaries (as Keras 3.15 prints them)
# ---------------------------------------------------------------------------

_KERAS_BASE = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


@pytest.mark.parametrize(
    ("name", "config", "expected"),
    [
        (
            "SGD",
            {
                "name": "sgd",
                "learning_rate": 0.009999999776482582,
                **_KERAS_BASE,
                "momentum": 0.0,
                "nesterov": False,
            },
            specs.SGD(),
        ),
        (
            "Adam",
            {
                "name": "adam",
                "learning_rate": 0.0010000000474974513,
                **_KERAS_BASE,
                "beta_1": 0.9,
                "beta_2": 0.999,
                "epsilon": 1e-07,
                "amsgrad": True,
            },
            specs.Adam(amsgrad=True),
        ),
        (
            "keras.optimizers.RMSprop",
            {
                "name": "rm_sprop",
                "learning_rate": 0.0010000000474974513,
                **_KERAS_BASE,
                "rho": 0.9,
                "momentum": 0.0,
                "epsilon": 1e-07,
                "centered": True,
            },
            specs.RMSprop(centered=True),
        ),
        ("adagrad", {"learning_rate": 0.25, "initial_accumulator_value": 0.5}, specs.Adagrad(0.25, 0.5)),
        # A float64 learning rate that is not a float32 is kept as is.
        ("sgd", {"learning_rate": 0.1}, specs.SGD(learning_rate=0.1)),
        ("sgd", {"learning_rate": 3, "weight_decay": 0.0}, specs.SGD(learning_rate=3.0)),
    ],
)
def test_optimizer_from_keras_config(name: str, config: dict, expected: specs.Optimizer) -> None:
    assert specs.optimizer_from_config(name, config) == expected


@pytest.mark.parametrize(
    ("name", "config", "match"),
    [
        ("Muon", {}, "Muon is not supported server-side.*use AdamW or Lion"),
        ("LossScaleOptimizer", {}, "loss scaling is done on the worker"),
        ("ScheduleFreeAdamW", {}, "ScheduleFreeAdamW is not supported"),
        (
            "Adam",
            {
                "learning_rate": {
                    "module": None,
                    "class_name": "MySchedule",
                    "config": {},
                    "registered_name": "MySchedule",
                }
            },
            r"'MySchedule \(user-written\)' is not supported server-side",
        ),
        (
            "Adam",
            {"learning_rate": {"module": "keras.optimizers.schedules", "class_name": "Warmup", "config": {}}},
            "learning-rate schedule 'Warmup' is not supported server-side",
        ),
        ("SGD", {"clipnorm": 1.0, "clipvalue": 0.5}, "only one of `clipnorm`, `clipvalue`"),
        ("SGD", {"clipnorm": 0.0}, "`clipnorm` must be > 0 or None"),
        ("SGD", {"use_ema": True, "ema_momentum": 1.5}, r"`ema_momentum` must be in \[0, 1\]"),
        ("SGD", {"use_ema": True, "ema_overwrite_frequency": -1}, "`ema_overwrite_frequency` must be an"),
        ("SGD", {"loss_scale_factor": 128.0}, "loss_scale_factor=128.0 is not supported.*worker"),
        ("SGD", {"gradient_accumulation_steps": 1}, "`gradient_accumulation_steps` must be an integer >= 2"),
        ("SGD", {"gradient_accumulation_steps": 2.5}, "`gradient_accumulation_steps` must be an integer"),
        ("AdamW", {"weight_decay": None}, "`weight_decay` must be a float"),
        ("SGD", {"beta_1": 0.9}, "unknown config key 'beta_1'"),
        ("SGD", {"learning_rate": "fast"}, "`learning_rate` must be a number"),
        ("SGD", {"momentum": 1.5}, r"`momentum` must be in \[0, 1\)"),
    ],
)
def test_optimizer_from_config_rejects_unsupported(name: str, config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        specs.optimizer_from_config(name, config)


# ---------------------------------------------------------------------------
# The optimizers added for issue 9: generic contract, base-optimizer features, schedules, wire
# ---------------------------------------------------------------------------

NEW_VARIANTS: list[specs.Optimizer] = [
    specs.AdamW(),
    specs.Nadam(learning_rate=0.01),
    specs.Adamax(learning_rate=0.01, beta_1=0.8),
    specs.Adadelta(learning_rate=1.0),
    specs.Ftrl(learning_rate=0.1, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.1),
    specs.Lion(learning_rate=0.01),
    specs.Adafactor(learning_rate=0.1),
    specs.Lamb(learning_rate=0.01),
    specs.SGD(learning_rate=0.1, momentum=0.9, weight_decay=0.01, clipnorm=0.5),
    specs.Adam(learning_rate=0.01, clipvalue=0.2, gradient_accumulation_steps=2),
    specs.Nadam(learning_rate=specs.CosineDecay(0.01, 10, warmup_target=0.1, warmup_steps=2)),
    specs.RMSprop(
        learning_rate=specs.PiecewiseConstantDecay((1, 2), (0.1, 0.01, 0.001)), global_clipnorm=1.0
    ),
    specs.Lion(learning_rate=specs.ExponentialDecay(0.01, 3, 0.5, staircase=True)),
    specs.Adagrad(learning_rate=specs.PolynomialDecay(0.1, 5, cycle=True)),
    specs.Ftrl(learning_rate=specs.InverseTimeDecay(0.1, 2, 0.5)),
    specs.Lamb(learning_rate=specs.CosineDecayRestarts(0.1, 2, t_mul=1.5, m_mul=0.9, alpha=0.1)),
    specs.Adam(learning_rate=0.01, use_ema=True, ema_momentum=0.9),
    specs.SGD(learning_rate=0.1, momentum=0.5, use_ema=True, ema_overwrite_frequency=2),
    specs.Lamb(learning_rate=0.01, use_ema=True, ema_overwrite_frequency=3),
    specs.Adam(learning_rate=0.01, gradient_accumulation_steps=2, use_ema=True, ema_momentum=0.5),
]


@pytest.mark.parametrize("opt", NEW_VARIANTS, ids=_ids)
def test_new_spec_round_trip_client_proto_server(opt: specs.Optimizer) -> None:
    wire = ps_pb2.OptimizerSpec.FromString(opt.to_proto().SerializeToString())
    assert specs.optimizer_from_proto(wire) == opt
    assert hash(specs.optimizer_from_proto(wire)) == hash(opt)
    assert type(opt).from_proto(wire) == opt
    assert server.from_spec(wire).config == opt
    assert server.from_spec(wire).name == opt.name
    # Deterministic bytes: the store compares specs by their serialization.
    again = specs.optimizer_from_proto(wire).to_proto()
    assert again.SerializeToString(deterministic=True) == wire.SerializeToString(deterministic=True)


@pytest.mark.parametrize("opt", NEW_VARIANTS, ids=_ids)
def test_new_blocks_give_the_same_result_as_one_pass(opt: specs.Optimizer, monkeypatch) -> None:
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal((7, 9)).astype(np.float32)
    grads = [rng.standard_normal((7, 9)).astype(np.float32) for _ in range(4)]
    whole, whole_slots = _run(opt, w0, grads)
    monkeypatch.setattr(server, "BLOCK_ELEMENTS", 5)
    blocked, blocked_slots = _run(opt, w0, grads)
    for a, b in zip(whole, blocked, strict=True):
        np.testing.assert_array_equal(a, b)
    for name in whole_slots:
        np.testing.assert_array_equal(whole_slots[name], blocked_slots[name])


@pytest.mark.parametrize("opt", NEW_VARIANTS, ids=_ids)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_new_apply_contract(opt: specs.Optimizer, dtype) -> None:
    rng = np.random.default_rng(5)
    value = rng.standard_normal((3, 4)).astype(dtype)
    before = value.copy()
    value.flags.writeable = False
    impl = server.from_config(opt)
    slots = impl.init_slots(value)
    assert tuple(slots) == tuple(impl.slot_shapes(value.shape))
    assert all(slots[k].shape == shape for k, shape in impl.slot_shapes(value.shape).items())
    new = value
    for step in range(2):
        new = impl.apply(new, rng.standard_normal((3, 4)).astype(dtype), slots, step)
    np.testing.assert_array_equal(value, before)
    assert new.dtype == value.dtype and new.shape == value.shape and new.flags.c_contiguous
    assert np.isfinite(new).all()
    assert not np.array_equal(new, value)


def test_slot_shapes_of_the_new_optimizers() -> None:
    shape = (2, 3, 4)
    assert server.from_config(specs.Nadam()).slot_shapes(shape) == {
        "momentum": shape,
        "velocity": shape,
        "u_product": (),
    }
    assert server.from_config(specs.Adafactor()).slot_shapes(shape) == {"r": (2, 3), "c": (2, 4)}
    assert server.from_config(specs.Adafactor()).slot_shapes((5,)) == {"velocity": (5,)}
    assert server.from_config(specs.Ftrl(initial_accumulator_value=0.5)).init_slots(np.zeros(2))[
        "accumulator"
    ].tolist() == [0.5, 0.5]
    assert server.from_config(specs.SGD(gradient_accumulation_steps=2)).slot_shapes((3,)) == {
        "gradient_accumulator": (3,)
    }
    assert server.from_config(specs.Adafactor()).needs_whole_variable
    assert server.from_config(specs.Lamb()).needs_whole_variable
    assert server.from_config(specs.Adam(clipnorm=1.0)).needs_whole_variable
    assert not server.from_config(specs.Adam(clipvalue=1.0)).needs_whole_variable


def test_weight_decay_clipping_and_accumulation_by_hand() -> None:
    one = np.ones(4)
    # weight decay first (w - w * wd * lr), then the rule: 1 - 0.5 * 0.1 - 0.1 * 1
    impl = server.from_config(specs.SGD(learning_rate=0.1, weight_decay=0.5))
    np.testing.assert_allclose(impl.apply(one, one, {}, 0), np.full(4, 0.85))
    # clipnorm: ||g|| = 2 clipped to 1, so g = 0.5 each
    impl = server.from_config(specs.SGD(learning_rate=1.0, clipnorm=1.0))
    np.testing.assert_allclose(impl.apply(one, one, {}, 0), np.full(4, 0.5))
    # a gradient already inside the norm is left alone
    np.testing.assert_allclose(impl.apply(one, one * 0.1, {}, 0), np.full(4, 0.9))
    # clipvalue
    impl = server.from_config(specs.SGD(learning_rate=1.0, clipvalue=0.25))
    np.testing.assert_allclose(
        impl.apply(one, np.array([-1.0, 0.1, 2.0, 0.0]), {}, 0), [1.25, 0.9, 0.75, 1.0]
    )
    # global_clipnorm is the worker's: the shard ignores it
    impl = server.from_config(specs.SGD(learning_rate=1.0, global_clipnorm=0.001))
    np.testing.assert_allclose(impl.apply(one, one, {}, 0), np.zeros(4))
    # accumulation: pushes 0 and 1 accumulate, push 2 applies the mean of the three
    impl = server.from_config(specs.SGD(learning_rate=1.0, gradient_accumulation_steps=3))
    slots = impl.init_slots(one)
    w = one
    for i, g in enumerate([1.0, 2.0, 6.0]):
        w = impl.apply(w, np.full(4, g), slots, i)
        expected = 1.0 if i < 2 else 1.0 - 3.0
        np.testing.assert_allclose(w, np.full(4, expected))
    np.testing.assert_array_equal(slots["gradient_accumulator"], np.zeros(4))


def test_accumulated_adam_counts_applied_updates_for_bias_correction() -> None:
    plain = server.from_config(specs.Adam(learning_rate=0.1, epsilon=0.0))
    accumulated = server.from_config(
        specs.Adam(learning_rate=0.1, epsilon=0.0, gradient_accumulation_steps=2)
    )
    w = np.array([1.0])
    s1, s2 = plain.init_slots(w), accumulated.init_slots(w)
    a = plain.apply(w, np.array([0.5]), s1, 0)
    b = accumulated.apply(accumulated.apply(w, np.array([0.2]), s2, 0), np.array([0.8]), s2, 1)
    np.testing.assert_allclose(b, a, rtol=1e-12)  # mean 0.5 at bias-correction step 1


def test_schedules_by_hand() -> None:
    assert specs.ExponentialDecay(1.0, 2, 0.5)(4) == 0.25
    assert specs.ExponentialDecay(1.0, 2, 0.5, staircase=True)(3) == 0.5
    pcd = specs.PiecewiseConstantDecay((2, 4.9), (1.0, 0.5, 0.25))
    assert [pcd(s) for s in range(6)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25]  # 4.9 truncates to 4
    assert specs.PolynomialDecay(1.0, 10, end_learning_rate=0.0)(5) == 0.5
    assert specs.PolynomialDecay(1.0, 10, end_learning_rate=0.0)(50) == 0.0
    assert specs.PolynomialDecay(1.0, 10, end_learning_rate=0.0, cycle=True)(15) == pytest.approx(0.25)
    assert specs.InverseTimeDecay(1.0, 1, 1.0)(3) == 0.25
    cosine = specs.CosineDecay(1.0, 10, alpha=0.0)
    assert cosine(0) == 1.0 and cosine(5) == pytest.approx(0.5) and cosine(10) == pytest.approx(0.0, abs=1e-7)
    warm = specs.CosineDecay(0.0, 10, warmup_target=1.0, warmup_steps=4)
    assert [warm(s) for s in (0, 2, 4)] == [0.0, 0.5, 1.0]
    restarts = specs.CosineDecayRestarts(1.0, 2, t_mul=1.0, m_mul=0.5)
    assert restarts(2) == 0.5 and restarts(4) == 0.25
    # the shard uses the schedule at the iteration (before the step), as Keras does
    impl = server.from_config(specs.SGD(learning_rate=specs.ExponentialDecay(1.0, 1, 0.5)))
    assert [impl.learning_rate(i) for i in range(3)] == [1.0, 0.5, 0.25]
    np.testing.assert_allclose(impl.apply(np.ones(2), np.ones(2), {}, 2), [0.75, 0.75])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: specs.ExponentialDecay(0.1, 0, 0.5), "ExponentialDecay: Argument `decay_steps` must be > 0"),
        (lambda: specs.PolynomialDecay(0.1, -1), "`decay_steps` must be > 0"),
        (lambda: specs.InverseTimeDecay(0.1, 0, 1.0), "`decay_steps` must be > 0"),
        (lambda: specs.CosineDecay(0.1, 0), "`decay_steps` must be > 0"),
        (lambda: specs.CosineDecay(0.1, 10, warmup_steps=-1), "`warmup_steps` must be >= 0"),
        (lambda: specs.CosineDecayRestarts(0.1, 0), "`first_decay_steps` must be > 0"),
        (lambda: specs.PiecewiseConstantDecay((), (1.0,)), "`boundaries` must be a non-empty sequence"),
        (lambda: specs.PiecewiseConstantDecay((1,), (1.0,)), "`values` must be one longer"),
        (lambda: specs.PiecewiseConstantDecay("ab", (1.0,)), "`boundaries` must be a sequence of numbers"),
        (lambda: specs.ExponentialDecay(math.nan, 1, 0.5), "`initial_learning_rate` must be finite"),
        (
            lambda: specs.SGD(learning_rate="fast"),
            "`learning_rate` must be a number or a LearningRateSchedule",
        ),
        (lambda: specs.SGD(weight_decay=-0.1), "`weight_decay` must be >= 0 or None"),
        (lambda: specs.SGD(clipvalue=-1.0), "`clipvalue` must be > 0 or None"),
        (lambda: specs.SGD(global_clipnorm=0.0), "`global_clipnorm` must be > 0 or None"),
        (lambda: specs.SGD(clipnorm=1.0, global_clipnorm=1.0), "only one of"),
        (
            lambda: specs.SGD(gradient_accumulation_steps=1),
            "`gradient_accumulation_steps` must be an integer >= 2",
        ),
        (
            lambda: specs.SGD(gradient_accumulation_steps=True),
            "`gradient_accumulation_steps` must be an integer",
        ),
        (lambda: specs.AdamW(weight_decay=None), "AdamW: Argument `weight_decay` must be a float"),
        (lambda: specs.Nadam(beta_1=1.0), r"Nadam: Argument `beta_1` must be in \[0, 1\)"),
        (lambda: specs.Adamax(epsilon=-1.0), "Adamax: Argument `epsilon` must be >= 0"),
        (lambda: specs.Adadelta(rho=1.0), r"Adadelta: Argument `rho` must be in \[0, 1\)"),
        (lambda: specs.Ftrl(learning_rate_power=0.5), "Ftrl: Argument `learning_rate_power` must be <= 0"),
        (lambda: specs.Ftrl(l1_regularization_strength=-1), "`l1_regularization_strength` must be >= 0"),
        (lambda: specs.Ftrl(beta=-1), "Ftrl: Argument `beta` must be >= 0"),
        (lambda: specs.Lion(beta_1=0.0), r"Lion: Argument `beta_1` must be in \(0, 1\]"),
        (lambda: specs.Lion(beta_2=1.5), r"`beta_2` must be in \[0, 1\]"),
        (lambda: specs.Adafactor(clip_threshold=0), "Adafactor: Argument `clip_threshold` must be > 0"),
        (lambda: specs.Adafactor(beta_2_decay=0.5), "`beta_2_decay` must be <= 0"),
        (lambda: specs.Adafactor(relative_step=1), "`relative_step` must be a bool"),
        (lambda: specs.Lamb(beta_2=1.0), r"Lamb: Argument `beta_2` must be in \[0, 1\)"),
    ],
)
def test_new_spec_validation_names_the_field(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_abstract_bases_cannot_be_built() -> None:
    with pytest.raises(TypeError, match="abstract"):
        specs.Optimizer()
    with pytest.raises(TypeError, match="abstract"):
        specs.LearningRateSchedule()


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            ps_pb2.OptimizerSpec(
                name="sgd",
                params={"learning_rate": 0.1},
                learning_rate_schedule=ps_pb2.LearningRateSchedule(
                    name="ExponentialDecay",
                    params={"initial_learning_rate": 0.1, "decay_steps": 1, "decay_rate": 1},
                ),
            ),
            "are both set",
        ),
        (
            ps_pb2.OptimizerSpec(
                name="sgd", learning_rate_schedule=ps_pb2.LearningRateSchedule(name="Halving")
            ),
            "'Halving' is not supported server-side",
        ),
        (
            ps_pb2.OptimizerSpec(
                name="sgd",
                learning_rate_schedule=ps_pb2.LearningRateSchedule(name="CosineDecay", params={"x": 1}),
            ),
            "no parameter 'x'",
        ),
        (
            ps_pb2.OptimizerSpec(
                name="sgd",
                learning_rate_schedule=ps_pb2.LearningRateSchedule(
                    name="CosineDecay", params={"initial_learning_rate": 0.1}
                ),
            ),
            "CosineDecay.*decay_steps",
        ),
        (
            ps_pb2.OptimizerSpec(
                name="sgd",
                learning_rate_schedule=ps_pb2.LearningRateSchedule(
                    name="ExponentialDecay",
                    params={"initial_learning_rate": 0.1, "decay_steps": 1, "decay_rate": 1},
                    boundaries=[1.0],
                ),
            ),
            "takes no boundaries",
        ),
        (ps_pb2.OptimizerSpec(name="sgd", params={"gradient_accumulation_steps": 2.5}), "must be an integer"),
        (ps_pb2.OptimizerSpec(name="sgd", params={"clipnorm": 1, "clipvalue": 1}), "only one of"),
    ],
)
def test_bad_wire_schedules_and_options(spec: ps_pb2.OptimizerSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        specs.optimizer_from_proto(spec)
    with pytest.raises(ValueError, match=match):
        server.from_spec(spec)


def test_old_specs_keep_their_wire_bytes() -> None:
    # Options that are off are left out, so specs from before issue 9 (and their checkpoints) are unchanged.
    assert set(specs.SGD().to_proto().params) == {"learning_rate", "momentum", "nesterov"}
    assert not specs.SGD().to_proto().HasField("learning_rate_schedule")


def test_optimizer_from_keras_names_dicts_and_specs() -> None:
    assert specs.optimizer_from_keras("adam") == specs.Adam()
    assert specs.optimizer_from_keras("Nadam") == specs.Nadam()
    assert specs.optimizer_from_keras("adam_w") == specs.AdamW()
    assert specs.optimizer_from_keras({"class_name": "SGD", "config": {"momentum": 0.5}}) == specs.SGD(
        momentum=0.5
    )
    opt = specs.Lion()
    assert specs.optimizer_from_keras(opt) is opt
    config = {
        "learning_rate": {
            "module": "keras.optimizers.schedules",
            "class_name": "CosineDecay",
            "config": {
                "initial_learning_rate": 0.1,
                "decay_steps": 10,
                "alpha": 0.0,
                "name": "CosineDecay",
                "warmup_target": None,
                "warmup_steps": 0,
            },
            "registered_name": None,
        },
        "weight_decay": 0.01,
        "clipnorm": 1.0,
        "gradient_accumulation_steps": 4,
    }
    assert specs.optimizer_from_config("Adam", config) == specs.Adam(
        learning_rate=specs.CosineDecay(0.1, 10),
        weight_decay=0.01,
        clipnorm=1.0,
        gradient_accumulation_steps=4,
    )
    with pytest.raises(ValueError, match="unknown optimizer 'adamq'"):
        specs.optimizer_from_keras("adamq")
    with pytest.raises(ValueError, match="Muon is not supported"):
        specs.optimizer_from_keras("muon")
    with pytest.raises(ValueError, match="needs a 'class_name'"):
        specs.optimizer_from_keras({"config": {}})
    with pytest.raises(TypeError, match="Argument `optimizer` must be"):
        specs.optimizer_from_keras(3)


def test_clip_by_global_norm() -> None:
    grads = [np.array([3.0], np.float32), None, np.array([[4.0]], np.float32)]
    out = specs.clip_by_global_norm(grads, 1.0)
    assert out[1] is None
    np.testing.assert_allclose(out[0], [0.6], rtol=1e-6)
    np.testing.assert_allclose(out[2], [[0.8]], rtol=1e-6)
    assert out[0].dtype == np.float32
    np.testing.assert_array_equal(specs.clip_by_global_norm(grads, 10.0)[0], grads[0])  # inside: unchanged
    zeros = specs.clip_by_global_norm([np.zeros(2)], 1.0)
    np.testing.assert_array_equal(zeros[0], np.zeros(2))
    assert np.isnan(specs.clip_by_global_norm([np.array([np.inf, 1.0])], 1.0)[0]).all()
    with pytest.raises(ValueError, match="`clipnorm` must be > 0"):
        specs.clip_by_global_norm(grads, 0.0)


# ---------------------------------------------------------------------------
# use_ema: the moving average of the weights (Keras's _update_model_variables_moving_average)
# ---------------------------------------------------------------------------


def test_ema_spec_travels_and_is_left_out_while_off() -> None:
    opt = specs.Adam(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=5)
    params = opt.to_proto().params
    assert (params["use_ema"], params["ema_momentum"], params["ema_overwrite_frequency"]) == (1.0, 0.9, 5.0)
    assert specs.optimizer_from_proto(opt.to_proto()) == opt
    assert server.from_spec(opt.to_proto()).config == opt
    assert "use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=5" in repr(opt)
    # Off: the EMA arguments are ignored (as Keras ignores them), left out of the wire and the repr.
    assert specs.Adam(ema_momentum=0.5, ema_overwrite_frequency=3) == specs.Adam()
    assert "use_ema" not in specs.Adam().to_proto().params and "ema" not in repr(specs.Adam())
    assert (
        specs.SGD(use_ema=True, ema_overwrite_frequency=0).ema_overwrite_frequency is None
    )  # Keras: 0 = off
    wire = ps_pb2.OptimizerSpec(name="sgd", params={"use_ema": 1.0, "ema_overwrite_frequency": 2.0})
    assert specs.optimizer_from_proto(wire) == specs.SGD(use_ema=True, ema_overwrite_frequency=2)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: specs.SGD(use_ema=1), "`use_ema` must be a bool"),
        (lambda: specs.SGD(use_ema=True, ema_momentum=-0.1), r"`ema_momentum` must be in \[0, 1\]"),
        (
            lambda: specs.SGD(use_ema=True, ema_overwrite_frequency=2.5),
            "`ema_overwrite_frequency` must be an",
        ),
        (lambda: specs.SGD(use_ema=True, ema_overwrite_frequency=-2), "an integer >= 1 or None"),
    ],
)
def test_ema_spec_validation(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_ema_from_a_keras_config() -> None:
    config = {**_KERAS_BASE, "learning_rate": 0.009999999776482582, "momentum": 0.0, "nesterov": False}
    config.update(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)
    assert specs.optimizer_from_config("SGD", config) == specs.SGD(
        use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3
    )


def test_ema_slot_starts_as_a_copy_of_the_value() -> None:
    impl = server.from_config(specs.Adam(use_ema=True))
    value = np.arange(6, dtype=np.float16).reshape(2, 3)
    slots = impl.init_slots(value)
    assert list(slots) == ["momentum", "velocity", "average"]
    assert impl.slot_names() == ("momentum", "velocity")  # not the rule's: the rule never reads it
    np.testing.assert_array_equal(slots["average"], value)
    assert slots["average"].dtype == np.float16 and not np.shares_memory(slots["average"], value)


def test_ema_by_hand_with_overwrite() -> None:
    # SGD lr 0.1, gradient 1, momentum 0.5, overwrite every 3rd update:
    # update 0: w = 0.9, average = w (Keras's first step); update 1: w = 0.8, average = 0.85;
    # update 2: w = 0.7, average = 0.775, and w becomes 0.775; update 3: w = 0.675, average = 0.725.
    opt = specs.SGD(learning_rate=0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)
    history, slots = _run(opt, np.ones(2), [np.ones(2)] * 4)
    np.testing.assert_allclose([h[0] for h in history], [0.9, 0.8, 0.775, 0.675], rtol=1e-12)
    np.testing.assert_allclose(slots["average"], [0.725, 0.725], rtol=1e-12)


def test_ema_in_float32_follows_keras_arithmetic() -> None:
    # momentum * average + (1 - momentum) * w, with 1 - momentum computed in float32 as Keras does.
    opt = specs.Adam(learning_rate=0.01, use_ema=True)
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(5).astype(np.float32)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(3)]
    history, slots = _run(opt, w0, grads)
    m = np.float32(0.99)
    expected = history[0]
    for w in history[1:]:
        expected = m * expected + (np.float32(1) - m) * w
    np.testing.assert_array_equal(slots["average"], expected)
    assert slots["average"].dtype == np.float32


def test_ema_moves_on_pushes_that_only_accumulate() -> None:
    # Keras updates the average on every call, with iterations = calls // k (applied updates):
    # SGD lr 1, k = 2, momentum 0.5. Pushes 0, 1 (iterations 0): w = 1 - mean(1, 3) = -1, average = w.
    # Push 2 accumulates (iterations 1): average = 0.5 * -1 + 0.5 * -1 = -1; push 3 applies mean(0, 2):
    # w = -2, average = -1.5; push 4 accumulates (iterations 2): average = -1.75 while w stays -2.
    opt = specs.SGD(learning_rate=1.0, gradient_accumulation_steps=2, use_ema=True, ema_momentum=0.5)
    impl = server.from_config(opt)
    w = np.ones(1)
    slots = impl.init_slots(w)
    averages = []
    for i, g in enumerate([1.0, 3.0, 0.0, 2.0, 0.0]):
        w = impl.apply(w, np.full(1, g), slots, i)
        averages.append(float(slots["average"][0]))
    assert averages == [1.0, -1.0, -1.0, -1.5, -1.75]
    assert float(w[0]) == -2.0


def test_ema_overwrite_counts_applied_updates_with_accumulation() -> None:
    # Overwrite every 2nd applied update: iterations = push // 2, so pushes 2 and 3 (iterations 1) overwrite.
    opt = specs.SGD(
        learning_rate=1.0,
        gradient_accumulation_steps=2,
        use_ema=True,
        ema_momentum=0.5,
        ema_overwrite_frequency=2,
    )
    impl = server.from_config(opt)
    w = np.zeros(1)
    slots = impl.init_slots(w)
    values = []
    for i in range(4):
        w = impl.apply(w, np.full(1, -2.0), slots, i)
        values.append(float(w[0]))
    # push 1: w = 2, average 2; push 2: accumulates, average 2, overwrite (w = 2);
    # push 3: w = 4, average = 3, overwrite: w = 3.
    assert values == [0.0, 2.0, 2.0, 3.0]


def test_ema_rows_are_lazy() -> None:
    # A table's average moves for the rows a push touches; the first push to the table sets them.
    opt = specs.SGD(learning_rate=1.0, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)
    impl = server.from_config(opt)
    table = np.zeros((3, 2))
    slots = impl.init_slots(table)
    for iteration, rows in enumerate([[0], [0, 2], [2]]):
        rows_arr = np.array(rows)
        table[rows_arr] = impl.apply_rows(table, rows_arr, np.ones((len(rows), 2)), slots, iteration)
    # row 0: w -1 (average -1), then -2 (average -1.5); row 2: w -1 at push 1 (average 0.5 * 0 + 0.5 * -1),
    # then -2 at push 2 (average -1.25), overwritten (push 2 is the 3rd); row 1 untouched.
    np.testing.assert_array_equal(table, [[-2, -2], [0, 0], [-1.25, -1.25]])
    np.testing.assert_array_equal(slots["average"], [[-1.5, -1.5], [0, 0], [-1.25, -1.25]])
