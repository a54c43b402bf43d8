"""The public surface of psclient: ``__all__`` lists exactly the public names; contract names exist."""

from __future__ import annotations

import importlib
import inspect
import re

import grpc
import pytest

import psclient

CONTRACT = {
    "PSClient", "AsyncPSClient", "SGD", "Adagrad", "Adam", "RMSprop", "PSError",
    "NotFoundError", "InvalidArgumentError", "AlreadyExistsError", "UnauthenticatedError",
    "PermissionDeniedError", "UnavailableError", "DeadlineExceededError", "AbortedError",
    "ResourceExhaustedError", "FailedPreconditionError", "InternalError",
}  # fmt: skip

CLIENT_METHODS = (
    "create", "create_many", "pull", "pull_with_versions", "push", "push_pull", "close",
    "set_learning_rate", "update_optimizer", "replace_optimizer", "assign",
)  # fmt: skip


def test_public_api_all_matches_the_public_names() -> None:
    public = {
        name
        for name, value in vars(psclient).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert set(psclient.__all__) == public
    assert len(psclient.__all__) == len(set(psclient.__all__))


@pytest.mark.parametrize(
    "package",
    [
        pytest.param("psclient.keras", marks=pytest.mark.tf),  # imports TensorFlow
        pytest.param("psclient.horovod.keras", marks=pytest.mark.tf),
        "psclient.elastic",
        "psclient.collective",
        "psload",
    ],
)
def test_public_api_every_public_package_lists_what_it_defines_in_all(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.__all__ names {name!r}, which it lacks"
    ours = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and getattr(value, "__module__", "").split(".")[0] in ("psclient", "pscore", "psload")
    }  # typing's Any and the like, imported for annotations, are not the package's API
    assert ours <= set(module.__all__), sorted(ours - set(module.__all__))
    assert len(module.__all__) == len(set(module.__all__))


def test_public_api_has_the_contract_names() -> None:
    assert set(psclient.__all__) >= CONTRACT


def test_public_api_exports_every_server_side_optimizer() -> None:
    optimizers = {
        "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Nadam", "Adamax", "Adadelta", "Ftrl", "Lion",
        "Adafactor", "Lamb",
    }  # fmt: skip
    assert set(psclient.__all__) >= optimizers
    for name in optimizers:
        assert issubclass(getattr(psclient, name), psclient.Optimizer)


def test_public_api_errors_are_ps_errors_with_a_status_code() -> None:
    for name in psclient.__all__:
        obj = getattr(psclient, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, psclient.PSError)
            assert isinstance(obj.code, grpc.StatusCode)


def test_public_api_worker_id_conflict_is_a_failed_precondition() -> None:
    assert issubclass(psclient.WorkerIdConflictError, psclient.FailedPreconditionError)
    assert psclient.WorkerIdConflictError.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not psclient.WorkerIdConflictError.retryable


def test_public_api_sync_and_async_clients_have_the_same_methods_and_signatures() -> None:
    for method in CLIENT_METHODS:
        sync, aio = getattr(psclient.PSClient, method), getattr(psclient.AsyncPSClient, method)
        assert inspect.iscoroutinefunction(aio), method
        assert list(inspect.signature(sync).parameters) == list(inspect.signature(aio).parameters), method
    assert hasattr(psclient.PSClient, "__enter__") and hasattr(psclient.PSClient, "__exit__")
    assert hasattr(psclient.AsyncPSClient, "__aenter__") and hasattr(psclient.AsyncPSClient, "__aexit__")


def _public_methods(cls: type) -> set[str]:
    return {
        name
        for name in dir(cls)
        if not name.startswith("_") and not isinstance(inspect.getattr_static(cls, name), property)
    }


def test_public_api_every_client_method_has_its_twin_with_the_same_signature() -> None:
    sync, aio = _public_methods(psclient.PSClient), _public_methods(psclient.AsyncPSClient)
    # The sync client's futures run a call in its event loop's thread while the caller computes; an
    # AsyncPSClient caller makes a task of the method itself.
    futures = {name for name in sync if name.endswith("_future")}
    assert {name.removesuffix("_future") for name in futures} <= aio, futures
    assert sync - futures == aio, (sync - futures) ^ aio
    assert aio >= set(CLIENT_METHODS)
    for name in sorted(aio):
        s, a = getattr(psclient.PSClient, name), getattr(psclient.AsyncPSClient, name)
        assert inspect.iscoroutinefunction(a) or inspect.isasyncgenfunction(a), name
        assert list(inspect.signature(s).parameters) == list(inspect.signature(a).parameters), name
    for name in futures:
        base = name.removesuffix("_future")
        params = list(inspect.signature(getattr(psclient.PSClient, name)).parameters)
        assert params == list(inspect.signature(getattr(psclient.PSClient, base)).parameters), name


def test_public_api_client_constructor_matches_the_contract() -> None:
    params = list(inspect.signature(psclient.PSClient).parameters)
    expected = ["addresses", "worker_id", "auth_token", "timeout", "tls_ca", "tls_cert", "tls_key"]
    assert params[: len(expected)] == expected


# What a documented ``Raises:`` may name besides PSError subclasses: programming errors found before any
# call is made (bad arguments, a closed client) and files that cannot be written; HostsUpdatedInterrupt is
# Horovod's control-flow signal (ranks changed at a commit), not an error.
_NOT_PS_ERRORS = {"ValueError", "TypeError", "RuntimeError", "OSError", "HostsUpdatedInterrupt"}
_PUBLIC_MODULES = ("psclient", "psclient.elastic", "psclient.collective", "psclient.admin", "psclient.probe")


def _documented_raises() -> dict[str, list[str]]:
    """``{exception name: [where documented]}`` over the ``Raises:`` sections of the public API."""
    found: dict[str, list[str]] = {}
    for modname in _PUBLIC_MODULES:
        module = importlib.import_module(modname)
        for name in getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]):
            obj = getattr(module, name)
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{k}", m) for k, m in vars(obj).items() if not k.startswith("_")]
            for where, member in members:
                section = re.search(r"Raises:\n((?:[ \t]+.+\n?)+)", inspect.getdoc(member) or "")
                for line in section.group(1).splitlines() if section else ():
                    raised = re.match(r" {4}([\w.]+(?:, [\w.]+)*):", line)
                    for exc in raised.group(1).split(", ") if raised else ():
                        found.setdefault(exc, []).append(f"{modname}:{where}")
    return found


def test_public_api_every_documented_raise_is_a_ps_error_with_a_code() -> None:
    import psclient.elastic

    documented = _documented_raises()
    assert {"NotFoundError", "InvalidArgumentError", "RendezvousError"} <= set(documented)  # the walk works
    namespaces = (psclient, psclient.elastic)
    for exc, where in documented.items():
        if exc in _NOT_PS_ERRORS:
            continue
        cls = next((getattr(ns, exc) for ns in namespaces if hasattr(ns, exc)), None)
        assert cls is not None, f"{exc} (documented in {where[:3]}) is not exported by psclient"
        assert issubclass(cls, psclient.PSError), f"{exc} (documented in {where[:3]}) is not a PSError"
        assert isinstance(cls.code, grpc.StatusCode), exc
