"""Optimizer specs: which update rule a shard applies to a variable, with Keras 3 names and defaults.

The shard applies pushed gradients itself (``psserver.optimizers``) with the same
update rules as ``keras.optimizers`` of Keras 3. For a variable ``w``, gradient
``g`` and ``t = iterations + 1`` (the 1-based step)::

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
    RMSprop   v = rho * v + (1 - rho) * g**2
              a = rho * a + (1 - rho) * g;  d = v - a**2 + epsilon        (centered=True)
                                            d = v + epsilon               (centered=False)
              inc = lr * g / sqrt(d)
              m = momentum * m + inc;  w = w - m                          (momentum > 0)
              w = w - inc                                                 (momentum == 0)

Specs are frozen dataclasses, so two equal specs compare equal (creating a
variable is idempotent for an equal spec). On the wire they are a
``psproto.v1.OptimizerSpec``: the lower-case name and every hyper-parameter as a
double, booleans as 0.0/1.0.

Not supported server-side (rejected with ``ValueError``): learning-rate
schedules, weight decay, gradient clipping, EMA, loss scaling and gradient
accumulation.

>>> Adam(learning_rate=1e-3).to_proto().params["beta_1"]
0.9
>>> optimizer_from_config("SGD", {"learning_rate": 0.009999999776482582, "momentum": 0.9})
SGD(learning_rate=0.01, momentum=0.9, nesterov=False)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from psproto.v1 import ps_pb2

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "Optimizer",
    "RMSprop",
    "optimizer_from_config",
    "optimizer_from_proto",
]


class Optimizer:
    """Base class of the optimizer specs (frozen dataclasses; see the subclasses).

    Subclasses declare their hyper-parameters as dataclass fields whose defaults
    are a ``float`` or a ``bool``; the base class normalises and type-checks them.
    """

    __slots__ = ()

    name: ClassVar[str]

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if isinstance(field.default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{type(self).__name__}.{field.name} must be a bool, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{type(self).__name__}.{field.name} must be a number, got {value!r}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}.{field.name} must be finite, got {value!r}")
            object.__setattr__(self, field.name, value)
        self._validate()

    def _validate(self) -> None:
        """Checks the ranges of the hyper-parameters.

        Raises:
            ValueError: a hyper-parameter is out of range.
        """

    def _check(self, field: str, ok: bool, requirement: str) -> None:
        if not ok:
            raise ValueError(
                f"{type(self).__name__}.{field} must be {requirement}, got {getattr(self, field)!r}"
            )

    def params(self) -> dict[str, float]:
        """The hyper-parameters as the wire carries them (booleans as 0.0/1.0)."""
        return {
            f.name: float(getattr(self, f.name))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        }

    def to_proto(self) -> ps_pb2.OptimizerSpec:
        """Returns the wire form of this spec."""
        return ps_pb2.OptimizerSpec(name=self.name, params=self.params())

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


@dataclasses.dataclass(frozen=True, slots=True)
class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    Attributes:
        learning_rate: step size, > 0.
        momentum: in [0, 1); 0 is plain gradient descent.
        nesterov: use Nesterov momentum (only matters when momentum > 0).
    """

    name: ClassVar[str] = "sgd"

    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False

    def _validate(self) -> None:
        self._check("learning_rate", self.learning_rate > 0, "> 0")
        self._check("momentum", 0 <= self.momentum < 1, "in [0, 1)")


@dataclasses.dataclass(frozen=True, slots=True)
class Adagrad(Optimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``.

    Attributes:
        learning_rate: step size, > 0.
        initial_accumulator_value: starting value of the accumulator, >= 0.
        epsilon: added to the accumulator under the square root, >= 0.
    """

    name: ClassVar[str] = "adagrad"

    learning_rate: float = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def _validate(self) -> None:
        self._check("learning_rate", self.learning_rate > 0, "> 0")
        self._check("initial_accumulator_value", self.initial_accumulator_value >= 0, ">= 0")
        self._check("epsilon", self.epsilon >= 0, ">= 0")
        if self.initial_accumulator_value + self.epsilon <= 0:
            raise ValueError("Adagrad: initial_accumulator_value and epsilon cannot both be 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Adam(Optimizer):
    """Adam (optionally AMSGrad), as ``keras.optimizers.Adam``.

    Attributes:
        learning_rate: step size, > 0.
        beta_1: decay rate of the first moment, in [0, 1).
        beta_2: decay rate of the second moment, in [0, 1).
        epsilon: added to ``sqrt(v)`` in the denominator, >= 0.
        amsgrad: use the maximum of past second moments (AMSGrad).
    """

    name: ClassVar[str] = "adam"

    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False

    def _validate(self) -> None:
        self._check("learning_rate", self.learning_rate > 0, "> 0")
        self._check("beta_1", 0 <= self.beta_1 < 1, "in [0, 1)")
        self._check("beta_2", 0 <= self.beta_2 < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class RMSprop(Optimizer):
    """RMSprop (optionally centered, with plain momentum), as ``keras.optimizers.RMSprop``.

    Attributes:
        learning_rate: step size, > 0.
        rho: decay rate of the moving averages, in [0, 1).
        momentum: in [0, 1); 0 disables momentum.
        epsilon: added to the second moment under the square root, >= 0.
        centered: normalise by the estimated variance instead of the second moment.
    """

    name: ClassVar[str] = "rmsprop"

    learning_rate: float = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False

    def _validate(self) -> None:
        self._check("learning_rate", self.learning_rate > 0, "> 0")
        self._check("rho", 0 <= self.rho < 1, "in [0, 1)")
        self._check("momentum", 0 <= self.momentum < 1, "in [0, 1)")
        self._check("epsilon", self.epsilon >= 0, ">= 0")


_BY_NAME: Final[dict[str, type[Optimizer]]] = {cls.name: cls for cls in (SGD, Adagrad, Adam, RMSprop)}

# Keys of a Keras 3 optimizer config that carry no update-rule information.
_IGNORED_CONFIG_KEYS: Final[frozenset[str]] = frozenset(
    {"name", "ema_momentum", "ema_overwrite_frequency", "jit_compile", "is_legacy_optimizer"}
)
# Keras features the shard does not implement, with the value that means "off".
_UNSUPPORTED_CONFIG_KEYS: Final[dict[str, tuple[Any, ...]]] = {
    "weight_decay": (None, 0, 0.0),
    "clipnorm": (None,),
    "global_clipnorm": (None,),
    "clipvalue": (None,),
    "use_ema": (False,),
    "loss_scale_factor": (None, 1, 1.0),
    "gradient_accumulation_steps": (None, 1),
    "decay": (None, 0, 0.0),
}


def _lookup(name: str) -> type[Optimizer]:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; supported: {', '.join(sorted(_BY_NAME))}") from None


def _field_defaults(cls: type[Optimizer]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def optimizer_from_proto(spec: ps_pb2.OptimizerSpec) -> Optimizer:
    """Parses a ``psproto.v1.OptimizerSpec``; missing parameters take their Keras defaults.

    Raises:
        ValueError: unknown optimizer name, unknown parameter, a boolean that is
            not 0 or 1, or a value out of range.
    """
    cls = _lookup(spec.name.lower())
    defaults = _field_defaults(cls)
    kwargs: dict[str, Any] = {}
    for key, value in spec.params.items():
        if key not in defaults:
            raise ValueError(
                f"optimizer {cls.name!r} has no parameter {key!r}; expected some of {', '.join(defaults)}"
            )
        if isinstance(defaults[key], bool):
            if value not in (0.0, 1.0):
                raise ValueError(f"optimizer {cls.name!r}: {key} must be 0 or 1, got {value!r}")
            kwargs[key] = value == 1.0
        else:
            kwargs[key] = value
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
    decimal, so ``keras.optimizers.SGD()`` gives ``SGD(learning_rate=0.01)``.

    Args:
        name: the optimizer class name, any case ("SGD", "Adam", "adam",
            "keras.optimizers.RMSprop").
        config: the optimizer's config.

    Raises:
        ValueError: an unsupported optimizer, a learning-rate schedule, a
            feature the shard does not implement (weight decay, clipping, EMA,
            loss scaling, gradient accumulation), an unknown key or a value
            out of range.
    """
    cls = _lookup(name.rsplit(".", 1)[-1].lower())
    defaults = _field_defaults(cls)
    kwargs: dict[str, Any] = {}
    for key, value in config.items():
        if key in _IGNORED_CONFIG_KEYS:
            continue
        if key in _UNSUPPORTED_CONFIG_KEYS:
            off = _UNSUPPORTED_CONFIG_KEYS[key]
            if not any(value is o or (type(value) is type(o) and value == o) for o in off):
                raise ValueError(
                    f"{name}: {key}={value!r} is not supported by server-side optimizers "
                    f"(only {' or '.join(repr(o) for o in off)})"
                )
            continue
        if key not in defaults:
            raise ValueError(f"{name}: unknown config key {key!r}")
        if key == "learning_rate":
            if isinstance(value, Mapping):
                schedule = value.get("class_name", "a learning-rate schedule")
                raise ValueError(
                    f"{name}: learning_rate is {schedule}; server-side optimizers support only a "
                    "constant float learning rate, not learning-rate schedules"
                )
            if isinstance(value, float):
                value = _float32_shortest(value)
        kwargs[key] = value
    return cls(**kwargs)
