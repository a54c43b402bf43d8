"""Server-side optimizers: apply a pushed gradient to a stored numpy variable, as Keras 3 does.

The update rules, operation order and slot names are those of
``keras.optimizers`` (Keras 3): see ``psclient.optimizers`` for the formulas,
which also owns the names, defaults and validation of the hyper-parameters.

Slots (``dict[str, np.ndarray]``, same shape and dtype as the variable, names as
Keras's optimizer variables, stable for checkpoints)::

    sgd       momentum                      (only when momentum > 0)
    adagrad   accumulator                   (starts at initial_accumulator_value)
    adam      momentum, velocity, velocity_hat (the last only with amsgrad)
    rmsprop   velocity, momentum (momentum > 0), average_gradient (centered)

``apply`` never writes to the variable it is given (the store keeps old values
alive for concurrent readers): it returns a new array and updates the slots in
place. It works through the flat arrays in cache-sized blocks, so a multi-pass
rule like Adam reads each big array from memory about once and its temporaries
stay small. Arithmetic is done in the variable's dtype, except float16, which is
computed in float32 and rounded back. As in TensorFlow, NaN and inf propagate
silently.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Final

import numpy as np

from psclient import optimizers as specs
from psproto.v1 import ps_pb2

__all__ = [
    "ServerAdagrad",
    "ServerAdam",
    "ServerOptimizer",
    "ServerRMSprop",
    "ServerSGD",
    "from_config",
    "from_spec",
]

# Elements per block: 64 Ki elements is 256 KiB of float32 per array, so the
# handful of arrays one block of Adam touches stays in the CPU's L2/L3 cache.
BLOCK_ELEMENTS: Final[int] = 1 << 16

_F32: Final[np.dtype] = np.dtype(np.float32)
_F16: Final[np.dtype] = np.dtype(np.float16)


class ServerOptimizer(abc.ABC):
    """One update rule with fixed hyper-parameters, shared by every variable that uses it.

    Stateless apart from its configuration: per-variable state lives in the slots
    the caller keeps (``init_slots``) and passes to every ``apply``.

    Attributes:
        config: the validated spec this optimizer was built from.
    """

    name: ClassVar[str]
    # Scratch buffers (each one block long) that _update may use.
    _SCRATCH: ClassVar[int] = 0

    def __init__(self, config: specs.Optimizer) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    @property
    def spec(self) -> ps_pb2.OptimizerSpec:
        """The wire form of this optimizer's configuration."""
        return self.config.to_proto()

    @abc.abstractmethod
    def slot_names(self) -> tuple[str, ...]:
        """The names of the slots ``init_slots`` creates, in a stable order."""

    def _initial_slot_value(self, slot: str) -> float:
        return 0.0

    def init_slots(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """Returns fresh slots for a variable: C-contiguous arrays of its shape and dtype.

        A variable whose dtype is not floating point is not trainable and gets no slots.
        """
        if not np.issubdtype(value.dtype, np.floating):
            return {}
        return {
            slot: np.full(value.shape, self._initial_slot_value(slot), dtype=value.dtype)
            for slot in self.slot_names()
        }

    def apply(
        self, value: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], iteration: int
    ) -> np.ndarray:
        """Applies one gradient and returns the new value; ``value`` itself is left untouched.

        Args:
            value: the current variable (read only).
            grad: its gradient, same shape; cast to ``value``'s dtype first, as Keras does.
            slots: the variable's slots (from ``init_slots`` or a checkpoint), updated in place.
            iteration: how many updates were applied to this variable before this one
                (Keras's ``optimizer.iterations`` before the step), >= 0.

        Returns:
            A new C-contiguous array with ``value``'s shape and dtype.

        Raises:
            TypeError: ``value`` or ``grad`` is not floating point (not trainable).
            ValueError: mismatched shapes, a missing, misshapen or read-only slot,
                or a negative iteration.
        """
        self._check(value, grad, slots, iteration)
        dtype = value.dtype
        out = np.empty(value.shape, dtype=dtype)
        if value.size == 0:
            return out
        compute = _F32 if dtype == _F16 else dtype
        consts = self._constants(compute, int(iteration))
        flat_value = value.reshape(-1)
        flat_grad = grad.reshape(-1)
        flat_out = out.reshape(-1)
        flat_slots = {}
        copied: list[str] = []
        for slot in self.slot_names():
            arr = slots[slot]
            if arr.flags.c_contiguous:
                flat_slots[slot] = arr.reshape(-1)
            else:
                flat_slots[slot] = np.ascontiguousarray(arr).reshape(-1)
                copied.append(slot)
        block = min(BLOCK_ELEMENTS, value.size)
        scratch = [np.empty(block, dtype=compute) for _ in range(self._SCRATCH)]
        direct = compute == dtype and all(a.dtype == dtype for a in flat_slots.values())
        out_block = None if direct else np.empty(block, dtype=compute)
        with np.errstate(all="ignore"):
            for start in range(0, value.size, block):
                stop = min(start + block, value.size)
                n = stop - start
                v = flat_value[start:stop]
                g = flat_grad[start:stop]
                if g.dtype != dtype:
                    g = g.astype(dtype)
                s = {k: a[start:stop] for k, a in flat_slots.items()}
                tmp = [t[:n] for t in scratch]
                if direct:
                    self._update(v, g, s, flat_out[start:stop], tmp, consts)
                    continue
                # float16 (or slots of another dtype): compute on compute-dtype copies.
                s_work = {k: a.astype(compute) for k, a in s.items()}
                o = out_block[:n]
                self._update(v.astype(compute), g.astype(compute, copy=False), s_work, o, tmp, consts)
                for k, a in s.items():
                    a[...] = s_work[k]
                flat_out[start:stop] = o
        for slot in copied:
            slots[slot][...] = flat_slots[slot].reshape(slots[slot].shape)
        return out

    def _check(
        self, value: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], iteration: int
    ) -> None:
        if not np.issubdtype(value.dtype, np.floating):
            raise TypeError(f"{self.name}: variables of dtype {value.dtype.name} are not trainable")
        if not np.issubdtype(grad.dtype, np.floating):
            raise TypeError(f"{self.name}: gradient dtype {grad.dtype.name} is not floating point")
        if grad.shape != value.shape:
            raise ValueError(f"{self.name}: gradient shape {grad.shape} != variable shape {value.shape}")
        if isinstance(iteration, bool) or not isinstance(iteration, int | np.integer) or iteration < 0:
            raise ValueError(f"{self.name}: iteration must be an int >= 0, got {iteration!r}")
        for slot in self.slot_names():
            arr = slots.get(slot)
            if arr is None:
                raise ValueError(f"{self.name}: slot {slot!r} is missing (have {sorted(slots)})")
            if arr.shape != value.shape:
                raise ValueError(f"{self.name}: slot {slot!r} has shape {arr.shape}, expected {value.shape}")
            if not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"{self.name}: slot {slot!r} has non-float dtype {arr.dtype.name}")
            if not arr.flags.writeable:
                raise ValueError(f"{self.name}: slot {slot!r} is read-only")

    @abc.abstractmethod
    def _constants(self, dtype: np.dtype, iteration: int) -> tuple[np.floating, ...]:
        """The scalar factors of one step, in the compute dtype."""

    @abc.abstractmethod
    def _update(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        out: np.ndarray,
        tmp: list[np.ndarray],
        consts: tuple[np.floating, ...],
    ) -> None:
        """Updates one block: writes the new value into ``out`` and the slots in place.

        All arrays are 1-D blocks of the same length and the compute dtype.
        ``out`` never overlaps the other arrays and may serve as scratch space
        before it receives the result; ``tmp`` are ``_SCRATCH`` scratch blocks.
        """


class ServerSGD(ServerOptimizer):
    """``keras.optimizers.SGD``."""

    name: ClassVar[str] = "sgd"
    _SCRATCH: ClassVar[int] = 1
    config: specs.SGD

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.config.momentum > 0 else ()

    def _constants(self, dtype: np.dtype, iteration: int) -> tuple[np.floating, ...]:
        return dtype.type(self.config.learning_rate), dtype.type(self.config.momentum)

    def _update(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        out: np.ndarray,
        tmp: list[np.ndarray],
        consts: tuple[np.floating, ...],
    ) -> None:
        lr, momentum = consts
        np.multiply(grad, lr, out=out)  # g * lr
        if not slots:
            np.subtract(value, out, out=out)
            return
        m = slots["momentum"]
        m *= momentum
        m -= out  # m = m * momentum - g * lr
        if self.config.nesterov:
            np.multiply(m, momentum, out=tmp[0])
            np.subtract(tmp[0], out, out=tmp[0])
            np.add(value, tmp[0], out=out)  # w + (m * momentum - g * lr)
        else:
            np.add(value, m, out=out)


class ServerAdagrad(ServerOptimizer):
    """``keras.optimizers.Adagrad``."""

    name: ClassVar[str] = "adagrad"
    _SCRATCH: ClassVar[int] = 1
    config: specs.Adagrad

    def slot_names(self) -> tuple[str, ...]:
        return ("accumulator",)

    def _initial_slot_value(self, slot: str) -> float:
        return self.config.initial_accumulator_value

    def _constants(self, dtype: np.dtype, iteration: int) -> tuple[np.floating, ...]:
        return dtype.type(self.config.learning_rate), dtype.type(self.config.epsilon)

    def _update(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        out: np.ndarray,
        tmp: list[np.ndarray],
        consts: tuple[np.floating, ...],
    ) -> None:
        lr, epsilon = consts
        acc = slots["accumulator"]
        np.square(grad, out=out)
        acc += out
        np.add(acc, epsilon, out=out)
        np.sqrt(out, out=out)
        np.multiply(grad, lr, out=tmp[0])
        np.divide(tmp[0], out, out=out)  # lr * g / sqrt(acc + eps)
        np.subtract(value, out, out=out)


class ServerAdam(ServerOptimizer):
    """``keras.optimizers.Adam`` (and AMSGrad)."""

    name: ClassVar[str] = "adam"
    _SCRATCH: ClassVar[int] = 1
    config: specs.Adam

    def slot_names(self) -> tuple[str, ...]:
        names = ("momentum", "velocity")
        return (*names, "velocity_hat") if self.config.amsgrad else names

    def _constants(self, dtype: np.dtype, iteration: int) -> tuple[np.floating, ...]:
        c = self.config
        t = dtype.type(iteration + 1)
        one = dtype.type(1)
        beta_1_power = np.power(dtype.type(c.beta_1), t)
        beta_2_power = np.power(dtype.type(c.beta_2), t)
        with np.errstate(all="ignore"):
            alpha = dtype.type(c.learning_rate) * np.sqrt(one - beta_2_power) / (one - beta_1_power)
        return alpha, dtype.type(1 - c.beta_1), dtype.type(1 - c.beta_2), dtype.type(c.epsilon)

    def _update(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        out: np.ndarray,
        tmp: list[np.ndarray],
        consts: tuple[np.floating, ...],
    ) -> None:
        alpha, one_minus_beta_1, one_minus_beta_2, epsilon = consts
        m = slots["momentum"]
        v = slots["velocity"]
        np.subtract(grad, m, out=out)
        out *= one_minus_beta_1
        m += out  # m += (g - m) * (1 - beta_1)
        np.square(grad, out=out)
        out -= v
        out *= one_minus_beta_2
        v += out  # v += (g**2 - v) * (1 - beta_2)
        if self.config.amsgrad:
            v_hat = slots["velocity_hat"]
            np.maximum(v_hat, v, out=v_hat)
            v = v_hat
        np.sqrt(v, out=out)
        out += epsilon
        np.multiply(m, alpha, out=tmp[0])
        np.divide(tmp[0], out, out=out)  # m * alpha / (sqrt(v) + eps)
        np.subtract(value, out, out=out)


class ServerRMSprop(ServerOptimizer):
    """``keras.optimizers.RMSprop`` (centered and with momentum)."""

    name: ClassVar[str] = "rmsprop"
    _SCRATCH: ClassVar[int] = 1
    config: specs.RMSprop

    def slot_names(self) -> tuple[str, ...]:
        names = ["velocity"]
        if self.config.momentum > 0:
            names.append("momentum")
        if self.config.centered:
            names.append("average_gradient")
        return tuple(names)

    def _constants(self, dtype: np.dtype, iteration: int) -> tuple[np.floating, ...]:
        c = self.config
        return (
            dtype.type(c.learning_rate),
            dtype.type(c.rho),
            dtype.type(1 - c.rho),
            dtype.type(c.momentum),
            dtype.type(c.epsilon),
        )

    def _update(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        out: np.ndarray,
        tmp: list[np.ndarray],
        consts: tuple[np.floating, ...],
    ) -> None:
        lr, rho, one_minus_rho, momentum, epsilon = consts
        velocity = slots["velocity"]
        velocity *= rho
        np.square(grad, out=out)
        out *= one_minus_rho
        velocity += out  # v = rho * v + (1 - rho) * g**2
        if self.config.centered:
            average = slots["average_gradient"]
            average *= rho
            np.multiply(grad, one_minus_rho, out=out)
            average += out  # a = rho * a + (1 - rho) * g
            np.square(average, out=out)
            np.subtract(velocity, out, out=out)
            out += epsilon  # v - a**2 + eps
        else:
            np.add(velocity, epsilon, out=out)
        np.sqrt(out, out=out)
        np.multiply(grad, lr, out=tmp[0])
        np.divide(tmp[0], out, out=out)  # increment = lr * g / sqrt(d)
        if self.config.momentum > 0:
            m = slots["momentum"]
            m *= momentum
            m += out  # m = momentum * m + increment
            np.subtract(value, m, out=out)
        else:
            np.subtract(value, out, out=out)


_SERVER_CLASSES: Final[dict[type[specs.Optimizer], type[ServerOptimizer]]] = {
    specs.SGD: ServerSGD,
    specs.Adagrad: ServerAdagrad,
    specs.Adam: ServerAdam,
    specs.RMSprop: ServerRMSprop,
}


def from_config(config: specs.Optimizer) -> ServerOptimizer:
    """Builds the server optimizer for a validated client spec (``psclient.SGD(...)`` etc.).

    Raises:
        ValueError: the spec's type has no server implementation.
    """
    try:
        cls = _SERVER_CLASSES[type(config)]
    except KeyError:
        raise ValueError(f"no server-side optimizer for {type(config).__name__}") from None
    return cls(config)


def from_spec(spec: ps_pb2.OptimizerSpec) -> ServerOptimizer:
    """Builds the server optimizer a ``psproto.v1.OptimizerSpec`` names.

    Missing parameters take the Keras 3 defaults.

    Raises:
        ValueError: unknown optimizer name, unknown parameter or invalid value
            (the message says which).
    """
    return from_config(specs.optimizer_from_proto(spec))
