"""Shared fixtures: real ``psserver`` processes on loopback, clients, raw stubs, unique names.

Fixtures (all documented where defined):

``cluster``
    A 2-shard ``LocalCluster`` shared by the whole session (default flags). Tests
    that use it must name their variables uniquely (``var_name``). After each test
    it checks that every shard is still alive, so a test that crashes a shard fails
    by name (and the next test gets a fresh cluster).
``make_cluster``
    Factory for a private cluster with its own flags:
    ``make_cluster(num_shards=1, server_args=["--allow-non-finite"])``. Started
    on call, stopped (SIGTERM) at teardown.
``client`` / ``async_client``
    A ``PSClient`` / ``AsyncPSClient`` on ``cluster``, closed at teardown.
``raw_stubs``
    The generated ``ParameterServerStub`` of each ``cluster`` shard (sync
    channels), for sending malformed requests the clients never build.
``var_name``
    A variable name unique to the test (and valid on the wire).
``net``
    A 3-host cluster in a box (``trainer.netns.NetnsCluster``: network namespaces on a bridge of its
    own), removed at teardown; the test skips with the reason where namespaces cannot be made.

Only process-based tests use these; unit tests need none of them (no sockets, no TF).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from _cpu_report import pytest_addoption, pytest_configure  # noqa: F401  (--cpu-report N: the plugin's hooks)
from _support import CALL_TIMEOUT_S

from psproto.v1 import ps_pb2_grpc
from trainer.cluster import LocalCluster
from trainer.netns import NetnsCluster, netns_available

_FAILED = pytest.StashKey[bool]()

# Every Python process the suite starts runs tests/_site/sitecustomize.py first (see there: it keeps JAX,
# which TensorFlow imports whenever it is installed, out of the processes that do not train on JAX).
_SITE = str(Path(__file__).resolve().parent / "_site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)
# One intra-op (compute) thread in every TensorFlow process the suite starts, one OpenMP/OpenBLAS thread in
# every numpy and PyTorch one (set where not set already): 3 test processes, each with its 2-4 TensorFlow,
# shard and worker processes, share 2 cores, and a pool of a thread per core per process spins while it
# waits for work. Both sides of every comparison (a distributed run and its local baseline, the ranks of a
# ring) run with the same setting. Three e2e files in 3 processes: 415, 417 -> 404, 408 s of CPU and
# 231, 242 -> 220, 221 s (bench/results/suite_cpu_2026-12-07d). The inter-op pool keeps its default:
# with TF_NUM_INTEROP_THREADS=1, two workers in one process (tests/e2e/test_keras_sync_parts.py) stall until
# the barrier times out, one's blocking exchange holding the only thread the other's step needs.
SUBPROCESS_THREADS = {"TF_NUM_INTRAOP_THREADS": "1", "OMP_NUM_THREADS": "1"}
for _key, _value in SUBPROCESS_THREADS.items():
    os.environ.setdefault(_key, _value)


def _compile_project() -> None:
    """Writes the ``.pyc`` of every module of the project's packages, the tests' helpers, the examples and the
    benchmarks (in each folder's ``__pycache__``, which git ignores) where they are missing or stale.

    Where ``PYTHONDONTWRITEBYTECODE`` is set (many container images set it, the machines this project is
    built on among them) no process writes them, so each of the ~750 Python processes the suite starts
    (shards, workers, launchers) compiled every project module it imported from source: 67 in a shard.
    Reading a ``.pyc`` is not writing one, so once they exist every process reads them, as it does those of
    the installed packages (pip writes them at install). Run by the controller before its workers start."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    packages = ("pscore", "psserver", "psclient", "psload", "psproto", "trainer")
    for name in (*packages, "tests", "examples", "bench"):
        if (root / name).is_dir():  # bench's results hold scripts no test imports
            compileall.compile_dir(root / name, maxlevels=0 if name == "bench" else 10, quiet=2)


if sys.flags.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:
    _compile_project()
_site = sys.modules.get("sitecustomize")
if _site is not None and str(getattr(_site, "__file__", "")).startswith(_SITE):
    _site.restore()  # this process (pytest, or an xdist worker started with it) keeps what is installed


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, ``addopts``): 1.5 test processes per core, 2 to 8.

    Run one at a time, the suite keeps the cores about half busy: its tests wait on the processes they
    start (shards, TensorFlow workers), on timeouts and on links. On the 2-core development VM the whole
    suite took 19 min 31 s in one process, 12 min 50 s in 2 and 11 min 50 s - 12 min 0 s in 3, test by test
    (``--dist worksteal``), 11 min 29 s in 3 file by file (``--dist loadfile``), and 10 min 15 s in 3 file
    by file with the e2e files first (``--no-loadscope-reorder``, as ``addopts`` has it; 2026-11-28). More
    than 8 would mostly add TensorFlow processes' memory.
    """
    cores = _cores()
    return max(2, min(8, cores + cores // 2))


def _cores() -> int:
    """The cores this process may use: its CPU affinity, and a container's CPU quota where one is set
    (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), since a container may see every core of its host."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for read in (
        lambda: Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2],
        lambda: [Path(f"/sys/fs/cgroup/cpu/cpu.cfs_{k}_us").read_text() for k in ("quota", "period")],
    ):
        with contextlib.suppress(OSError, ValueError):
            quota, period = read()
            if quota.strip() == "max" or int(quota) < 0:  # no quota
                break
            return max(1, min(cores, -(-int(quota) // int(period))))
    return cores


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_FAILED] = True
    return report


def _report_shards(request: pytest.FixtureRequest, clusters: Sequence[LocalCluster]) -> None:
    """After a failed test: every live shard writes its threads' stacks into its log (SIGUSR1,
    ``pscore.loopwatch``), and the report gets each shard's log tail, so a call that hung shows where."""
    if not request.node.stash.get(_FAILED, False):
        return
    tails = [f"=== cluster {i} ===\n{c.failure_report()}" for i, c in enumerate(clusters)]
    request.node.add_report_section("teardown", "shard logs", "\n".join(tails))


@pytest.fixture(scope="session")
def _shared_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_shards=2) as cluster:
        yield cluster


@pytest.fixture
def cluster(_shared_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """The session's shared 2-shard cluster; asserts after the test that every shard still serves."""
    yield _shared_cluster
    _report_shards(request, [_shared_cluster])
    dead = [s for s, p in enumerate(_shared_cluster.procs) if p is None or p.poll() is not None]
    if dead:
        tails = "\n".join(f"--- shard {s} ---\n{_shared_cluster.log_tail(s)}" for s in dead)
        for s in dead:  # leave a working cluster to the tests that follow
            _shared_cluster.start_shard(s)
        pytest.fail(f"shards {dead} died during the test:\n{tails}")


@pytest.fixture
def make_cluster(request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalCluster]]:
    """Factory: ``make_cluster(num_shards=2, server_args=(), **LocalCluster kwargs)`` -> started cluster.

    Every cluster made is stopped at teardown (after a failed test, the report shows the shards' logs).
    """
    made: list[LocalCluster] = []

    def factory(num_shards: int = 2, server_args: Sequence[str] = (), **kwargs: Any) -> LocalCluster:
        c = LocalCluster(num_shards=num_shards, server_args=server_args, **kwargs)
        made.append(c)
        return c.start()

    yield factory
    _report_shards(request, made)
    for c in made:
        c.stop()


@pytest.fixture
def var_name(request: pytest.FixtureRequest) -> str:
    """A variable name unique to this test, e.g. ``test_push_sgd[float32]`` -> ``test_push_sgd_float32_``."""
    return re.sub(r"[^A-Za-z0-9_/]", "_", request.node.name)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Any]:
    """A ``psclient.PSClient`` on ``cluster`` (worker id from the test name), closed at teardown."""
    import psclient

    with psclient.PSClient(cluster.addresses, timeout=CALL_TIMEOUT_S) as c:
        yield c


@pytest.fixture
async def async_client(cluster: LocalCluster) -> Any:
    """A ``psclient.AsyncPSClient`` on ``cluster``, on the test's event loop; closed at teardown."""
    import psclient

    async with psclient.AsyncPSClient(cluster.addresses, timeout=CALL_TIMEOUT_S) as c:
        yield c


@pytest.fixture
def raw_stubs(cluster: LocalCluster) -> Iterator[list[ps_pb2_grpc.ParameterServerStub]]:
    """The raw generated stub of every ``cluster`` shard, in shard order (sync channels)."""
    channels = [grpc.insecure_channel(a) for a in cluster.addresses]
    try:
        yield [ps_pb2_grpc.ParameterServerStub(ch) for ch in channels]
    finally:
        for ch in channels:
            ch.close()


@pytest.fixture
def net() -> Iterator[NetnsCluster]:
    """Three hosts on a bridge of their own (``net.hosts``); skips where namespaces cannot be made."""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    with NetnsCluster(3) as cluster:
        yield cluster
