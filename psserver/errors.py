"""Server-side errors: each carries the gRPC status code the servicer aborts with."""

from __future__ import annotations

from typing import ClassVar

import grpc

from psclient.errors import WORKER_ID_CONFLICT


class ServerError(Exception):
    """An error to report to the caller with ``code`` and this message.

    ``reason``, when set, travels with it (trailing metadata ``ps-error-reason``,
    or ``PushResponse.reason`` in a PushSession) so that the client can raise a
    more specific exception than the code's.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = ""


class InvalidArgument(ServerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServerError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class WorkerIdConflict(FailedPrecondition):
    """A push from an older session of a worker id that a newer session took over (two live clients)."""

    reason = WORKER_ID_CONFLICT


class Aborted(ServerError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(ServerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServerError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ServerError):
    code = grpc.StatusCode.UNAUTHENTICATED
