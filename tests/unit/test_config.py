"""Unit tests of ServerConfig, ClientConfig, TF_CONFIG parsing and psserver's flag handling."""

from __future__ import annotations

import json

import pytest

from psclient.config import ClientConfig, ps_addresses_from_tf_config
from psserver.__main__ import build_parser, config_from_args
from psserver.config import ConfigError, ServerConfig, ps_task_from_tf_config

TF_CONFIG = json.dumps(
    {
        "cluster": {"ps": ["ps0.example:2222", "ps1.example:2223"], "worker": ["w0:1", "w1:1"]},
        "task": {"type": "ps", "index": 1},
    }
)


def test_config_server_defaults_are_valid() -> None:
    c = ServerConfig(shard=0)
    assert (c.num_shards, c.port, c.mode, c.allow_non_finite) == (1, 0, "async", False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shard": 0, "num_shards": 0}, "num-shards"),
        ({"shard": 2, "num_shards": 2}, "--shard"),
        ({"shard": -1}, "--shard"),
        ({"shard": 0, "port": 70000}, "--port"),
        ({"shard": 0, "mode": "bogus"}, "--mode"),
        ({"shard": 0, "staleness": -1}, "--staleness"),
        ({"shard": 0, "mode": "sync"}, "replicas"),
        ({"shard": 0, "mode": "sync", "replicas_to_aggregate": 3, "total_replicas": 2}, "replicas"),
        ({"shard": 0, "mode": "ssp"}, "total-replicas"),
        ({"shard": 0, "tls_cert": "c.pem"}, "tls"),
        ({"shard": 0, "tls_client_ca": "ca.pem"}, "tls"),
        ({"shard": 0, "max_message_bytes": 1000}, "max_message_bytes"),
    ],
)
def test_config_server_rejects_invalid_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerConfig(**kwargs)


def test_config_ps_task_from_tf_config() -> None:
    task = ps_task_from_tf_config({"TF_CONFIG": TF_CONFIG})
    assert (task.shard, task.num_shards, task.host, task.port) == (1, 2, "ps1.example", 2223)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (None, "not set"),
        ("{not json", "malformed"),
        (json.dumps({"cluster": {"ps": ["a:1"]}}), "malformed"),
        (json.dumps({"cluster": {"ps": ["a:1"]}, "task": {"type": "worker", "index": 0}}), "'worker'"),
        (json.dumps({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 3}}), "malformed"),
        (json.dumps({"cluster": {"ps": ["no-port"]}, "task": {"type": "ps", "index": 0}}), "no-port"),
        (json.dumps({"cluster": {"ps": ["host:http"]}, "task": {"type": "ps", "index": 0}}), "host:http"),
    ],
)
def test_config_ps_task_from_tf_config_errors_are_config_errors(raw: str | None, match: str) -> None:
    env = {} if raw is None else {"TF_CONFIG": raw}
    with pytest.raises(ConfigError, match=match):
        ps_task_from_tf_config(env)


def test_config_flags_without_shard_come_from_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", TF_CONFIG)
    monkeypatch.delenv("PS_HOST", raising=False)
    config = config_from_args(build_parser().parse_args([]))
    assert (config.shard, config.num_shards, config.port, config.host) == (1, 2, 2223, "0.0.0.0")
    config = config_from_args(build_parser().parse_args(["--port", "0", "--host", "10.0.0.1"]))
    assert (config.port, config.host) == (0, "10.0.0.1")


def test_config_flags_shard_wins_over_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", TF_CONFIG)
    config = config_from_args(build_parser().parse_args(["--shard", "0"]))
    assert (config.shard, config.num_shards, config.port) == (0, 1, 0)


def test_config_flags_bad_tf_config_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from psserver.__main__ import main

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_config_flags_allow_non_finite_and_message_size() -> None:
    args = build_parser().parse_args(["--shard", "0", "--allow-non-finite", "--max-message-mib", "8"])
    config = config_from_args(args)
    assert config.allow_non_finite and config.max_message_bytes == 8 << 20


def test_config_flags_inline_apply_bytes() -> None:
    default = config_from_args(build_parser().parse_args(["--shard", "0"]))
    assert default.inline_apply_bytes == ServerConfig(shard=0).inline_apply_bytes == 1 << 20
    config = config_from_args(build_parser().parse_args(["--shard", "0", "--inline-apply-bytes", "1TiB"]))
    assert config.inline_apply_bytes == 1 << 40
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--shard", "0", "--inline-apply-bytes", "lots"])


def test_config_client_valid() -> None:
    c = ClientConfig(addresses=("127.0.0.1:1", "localhost:2"), worker_id="w0")
    assert c.num_shards == 2 and c.worker_id == "w0"
    assert ClientConfig(addresses=("h:1",)).worker_id != ClientConfig(addresses=("h:1",)).worker_id


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"addresses": ()}, "at least one"),
        ({"addresses": ("nohost",)}, "HOST:PORT"),
        ({"addresses": ("h:port",)}, "HOST:PORT"),
        ({"addresses": ("h:1", "h:1")}, "repeat"),
        ({"addresses": ("h:1",), "worker_id": ""}, "worker_id"),
        ({"addresses": ("h:1",), "timeout": 0}, "timeout"),
        ({"addresses": ("h:1",), "tls_cert": "c.pem"}, "tls"),
        ({"addresses": ("h:1",), "chunk_bytes": 10}, "chunk_bytes"),
        ({"addresses": ("h:1",), "unary_max_bytes": 1 << 30}, "unary_max_bytes"),
    ],
)
def test_config_client_rejects_invalid_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClientConfig(**kwargs)


def test_config_client_ps_addresses_from_tf_config() -> None:
    assert ps_addresses_from_tf_config({"TF_CONFIG": TF_CONFIG}) == ["ps0.example:2222", "ps1.example:2223"]
    for env in ({}, {"TF_CONFIG": "[]"}, {"TF_CONFIG": json.dumps({"cluster": {"ps": []}})}):
        with pytest.raises(ValueError):
            ps_addresses_from_tf_config(env)
