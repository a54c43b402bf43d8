"""A pytest plugin: the CPU time each test file costs, the processes it started included.

The suite is bound by its CPU (two cores, most of it TensorFlow in subprocesses), so wall-clock
``--durations`` on a busy machine say little about what to make cheaper. With ``--cpu-report N`` every
test's phases are measured as user + system time of the test process and of the children it has
reaped (``resource.getrusage``: a ``subprocess.run``'s whole tree, the shards a fixture stopped), and
the session ends with the N most expensive files and tests and the total. Under pytest-xdist each
worker measures its own tests and the figures travel to the controller in the reports.

    python -m pytest --cpu-report 30
"""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest

_KEY = "cpu_s"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-report",
        type=int,
        default=0,
        metavar="N",
        help="after the run, the N test files and tests that cost the most CPU time (user + system, their "
        "subprocesses included) and the total (default 0: no report)",
    )


def _cpu_now() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _Meter:
    def __init__(self) -> None:
        self.mark = _cpu_now()
        self.by_test: dict[str, float] = defaultdict(float)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.mark = _cpu_now()  # collecting is nobody's test

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, Any]:
        report = yield
        now = _cpu_now()
        report.user_properties.append((_KEY, now - self.mark))
        self.mark = now
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in report.user_properties:
            if key == _KEY:
                self.by_test[report.nodeid] += float(value)

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        limit = config.getoption("cpu_report")
        if not self.by_test:
            return
        by_file: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.by_test.items():
            by_file[nodeid.split("::", 1)[0]] += seconds
        total = sum(by_file.values())
        tr = terminalreporter
        tr.write_sep("=", f"CPU time: {total:.0f} s in all (tests, their fixtures and subprocesses)")
        for name, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:limit]:
            tr.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {name}")
        tr.write_sep("-", f"the {limit} tests that cost the most CPU time")
        for name, seconds in sorted(self.by_test.items(), key=lambda kv: -kv[1])[:limit]:
            tr.write_line(f"{seconds:8.1f}s  {name}")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("cpu_report"):
        config.pluginmanager.register(_Meter(), "cpu_report_meter")
