"""Server-side errors: each carries the gRPC status code the servicer aborts with."""

from __future__ import annotations

from typing import ClassVar

import grpc


class ServerError(Exception):
    """An error to report to the caller with ``code`` and this message."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class InvalidArgument(ServerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServerError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ServerError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(ServerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServerError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ServerError):
    code = grpc.StatusCode.UNAUTHENTICATED
