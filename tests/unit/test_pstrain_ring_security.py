"""pstrain's ring security flags: parsed, turned into Ring options, refused outside --mode allreduce."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.__main__ import build_parser, main
from trainer.options import ring_security_options, security_argv

TLS = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem", "--tls-client-ca", "ca.pem"]


def test_flags_become_ring_options_and_are_forwarded(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    argv = ["worker", "--mode", "allreduce", "--auth-token-file", str(token), *TLS]
    args = build_parser().parse_args(argv)
    assert ring_security_options(args) == {
        "auth_token": "s3cret",
        "tls_ca": "ca.pem",
        "tls_cert": "c.pem",
        "tls_key": "k.pem",
        "tls_client_ca": "ca.pem",
    }
    assert sorted(security_argv(args)) == sorted(["--auth-token-file", str(token), *TLS])
    plain = build_parser().parse_args(["demo", "--mode", "allreduce"])
    assert ring_security_options(plain) == {} and security_argv(plain) == []


def test_bad_token_file_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("  \n")
    args = build_parser().parse_args(
        ["demo", "--mode", "allreduce", "--auth-token-file", str(tmp_path / "token")]
    )
    with pytest.raises(ValueError, match="empty"):
        ring_security_options(args)


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("demo", "--tls-cert"),  # the demo's local shards run without TLS
        ("demo", "--auth-token-file"),
        ("worker", "--tls-client-ca"),  # a PS worker is a client: no server-side TLS flag
    ],
)
def test_other_modes_refuse_the_flags(command: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--mode", "async", flag, "x.pem"]) == 2
    assert flag in capsys.readouterr().err
