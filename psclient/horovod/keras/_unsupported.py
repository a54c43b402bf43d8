"""Horovod Keras features that have a different home here: ``elastic`` and ``load_model``."""

from __future__ import annotations

from typing import Any, NoReturn

from psclient.horovod._state import unsupported


class _Unsupported:
    """A stand-in module whose every attribute raises ``UnsupportedError`` naming the alternative."""

    def __init__(self, what: str, instead: str) -> None:
        self._what = what
        self._instead = instead

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        unsupported(f"{self._what} ({name})", self._instead)


elastic = _Unsupported(
    "elastic training (hvd.elastic)",
    "restart the psrun job from the last checkpoint (keras.callbacks.BackupAndRestore) with the new -np",
)


def load_model(
    filepath: Any,
    custom_optimizers: Any = None,
    custom_objects: Any = None,
    compression: Any = None,
    legacy_opts: bool = False,
) -> NoReturn:
    """Not supported (raises UnsupportedError): load with Keras, then wrap the optimizer."""
    unsupported(
        "hvd.load_model",
        "load with keras.models.load_model(path) (a DistributedOptimizer saves as its plain class) and "
        "compile "
        "again with hvd.DistributedOptimizer(...) (its slots start fresh), or resume with "
        "keras.callbacks.BackupAndRestore",
    )
