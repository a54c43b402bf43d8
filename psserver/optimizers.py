"""Server-side optimizers: apply a pushed gradient to a stored numpy variable, as Keras 3 does.

The update rules, operation order and slot names are those of
``keras.optimizers`` (Keras 3): see ``pscore.optimizers`` for the formulas,
which also owns the names, defaults and validation of the hyper-parameters.

Slots (``dict[str, np.ndarray]``, same shape and dtype as the variable, names as
Keras's optimizer variables, stable for checkpoints)::

    sgd       momentum                      (only when momentum > 0)
    adagrad   accumulator                   (starts at initial_accumulator_value)
    adam      momentum, velocity, velocity_hat (the last only with amsgrad; also adamw)
    rmsprop   velocity, momentum (momentum > 0), average_gradient (centered)
    nadam     momentum, velocity, u_product (a scalar, starts at 1)
    adamax    momentum, norm
    adadelta  accumulated_grad, accumulated_delta_var
    ftrl      accumulator (starts at initial_accumulator_value), linear
    lion      momentum
    adafactor r (shape[:-1]) and c (shape[:-2] + shape[-1:]) for rank >= 2, else velocity
    lamb      momentum, velocity

plus ``gradient_accumulator`` (same shape) with ``gradient_accumulation_steps``,
and ``average`` (same shape, created equal to the initial value) with ``use_ema``.
Slots that are not of the variable's shape (``u_product``, ``r``, ``c``) are the
exception; ``slot_shapes`` gives every slot's shape.

Before the update rule, ``apply`` does what Keras's base optimizer does around
``update_step``: gradient accumulation, per-variable clipping (``clipnorm``,
``clipvalue``; ``global_clipnorm`` is the worker's job and ignored here), weight
decay, and the learning rate (a constant or a schedule evaluated at the
iteration); after it, with ``use_ema``, the moving average and its periodic
overwrite of the variable. Rules whose math needs the whole variable (``clipnorm``, Adafactor,
Lamb: ``needs_whole_variable``) are refused by the store for a variable cut
into partitions.

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
import functools
from typing import Any, ClassVar, Final

import numpy as np

from pscore import optimizers as specs
from pscore.embedding import Regularizer
from psproto.v1 import ps_pb2

__all__ = [
    "ServerAdadelta",
    "ServerAdafactor",
    "ServerAdagrad",
    "ServerAdam",
    "ServerAdamW",
    "ServerAdamax",
    "ServerFtrl",
    "ServerLamb",
    "ServerLion",
    "ServerNadam",
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


@functools.cache
def _floating(dtype: np.dtype) -> bool:
    """``np.issubdtype(dtype, np.floating)``, remembered per dtype (it runs on every push)."""
    return bool(np.issubdtype(dtype, np.floating))


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
    # The rule itself needs the whole variable (norms, means over axes), not elementwise blocks.
    _WHOLE: ClassVar[bool] = False

    def __init__(self, config: specs.Optimizer) -> None:
        self.config = config
        # ``slot_shapes`` by variable shape, for the checks of every apply (the config is a frozen spec, set
        # once: an optimizer change makes a new ServerOptimizer).
        self._checked_shapes: dict[tuple[int, ...], dict[str, tuple[int, ...]]] = {}
        self._rule_slots = self.slot_names()  # for every apply (the config is set once, as above)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    @property
    def spec(self) -> ps_pb2.OptimizerSpec:
        """The wire form of this optimizer's configuration."""
        return self.config.to_proto()

    @property
    def needs_whole_variable(self) -> bool:
        """Whether the update of one element depends on the whole variable (clipnorm, Adafactor, Lamb).

        Such a variable cannot be cut into partitions on several shards: each
        shard would see only its part (another norm, other row means).
        """
        return self._WHOLE or self.config.clipnorm is not None

    @abc.abstractmethod
    def slot_names(self) -> tuple[str, ...]:
        """The names of the update rule's slots of the variable's shape, in a stable order."""

    def _initial_slot_value(self, slot: str) -> float:
        return 0.0

    def _extra_slot_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Slots of the update rule that are not of the variable's shape (a scalar, factored moments)."""
        return {}

    def slot_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Every slot a variable of ``shape`` has, with its shape, in a stable order."""
        shape = tuple(shape)
        out = {slot: shape for slot in self.slot_names()}
        out.update(self._extra_slot_shapes(shape))
        if self.config.gradient_accumulation_steps:
            out["gradient_accumulator"] = shape
        if self.config.use_ema:
            out["average"] = shape
        return out

    def init_slots(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """Returns fresh slots for a variable: C-contiguous arrays of the variable's dtype.

        The moving average (``use_ema``) starts as a copy of ``value``. A variable
        whose dtype is not floating point is not trainable and gets no slots.
        """
        if not _floating(value.dtype):
            return {}
        return {
            slot: (
                np.array(value, order="C", copy=True)
                if slot == "average"
                else np.full(shape, self._initial_slot_value(slot), dtype=value.dtype)
            )
            for slot, shape in self.slot_shapes(value.shape).items()
        }

    def learning_rate(self, iteration: int) -> float:
        """The learning rate of the update after ``iteration`` pushes: the constant, or the schedule's value.

        Keras evaluates a schedule at ``optimizer.iterations`` before the step
        increments it, and with gradient accumulation at the count of every
        call (not only of applied updates); so does the shard.
        """
        lr = self.config.learning_rate  # type: ignore[attr-defined]
        if isinstance(lr, specs.LearningRateSchedule):
            return lr(iteration)
        return float(lr)

    def apply(
        self, value: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], iteration: int
    ) -> np.ndarray:
        """Applies one gradient and returns the new value; ``value`` itself is left untouched.

        In Keras's order: gradient accumulation (a push that only accumulates
        returns a copy of ``value``), clipping, weight decay, the update rule, then
        the moving average (``use_ema``, also on a push that only accumulates).

        Args:
            value: the current variable (read only).
            grad: its gradient, same shape; cast to ``value``'s dtype first, as Keras does.
            slots: the variable's slots (from ``init_slots`` or a checkpoint), updated in place.
            iteration: how many pushes were applied to this variable before this one
                (Keras's ``optimizer.iterations`` before the step, counting every
                call with gradient accumulation), >= 0.

        Returns:
            A new C-contiguous array with ``value``'s shape and dtype.

        Raises:
            TypeError: ``value`` or ``grad`` is not floating point (not trainable).
            ValueError: mismatched shapes, a missing, misshapen or read-only slot,
                or a negative iteration.
        """
        # The checks, inline (a method of their own was one call more a variable):
        if not _floating(value.dtype):
            raise TypeError(f"{self.name}: variables of dtype {value.dtype.name} are not trainable")
        if not _floating(grad.dtype):
            raise TypeError(f"{self.name}: gradient dtype {grad.dtype.name} is not floating point")
        if grad.shape != value.shape:
            raise ValueError(f"{self.name}: gradient shape {grad.shape} != variable shape {value.shape}")
        if isinstance(iteration, bool) or not isinstance(iteration, int | np.integer) or iteration < 0:
            raise ValueError(f"{self.name}: iteration must be an int >= 0, got {iteration!r}")
        shapes = self._checked_shapes.get(value.shape)
        if shapes is None:
            shapes = self._checked_shapes[value.shape] = self.slot_shapes(value.shape)
        for slot, shape in shapes.items():
            arr = slots.get(slot)
            if arr is None:
                raise ValueError(f"{self.name}: slot {slot!r} is missing (have {sorted(slots)})")
            if arr.shape != shape:
                raise ValueError(f"{self.name}: slot {slot!r} has shape {arr.shape}, expected {shape}")
            if not _floating(arr.dtype):
                raise ValueError(f"{self.name}: slot {slot!r} has non-float dtype {arr.dtype.name}")
            if not arr.flags.writeable:
                raise ValueError(f"{self.name}: slot {slot!r} is read-only")
        dtype = value.dtype
        if value.size == 0:
            return np.empty(value.shape, dtype=dtype)
        iteration = int(iteration)
        if grad.dtype != dtype:
            grad = grad.astype(dtype)
        c = self.config
        step = iteration
        if c.gradient_accumulation_steps:
            k = c.gradient_accumulation_steps
            acc = slots["gradient_accumulator"]
            with np.errstate(all="ignore"):
                if (iteration + 1) % k:
                    acc += grad
                    return self._average(
                        np.array(value, dtype=dtype, order="C", copy=True), slots, iteration // k
                    )
                grad = (grad + acc) / dtype.type(k)
            acc[...] = 0
            step = iteration // k  # Keras's `iterations` with accumulation: applied updates
        compute = _F32 if dtype == _F16 else dtype
        lr = c.learning_rate  # type: ignore[attr-defined]
        lr = lr(iteration) if isinstance(lr, specs.LearningRateSchedule) else float(lr)  # learning_rate()
        if c.clipnorm is not None or c.clipvalue is not None or c.weight_decay is not None:
            value, grad = self._preprocess(value, grad, compute, lr)
        new = self._apply_rule(value, grad, slots, step, lr)
        return self._average(new, slots, step) if c.use_ema else new

    def _preprocess(
        self, value: np.ndarray, grad: np.ndarray, compute: np.dtype, lr: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Clipping and weight decay (``apply``'s, when the optimizer has any): the value and gradient."""
        c = self.config
        dtype = value.dtype
        with np.errstate(all="ignore"):
            if c.clipnorm is not None:
                g = grad.astype(compute, copy=False)
                l2sum = np.sum(np.square(g))
                l2norm = np.sqrt(l2sum) if l2sum > 0 else l2sum
                clip = compute.type(c.clipnorm)
                grad = (g * clip / np.maximum(l2norm, clip)).astype(dtype, copy=False)
            elif c.clipvalue is not None:
                grad = np.clip(grad, -c.clipvalue, c.clipvalue).astype(dtype, copy=False)
            if c.weight_decay is not None:
                v = value.astype(compute, copy=False)
                decay = v * compute.type(c.weight_decay) * compute.type(lr)
                value = (v - decay).astype(dtype, copy=False)
        return value, grad

    def _average(self, new: np.ndarray, slots: dict[str, np.ndarray], step: int) -> np.ndarray:
        """Keras's moving average after an update (``use_ema``); returns the variable's new value.

        ``step`` is Keras's ``iterations`` before the update (applied updates):
        the first update sets the average to ``new``, later ones move it by
        ``1 - ema_momentum`` towards ``new``, in the compute dtype, in Keras's
        order (``momentum * average + (1 - momentum) * new``). Every
        ``ema_overwrite_frequency`` updates the variable becomes its average.
        """
        c = self.config
        if not c.use_ema or new.size == 0:
            return new
        average = slots["average"]
        if step == 0:
            average[...] = new
        else:
            compute = _F32 if new.dtype == _F16 else new.dtype
            momentum = compute.type(c.ema_momentum)
            rest = compute.type(1) - momentum
            flat_average, flat_new = average.reshape(-1), new.reshape(-1)
            block = min(BLOCK_ELEMENTS, new.size)
            tmp = np.empty(block, dtype=compute)
            with np.errstate(all="ignore"):
                for start in range(0, new.size, block):
                    stop = min(start + block, new.size)
                    a, t = flat_average[start:stop], tmp[: stop - start]
                    np.multiply(flat_new[start:stop], rest, out=t)
                    t += a.astype(compute, copy=False) * momentum
                    a[...] = t
        every = c.ema_overwrite_frequency
        if every and (step + 1) % every == 0:
            return np.array(average, dtype=new.dtype, order="C", copy=True)
        return new

    def check_rows(self) -> None:
        """Raises ValueError if this optimizer cannot update an embedding table row by row.

        Rules that need the whole variable (clipnorm, Adafactor, Lamb) and
        gradient accumulation (a slot of sums over pushes) are refused.
        """
        if self.needs_whole_variable:
            raise ValueError(
                f"{self.config!r} needs the whole variable (norms or means over it); an embedding table is "
                "spread by row over the shards and updated row by row: use clipvalue, or another optimizer"
            )
        if self.config.gradient_accumulation_steps:
            raise ValueError(f"{self.config!r}: gradient_accumulation_steps is not supported for tables")

    def apply_rows(
        self,
        value: np.ndarray,
        rows: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        iteration: int,
        regularizer: Regularizer | None = None,
    ) -> np.ndarray:
        """Applies a row-sparse gradient: returns the new values of ``rows`` (the caller writes them back).

        The lazy rule: only the given rows and their slots are updated, with the
        dense rule's arithmetic (clipvalue, weight decay and the update rule, in
        Keras's order), and the step count ``iteration`` is the table's. For SGD
        without momentum and Adagrad this is exactly the dense update with zero
        gradients elsewhere (those leave a row unchanged); for SGD with
        momentum, Adam, RMSprop, FTRL and the others the untouched rows'
        slots and values simply wait (TensorFlow's sparse/lazy updates).
        Scalar slots (Nadam's ``u_product``) advance once per push. The moving
        average (``use_ema``) of the given rows moves too (the first push to the
        table sets it), and its overwrite (``ema_overwrite_frequency``, counted
        in pushes to the table) writes the average into those rows only.

        Args:
            value: the table piece, shape ``[rows, dim]`` (read only).
            rows: distinct local row indices, shape ``[n]``.
            grad: their gradients, shape ``[n, dim]``.
            slots: the piece's slots, updated in place at ``rows``.
            iteration: pushes applied to this table before this one.
            regularizer: the table's; its gradient at the rows' current values is added to
                ``grad`` first (before clipping, as Keras adds a regularizer's term to the loss).

        Raises:
            ValueError: see ``check_rows``, or mismatched shapes.
        """
        c = self.config
        if self._WHOLE or c.clipnorm is not None or c.gradient_accumulation_steps:
            self.check_rows()  # raises
        if grad.shape != (rows.size, *value.shape[1:]):
            raise ValueError(f"{self.name}: row gradient {grad.shape} for {rows.size} rows of {value.shape}")
        dtype = value.dtype
        if grad.dtype != dtype:
            grad = grad.astype(dtype)
        if rows.size == 0:
            return np.empty(grad.shape, dtype=dtype)
        compute = _F32 if dtype == _F16 else dtype
        lr = c.learning_rate  # type: ignore[attr-defined]
        lr = lr(int(iteration)) if isinstance(lr, specs.LearningRateSchedule) else float(lr)  # learning_rate
        v = value[rows]
        shaped = self._rule_slots
        gathered = {}  # a loop, not a comprehension: no call per push
        for k, a in slots.items():
            gathered[k] = a[rows] if k in shaped else a
        if regularizer is not None or c.clipvalue is not None or c.weight_decay is not None:
            with np.errstate(all="ignore"):
                if regularizer is not None:
                    w = v.astype(compute, copy=False)
                    grad = (grad.astype(compute, copy=False) + regularizer.gradient(w)).astype(
                        dtype, copy=False
                    )
                if c.clipvalue is not None:
                    grad = np.clip(grad, -c.clipvalue, c.clipvalue).astype(dtype, copy=False)
                if c.weight_decay is not None:
                    w = v.astype(compute, copy=False)
                    v = (w - w * compute.type(c.weight_decay) * compute.type(lr)).astype(dtype, copy=False)
        new = self._apply_rule(v, grad, gathered, int(iteration), lr)
        for k in shaped:
            slots[k][rows] = gathered[k]
        if c.use_ema:
            average = {"average": slots["average"][rows]}
            new = self._average(new, average, int(iteration))
            slots["average"][rows] = average["average"]
        return new

    def _apply_rule(
        self, value: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], step: int, lr: float
    ) -> np.ndarray:
        """The update rule (Keras's ``update_step``), blockwise; ``step`` is the 0-based update count."""
        dtype = value.dtype
        out = np.empty(value.shape, dtype=dtype)
        compute = _F32 if dtype == _F16 else dtype
        consts = self._constants(compute, step, compute.type(lr), slots)
        flat_value = value.reshape(-1)
        flat_grad = grad.reshape(-1)
        flat_out = out.reshape(-1)
        flat_slots = {}
        copied: list[str] = []
        for slot in self._rule_slots:
            arr = slots[slot]
            if arr.flags.c_contiguous:
                flat_slots[slot] = arr.reshape(-1)
            else:
                flat_slots[slot] = np.ascontiguousarray(arr).reshape(-1)
                copied.append(slot)
        block = min(BLOCK_ELEMENTS, value.size)
        scratch = []  # loops, not comprehensions: no function called per push (a small push walks once)
        for _ in range(self._SCRATCH):
            scratch.append(np.empty(block, dtype=compute))
        direct = compute == dtype
        for a in flat_slots.values():
            direct = direct and a.dtype == dtype
        if direct and block == value.size:  # one block of the compute dtype (a small variable): no slices
            self._block(flat_value, flat_grad, flat_slots, flat_out, scratch, consts)
        else:
            out_block = None if direct else np.empty(block, dtype=compute)
            self._blocks(
                flat_value, flat_grad, flat_out, flat_slots, scratch, out_block, block, compute, consts
            )
        for slot in copied:
            slots[slot][...] = flat_slots[slot].reshape(slots[slot].shape)
        return out

    @np.errstate(all="ignore")
    def _block(self, *update: Any) -> None:
        """``_update(*update)`` of a whole variable that is one block of the compute dtype, floating-point
        errors ignored (``_blocks``'s walk, for one block)."""
        self._update(*update)

    @np.errstate(all="ignore")  # as a decorator: one Python call an update, where a ``with`` makes three
    def _blocks(
        self,
        flat_value: np.ndarray,
        flat_grad: np.ndarray,
        flat_out: np.ndarray,
        flat_slots: dict[str, np.ndarray],
        scratch: list[np.ndarray],
        out_block: np.ndarray | None,
        block: int,
        compute: np.dtype,
        consts: tuple[np.floating, ...],
    ) -> None:
        """``_apply_rule``'s walk over the blocks, floating-point errors ignored; ``out_block`` None: the
        variable, its gradient and slots are of the compute dtype (no copies)."""
        size = flat_value.size
        for start in range(0, size, block):
            stop = min(start + block, size)
            n = stop - start
            v = flat_value[start:stop]
            g = flat_grad[start:stop]
            s = {}
            for k, a in flat_slots.items():
                s[k] = a[start:stop]
            tmp = scratch if n == block else [t[:n] for t in scratch]
            if out_block is None:
                self._update(v, g, s, flat_out[start:stop], tmp, consts)
                continue
            # float16 (or slots of another dtype): compute on compute-dtype copies.
            s_work = {k: a.astype(compute) for k, a in s.items()}
            o = out_block[:n]
            self._update(v.astype(compute), g.astype(compute, copy=False), s_work, o, tmp, consts)
            for k, a in s.items():
                a[...] = s_work[k]
            flat_out[start:stop] = o

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        """The scalar factors of one step, in the compute dtype (may update scalar slots)."""
        raise NotImplementedError

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
        raise NotImplementedError


class ServerSGD(ServerOptimizer):
    """``keras.optimizers.SGD``."""

    name: ClassVar[str] = "sgd"
    _SCRATCH: ClassVar[int] = 1
    config: specs.SGD

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.config.momentum > 0 else ()

    def _apply_rule(
        self, value: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], step: int, lr: float
    ) -> np.ndarray:
        """Without momentum, a variable of one block in its compute dtype: ``value - grad * lr`` as
        ``_update`` computes it, without the walk's set-up (no scratch, no constants, no slot views: two
        Python calls where the walk makes four). Else the walk."""
        dtype = value.dtype
        if self.config.momentum > 0 or dtype == _F16 or value.size > BLOCK_ELEMENTS:
            return super()._apply_rule(value, grad, slots, step, lr)
        out = np.empty(value.shape, dtype=dtype)
        self._plain(value, grad, out, dtype.type(lr))
        return out

    @np.errstate(all="ignore")
    def _plain(self, value: np.ndarray, grad: np.ndarray, out: np.ndarray, lr: np.floating) -> None:
        """``_update`` without momentum, floating-point errors ignored (as ``_block``'s)."""
        np.multiply(grad, lr, out=out)  # g * lr
        np.subtract(value, out, out=out)

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        return lr, dtype.type(self.config.momentum)

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

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        return lr, dtype.type(self.config.epsilon)

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

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        c = self.config
        t = dtype.type(step + 1)
        one = dtype.type(1)
        beta_1_power = np.power(dtype.type(c.beta_1), t)
        beta_2_power = np.power(dtype.type(c.beta_2), t)
        with np.errstate(all="ignore"):
            alpha = lr * np.sqrt(one - beta_2_power) / (one - beta_1_power)
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


class ServerAdamW(ServerAdam):
    """``keras.optimizers.AdamW``: Adam, with the base optimizer's weight decay (always set)."""

    name: ClassVar[str] = "adamw"
    config: specs.AdamW  # type: ignore[assignment]


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

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        c = self.config
        return (
            lr,
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


class ServerNadam(ServerOptimizer):
    """``keras.optimizers.Nadam``; Keras's optimizer-wide ``u_product`` is the per-variable scalar slot."""

    name: ClassVar[str] = "nadam"
    config: specs.Nadam

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "velocity")

    def _extra_slot_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        return {"u_product": ()}

    def _initial_slot_value(self, slot: str) -> float:
        return 1.0 if slot == "u_product" else 0.0

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        c = self.config
        one, half = dtype.type(1), dtype.type(0.5)
        beta_1, beta_2, decay = dtype.type(c.beta_1), dtype.type(c.beta_2), dtype.type(0.96)
        local_step, next_step = dtype.type(step + 1), dtype.type(step + 2)
        with np.errstate(all="ignore"):
            u_product = (
                dtype.type(slots["u_product"][()]) * beta_1 * (one - half * np.power(decay, local_step))
            )
            slots["u_product"][()] = u_product
            u_t = beta_1 * (one - half * np.power(decay, local_step))
            u_t_1 = beta_1 * (one - half * np.power(decay, next_step))
            u_product_t_1 = u_product * u_t_1
            beta_2_power = np.power(beta_2, local_step)
        return (
            lr,
            one - beta_1,
            one - beta_2,
            u_t_1,
            one - u_product_t_1,
            one - u_t,
            one - u_product,
            one - beta_2_power,
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
        lr, one_minus_beta_1, one_minus_beta_2, u_t_1, den_1, one_minus_u_t, den_0, bias_2, epsilon = consts
        m = slots["momentum"]
        v = slots["velocity"]
        m += (grad - m) * one_minus_beta_1
        v += (np.square(grad) - v) * one_minus_beta_2
        m_hat = u_t_1 * m / den_1 + one_minus_u_t * grad / den_0
        np.subtract(value, m_hat * lr / (np.sqrt(v / bias_2) + epsilon), out=out)


class ServerAdamax(ServerOptimizer):
    """``keras.optimizers.Adamax``."""

    name: ClassVar[str] = "adamax"
    config: specs.Adamax

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "norm")

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        c = self.config
        beta_1_power = np.power(dtype.type(c.beta_1), dtype.type(step + 1))
        return (
            lr,
            dtype.type(1 - c.beta_1),
            dtype.type(c.beta_2),
            dtype.type(1) - beta_1_power,
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
        lr, one_minus_beta_1, beta_2, bias_1, epsilon = consts
        m = slots["momentum"]
        u = slots["norm"]
        m += (grad - m) * one_minus_beta_1
        np.maximum(u * beta_2, np.abs(grad), out=u)
        np.subtract(value, lr * m / (bias_1 * (u + epsilon)), out=out)


class ServerAdadelta(ServerOptimizer):
    """``keras.optimizers.Adadelta``."""

    name: ClassVar[str] = "adadelta"
    config: specs.Adadelta

    def slot_names(self) -> tuple[str, ...]:
        return ("accumulated_grad", "accumulated_delta_var")

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        c = self.config
        return lr, dtype.type(c.rho), dtype.type(1 - c.rho), dtype.type(c.epsilon)

    def _update(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        out: np.ndarray,
        tmp: list[np.ndarray],
        consts: tuple[np.floating, ...],
    ) -> None:
        lr, rho, one_minus_rho, epsilon = consts
        acc_grad = slots["accumulated_grad"]
        acc_delta = slots["accumulated_delta_var"]
        acc_grad[...] = rho * acc_grad + one_minus_rho * np.square(grad)
        delta = -(np.sqrt(acc_delta + epsilon) * grad) / np.sqrt(acc_grad + epsilon)
        acc_delta[...] = rho * acc_delta + one_minus_rho * np.square(delta)
        np.add(value, lr * delta, out=out)


class ServerFtrl(ServerOptimizer):
    """``keras.optimizers.Ftrl``."""

    name: ClassVar[str] = "ftrl"
    config: specs.Ftrl

    def slot_names(self) -> tuple[str, ...]:
        return ("accumulator", "linear")

    def _initial_slot_value(self, slot: str) -> float:
        return self.config.initial_accumulator_value if slot == "accumulator" else 0.0

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        c = self.config
        with np.errstate(all="ignore"):
            l2_reg = dtype.type(c.l2_regularization_strength) + dtype.type(c.beta) / (dtype.type(2.0) * lr)
        return (
            lr,
            dtype.type(-c.learning_rate_power),
            dtype.type(2 * c.l2_shrinkage_regularization_strength),
            dtype.type(2) * l2_reg,
            dtype.type(c.l1_regularization_strength),
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
        lr, power, shrinkage, two_l2_reg, l1 = consts
        accum = slots["accumulator"]
        linear = slots["linear"]
        grad_to_use = grad + shrinkage * value
        new_accum = accum + np.square(grad)
        new_accum_power = np.power(new_accum, power)
        linear += grad_to_use - (new_accum_power - np.power(accum, power)) / lr * value
        quadratic = new_accum_power / lr + two_l2_reg
        np.divide(np.clip(linear, -l1, l1) - linear, quadratic, out=out)
        accum[...] = new_accum


class ServerLion(ServerOptimizer):
    """``keras.optimizers.Lion``."""

    name: ClassVar[str] = "lion"
    config: specs.Lion

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",)

    def _constants(
        self, dtype: np.dtype, step: int, lr: np.floating, slots: dict[str, np.ndarray]
    ) -> tuple[np.floating, ...]:
        c = self.config
        beta_1, beta_2, one = dtype.type(c.beta_1), dtype.type(c.beta_2), dtype.type(1.0)
        return lr, beta_1, one - beta_1, beta_2, one - beta_2

    def _update(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        out: np.ndarray,
        tmp: list[np.ndarray],
        consts: tuple[np.floating, ...],
    ) -> None:
        lr, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2 = consts
        m = slots["momentum"]
        np.subtract(value, lr * np.sign(m * beta_1 + grad * one_minus_beta_1), out=out)
        m[...] = m * beta_2 + grad * one_minus_beta_2


def _rms(x: np.ndarray) -> np.floating:
    return np.sqrt(np.mean(np.square(x)))


class _WholeVariableOptimizer(ServerOptimizer):
    """A rule computed on the whole variable at once (in float32 for float16 variables)."""

    _WHOLE: ClassVar[bool] = True

    def _apply_rule(
        self, value: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], step: int, lr: float
    ) -> np.ndarray:
        dtype = value.dtype
        compute = _F32 if dtype == _F16 else dtype
        work = {
            k: a.astype(compute, copy=True)
            for k, a in slots.items()
            if k not in ("gradient_accumulator", "average")  # not the rule's
        }
        with np.errstate(all="ignore"):
            new = self._rule(
                value.astype(compute), grad.astype(compute), work, step, compute.type(lr), compute
            )
        for k, a in work.items():
            slots[k][...] = a
        return np.ascontiguousarray(new, dtype=dtype)

    @abc.abstractmethod
    def _rule(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        step: int,
        lr: np.floating,
        dtype: np.dtype,
    ) -> np.ndarray:
        """Returns the new value and updates ``slots`` (compute-dtype copies) in place."""


class ServerAdafactor(_WholeVariableOptimizer):
    """``keras.optimizers.Adafactor``: factored second moments for rank >= 2."""

    name: ClassVar[str] = "adafactor"
    config: specs.Adafactor

    def slot_names(self) -> tuple[str, ...]:
        return ()

    def _extra_slot_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        if len(shape) < 2:
            return {"velocity": shape}
        return {"r": shape[:-1], "c": shape[:-2] + shape[-1:]}

    def _rule(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        step: int,
        lr: np.floating,
        dtype: np.dtype,
    ) -> np.ndarray:
        c = self.config
        one = dtype.type(1.0)
        local_step = dtype.type(step + 1)
        if not c.has_schedule and c.relative_step:
            lr = np.minimum(lr, one / np.sqrt(local_step))
        rho_t = np.minimum(lr, one / np.sqrt(local_step))
        alpha_t = np.maximum(dtype.type(c.epsilon_2), _rms(value)) * rho_t
        regulated_grad_square = np.square(grad) + dtype.type(c.epsilon_1)
        beta_2_t = one - np.power(local_step, dtype.type(c.beta_2_decay))
        if value.ndim >= 2:
            r, col = slots["r"], slots["c"]
            r[...] = beta_2_t * r + (one - beta_2_t) * np.mean(regulated_grad_square, axis=-1)
            col[...] = beta_2_t * col + (one - beta_2_t) * np.mean(regulated_grad_square, axis=-2)
            v = np.expand_dims(r / np.mean(r, axis=-1, keepdims=True), -1) * np.expand_dims(col, -2)
        else:
            v = slots["velocity"]
            v[...] = beta_2_t * v + (one - beta_2_t) * regulated_grad_square
        u_t = grad / np.sqrt(v)
        u_t_hat = u_t / np.maximum(one, _rms(u_t) / dtype.type(c.clip_threshold))
        return value - alpha_t * u_t_hat


class ServerLamb(_WholeVariableOptimizer):
    """``keras.optimizers.Lamb``: Adam's step scaled by the trust ratio ``||w|| / ||step||``."""

    name: ClassVar[str] = "lamb"
    config: specs.Lamb

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "velocity")

    def _rule(
        self,
        value: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        step: int,
        lr: np.floating,
        dtype: np.dtype,
    ) -> np.ndarray:
        c = self.config
        one = dtype.type(1.0)
        local_step = dtype.type(step + 1)
        beta_1_power = np.power(dtype.type(c.beta_1), local_step)
        beta_2_power = np.power(dtype.type(c.beta_2), local_step)
        m, v = slots["momentum"], slots["velocity"]
        m += (grad - m) * dtype.type(1 - c.beta_1)
        v += (np.square(grad) - v) * dtype.type(1 - c.beta_2)
        update = (m / (one - beta_1_power)) / (np.sqrt(v / (one - beta_2_power)) + dtype.type(c.epsilon))
        w_norm = np.sqrt(np.sum(np.square(value)))
        g_norm = np.sqrt(np.sum(np.square(update)))
        ratio = w_norm / g_norm if w_norm > 0 and g_norm > 0 else one
        return value - ratio * lr * update


_SERVER_CLASSES: Final[dict[type[specs.Optimizer], type[ServerOptimizer]]] = {
    specs.SGD: ServerSGD,
    specs.Adagrad: ServerAdagrad,
    specs.Adam: ServerAdam,
    specs.AdamW: ServerAdamW,
    specs.RMSprop: ServerRMSprop,
    specs.Nadam: ServerNadam,
    specs.Adamax: ServerAdamax,
    specs.Adadelta: ServerAdadelta,
    specs.Ftrl: ServerFtrl,
    specs.Lion: ServerLion,
    specs.Adafactor: ServerAdafactor,
    specs.Lamb: ServerLamb,
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
