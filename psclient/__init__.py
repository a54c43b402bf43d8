"""psclient: the worker-side library of paramserver (numpy-only core; Keras glue in ``psclient.keras``)."""

from psclient._async_client import AsyncPSClient
from psclient._sync_client import PSClient
from psclient.config import ClientConfig
from psclient.errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    PSError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
)
from psclient.optimizers import SGD, Adagrad, Adam, Optimizer, RMSprop

__all__ = [
    "SGD", "AbortedError", "Adagrad", "Adam", "AlreadyExistsError", "AsyncPSClient", "CancelledError",
    "ClientConfig", "DataLossError", "DeadlineExceededError", "FailedPreconditionError", "InternalError",
    "InvalidArgumentError", "NotFoundError", "Optimizer", "OutOfRangeError", "PSClient", "PSError",
    "PermissionDeniedError", "RMSprop", "ResourceExhaustedError", "UnauthenticatedError", "UnavailableError",
    "UnimplementedError", "UnknownError",
]  # fmt: skip
