"""Training runs: one parameter-server worker, the single-process baseline, and evaluation from the shards.

Imports TensorFlow (through Keras); the CLI imports this module only once it
has parsed its flags.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import keras

import psclient
import psclient.keras as psk
from trainer import data, models

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """What to train and how (shared by every worker of a job)."""

    model: str = "cnn"
    data: str = "digits"
    data_path: str | None = None
    synthetic_size: int = 4096
    image_size: int = 28
    epochs: int = 10
    batch_size: int = 32
    learning_rate: float = 1e-3
    seed: int = 0
    # wide_deep (the click log): users in the vocabulary (items: a tenth), and the dynamic tables' bounds.
    num_users: int = 2_000_000
    table_capacity: int | None = None
    min_count: int = 1

    def load(self) -> data.Split:
        return data.load(
            self.data, path=self.data_path, num_train=self.synthetic_size, image_size=self.image_size
        )


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """One worker's (or the local run's) training outcome."""

    worker_index: int
    steps: int
    train_seconds: float
    steps_per_second: float
    final_loss: float
    final_accuracy: float
    stale_steps: int = 0
    # this process's CPU time (every thread) per timed step, over the same steps as steps_per_second
    cpu_seconds_per_step: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)  # model-specific measurements (wide_deep: bytes, RSS)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


class EpochPrinter(keras.callbacks.Callback):
    """Prints one progress line per epoch (loss, accuracy, steps/s) and times the steps after the first.

    Also measures the process's CPU time (all its threads: the input pipeline and the exchange's too)
    from the end of the first step to the end of the last, so that a rate measured on a busy machine
    comes with a cost that the machine's other load does not change (``cpu_seconds_per_step``).
    """

    def __init__(self, epochs: int, prefix: str = "", out: TextIO = sys.stdout) -> None:
        super().__init__()
        self.epochs, self.prefix, self.out = epochs, prefix, out
        self.steps = 0
        self.train_seconds = 0.0
        self._t0: float | None = None
        self._cpu0 = self._cpu1 = 0.0
        self._epoch_t0 = 0.0
        self._epoch_steps = 0
        self.last_logs: dict[str, float] = {}

    @property
    def steps_per_second(self) -> float:
        return (self.steps - 1) / self.train_seconds if self.steps > 1 and self.train_seconds > 0 else 0.0

    @property
    def cpu_seconds_per_step(self) -> float:
        """This process's CPU seconds per step over the steps after the first (NaN before two steps)."""
        return (self._cpu1 - self._cpu0) / (self.steps - 1) if self.steps > 1 else float("nan")

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch_t0, self._epoch_steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.steps += 1
        self._epoch_steps += 1
        self._cpu1 = time.process_time()
        if self.steps == 1:
            self._t0 = time.perf_counter()  # the first step traces the graph: not timed
            self._cpu0 = self._cpu1

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.last_logs = {k: float(v) for k, v in (logs or {}).items()}
        elapsed = time.perf_counter() - self._epoch_t0
        rate = self._epoch_steps / elapsed if elapsed > 0 else 0.0
        loss, acc = self.last_logs.get("loss", float("nan")), self.last_logs.get("accuracy", float("nan"))
        print(
            f"{self.prefix}epoch {epoch + 1}/{self.epochs}: loss {loss:.4f} accuracy {acc:.4f} "
            f"({rate:.0f} steps/s)",
            file=self.out,
            flush=True,
        )

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._t0 is not None:
            self.train_seconds = time.perf_counter() - self._t0

    def summary(self) -> dict[str, Any]:
        """The run's steps, timing and final loss/accuracy (fields of ``WorkerResult``)."""
        return {
            "steps": self.steps,
            "train_seconds": self.train_seconds,
            "steps_per_second": self.steps_per_second,
            "cpu_seconds_per_step": self.cpu_seconds_per_step,
            "final_loss": self.last_logs.get("loss", float("nan")),
            "final_accuracy": self.last_logs.get("accuracy", float("nan")),
        }


def build_model(config: TrainConfig, split: data.Split, optimizer: Any) -> keras.Model:
    """The named model for ``split``'s input, compiled: on TensorFlow without XLA (the PS exchange is a
    ``tf.numpy_function``), on JAX jitted (the exchange is an ``io_callback`` in the step) unless
    ``PSTRAIN_JIT_COMPILE=0`` (the eager step, for comparison)."""
    keras.utils.set_random_seed(config.seed)
    model = models.build(config.model, split.input_shape, split.num_classes)
    jit = keras.backend.backend() != "tensorflow" and os.environ.get("PSTRAIN_JIT_COMPILE", "1") != "0"
    model.compile(
        optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        jit_compile="auto" if jit else False,
    )  # fmt: skip
    return model


def count_step_calls(model: keras.Model) -> list[int]:
    """Counts the Python runs of ``model.train_step`` from now on, in the list's one item: in a compiled
    ``fit`` (a ``tf.function``, ``jax.jit``) its traces, a few; in an eager one, one a step."""
    calls = [0]
    original = model.train_step

    def train_step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    model.train_step = train_step
    return calls


def fit_shard(
    model: keras.Model,
    config: TrainConfig,
    split: data.Split,
    *,
    num_workers: int = 1,
    worker_index: int = 0,
    prefix: str | None = None,
    callbacks: list[keras.callbacks.Callback] | None = None,
) -> EpochPrinter:
    """``model.fit`` on this worker's shard of the training data; returns the progress printer.

    ``prefix`` of the progress lines defaults to ``[worker <index>] ``.
    """
    ds = data.make_dataset(
        split.x_train,
        split.y_train,
        batch_size=config.batch_size,
        num_workers=num_workers,
        worker_index=worker_index,
        seed=config.seed,
    )
    printer = EpochPrinter(config.epochs, f"[worker {worker_index}] " if prefix is None else prefix)
    # shuffle=False: the dataset shuffles itself (Keras would otherwise warn that it ignores the flag)
    model.fit(ds, epochs=config.epochs, callbacks=[*(callbacks or []), printer], verbose=0, shuffle=False)
    return printer


def train_worker(
    config: TrainConfig,
    ps_addresses: list[str],
    *,
    worker_index: int,
    num_workers: int,
    mode: str = "async",
    overlap: bool = True,
    timeout: float = 120.0,
    sync_parts: int = 1,
    client_options: dict[str, Any] | None = None,
) -> WorkerResult:
    """Trains one worker of a parameter-server job with Keras ``fit`` on its shard of the data.

    ``sync_parts`` goes to ``psclient.keras.PSWorker`` (sync: a step pushed in parts); ``client_options``
    to ``psclient.PSClient`` (``auth_token``, ``tls_ca``, ``tls_cert``, ``tls_key``, ``partition_bytes``).

    Raises:
        psclient.PSError: a shard failed, or a barrier timed out.
    """
    if config.model == "wide_deep":
        from trainer import recsys

        return recsys.train_worker(  # type: ignore[no-any-return]
            config, ps_addresses, worker_index=worker_index, num_workers=num_workers, mode=mode,
            overlap=overlap, timeout=timeout, sync_parts=sync_parts, **(client_options or {}),
        )  # fmt: skip
    split = config.load()
    with psk.PSWorker(
        ps_addresses,
        worker_index=worker_index,
        num_workers=num_workers,
        mode=mode,
        overlap=overlap,
        timeout=timeout,
        sync_parts=sync_parts,
        **(client_options or {}),
    ) as worker:
        optimizer = psk.DistributedOptimizer(keras.optimizers.Adam(config.learning_rate), worker)
        model = build_model(config, split, optimizer)
        step_calls = count_step_calls(model)
        printer = fit_shard(
            model,
            config,
            split,
            num_workers=num_workers,
            worker_index=worker_index,
            callbacks=[worker.callback()],
        )
        return WorkerResult(
            worker_index=worker_index,
            **printer.summary(),
            stale_steps=worker.stale_steps,
            extra={"step_python_calls": step_calls[0]},
        )


def train_local(config: TrainConfig) -> tuple[WorkerResult, float]:
    """The single-process baseline (OneDeviceStrategy's place); returns the result and the test accuracy."""
    if config.model == "wide_deep":
        from trainer import recsys

        result, metrics = recsys.train_local(config)
        return WorkerResult(**{**asdict(result), "extra": {**result.extra, **metrics}}), metrics[
            "test_accuracy"
        ]
    split = config.load()
    model = build_model(config, split, keras.optimizers.Adam(config.learning_rate))
    step_calls = count_step_calls(model)
    printer = fit_shard(model, config, split, prefix="[local] ")
    result = WorkerResult(worker_index=0, **printer.summary(), extra={"step_python_calls": step_calls[0]})
    return result, test_accuracy(model, split)


def evaluate_from_ps(config: TrainConfig, ps_addresses: list[str], timeout: float = 60.0) -> float:
    """Builds the model, loads the shards' current values into it, and returns its test accuracy.

    Raises:
        psclient.PSError: a shard failed, or the model's variables are not on the shards.
    """
    split = config.load()
    model = build_model(config, split, keras.optimizers.Adam(config.learning_rate))
    with psclient.PSClient(ps_addresses, worker_id="evaluator", timeout=timeout) as client:
        psk.load_from_ps(model, client)
    return test_accuracy(model, split)


def test_accuracy(model: keras.Model, split: data.Split) -> float:
    ds = data.make_dataset(split.x_test, split.y_test, batch_size=256, shuffle=False)
    _, accuracy = model.evaluate(ds, verbose=0)
    return float(accuracy)
