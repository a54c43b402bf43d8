"""Typed exceptions for every gRPC status a shard or peer can return.

The tree (names as in ``tf.errors``; every class carries ``.code``)::

    PSError
    ├── CancelledError                 CANCELLED
    ├── UnknownError                   UNKNOWN
    ├── InvalidArgumentError           INVALID_ARGUMENT   bad shape, dtype, bytes, NaN gradient
    ├── DeadlineExceededError          DEADLINE_EXCEEDED  call deadline, barrier or ring timeout
    ├── NotFoundError                  NOT_FOUND          unknown variable
    ├── AlreadyExistsError             ALREADY_EXISTS     create with a conflicting spec
    ├── PermissionDeniedError          PERMISSION_DENIED
    ├── ResourceExhaustedError         RESOURCE_EXHAUSTED message too large, overloaded
    ├── FailedPreconditionError        FAILED_PRECONDITION
    │   └── WorkerIdConflictError                         two live clients push with one worker_id
    ├── AbortedError                   ABORTED            a consistent cut not held (another holds the shard)
    │   └── ConsistentCutError                            a consistent save aborted (shard down, deadline)
    ├── OutOfRangeError                OUT_OF_RANGE
    ├── UnimplementedError             UNIMPLEMENTED
    ├── InternalError                  INTERNAL
    ├── UnavailableError               UNAVAILABLE        shard down or restarting
    ├── DataLossError                  DATA_LOSS
    └── UnauthenticatedError           UNAUTHENTICATED    missing or wrong auth token

``PSError.retryable`` says whether retrying the same call can succeed.

A more specific class than the code's is chosen by the reason the server sends
with the status (trailing metadata ``ps-error-reason``; in a PushSession, the
response's ``reason``), never by the message text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

import grpc

ERROR_REASON_KEY = "ps-error-reason"  # trailing metadata: a machine-readable reason for the status
WORKER_ID_CONFLICT = "worker_id_conflict"


class PSError(Exception):
    """Base class of every psclient error.

    Attributes:
        code: the ``grpc.StatusCode``.
        details: the server's message (names the variable, worker or rank).
        method: the RPC that failed, when known.
        address: the shard or peer address, when known.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    retryable: ClassVar[bool] = False
    reason: ClassVar[str] = ""  # sent with the status (``ps-error-reason``) to tell a subclass apart

    def __init__(self, details: str, *, method: str | None = None, address: str | None = None) -> None:
        self.details = details
        self.method = method
        self.address = address
        where = " ".join(p for p in (method and f"{method}", address and f"on {address}") if p)
        super().__init__(f"{details} ({where})" if where else details)


class CancelledError(PSError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(PSError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(PSError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(PSError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class NotFoundError(PSError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(PSError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(PSError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(PSError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class FailedPreconditionError(PSError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class WorkerIdConflictError(FailedPreconditionError):
    """Two live clients push with the same ``worker_id`` (this one is the older session).

    The shard applies pushes once per ``(worker_id, session, seq)``; a newer
    client with the same id took over, and this client's pushes are refused
    (nothing of them applied). Not retryable: give each worker its own id.
    """

    reason = WORKER_ID_CONFLICT


class AbortedError(PSError):
    code = grpc.StatusCode.ABORTED


class ConsistentCutError(AbortedError):
    """A consistent save (``save_checkpoint(consistent=True)``, ``psctl save --consistent``) was aborted.

    A shard was down or refused, or the deadline passed. Nothing is left held
    and no partial set of files is left behind; ``__cause__`` is the shard's
    error and ``shard`` its index (None when the deadline passed between calls).
    Retryable: a later save may succeed.
    """

    retryable = True

    def __init__(
        self, details: str, *, shard: int | None = None, method: str | None = None, address: str | None = None
    ) -> None:
        super().__init__(details, method=method, address=address)
        self.shard = shard


class OutOfRangeError(PSError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(PSError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(PSError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(PSError):
    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DataLossError(PSError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(PSError):
    code = grpc.StatusCode.UNAUTHENTICATED


_STATUS_TO_ERROR: dict[grpc.StatusCode, type[PSError]] = {
    cls.code: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}


_REASON_TO_ERROR: dict[tuple[grpc.StatusCode, str], type[PSError]] = {
    (cls.code, cls.reason): cls for cls in (WorkerIdConflictError,)
}


_STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def status_number(code: grpc.StatusCode) -> int:
    """The status code's number on the wire (``PushResponse.code``, a ring abort frame): OK is 0."""
    return int(code.value[0])


def status_from_number(number: int) -> grpc.StatusCode:
    """The status code of a number from the wire (UNKNOWN for a number gRPC does not define)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_class(code: grpc.StatusCode, reason: str = "") -> type[PSError]:
    """The exception class for a status code and the server's reason (``UnknownError``: unknown code)."""
    return _REASON_TO_ERROR.get((code, reason)) or _STATUS_TO_ERROR.get(code, UnknownError)


def error_reason(err: grpc.RpcError) -> str:
    """The ``ps-error-reason`` trailing metadata of a failed call ("" when absent)."""
    trailing = getattr(err, "trailing_metadata", None)
    try:
        metadata = trailing() if callable(trailing) else None
    except Exception:  # a call object that cannot report it
        return ""
    for key, value in metadata or ():
        if key == ERROR_REASON_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def from_rpc_error(err: grpc.RpcError, *, method: str | None = None, address: str | None = None) -> PSError:
    """Converts a ``grpc.RpcError`` (sync or aio) into the matching ``PSError``."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return error_class(code, error_reason(err))(details or code.name, method=method, address=address)


@contextlib.contextmanager
def map_rpc_errors(*, method: str | None = None, address: str | None = None) -> Iterator[None]:
    """Re-raises any ``grpc.RpcError`` in the block as the matching ``PSError``."""
    try:
        yield
    except grpc.RpcError as err:
        raise from_rpc_error(err, method=method, address=address) from err
