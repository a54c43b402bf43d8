"""Parity of psserver.optimizers with keras.optimizers (Keras 3) on the same seeded gradients, float32.

Every optimizer of ``keras.optimizers`` the shards implement, with weight decay,
per-variable clipping, gradient accumulation, every built-in learning-rate
schedule and the moving average of the weights (``use_ema``, with and without
``ema_overwrite_frequency``: the values and the averages), over ``STEPS`` steps
at rtol 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

from pscore import optimizers as specs
from psserver import optimizers as server

pytestmark = pytest.mark.tf

STEPS = 24
SHAPE = S = (6, 5)


def _schedule(name: str, initial_learning_rate: float, **kwargs) -> tuple[str, dict]:
    return name, {"initial_learning_rate": initial_learning_rate, **kwargs}


# (optimizer class, its kwargs, (schedule class, its kwargs) or None, variable shape)
VARIANTS: list[tuple[str, dict, tuple[str, dict] | None, tuple[int, ...]]] = [
    ("SGD", {}, None, SHAPE),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9}, None, SHAPE),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}, None, SHAPE),
    ("SGD", {"learning_rate": 0.1, "weight_decay": 0.01}, None, SHAPE),
    ("SGD", {"learning_rate": 0.1, "clipnorm": 0.5}, None, SHAPE),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.5, "clipvalue": 0.3}, None, SHAPE),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "gradient_accumulation_steps": 3}, None, SHAPE),
    ("Adagrad", {}, None, SHAPE),
    ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.01, "epsilon": 1e-6}, None, SHAPE),
    ("Adagrad", {"learning_rate": 0.1, "weight_decay": 0.05, "clipnorm": 1.0}, None, SHAPE),
    ("Adam", {}, None, SHAPE),
    ("Adam", {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6}, None, SHAPE),
    ("Adam", {"learning_rate": 0.01, "amsgrad": True}, None, SHAPE),
    ("Adam", {"learning_rate": 0.01, "weight_decay": 0.1, "clipvalue": 0.5}, None, SHAPE),
    ("Adam", {"learning_rate": 0.01, "gradient_accumulation_steps": 4, "clipnorm": 2.0}, None, SHAPE),
    ("AdamW", {}, None, SHAPE),
    ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1, "amsgrad": True}, None, SHAPE),
    ("RMSprop", {}, None, SHAPE),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.9}, None, SHAPE),
    ("RMSprop", {"learning_rate": 0.01, "rho": 0.8, "centered": True}, None, SHAPE),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.2}, None, SHAPE),
    ("Nadam", {}, None, SHAPE),
    ("Nadam", {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.9, "epsilon": 1e-5}, None, SHAPE),
    ("Nadam", {"learning_rate": 0.01, "gradient_accumulation_steps": 2, "weight_decay": 0.01}, None, SHAPE),
    ("Adamax", {}, None, SHAPE),
    ("Adamax", {"learning_rate": 0.02, "beta_1": 0.7, "beta_2": 0.9, "clipnorm": 1.5}, None, SHAPE),
    ("Adadelta", {}, None, SHAPE),
    ("Adadelta", {"learning_rate": 1.0, "rho": 0.9, "epsilon": 1e-5}, None, SHAPE),
    ("Ftrl", {}, None, SHAPE),
    (
        "Ftrl",
        {
            "learning_rate": 0.1,
            "learning_rate_power": -0.7,
            "initial_accumulator_value": 0.2,
            "l1_regularization_strength": 0.01,
            "l2_regularization_strength": 0.02,
            "l2_shrinkage_regularization_strength": 0.03,
            "beta": 0.5,
        },
        None,
        SHAPE,
    ),
    ("Lion", {}, None, SHAPE),
    ("Lion", {"learning_rate": 0.01, "beta_1": 0.5, "beta_2": 0.9, "weight_decay": 0.1}, None, SHAPE),
    ("Adafactor", {}, None, SHAPE),
    ("Adafactor", {"learning_rate": 0.1, "clip_threshold": 0.5, "epsilon_2": 1e-2}, None, (7,)),
    ("Adafactor", {"learning_rate": 0.05, "beta_2_decay": -0.5}, None, (2, 3, 4)),
    ("Lamb", {}, None, SHAPE),
    ("Lamb", {"learning_rate": 0.01, "beta_1": 0.8, "weight_decay": 0.01}, None, SHAPE),
    # Every built-in schedule (evaluated at the update count before the step, as Keras does).
    ("SGD", {"momentum": 0.9}, _schedule("ExponentialDecay", 0.1, decay_steps=5, decay_rate=0.5), SHAPE),
    ("Adam", {}, _schedule("ExponentialDecay", 0.05, decay_steps=4, decay_rate=0.3, staircase=True), SHAPE),
    ("Adam", {}, ("PiecewiseConstantDecay", {"boundaries": [3, 9], "values": [0.05, 0.01, 1e-3]}), S),
    ("RMSprop", {}, _schedule("PolynomialDecay", 0.05, decay_steps=10), SHAPE),
    (
        "SGD",
        {},
        _schedule("PolynomialDecay", 0.2, decay_steps=7, end_learning_rate=0.01, power=2.0, cycle=True),
        SHAPE,
    ),
    ("Adagrad", {}, _schedule("InverseTimeDecay", 0.3, decay_steps=3, decay_rate=0.7), SHAPE),
    ("Nadam", {}, _schedule("InverseTimeDecay", 0.03, decay_steps=3, decay_rate=0.7, staircase=True), SHAPE),
    ("Adamax", {}, _schedule("CosineDecay", 0.05, decay_steps=15, alpha=0.1), SHAPE),
    (
        "AdamW",
        {"weight_decay": 0.05},
        _schedule("CosineDecay", 0.0, decay_steps=12, warmup_target=0.05, warmup_steps=6),
        SHAPE,
    ),
    ("Lion", {}, _schedule("CosineDecayRestarts", 0.01, first_decay_steps=4), SHAPE),
    (
        "SGD",
        {"momentum": 0.5},
        _schedule("CosineDecayRestarts", 0.1, first_decay_steps=5, t_mul=1.0, m_mul=0.5, alpha=0.1),
        SHAPE,
    ),
    ("Adafactor", {}, _schedule("CosineDecayRestarts", 0.1, first_decay_steps=3, t_mul=1.5, m_mul=0.8), (5,)),
    ("Lamb", {}, _schedule("ExponentialDecay", 0.01, decay_steps=5, decay_rate=0.5), SHAPE),
    ("Adadelta", {"gradient_accumulation_steps": 2}, _schedule("PolynomialDecay", 1.0, decay_steps=20), (9,)),
    ("Ftrl", {"l1_regularization_strength": 0.001}, _schedule("CosineDecay", 0.2, decay_steps=20), SHAPE),
    # use_ema: every optimizer, with and without the overwrite (the average compared too).
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "use_ema": True}, None, SHAPE),
    ("SGD", {"learning_rate": 0.1, "use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 5},
     None, SHAPE),
    (
        "SGD",
        {"learning_rate": 0.1, "momentum": 0.9, "gradient_accumulation_steps": 3, "use_ema": True,
         "ema_momentum": 0.8, "ema_overwrite_frequency": 2},
        None,
        SHAPE,
    ),
    ("Adagrad", {"learning_rate": 0.1, "use_ema": True, "ema_overwrite_frequency": 7}, None, SHAPE),
    ("Adam", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9}, None, SHAPE),
    ("Adam", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 4},
     None, SHAPE),
    ("AdamW", {"learning_rate": 0.01, "use_ema": True, "ema_overwrite_frequency": 6}, None, SHAPE),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.9, "use_ema": True, "ema_momentum": 0.7}, None, SHAPE),
    ("Nadam", {"learning_rate": 0.01, "use_ema": True, "ema_overwrite_frequency": 3}, None, SHAPE),
    ("Adamax", {"learning_rate": 0.02, "use_ema": True, "ema_momentum": 0.9}, None, SHAPE),
    ("Adadelta", {"learning_rate": 1.0, "use_ema": True, "ema_overwrite_frequency": 5}, None, SHAPE),
    ("Ftrl", {"learning_rate": 0.1, "use_ema": True, "ema_momentum": 0.5}, None, SHAPE),
    ("Lion", {"learning_rate": 0.01, "use_ema": True, "ema_overwrite_frequency": 4}, None, SHAPE),
    ("Adafactor", {"learning_rate": 0.1, "use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 5},
     None, SHAPE),
    ("Lamb", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9}, None, SHAPE),
    (
        "Adam",
        {"use_ema": True, "ema_momentum": 0.8, "ema_overwrite_frequency": 5},
        _schedule("ExponentialDecay", 0.05, decay_steps=4, decay_rate=0.5),
        SHAPE,
    ),
]  # fmt: skip


def _id(variant) -> str:
    cls, kwargs, schedule, shape = variant
    return f"{cls}{kwargs}{schedule[0] if schedule else ''}{list(shape)}"


@pytest.fixture(scope="module")
def keras():
    pytest.importorskip("tensorflow")
    return pytest.importorskip("keras")


@pytest.mark.parametrize("variant", VARIANTS, ids=[_id(v) for v in VARIANTS])
def test_matches_keras_step_by_step(keras, variant) -> None:
    class_name, kwargs, schedule, shape = variant
    keras_kwargs = dict(kwargs)
    if schedule is not None:
        keras_kwargs["learning_rate"] = getattr(keras.optimizers.schedules, schedule[0])(**schedule[1])
    keras_opt = getattr(keras.optimizers, class_name)(**keras_kwargs)
    spec = specs.optimizer_from_keras(keras_opt)
    expected_kwargs = dict(kwargs)
    if schedule is not None:
        expected_kwargs["learning_rate"] = getattr(specs, schedule[0])(**schedule[1])
    assert spec == getattr(specs, class_name)(**expected_kwargs)
    ours = server.from_spec(spec.to_proto())

    rng = np.random.default_rng(1234)
    initial = rng.standard_normal(shape).astype(np.float32)
    variable = keras.Variable(initial, dtype="float32")
    value = initial.copy()
    slots = ours.init_slots(value)
    for step in range(STEPS):
        # Gradients of varying scale and sign, some exact zeros.
        grad = (rng.standard_normal(shape) * rng.choice([0.0, 0.1, 1.0, 3.0], shape)).astype(np.float32)
        if schedule is not None:
            lr = float(keras.ops.convert_to_numpy(keras_opt.learning_rate))
            assert ours.learning_rate(step) == pytest.approx(lr, rel=1e-6, abs=1e-9), f"step {step + 1}"
        keras_opt.apply_gradients([(keras.ops.convert_to_tensor(grad), variable)])
        value = ours.apply(value, grad, slots, step)
        np.testing.assert_allclose(
            value, np.asarray(variable.numpy()), rtol=1e-5, atol=1e-6, err_msg=f"step {step + 1}"
        )
        if spec.use_ema:
            average = keras_opt._model_variables_moving_average[0]
            np.testing.assert_allclose(
                slots["average"],
                np.asarray(average.numpy()),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"step {step + 1}",
            )


@pytest.mark.parametrize(
    "class_name",
    [
        "SGD",
        "Adagrad",
        "Adam",
        "AdamW",
        "RMSprop",
        "Nadam",
        "Adamax",
        "Adadelta",
        "Ftrl",
        "Lion",
        "Adafactor",
        "Lamb",
    ],
)
def test_keras_defaults_match_the_specs(keras, class_name: str) -> None:
    config = getattr(keras.optimizers, class_name)().get_config()
    assert specs.optimizer_from_config(class_name, config) == getattr(specs, class_name)()
    if class_name != "Lamb":  # keras.optimizers.get does not know "lamb" (Keras 3.15)
        name = class_name.lower()
        assert specs.optimizer_from_keras(keras.optimizers.get(name)) == specs.optimizer_from_keras(name)


@pytest.mark.parametrize(
    ("schedule", "kwargs"),
    [
        ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.9}),
        ("PiecewiseConstantDecay", {"boundaries": [10, 100.7, 1000], "values": [1.0, 0.5, 0.1, 0.01]}),
        ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 300, "power": 0.5, "cycle": True}),
        ("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 30, "decay_rate": 0.5}),
        ("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 500, "alpha": 0.01}),
        (
            "CosineDecay",
            {"initial_learning_rate": 0.0, "decay_steps": 400, "warmup_target": 0.1, "warmup_steps": 100},
        ),
        ("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 50}),
        (
            "CosineDecayRestarts",
            {"initial_learning_rate": 0.1, "first_decay_steps": 30, "t_mul": 1.0, "m_mul": 0.9},
        ),
    ],
)
def test_schedules_match_keras_over_many_steps(keras, schedule: str, kwargs: dict) -> None:
    theirs = getattr(keras.optimizers.schedules, schedule)(**kwargs)
    ours = specs.schedule_from_config(keras.optimizers.schedules.serialize(theirs))
    assert ours == getattr(specs, schedule)(**kwargs)
    for step in [*range(0, 1200, 7), 10, 11, 100, 101, 150, 350, 1000, 1001]:
        want = float(keras.ops.convert_to_numpy(theirs(step)))
        assert ours(step) == pytest.approx(want, rel=1e-6, abs=1e-12), step


def test_clip_by_global_norm_matches_keras(keras) -> None:
    from keras.src.optimizers.base_optimizer import clip_by_global_norm as keras_clip

    rng = np.random.default_rng(5)
    grads = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    for clipnorm in (0.5, 1.0, 100.0):
        want = [np.asarray(keras.ops.convert_to_numpy(g)) for g in keras_clip(grads, clipnorm)]
        got = specs.clip_by_global_norm(grads, clipnorm)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == np.float32
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_user_written_schedule_is_refused(keras) -> None:
    class Halving(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.1 / (step + 1)

        def get_config(self):
            return {}

    with pytest.raises(ValueError, match=r"'Halving \(user-written\)' is not supported server-side"):
        specs.optimizer_from_keras(keras.optimizers.SGD(learning_rate=Halving()))


def test_refused_keras_optimizers(keras) -> None:
    with pytest.raises(ValueError, match="loss scaling is done on the worker"):
        specs.optimizer_from_keras(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    with pytest.raises(ValueError, match=r"Muon is not supported server-side.*use AdamW or Lion"):
        specs.optimizer_from_keras(keras.optimizers.Muon())
    # use_ema is implemented on the shards (issue 20)
    assert specs.optimizer_from_keras(keras.optimizers.Adam(use_ema=True)) == specs.Adam(use_ema=True)
