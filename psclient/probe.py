"""``python -m psclient.probe HOST:PORT``: a gRPC health check; exits 0 when the shard is SERVING.

For container health checks (Docker ``HEALTHCHECK``, compose ``healthcheck``,
Kubernetes ``exec`` probes) without downloading ``grpc_health_probe``. Exit
codes: 0 SERVING, 1 any other status or an error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pscore.errors import PSError, from_rpc_error
from psproto.v1 import ps_pb2

DEFAULT_SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def check(
    address: str,
    *,
    service: str = DEFAULT_SERVICE,
    timeout: float = 3.0,
    auth_token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> str:
    """Returns the serving status name of ``service`` at ``address`` (e.g. ``"SERVING"``).

    Raises:
        PSError: the shard did not answer (``UnavailableError``, ``DeadlineExceededError``, ...), or
            refused the call (``UnauthenticatedError``: a wrong token).
    """
    if tls_ca or tls_cert:
        creds = grpc.ssl_channel_credentials(_read(tls_ca), _read(tls_key), _read(tls_cert))
        channel = grpc.secure_channel(address, creds)
    else:
        channel = grpc.insecure_channel(address)
    metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=metadata
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, method="Health.Check", address=address) from err
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m psclient.probe", description=__doc__.splitlines()[0])
    p.add_argument("address", help="HOST:PORT of the shard")
    p.add_argument("--service", default=DEFAULT_SERVICE, help="service to check (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    p.add_argument("--auth-token-file", help="file holding the cluster's auth token")
    p.add_argument("--tls-ca", help="PEM CA bundle (enables TLS)")
    p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    args = p.parse_args(argv)
    token = None
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = f.read().strip()
    try:
        status = check(
            args.address, service=args.service, timeout=args.timeout, auth_token=token,
            tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        )  # fmt: skip
    except PSError as err:
        if not args.quiet:
            print(f"{args.address}: {err.code.name}: {err.details}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
