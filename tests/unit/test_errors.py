"""Unit tests of pscore.errors: one typed exception per gRPC status code."""

from __future__ import annotations

import grpc
import pytest

import psclient
from pscore import errors

ALL_CODES = list(grpc.StatusCode)
ERROR_CODES = [c for c in ALL_CODES if c != grpc.StatusCode.OK]

# The DESIGN.md contract: these names exist and map to these codes.
CONTRACT = {
    "NotFoundError": grpc.StatusCode.NOT_FOUND,
    "InvalidArgumentError": grpc.StatusCode.INVALID_ARGUMENT,
    "AlreadyExistsError": grpc.StatusCode.ALREADY_EXISTS,
    "UnauthenticatedError": grpc.StatusCode.UNAUTHENTICATED,
    "PermissionDeniedError": grpc.StatusCode.PERMISSION_DENIED,
    "UnavailableError": grpc.StatusCode.UNAVAILABLE,
    "DeadlineExceededError": grpc.StatusCode.DEADLINE_EXCEEDED,
    "AbortedError": grpc.StatusCode.ABORTED,
    "ResourceExhaustedError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "FailedPreconditionError": grpc.StatusCode.FAILED_PRECONDITION,
    "InternalError": grpc.StatusCode.INTERNAL,
}


class FakeRpcError(grpc.RpcError):
    """What a failed sync or aio call raises: an RpcError with code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__()
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: c.name)
def test_errors_every_status_code_has_its_own_class(code: grpc.StatusCode) -> None:
    cls = errors.error_class(code)
    assert issubclass(cls, psclient.PSError)
    assert cls.code == code
    assert cls.__name__ != "PSError"


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.name)
def test_errors_from_rpc_error_keeps_code_details_method_and_address(code: grpc.StatusCode) -> None:
    err = errors.from_rpc_error(
        FakeRpcError(code, "variable 'w' has shape (3,)"), method="Push", address="127.0.0.1:1"
    )
    assert isinstance(err, psclient.PSError)
    if code == grpc.StatusCode.OK:  # never raised by grpc; must still map to something sane
        assert isinstance(err, psclient.UnknownError)
        return
    assert type(err) is errors.error_class(code)
    assert err.code == code
    assert err.details == "variable 'w' has shape (3,)"
    assert err.method == "Push" and err.address == "127.0.0.1:1"
    assert "variable 'w'" in str(err) and "Push" in str(err) and "127.0.0.1:1" in str(err)


def test_errors_from_rpc_error_without_details_uses_the_code_name() -> None:
    err = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, None))
    assert isinstance(err, psclient.UnavailableError)
    assert "UNAVAILABLE" in str(err)


def test_errors_from_rpc_error_of_a_bare_rpc_error_is_unknown() -> None:
    assert isinstance(errors.from_rpc_error(grpc.RpcError("boom")), psclient.UnknownError)


@pytest.mark.parametrize(("name", "code"), CONTRACT.items())
def test_errors_contract_names_are_exported_with_their_codes(name: str, code: grpc.StatusCode) -> None:
    cls = getattr(psclient, name)
    assert cls.code == code
    assert errors.error_class(code) is cls or issubclass(errors.error_class(code), cls)


def test_errors_map_rpc_errors_raises_typed_error_from_the_original() -> None:
    original = FakeRpcError(grpc.StatusCode.NOT_FOUND, "variable 'x' does not exist")
    with pytest.raises(psclient.NotFoundError, match="'x'") as info, errors.map_rpc_errors(method="Pull"):
        raise original
    assert info.value.__cause__ is original


def test_errors_map_rpc_errors_lets_other_exceptions_through() -> None:
    with pytest.raises(KeyError), errors.map_rpc_errors():
        raise KeyError("k")


def test_errors_retryable_flags() -> None:
    assert psclient.UnavailableError.retryable
    assert psclient.DeadlineExceededError.retryable
    assert not psclient.InvalidArgumentError.retryable
    assert not psclient.NotFoundError.retryable
