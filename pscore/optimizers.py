"""Optimizer specs: which update rule a shard applies to a variable, with Keras 3 names and defaults.

The shard applies pushed gradients itself (``psserver.optimizers``) with the same
update rules as ``keras.optimizers`` of Keras 3. For a variable ``w``, gradient
``g``, learning rate ``lr`` and ``t = iterations + 1`` (the 1-based step)::

    SGD       momentum == 0:   w = w - lr * g
              momentum > 0:    m = momentum * m - lr * g
                               w = w + m                                  (nesterov=False)
                               w = w + momentum * m - lr * g              (nesterov=True)
    Adagrad   a = a + g**2                          (a starts at initial_accumulator_value)
              w = w - lr * g / sqrt(a + epsilon)
    Adam      m = m + (g - m) * (1 - beta_1)
              v = v + (g**2 - v) * (1 - beta_2)
              vhat = max(vhat, v); v = vhat                               (amsgrad=True)
              w = w - m * lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) / (sqrt(v) + epsilon)
    AdamW     Adam with weight_decay (default 0.004)
    RMSprop   v = rho * v + (1 - rho) * g**2
              a = rho * a + (1 - rho) * g;  d = v - a**2 + epsilon        (centered=True)
                                            d = v + epsilon               (centered=False)
              inc = lr * g / sqrt(d)
              m = momentum * m + inc;  w = w - m                          (momentum > 0)
              w = w - inc                                                 (momentum == 0)
    Nadam     u = u * beta_1 * (1 - 0.5 * 0.96**t)       (u: the u_product slot, starts at 1)
              u_t = beta_1 * (1 - 0.5 * 0.96**t);  u_t1 = beta_1 * (1 - 0.5 * 0.96**(t + 1))
              m, v as Adam;  mhat = u_t1 * m / (1 - u * u_t1) + (1 - u_t) * g / (1 - u)
              w = w - mhat * lr / (sqrt(v / (1 - beta_2**t)) + epsilon)
    Adamax    m = m + (g - m) * (1 - beta_1);  n = max(beta_2 * n, |g|)
              w = w - lr * m / ((1 - beta_1**t) * (n + epsilon))
    Adadelta  a = rho * a + (1 - rho) * g**2
              d = -sqrt(b + epsilon) * g / sqrt(a + epsilon);  b = rho * b + (1 - rho) * d**2
              w = w + lr * d
    Ftrl      (Keras's FTRL-proximal with l1, l2, l2 shrinkage and beta; see keras.optimizers.Ftrl)
    Lion      w = w - lr * sign(beta_1 * m + (1 - beta_1) * g);  m = beta_2 * m + (1 - beta_2) * g
    Adafactor the second moment factored into row and column means for variables of rank >= 2
              (slots r and c), relative step size min(lr, 1/sqrt(t)), update clipping by
              clip_threshold (see keras.optimizers.Adafactor)
    Lamb      Adam's bias-corrected step scaled by the trust ratio ||w|| / ||step||

Before the rule, as Keras's base optimizer does: gradients are clipped per
variable (``clipnorm``: ``g * clipnorm / max(||g||, clipnorm)``; ``clipvalue``:
``clip(g, -clipvalue, clipvalue)``), then ``weight_decay`` is applied
(``w = w - w * weight_decay * lr``). ``global_clipnorm`` needs every gradient of
a step, which no shard sees: it is kept in the spec but the shard ignores it, and
the worker applies it (``clip_by_global_norm``) before pushing. With
``gradient_accumulation_steps = k`` the shard adds up pushed gradients and
applies their mean on every k-th push; the update rule counts applied updates
(``t``) while learning-rate schedules see every push, as in Keras.

With ``use_ema`` the shard keeps an exponential moving average of each
variable in its ``average`` slot (created equal to the initial value), updated
after each update as Keras's ``_update_model_variables_moving_average`` does,
with ``n`` the variable's update count before this one (``t - 1``; with
gradient accumulation, the applied updates, and the average moves on every
push as Keras moves it on every call)::

    average = w                                                          (n == 0)
    average = average * ema_momentum + w * (1 - ema_momentum)            (n > 0)
    w = average                       (ema_overwrite_frequency and (n + 1) % ema_overwrite_frequency == 0)

A client reads the averages with ``pull(names, ema=True)``; the Keras glue
writes them into the model (and the shards' variables) at the end of ``fit``,
as Keras's ``finalize_variable_values`` does. An embedding table's average
is updated row by row, lazily, like its other slots (the rows a push touches).

A learning rate may be a schedule of ``keras.optimizers.schedules``
(``ExponentialDecay``, ``PiecewiseConstantDecay``, ``PolynomialDecay``,
``InverseTimeDecay``, ``CosineDecay``, ``CosineDecayRestarts``): the shard
evaluates it, in float32 like Keras, at the variable's update count before the
step (Keras's ``optimizer.iterations``, not ``iterations + 1``).

Specs are frozen dataclasses, so two equal specs compare equal (creating a
variable is idempotent for an equal spec). On the wire they are a
``psproto.v1.OptimizerSpec``: the lower-case name and every hyper-parameter as a
double, booleans as 0.0/1.0, an optional argument that is None left out, and a
schedule in ``learning_rate_schedule``.

Not supported server-side (rejected with ``ValueError``): Muon, ScheduleFreeAdamW,
MultiOptimizer, loss scaling (``loss_scale_factor``, ``LossScaleOptimizer``: done
on the worker) and user-written schedules.

>>> Adam(learning_rate=1e-3).to_proto().params["beta_1"]
0.9
>>> optimizer_from_config("SGD", {"learning_rate": 0.009999999776482582, "momentum": 0.9})
SGD(learning_rate=0.01, momentum=0.9, nesterov=False)
>>> optimizer_from_keras("adamw")
AdamW(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, amsgrad=False, weight_decay=0.004)
>>> ExponentialDecay(0.5, decay_steps=10, decay_rate=0.5)(20)
0.125
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

import numpy as np

from psproto.v1 import ps_pb2

__all__ = [
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "CosineDecay",
    "CosineDecayRestarts",
    "ExponentialDecay",
    "Ftrl",
    "InverseTimeDecay",
    "Lamb",
    "LearningRateSchedule",
    "Lion",
    "Nadam",
    "Optimizer",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "RMSprop",
    "clip_by_global_norm",
    "optimizer_from_config",
    "optimizer_from_keras",
    "optimizer_from_proto",
    "schedule_from_config",
    "schedule_from_proto",
]

# Arguments of Keras's base optimizer that are optional numbers (None: off).
_OPTIONAL_FLOATS: Final[frozenset[str]] = frozenset(
    {"weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "warmup_target"}
)
_OPTIONAL_INTS: Final[frozenset[str]] = frozenset({"gradient_accumulation_steps", "ema_overwrite_frequency"})
# The base optimizer's moving-average arguments: left out of the wire form and the repr while
# ``use_ema`` is off (every spec without EMA stays as it was).
_EMA_FIELDS: Final[tuple[str, ...]] = ("use_ema", "ema_momentum", "ema_overwrite_frequency")
_F32 = np.float32


def _argument_error(owner: str, field: str, requirement: str, value: Any) -> ValueError:
    return ValueError(f"{owner}: Argument `{field}` must be {requirement}; received {field}={value!r}")


def _normalize(owner: str, field: dataclasses.Field, value: Any) -> Any:
    """Type-checks one argument and returns its canonical form (floats, bools, ints, tuples)."""
    name = field.name
    if name == "learning_rate" and isinstance(value, LearningRateSchedule):
        return value
    if name in _OPTIONAL_INTS:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != int(value):
            raise _argument_error(owner, name, "an integer or None", value)
        return int(value)
    if name in _OPTIONAL_FLOATS and value is None:
        return None
    if isinstance(field.default, bool):
        if not isinstance(value, bool | np.bool_):
            raise _argument_error(owner, name, "a bool", value)
        return bool(value)
    if isinstance(field.default, tuple):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
            raise _argument_error(owner, name, "a sequence of numbers", value)
        return tuple(_number(owner, name, v) for v in value)
    if name == "learning_rate" and not isinstance(value, numbers.Real):
        raise _argument_error(owner, name, "a number or a LearningRateSchedule", value)
    return _number(owner, name, value)


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _argument_error(owner, name, "a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise _argument_error(owner, name, "finite", value)
    return value


class _Spec:
    """Shared machinery of the optimizer and schedule specs (frozen dataclasses)."""

    __slots__ = ()

    name: ClassVar[str]

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, field.name, _normalize(owner, field, getattr(self, field.name)))
        self._validate()

    def _validate(self) -> None:
        """Checks the ranges of the arguments.

        Raises:
            ValueError: an argument is out of range.
        """

    def _check(self, field: str, ok: bool, requirement: str) -> None:
        if not ok:
            raise _argument_error(type(self).__name__, field, requirement, getattr(self, field))

    def _hidden(self) -> tuple[str, ...]:
        """Arguments left out of the repr and the wire form (options that are off)."""
        return ()

    def __repr__(self) -> str:
        shown = []
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        hidden = self._hidden()
        for f in sorted(fields, key=lambda f: f.kw_only):  # the rule's own arguments first
            value = getattr(self, f.name)
            if (f.kw_only and value is None) or f.name in hidden:
                continue  # base-optimizer options that are off
            shown.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def params(self) -> dict[str, float]:
        """The scalar arguments as the wire carries them (booleans as 0.0/1.0, None left out)."""
        out = {}
        hidden = self._hidden()
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None or isinstance(value, tuple | LearningRateSchedule) or f.name in hidden:
                continue
            out[f.name] = float(value)
        return out


def _parse_params(cls: type[_Spec], what: str, params: Mapping[str, float]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        field = fields.get(key)
        if field is None or isinstance(field.default, tuple):
            raise ValueError(
                f"{what} {cls.name!r} has no parameter {key!r}; expected some of {', '.join(fields)}"
            )
        if isinstance(field.default, bool):
            if value not in (0.0, 1.0):
                raise _argument_error(f"{what} {cls.name!r}", key, "0 or 1", value)
            kwargs[key] = value == 1.0
        else:
            kwargs[key] = value
    return kwargs


# ---------------------------------------------------------------------------
# Learning-rate schedules (keras.optimizers.schedules), evaluated in float32 as Keras does
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class LearningRateSchedule(_Spec):
    """Base class of the learning-rate schedule specs (Keras 3's built-in schedules).

    A schedule maps the optimizer step (the number of updates before this one)
    to a learning rate; the shard calls it for every update.
    """

    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if type(self) is LearningRateSchedule:
            raise TypeError("LearningRateSchedule is abstract; use one of its subclasses")
        _Spec.__post_init__(self)

    def __call__(self, step: int) -> float:
        """The learning rate at optimizer step ``step`` (>= 0), computed in float32 like Keras."""
        with np.errstate(all="ignore"):
            return float(self._evaluate(_F32(step)))

    def _evaluate(self, step: np.float32) -> np.float32:
        raise NotImplementedError

    def to_proto(self) -> ps_pb2.LearningRateSchedule:
        """Returns the wire form of this schedule."""
        return ps_pb2.LearningRateSchedule(name=self.name, params=self.params())


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)``, as ``keras.optimizers.schedules``.

    Attributes:
        initial_learning_rate: the rate at step 0.
        decay_steps: > 0.
        decay_rate: the factor per ``decay_steps`` steps.
        staircase: decay in whole periods (``floor(step / decay_steps)``).
    """

    name: ClassVar[str] = "ExponentialDecay"

    initial_learning_rate: float
    decay_steps: float
    decay_rate: float
    staircase: bool = False

    def _validate(self) -> None:
        self._check("decay_steps", self.decay_steps > 0, "> 0")

    def _evaluate(self, step: np.float32) -> np.float32:
        p = step / _F32(self.decay_steps)
        if self.staircase:
            p = np.floor(p)
        return _F32(self.initial_learning_rate) * np.power(_F32(self.decay_rate), p)


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[i]`` for ``boundaries[i-1] < step <= boundaries[i]``, as ``keras.optimizers.schedules``.

    Boundaries are compared with the integer step after truncation to integers,
    as Keras casts them to the step's int64.

    Attributes:
        boundaries: at least one number.
        values: one more value than boundaries.
    """

    name: ClassVar[str] = "PiecewiseConstantDecay"

    boundaries: tuple[float, ...] = ()
    values: tuple[float, ...] = ()

    def _validate(self) -> None:
        self._check("boundaries", len(self.boundaries) >= 1, "a non-empty sequence")
        self._check("values", len(self.values) == len(self.boundaries) + 1, "one longer than `boundaries`")

    def __call__(self, step: int) -> float:
        s = int(step)
        bounds = [math.trunc(b) for b in self.boundaries]
        values = [_F32(v) for v in self.values]
        result = _F32(0.0)
        result += _F32(s <= bounds[0]) * values[0]
        result += _F32(s > bounds[-1]) * values[-1]
        for low, high, value in zip(bounds[:-1], bounds[1:], values[1:-1], strict=True):
            result += _F32(low < s <= high) * value
        return float(result)

    def to_proto(self) -> ps_pb2.LearningRateSchedule:
        return ps_pb2.LearningRateSchedule(name=self.name, boundaries=self.boundaries, values=self.values)


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class PolynomialDecay(LearningRateSchedule):
    """Polynomial decay to ``end_learning_rate`` over ``decay_steps``, as ``keras.optimizers.schedules``.

    Attributes:
        initial_learning_rate: the rate at step 0.
        decay_steps: > 0.
        end_learning_rate: the rate after ``decay_steps``.
        power: the polynomial's power.
        cycle: restart the decay with a longer period after ``decay_steps``.
    """

    name: ClassVar[str] = "PolynomialDecay"

    initial_learning_rate: float
    decay_steps: float
    end_learning_rate: float = 0.0001
    power: float = 1.0
    cycle: bool = False

    def _validate(self) -> None:
        self._check("decay_steps", self.decay_steps > 0, "> 0")

    def _evaluate(self, step: np.float32) -> np.float32:
        initial = _F32(self.initial_learning_rate)
        end = _F32(self.end_learning_rate)
        decay_steps = _F32(self.decay_steps)
        if self.cycle:
            multiplier = _F32(1.0) if step == 0 else np.ceil(step / _F32(self.decay_steps))
            decay_steps = decay_steps * multiplier
        else:
            step = np.minimum(step, decay_steps)
        p = step / decay_steps
        return (initial - end) * np.power(_F32(1) - p, _F32(self.power)) + end


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class InverseTimeDecay(LearningRateSchedule):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)``, as ``keras.optimizers.schedules``.

    Attributes:
        initial_learning_rate: the rate at step 0.
        decay_steps: > 0.
        decay_rate: the decay's rate.
        staircase: decay in whole periods.
    """

    name: ClassVar[str] = "InverseTimeDecay"

    initial_learning_rate: float
    decay_steps: float
    decay_rate: float
    staircase: bool = False

    def _validate(self) -> None:
        self._check("decay_steps", self.decay_steps > 0, "> 0")

    def _evaluate(self, step: np.float32) -> np.float32:
        p = step / _F32(self.decay_steps)
        if self.staircase:
            p = np.floor(p)
        return _F32(self.initial_learning_rate) / (_F32(1) + _F32(self.decay_rate) * p)


def _cosine(step: np.float32, decay_steps: np.float32, start: np.float32, alpha: float) -> np.float32:
    fraction = step / decay_steps
    cosine = _F32(0.5) * (_F32(1.0) + np.cos(_F32(math.pi) * fraction))
    return start * (_F32(1 - alpha) * cosine + _F32(alpha))


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class CosineDecay(LearningRateSchedule):
    """Cosine decay with an optional linear warmup, as ``keras.optimizers.schedules.CosineDecay``.

    Attributes:
        initial_learning_rate: the rate at step 0.
        decay_steps: > 0, the length of the decay (after the warmup).
        alpha: the final rate as a fraction of the decay's starting rate.
        warmup_target: None (no warmup) or the rate reached after ``warmup_steps``.
        warmup_steps: >= 0.
    """

    name: ClassVar[str] = "CosineDecay"

    initial_learning_rate: float
    decay_steps: float
    alpha: float = 0.0
    warmup_target: float | None = None
    warmup_steps: float = 0.0

    def _validate(self) -> None:
        self._check("decay_steps", self.decay_steps > 0, "> 0")
        self._check("warmup_steps", self.warmup_steps >= 0, ">= 0")

    def _evaluate(self, step: np.float32) -> np.float32:
        initial = _F32(self.initial_learning_rate)
        decay_steps = _F32(self.decay_steps)
        if self.warmup_target is None:
            return _cosine(np.minimum(step, decay_steps), decay_steps, initial, self.alpha)
        target = _F32(self.warmup_target)
        warmup_steps = _F32(self.warmup_steps)
        step = np.minimum(step, decay_steps + warmup_steps)
        if step < warmup_steps:
            return (target - initial) * (step / warmup_steps) + initial
        return _cosine(step - warmup_steps, decay_steps, target, self.alpha)


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class CosineDecayRestarts(LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR), as ``keras.optimizers.schedules.CosineDecayRestarts``.

    Attributes:
        initial_learning_rate: the rate at step 0.
        first_decay_steps: > 0, the length of the first period.
        t_mul: each period is ``t_mul`` times longer than the previous one; > 0.
        m_mul: each period starts at ``m_mul`` times the previous start.
        alpha: the lowest rate as a fraction of ``initial_learning_rate``.
    """

    name: ClassVar[str] = "CosineDecayRestarts"

    initial_learning_rate: float
    first_decay_steps: float
    t_mul: float = 2.0
    m_mul: float = 1.0
    alpha: float = 0.0

    def _validate(self) -> None:
        self._check("first_decay_steps", self.first_decay_steps > 0, "> 0")
        self._check("t_mul", self.t_mul > 0, "> 0")

    def _evaluate(self, step: np.float32) -> np.float32:
        one = _F32(1.0)
        t_mul = _F32(self.t_mul)
        fraction = step / _F32(self.first_decay_steps)
        if t_mul == one:
            i_restart = np.floor(fraction)
            fraction = fraction - i_restart
        else:
            i_restart = np.floor(np.log(one - fraction * (one - t_mul)) / np.log(t_mul))
            sum_r = (one - np.power(t_mul, i_restart)) / (one - t_mul)
            fraction = (fraction - sum_r) / np.power(t_mul, i_restart)
        m_fac = np.power(_F32(self.m_mul), i_restart)
        cosine = _F32(0.5) * m_fac * (one + np.cos(_F32(math.pi) * fraction))
        alpha = _F32(self.alpha)
        return _F32(self.initial_learning_rate) * ((one - alpha) * cosine + alpha)


_SCHEDULES: Final[dict[str, type[LearningRateSchedule]]] = {
    cls.name.lower(): cls
    for cls in (
        ExponentialDecay,
        PiecewiseConstantDecay,
        PolynomialDecay,
        InverseTimeDecay,
        CosineDecay,
        CosineDecayRestarts,
    )
}


def _unsupported_schedule(name: str) -> ValueError:
    supported = ", ".join(cls.name for cls in _SCHEDULES.values())
    return ValueError(
        f"learning-rate schedule {name!r} is not supported server-side; the shard evaluates only "
        f"Keras's built-in schedules ({supported}). A user-written schedule runs Python the shard "
        "cannot run: use a built-in schedule, or a constant learning rate changed from the worker "
        "(a LearningRateScheduler callback, PSClient.set_learning_rate)"
    )


def _schedule_class(name: str) -> type[LearningRateSchedule]:
    try:
        return _SCHEDULES[name.rsplit(".", 1)[-1].lower()]
    except KeyError:
        raise _unsupported_schedule(name) from None


def schedule_from_proto(spec: ps_pb2.LearningRateSchedule) -> LearningRateSchedule:
    """Parses a ``psproto.v1.LearningRateSchedule``.

    Raises:
        ValueError: unknown schedule, unknown parameter, or a value out of range.
    """
    cls = _schedule_class(spec.name)
    kwargs = _parse_params(cls, "learning-rate schedule", spec.params)
    if cls is PiecewiseConstantDecay:
        kwargs.update(boundaries=tuple(spec.boundaries), values=tuple(spec.values))
    elif spec.boundaries or spec.values:
        raise ValueError(f"learning-rate schedule {cls.name!r} takes no boundaries or values")
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required argument is missing
        raise ValueError(f"learning-rate schedule {cls.name!r}: {err}") from None


def schedule_from_config(config: Any) -> LearningRateSchedule:
    """Maps a Keras 3 schedule (an instance, or its serialized dict) onto a schedule spec.

    Args:
        config: a ``keras.optimizers.schedules`` instance, or
            ``{"class_name": ..., "config": {...}, "module": ..., "registered_name": ...}``
            as an optimizer's ``get_config()["learning_rate"]`` holds it.

    Raises:
        ValueError: a user-written or unknown schedule, an unknown key or a value out of range.
    """
    if isinstance(config, LearningRateSchedule):
        return config
    if isinstance(config, Mapping):
        class_name = str(config.get("class_name", "?"))
        module = config.get("module")
        registered = config.get("registered_name")
        args = dict(config.get("config") or {})
    elif hasattr(config, "get_config"):
        class_name = type(config).__name__
        module = type(config).__module__
        registered = None
        args = dict(config.get_config())
    else:
        raise ValueError(f"Argument `learning_rate` must be a number or a schedule; received {config!r}")
    builtin = module is None or str(module).startswith("keras.")
    if registered is not None or not builtin:
        raise _unsupported_schedule(f"{class_name} (user-written)")
    cls = _schedule_class(class_name)
    args.pop("name", None)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(args) - fields
    if unknown:
        raise ValueError(f"{cls.name}: unknown config keys {sorted(unknown)}")
    try:
        return cls(**args)
    except TypeError as err:
        raise ValueError(f"{cls.name}: {err}") from None


# ---------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Optimizer(_Spec):
    """Base class of the optimizer specs (frozen dataclasses; see the subclasses).

    The keyword-only arguments are those of Keras's base optimizer that the
    shard implements; every subclass accepts them.

    Attributes:
        weight_decay: None, or >= 0: ``w = w - w * weight_decay * lr`` before each update.
        clipnorm: None, or > 0: each variable's gradient is clipped to this L2 norm.
        clipvalue: None, or > 0: each gradient element is clipped to ``[-clipvalue, clipvalue]``.
        global_clipnorm: None, or > 0: kept in the spec but applied by the worker
            (``clip_by_global_norm``), since a shard sees only its own variables.
        gradient_accumulation_steps: None, or >= 2: the shard applies the mean
            of every k pushed gradients on the k-th push.
        use_ema: keep an exponential moving average of the variable (the
            ``average`` slot), as Keras's ``use_ema``.
        ema_momentum: in [0, 1]: ``average = average * ema_momentum + w * (1 - ema_momentum)``
            after each update (the first update sets ``average = w``).
        ema_overwrite_frequency: None, or >= 1: every this many updates the
            variable is overwritten with its average (0 means None, as in Keras).

    While ``use_ema`` is False, ``ema_momentum`` and ``ema_overwrite_frequency``
    take their defaults (Keras ignores them then), so specs that differ only
    there compare equal.
    """

    name: ClassVar[str] = ""

    weight_decay: float | None = dataclasses.field(default=None, kw_only=True)
    clipnorm: float | None = dataclasses.field(default=None, kw_only=True)
    clipvalue: float | None = dataclasses.field(default=None, kw_only=True)
    global_clipnorm: float | None = dataclasses.field(default=None, kw_only=True)
    gradient_accumulation_steps: int | None = dataclasses.field(default=None, kw_only=True)
    use_ema: bool = dataclasses.field(default=False, kw_only=True)
    ema_momentum: float = dataclasses.field(default=0.99, kw_only=True)
    ema_overwrite_frequency: int | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if type(self) is Optimizer:
            raise TypeError("Optimizer is abstract; use one of its subclasses (SGD, Adam, ...)")
        _Spec.__post_init__(self)
        if not self.use_ema:  # ignored, as Keras does: one canonical spec
            object.__setattr__(self, "ema_momentum", 0.99)
            object.__setattr__(self, "ema_overwrite_frequency", None)
        elif self.ema_overwrite_frequency == 0:  # Keras: 0 is falsy, no overwrite
            object.__setattr__(self, "ema_overwrite_frequency", None)
        self._validate_base()

    def _hidden(self) -> tuple[str, ...]:
        return () if self.use_ema else _EMA_FIELDS

    def _validate_base(self) -> None:
        lr = getattr(self, "learning_rate", None)
        if not isinstance(lr, LearningRateSchedule):
            # >= 0 as in Keras: a callback may set 0 to hold the weights (LearningRateScheduler).
            self._check("learning_rate", lr is not None and lr >= 0, ">= 0")
        if self.weight_decay is not None:
            self._check("weight_decay", self.weight_decay >= 0, ">= 0 or None")
        for field in ("clipnorm", "clipvalue", "global_clipnorm"):
            value = getattr(self, field)
            if value is not None:
                self._check(field, value > 0, "> 0 or None")
        clips = [(f, getattr(self, f)) for f in ("clipnorm", "clipvalue", "global_clipnorm")]
        if sum(v is not None for _, v in clips) > 1:
            raise ValueError(
                f"{type(self).__name__}: only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be "
                "set; received " + ", ".join(f"{f}={v!r}" for f, v in clips)
            )
        steps = self.gradient_accumulation_steps
        if steps is not None:
            self._check("gradient_accumulation_steps", steps >= 2, "an integer >= 2 or None")
        self._check("ema_momentum", 0 <= self.ema_momentum <= 1, "in [0, 1]")
        every = self.ema_overwrite_frequency
        if every is not None:
            self._check("ema_overwrite_frequency", every >= 1, "an integer >= 1 or None")

    @property
    def needs_whole_variable(self) -> bool:
        """Whether the rule uses norms or means over the whole variable (``clipnorm``, Adafactor, Lamb):
        it cannot run on a partition of a variable, nor row by row on a table."""
        return isinstance(self, Adafactor | Lamb) or self.clipnorm is not None

    @property
    def has_schedule(self) -> bool:
        """Whether the learning rate is a schedule (evaluated on the shard) rather than a constant."""
        return isinstance(getattr(self, "learning_rate", None), LearningRateSchedule)

    def to_proto(self) -> ps_pb2.OptimizerSpec:
        """Returns the wire form of this spec."""
        spec = ps_pb2.OptimizerSpec(name=self.name, params=self.params())
        lr = getattr(self, "learning_rate", None)
        if isinstance(lr, LearningRateSchedule):
            spec.learning_rate_schedule.CopyFrom(lr.to_proto())
        return spec

    @classmethod
    def from_proto(cls, spec: ps_pb2.OptimizerSpec) -> Optimizer:
        """Parses a wire spec; on a subclass, the spec must name that subclass.

        Raises:
            ValueError: unknown or mismatched name, unknown or invalid parameter.
        """
        opt = optimizer_from_proto(spec)
        if cls is not Optimizer and not isinstance(opt, cls):
            raise ValueError(f"optimizer spec names {spec.name!r}, expected {cls.name!r}")
        return opt


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        momentum: in [0, 1); 0 is plain gradient descent.
        nesterov: use Nesterov momentum (only matters when momentum > 0).
    """

    name: ClassVar[str] = "sgd"

    learning_rate: float | LearningRateSchedule = 0.01
    momentum: float = 0.0
    nesterov: bool = False

    def _validate(self) -> None:
        self._check("momentum", 0 <= self.momentum < 1, "in [0, 1)")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Adagrad(Optimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        initial_accumulator_value: starting value of the accumulator, >= 0.
        epsilon: added to the accumulator under the square root, >= 0.
    """

    name: ClassVar[str] = "adagrad"

    learning_rate: float | LearningRateSchedule = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def _validate(self) -> None:
        self._check("initial_accumulator_value", self.initial_accumulator_value >= 0, ">= 0")
        self._check("epsilon", self.epsilon >= 0, ">= 0")
        if self.initial_accumulator_value + self.epsilon <= 0:
            raise ValueError("Adagrad: Arguments `initial_accumulator_value` and `epsilon` cannot both be 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Adam(Optimizer):
    """Adam (optionally AMSGrad), as ``keras.optimizers.Adam``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        beta_1: decay rate of the first moment, in [0, 1).
        beta_2: decay rate of the second moment, in [0, 1).
        epsilon: added to ``sqrt(v)`` in the denominator, >= 0.
        amsgrad: use the maximum of past second moments (AMSGrad).
    """

    name: ClassVar[str] = "adam"

    learning_rate: float | LearningRateSchedule = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False

    def _validate(self) -> None:
        self._check("beta_1", 0 <= self.beta_1 < 1, "in [0, 1)")
        self._check("beta_2", 0 <= self.beta_2 < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class AdamW(Adam):
    """Adam with decoupled weight decay, as ``keras.optimizers.AdamW`` (``weight_decay`` defaults to 0.004).

    >>> AdamW().weight_decay
    0.004
    """

    name: ClassVar[str] = "adamw"

    weight_decay: float = dataclasses.field(default=0.004, kw_only=True)  # type: ignore[assignment]

    def _validate(self) -> None:
        Adam._validate(self)
        if self.weight_decay is None:
            raise _argument_error("AdamW", "weight_decay", "a float", None)


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class RMSprop(Optimizer):
    """RMSprop (optionally centered, with plain momentum), as ``keras.optimizers.RMSprop``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        rho: decay rate of the moving averages, in [0, 1).
        momentum: in [0, 1); 0 disables momentum.
        epsilon: added to the second moment under the square root, >= 0.
        centered: normalise by the estimated variance instead of the second moment.
    """

    name: ClassVar[str] = "rmsprop"

    learning_rate: float | LearningRateSchedule = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False

    def _validate(self) -> None:
        self._check("rho", 0 <= self.rho < 1, "in [0, 1)")
        self._check("momentum", 0 <= self.momentum < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Nadam(Optimizer):
    """Adam with Nesterov momentum, as ``keras.optimizers.Nadam``.

    Keras keeps one ``u_product`` for the whole optimizer; every variable is
    updated once per step, so the shard keeps an equal per-variable copy (slot
    ``u_product``, a scalar).

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        beta_1: in [0, 1).
        beta_2: in [0, 1).
        epsilon: >= 0.
    """

    name: ClassVar[str] = "nadam"

    learning_rate: float | LearningRateSchedule = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def _validate(self) -> None:
        self._check("beta_1", 0 <= self.beta_1 < 1, "in [0, 1)")
        self._check("beta_2", 0 <= self.beta_2 < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Adamax(Optimizer):
    """Adam with the infinity norm, as ``keras.optimizers.Adamax``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        beta_1: in [0, 1).
        beta_2: in [0, 1).
        epsilon: >= 0.
    """

    name: ClassVar[str] = "adamax"

    learning_rate: float | LearningRateSchedule = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def _validate(self) -> None:
        self._check("beta_1", 0 <= self.beta_1 < 1, "in [0, 1)")
        self._check("beta_2", 0 <= self.beta_2 < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Adadelta(Optimizer):
    """Adadelta, as ``keras.optimizers.Adadelta``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        rho: decay rate, in [0, 1).
        epsilon: >= 0.
    """

    name: ClassVar[str] = "adadelta"

    learning_rate: float | LearningRateSchedule = 0.001
    rho: float = 0.95
    epsilon: float = 1e-7

    def _validate(self) -> None:
        self._check("rho", 0 <= self.rho < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Ftrl(Optimizer):
    """FTRL-proximal, as ``keras.optimizers.Ftrl``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        learning_rate_power: <= 0.
        initial_accumulator_value: >= 0.
        l1_regularization_strength: >= 0.
        l2_regularization_strength: >= 0.
        l2_shrinkage_regularization_strength: >= 0.
        beta: >= 0.
    """

    name: ClassVar[str] = "ftrl"

    learning_rate: float | LearningRateSchedule = 0.001
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0

    def _validate(self) -> None:
        self._check("learning_rate_power", self.learning_rate_power <= 0, "<= 0")
        for field in (
            "initial_accumulator_value",
            "l1_regularization_strength",
            "l2_regularization_strength",
            "l2_shrinkage_regularization_strength",
            "beta",
        ):
            self._check(field, getattr(self, field) >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Lion(Optimizer):
    """Lion (sign of an interpolated momentum), as ``keras.optimizers.Lion``.

    Attributes:
        learning_rate: step size, >= 0, or a schedule.
        beta_1: in (0, 1].
        beta_2: in [0, 1].
    """

    name: ClassVar[str] = "lion"

    learning_rate: float | LearningRateSchedule = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.99

    def _validate(self) -> None:
        self._check("beta_1", 0 < self.beta_1 <= 1, "in (0, 1]")
        self._check("beta_2", 0 <= self.beta_2 <= 1, "in [0, 1]")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Adafactor(Optimizer):
    """Adafactor, as ``keras.optimizers.Adafactor``.

    For a variable of rank >= 2 the second moment is factored into row means
    (slot ``r``, shape ``shape[:-1]``) and column means (slot ``c``, shape
    ``shape[:-2] + shape[-1:]``); lower ranks keep a full ``velocity``. Needs
    the whole variable on one shard: a variable cut into partitions is refused.

    Attributes:
        learning_rate: > 0, or a schedule.
        beta_2_decay: the decay exponent of the second moment, <= 0.
        epsilon_1: added to the squared gradient, >= 0.
        epsilon_2: the least relative step scale, >= 0.
        clip_threshold: update clipping threshold, > 0.
        relative_step: kept for Keras compatibility (Keras's rule caps the rate at
            ``1 / sqrt(t)`` either way).
    """

    name: ClassVar[str] = "adafactor"

    learning_rate: float | LearningRateSchedule = 0.001
    beta_2_decay: float = -0.8
    epsilon_1: float = 1e-30
    epsilon_2: float = 1e-3
    clip_threshold: float = 1.0
    relative_step: bool = True

    def _validate(self) -> None:
        self._check("beta_2_decay", self.beta_2_decay <= 0, "<= 0")
        self._check("epsilon_1", self.epsilon_1 >= 0, ">= 0")
        self._check("epsilon_2", self.epsilon_2 >= 0, ">= 0")
        self._check("clip_threshold", self.clip_threshold > 0, "> 0")


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Lamb(Optimizer):
    """LAMB (Adam scaled by a per-variable trust ratio), as ``keras.optimizers.Lamb``.

    Needs the whole variable on one shard: a variable cut into partitions is refused.

    Attributes:
        learning_rate: > 0, or a schedule.
        beta_1: in [0, 1).
        beta_2: in [0, 1).
        epsilon: >= 0.
    """

    name: ClassVar[str] = "lamb"

    learning_rate: float | LearningRateSchedule = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def _validate(self) -> None:
        self._check("beta_1", 0 <= self.beta_1 < 1, "in [0, 1)")
        self._check("beta_2", 0 <= self.beta_2 < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


_BY_NAME: Final[dict[str, type[Optimizer]]] = {
    cls.name: cls
    for cls in (SGD, Adagrad, Adam, AdamW, RMSprop, Nadam, Adamax, Adadelta, Ftrl, Lion, Adafactor, Lamb)
}

# Keras optimizers the shard refuses, with what to do instead.
_REFUSED: Final[dict[str, str]] = {
    "muon": (
        "Muon is not supported server-side: its update depends on the model's layer structure "
        "(exclude_layers, exclude_embeddings) and orthogonalises whole matrices; use AdamW or Lion"
    ),
    "schedulefreeadamw": (
        "ScheduleFreeAdamW is not supported server-side: it keeps two weight sequences and needs "
        "train/eval mode switches from the model; use AdamW with a learning-rate schedule"
    ),
    "multioptimizer": (
        "MultiOptimizer is not supported as one spec: give each variable its own optimizer "
        "(create_many(..., optimizers={name: spec}))"
    ),
    "optimizermap": (
        "OptimizerMap is not supported as one spec: give each variable its own optimizer "
        "(create_many(..., optimizers={name: spec}))"
    ),
    "lossscaleoptimizer": (
        "loss scaling is done on the worker, not on the shard: pass the wrapped optimizer "
        "(LossScaleOptimizer.inner_optimizer) and unscale the gradients before pushing"
    ),
    "optimizer": "keras.optimizers.Optimizer is abstract; name a concrete optimizer",
}

# Keys of a Keras 3 optimizer config that carry no update-rule information.
_IGNORED_CONFIG_KEYS: Final[frozenset[str]] = frozenset({"name", "jit_compile", "is_legacy_optimizer"})
# Keras features the shard does not implement, with the value that means "off" and why.
_UNSUPPORTED_CONFIG_KEYS: Final[dict[str, tuple[tuple[Any, ...], str]]] = {
    "loss_scale_factor": (
        (None, 1, 1.0),
        "loss scaling is done on the worker: unscale the gradients before pushing",
    ),
    "decay": ((None, 0, 0.0), "Keras 3 no longer supports `decay`; use a learning-rate schedule"),
}


def _lookup(name: str) -> type[Optimizer]:
    key = name.rsplit(".", 1)[-1].lower().replace("_", "")
    if key in _REFUSED:
        raise ValueError(_REFUSED[key])
    try:
        return _BY_NAME[key]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; supported: {', '.join(sorted(_BY_NAME))}") from None


def optimizer_from_proto(spec: ps_pb2.OptimizerSpec) -> Optimizer:
    """Parses a ``psproto.v1.OptimizerSpec``; missing parameters take their Keras defaults.

    Raises:
        ValueError: unknown optimizer name, unknown parameter, a boolean that is
            not 0 or 1, or a value out of range.
    """
    cls = _lookup(spec.name.lower())
    kwargs = _parse_params(cls, "optimizer", spec.params)
    if spec.HasField("learning_rate_schedule"):
        if "learning_rate" in kwargs:
            raise ValueError(
                f"optimizer {cls.name!r}: params['learning_rate'] and learning_rate_schedule are both set"
            )
        kwargs["learning_rate"] = schedule_from_proto(spec.learning_rate_schedule)
    return cls(**kwargs)


def _float32_shortest(x: float) -> float:
    """Undoes Keras's float32 rounding of the learning rate (0.009999999776482582 -> 0.01).

    Returns the shortest decimal that rounds to the same float32 when ``x`` is
    exactly a float32, else ``x``.
    """
    try:
        packed = struct.pack("<f", x)
    except OverflowError:
        return x
    if struct.unpack("<f", packed)[0] != x:
        return x
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return x


def optimizer_from_config(name: str, config: Mapping[str, Any]) -> Optimizer:
    """Maps a Keras 3 optimizer's class name and ``get_config()`` onto a spec.

    ``optimizer_from_config(type(opt).__name__, opt.get_config())`` or, for a
    serialized optimizer ``d``, ``optimizer_from_config(d["class_name"], d["config"])``.
    A learning rate that Keras rounded to float32 is mapped back to its shortest
    decimal, so ``keras.optimizers.SGD()`` gives ``SGD(learning_rate=0.01)``; a
    serialized built-in schedule becomes a schedule spec.

    Args:
        name: the optimizer class name, any case ("SGD", "Adam", "adam",
            "keras.optimizers.RMSprop").
        config: the optimizer's config.

    Raises:
        ValueError: an unsupported optimizer (Muon, ...), a user-written
            learning-rate schedule, a feature the shard does not implement
            (loss scaling), an unknown key or a value out of range.
    """
    cls = _lookup(name)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in config.items():
        if key in _IGNORED_CONFIG_KEYS:
            continue
        if key in _UNSUPPORTED_CONFIG_KEYS:
            off, why = _UNSUPPORTED_CONFIG_KEYS[key]
            if not any(value is o or (type(value) is type(o) and value == o) for o in off):
                raise ValueError(
                    f"{name}: {key}={value!r} is not supported by server-side optimizers ({why})"
                )
            continue
        if key not in fields:
            raise ValueError(f"{name}: unknown config key {key!r}")
        if key == "learning_rate":
            if isinstance(value, Mapping) or hasattr(value, "get_config"):
                value = schedule_from_config(value)
            elif isinstance(value, float):
                value = _float32_shortest(value)
        if key == "weight_decay" and fields[key].default is None and value in (0, 0.0):
            continue  # Keras: w - w * 0 * lr, no decay
        kwargs[key] = value
    return cls(**kwargs)


def optimizer_from_keras(optimizer: Any) -> Optimizer:
    """The spec for a Keras 3 optimizer, its name, or its serialized form, as ``model.compile`` accepts them.

    >>> optimizer_from_keras("rmsprop")
    RMSprop(learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-07, centered=False)

    Args:
        optimizer: a spec (returned as is); a name as ``keras.optimizers.get``
            takes it ("adam", "sgd", "AdamW", ...: the Keras defaults); a
            ``{"class_name": ..., "config": ...}`` dict; or a Keras optimizer
            instance (anything with ``get_config()``).

    Raises:
        ValueError: an optimizer or setting the shards do not implement (the
            message says what to use instead).
        TypeError: ``optimizer`` is none of the above.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, str):
        return _lookup(optimizer)()
    if isinstance(optimizer, Mapping):
        if "class_name" not in optimizer:
            raise ValueError(
                f"a serialized optimizer needs a 'class_name'; received keys {sorted(optimizer)}"
            )
        return optimizer_from_config(str(optimizer["class_name"]), optimizer.get("config") or {})
    if hasattr(optimizer, "get_config"):
        class_name = type(optimizer).__name__
        _lookup(class_name)  # refuses LossScaleOptimizer, Muon, ... before reading their config
        return optimizer_from_config(class_name, optimizer.get_config())
    raise TypeError(
        f"Argument `optimizer` must be a psclient optimizer, a Keras optimizer or its name; "
        f"received {optimizer!r}"
    )


def clip_by_global_norm(grads: list[np.ndarray], clipnorm: float) -> list[np.ndarray]:
    """Scales gradients so that their global L2 norm is at most ``clipnorm``, as Keras's ``global_clipnorm``.

    The math of ``keras.src.optimizers.base_optimizer.clip_by_global_norm``: with
    ``n = sqrt(sum of every element squared)``, each gradient is multiplied by
    ``clipnorm * min(1 / n, 1 / clipnorm)``; a non-finite ``n`` makes every
    result NaN. The worker applies it to all of a step's gradients before
    pushing (a shard sees only its own variables). ``None`` entries are passed through.

    >>> [g.tolist() for g in clip_by_global_norm([np.array([3.0]), np.array([4.0])], 1.0)]
    [[0.6000000000000001], [0.8]]

    Args:
        grads: the gradients (numpy arrays; float16 and float32 are summed in float32).
        clipnorm: the largest global norm, > 0.

    Returns:
        New arrays, same dtypes and shapes.

    Raises:
        ValueError: ``clipnorm`` is not a positive finite number.
    """
    clipnorm = _number("clip_by_global_norm", "clipnorm", clipnorm)
    if clipnorm <= 0:
        raise _argument_error("clip_by_global_norm", "clipnorm", "> 0", clipnorm)
    present = [np.asarray(g) for g in grads if g is not None]
    if not present:
        return list(grads)
    dtype = np.result_type(np.float32, *[g.dtype for g in present])
    with np.errstate(all="ignore"):
        squared = [np.sum(np.square(g, dtype=dtype)) for g in present]
        norm = np.sqrt(np.sum(np.array(squared, dtype=dtype)))
        c = dtype.type(clipnorm)
        scale = c * np.minimum(dtype.type(1) / norm, dtype.type(1) / c) + (norm - norm)
        return [None if g is None else (np.asarray(g) * scale).astype(np.asarray(g).dtype) for g in grads]
