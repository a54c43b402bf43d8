"""psrun's pure parts: -H parsing, rank placement, the per-rank TF_CONFIG, the several-hosts message."""

from __future__ import annotations

import json

import pytest

from trainer.psrun import Host, assign_ranks, build_parser, parse_hosts, rank_environments


def test_parse_hosts_reads_slots_and_defaults_to_one() -> None:
    assert parse_hosts("h1:2, h2:3,h3") == [Host("h1", 2), Host("h2", 3), Host("h3", 1)]


@pytest.mark.parametrize("spec", ["", "h1:0", "h1:x", ":2", "h1:1,h1:2"])
def test_parse_hosts_refuses_malformed_entries(spec: str) -> None:
    with pytest.raises(ValueError, match="-H"):
        parse_hosts(spec)


def test_assign_ranks_fills_hosts_in_order() -> None:
    assert assign_ranks(4, [Host("a", 2), Host("b", 2)]) == [[0, 1], [2, 3]]
    assert assign_ranks(3, [Host("a", 2), Host("b", 2)]) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="slots"):
        assign_ranks(5, [Host("a", 2), Host("b", 2)])


def test_rank_environments_on_one_host_give_each_rank_the_ring_and_its_index() -> None:
    envs = rank_environments(3)
    assert [r for r, _ in envs] == [0, 1, 2]
    configs = [json.loads(e["TF_CONFIG"]) for _, e in envs]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    for r, cfg in enumerate(configs):
        assert cfg == {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": r}}
    assert all(e["PSTRAIN_MODE"] == "allreduce" and e["PYTHONUNBUFFERED"] == "1" for _, e in envs)


def test_rank_environments_with_host_index_use_base_port_plus_local_rank() -> None:
    hosts = [Host("h1", 2), Host("h2", 2)]
    envs = rank_environments(4, hosts, host_index=1, base_port=7000)
    assert [r for r, _ in envs] == [2, 3]
    cfg = json.loads(envs[0][1]["TF_CONFIG"])
    assert cfg["cluster"]["worker"] == ["h1:7000", "h1:7001", "h2:7000", "h2:7001"]
    assert cfg["task"] == {"type": "worker", "index": 2}


def test_rank_environments_several_hosts_without_host_index_print_the_commands() -> None:
    with pytest.raises(ValueError, match="not supported yet") as err:
        rank_environments(4, [Host("h1", 2), Host("h2", 2)])
    assert "on h2: psrun -np 4 -H h1:2,h2:2 --host-index 1 --base-port 29500" in str(err.value)


def test_rank_environments_one_local_host_runs_here() -> None:
    assert len(rank_environments(2, [Host("localhost", 2)])) == 2
    with pytest.raises(ValueError, match="slots"):
        rank_environments(3, [Host("localhost", 2)])


def test_parser_takes_horovodrun_style_arguments() -> None:
    args = build_parser().parse_args(["-np", "2", "-H", "localhost:2", "python", "train.py", "--epochs", "3"])
    assert (args.np, args.hosts, args.command) == (2, "localhost:2", ["python", "train.py", "--epochs", "3"])
