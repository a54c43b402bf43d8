"""Horovod Keras features that have a different home here: ``load_model``."""

from __future__ import annotations

from typing import Any, NoReturn

from psclient.horovod._state import unsupported


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
