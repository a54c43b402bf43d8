"""``psrun``: starts the ranks of an all-reduce job on this host, in the place of ``horovodrun``.

    psrun -np 2 python train.py --epochs 3

Each of the N ranks gets ``TF_CONFIG`` (the ring addresses in rank order and its index:
what ``psclient.horovod.init`` and ``psclient.keras.AllReduceWorker`` read) and
``PSTRAIN_MODE=allreduce``. Every output line is prefixed with the rank and stream, as
horovodrun does (``[1]<stdout>:loss 0.3``). The first rank to fail stops the others
(SIGTERM, then SIGKILL after a grace period) and its exit status is psrun's; ``--timeout``
stops a job that runs too long (status 124). Imports no TensorFlow.

Several hosts (``-H host1:2,host2:2``): psrun does not start ranks over ssh. Run one psrun per
host with the same ``-np``, ``-H`` and ``--base-port`` and that host's ``--host-index``; the
ring addresses are then ``host:base_port + local_rank`` on every host, with no rendezvous.

Elastic mode (horovodrun's ``--min-np``/``--max-np``/``--host-discovery-script``, one host): the ranks
form their ring through psrun's rendezvous instead of ``TF_CONFIG``; a lost rank does not end the job
while ``--min-np`` are left (``hvd.elastic.run`` restores the last commit and goes on), and new ranks
join at a commit. See :mod:`trainer.elastic`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer import elastic, supervise
from trainer.cluster import is_local_host, reserve_ports

_GRACE_S = 5.0  # after SIGTERM, before SIGKILL
_DEFAULT_BASE_PORT = 29500


@dataclass(frozen=True, slots=True)
class Host:
    """One ``-H`` entry: a host name and its number of slots."""

    name: str
    slots: int


def parse_hosts(spec: str) -> list[Host]:
    """Parses horovodrun's ``-H host1:2,host2:2`` (a host without ``:slots`` has one slot).

    >>> parse_hosts("a:2,b")
    [Host(name='a', slots=2), Host(name='b', slots=1)]

    Raises:
        ValueError: an empty, malformed or repeated entry.
    """
    hosts: list[Host] = []
    for item in spec.split(","):
        name, sep, slots = item.strip().rpartition(":")
        if not sep:
            name, slots = slots, "1"
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H entry {item!r} is not HOST or HOST:SLOTS (SLOTS >= 1)")
        if any(h.name == name for h in hosts):
            raise ValueError(f"-H lists {name!r} twice")
        hosts.append(Host(name, int(slots)))
    return hosts


def assign_ranks(np_: int, hosts: Sequence[Host]) -> list[list[int]]:
    """The global ranks each host runs: hosts filled in order, as horovodrun does.

    >>> assign_ranks(3, [Host("a", 2), Host("b", 2)])
    [[0, 1], [2]]

    Raises:
        ValueError: fewer slots than ranks.
    """
    total = sum(h.slots for h in hosts)
    if np_ > total:
        raise ValueError(f"-np {np_} needs {np_} slots; -H gives {total}")
    out, next_rank = [], 0
    for h in hosts:
        n = min(h.slots, np_ - next_rank)
        out.append(list(range(next_rank, next_rank + n)))
        next_rank += n
    return out


def rank_environments(
    np_: int, hosts: Sequence[Host] | None = None, host_index: int | None = None, base_port: int | None = None
) -> list[tuple[int, dict[str, str]]]:
    """``(rank, extra environment)`` of each rank this psrun starts.

    Without ``hosts`` (or with one local host), all ranks on 127.0.0.1 at ports free now. With
    ``host_index``, the ranks of ``hosts[host_index]``, every rank at ``host:base_port + local_rank``.

    Raises:
        ValueError: bad counts, or several hosts without ``host_index`` (the message gives the commands).
    """
    if np_ < 1:
        raise ValueError("-np must be >= 1")
    if host_index is None:
        if hosts and (len(hosts) > 1 or not is_local_host(hosts[0].name)):
            raise ValueError(_several_hosts_hint(np_, hosts))
        if hosts:
            assign_ranks(np_, hosts)  # enough slots
        addresses = reserve_ports(np_)
        mine = list(range(np_))
    else:
        if not hosts:
            raise ValueError("--host-index needs -H")
        if not 0 <= host_index < len(hosts):
            raise ValueError(f"--host-index {host_index} is not in [0, {len(hosts)})")
        port = _DEFAULT_BASE_PORT if base_port is None else base_port
        ranks = assign_ranks(np_, hosts)
        addresses = [
            f"{h.name}:{port + i}" for h, rs in zip(hosts, ranks, strict=True) for i in range(len(rs))
        ]
        mine = ranks[host_index]
    out = []
    for r in mine:
        tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": r}}
        out.append(
            (r, {"TF_CONFIG": json.dumps(tf_config), "PSTRAIN_MODE": "allreduce", "PYTHONUNBUFFERED": "1"})
        )
    return out


def _several_hosts_hint(np_: int, hosts: Sequence[Host]) -> str:
    spec = ",".join(f"{h.name}:{h.slots}" for h in hosts)
    port = _DEFAULT_BASE_PORT
    lines = [
        "psrun: starting ranks on other hosts (over ssh) is not supported yet: start one psrun per host "
        "with the same -np, -H and --base-port and that host's --host-index:"
    ]
    lines += [
        f"  on {h.name}: psrun -np {np_} -H {spec} --host-index {i} --base-port {port} <command>"
        for i, h in enumerate(hosts)
    ]
    return "\n".join(lines)


def run(
    cmd: Sequence[str],
    np_: int,
    *,
    hosts: Sequence[Host] | None = None,
    host_index: int | None = None,
    base_port: int | None = None,
    timeout: float = 1800.0,
) -> int:
    """Runs ``cmd`` as this host's ranks; returns 0, the first failing rank's status, or 124 on timeout.

    Raises:
        ValueError: bad arguments (see ``rank_environments``).
    """
    if not cmd:
        raise ValueError("give the command to run, e.g. psrun -np 2 python train.py")
    ranks = rank_environments(np_, hosts, host_index, base_port)
    procs: list[subprocess.Popen[str]] = []
    relays: list[threading.Thread] = []
    try:
        for r, extra in ranks:
            proc, threads = supervise.start_prefixed(cmd, {**os.environ, **extra}, str(r))
            procs.append(proc)
            relays.extend(threads)
        code = supervise.wait_all(procs, timeout)
    finally:
        supervise.stop(procs, _GRACE_S)
        for t in relays:
            t.join(timeout=5)
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + signal number


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psrun", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("-H", "--hosts", default=None, help="HOST:SLOTS,... (one psrun per host: --host-index)")
    p.add_argument("--host-index", type=int, default=None, help="this host's index in -H")
    p.add_argument(
        "--base-port",
        type=int,
        default=None,
        help=f"with --host-index: a rank's port is BASE + its local rank (default {_DEFAULT_BASE_PORT})",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="stop the job after this many seconds")
    e = p.add_argument_group(
        "elastic arguments (horovodrun's; any of --min-np, --max-np, --host-discovery-script turns them on)",
        "The ranks run psclient.horovod with hvd.elastic.run. When a rank is lost the others restore their "
        "last commit, form a smaller ring and go on; new ranks join at the next commit. One host only.",
    )
    e.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_np",
        type=int,
        default=None,
        help="fewest ranks to go on with (default: -np)",
    )
    e.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=int,
        default=None,
        help="most ranks (default: the slots: -H localhost:N, the discovery script's, or -np)",
    )
    e.add_argument(
        "--host-discovery-script",
        default=None,
        help="prints HOST[:SLOTS] lines, run every second; this host's slots (others are ignored); "
        "a free slot gets a new rank",
    )
    e.add_argument(
        "--slots-per-host",
        type=int,
        default=1,
        help="slots of a discovered host printed without :SLOTS (default 1)",
    )
    e.add_argument(
        "--elastic-timeout",
        type=float,
        default=600.0,
        help="how long to wait for --min-np ranks after losing some (default 600 s)",
    )
    e.add_argument(
        "--reset-limit",
        type=int,
        default=None,
        help="end the job after the ring was re-formed this many times (default: no limit)",
    )
    e.add_argument(
        "--blacklist-cooldown-range",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="a failed slot gets a new rank after MIN*2^failures+jitter s, at most MAX "
        "(default: never, as horovodrun)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return p


def _elastic_options(args: argparse.Namespace, hosts: Sequence[Host] | None) -> elastic.ElasticOptions:
    if hosts and (len(hosts) > 1 or not is_local_host(hosts[0].name)):
        raise ValueError("elastic mode runs ranks on this host only (-H localhost:SLOTS)")
    slots = hosts[0].slots if hosts else args.np
    if args.host_index is not None or args.base_port is not None:
        raise ValueError("--host-index and --base-port are not used in elastic mode (one host)")
    return elastic.ElasticOptions(
        np_=args.np,
        min_np=args.np if args.min_np is None else args.min_np,
        max_np=args.max_np if args.max_np is not None else (1 << 16 if args.host_discovery_script else slots),
        slots=slots,
        discovery_script=args.host_discovery_script,
        slots_per_host=args.slots_per_host,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        cooldown_range=tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None,
        timeout=args.timeout,
        extra_env={"PSTRAIN_MODE": "allreduce", "PYTHONUNBUFFERED": "1"},
    )


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    signal.signal(signal.SIGTERM, _raise_interrupt)  # stop the ranks when psrun is stopped
    try:
        hosts = parse_hosts(args.hosts) if args.hosts else None
        if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
            if not cmd:
                raise ValueError("give the command to run, e.g. psrun -np 2 --min-np 1 python train.py")
            code = elastic.run_elastic(cmd, _elastic_options(args, hosts))
            return 128 - code if code < 0 else code
        return run(cmd, args.np, hosts=hosts, host_index=args.host_index, base_port=args.base_port,
                   timeout=args.timeout)  # fmt: skip
    except ValueError as err:
        msg = str(err)
        print(msg if msg.startswith("psrun:") else f"psrun: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
