"""Proves properties of a history (``psload.history``) of counter pushes and reads under faults.

The workload: every variable is a counter (SGD, learning rate 1, gradients of ones), so a value read says
how many updates were applied. In async and ssp modes every push adds 1 to the counters it names; in sync
mode the push of step ``s`` (every worker pushes ones) completes step ``s``, whose update (the mean of the
workers' ones) adds 1: a counter then counts completed steps, and steps complete in order from 0.

What ``check`` proves (each violation is an ``Anomaly``):

- ``lost`` / ``applied_twice``: every acknowledged push applied exactly once (async, ssp: a push that
  returned, whether it returned True or False: these modes drop no push, so False means a retry found
  its first attempt applied: ``pushes_answered_false`` counts them). The final read (process
  ``FINAL``, made after every fault healed) must count at least the acknowledged pushes and at most
  those plus the pushes whose outcome is unknown: a push that raised (``DeadlineExceededError`` above all)
  may or may not have been applied. Sync mode: at least the last acknowledged step + 1, at most the last
  step pushed + 1.
- ``stale_read``: a pull that began after a push was acknowledged sees it (a count at least the number of
  pushes acknowledged before the pull began; sync: the last step acknowledged before it, + 1).
- ``phantom_read``: a pull never counts more than the pushes invoked before it ended.
- ``not_integral`` / ``version_mismatch``: a count is a whole number, and equals the variable's version
  (every update adds exactly 1 in every mode).
- ``unbounded`` / ``incomplete``: every call returned within its deadline + ``slack_s``.
- ``nameless_error``: every error names its party: the message contains an address of the shard's
  replicas (``addresses``).
- ``two_primaries``: no two processes served for overlapping terms, from status reads (``GetStatus``,
  ``f == "status"``): a primary that reports ``lease_s`` > 0 over a call ``[t0, t1]`` surely serves during
  ``[t1, t0 + lease_s * (1 - RHO))`` (its lease clock may run 1 % fast); a primary that needs no lease
  (``lease_s`` < 0) served at some instant of ``[t0, t1]``. Two processes whose sure intervals overlap (or
  whose instant lies inside the other's sure interval) served at once. Status reads are samples: a
  dual term shorter than their spacing can be missed; the exactly-once and read checks catch its effects
  on acknowledged pushes.

Not anomalies, reported as notes: a process's reads going backwards (an old primary may serve, within its
lease, updates its backup did not acknowledge; a failover rolls those back), and pushes of unknown outcome.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from psload.history import Op

FINAL = "final"  # the process name of the final read, made after everything healed
RHO = 0.01  # the lease clocks' largest rate error (psserver.lease)
_EXAMPLES = 5  # ops kept per anomaly kind in a report


@dataclass(slots=True)
class Anomaly:
    """One violation: its kind, what is wrong, and the ops that show it."""

    kind: str
    message: str
    ops: list[Op] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "ops": [op.to_json() for op in self.ops]}


@dataclass(slots=True)
class Report:
    """The checker's verdict: anomalies (none: the history is valid), counts and notes."""

    anomalies: list[Anomaly] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.anomalies

    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for a in self.anomalies:
            counts[a.kind] += 1
        return dict(counts)

    def summary(self, examples: int = _EXAMPLES) -> str:
        """A few lines: the counts, the anomalies by kind with up to ``examples`` each, the notes."""
        lines = [
            f"{len(self.anomalies)} anomalies {self.kinds() or ''}".rstrip(),
            "stats: " + ", ".join(f"{k}={v}" for k, v in self.stats.items()),
        ]
        shown: dict[str, int] = defaultdict(int)
        for a in self.anomalies:
            if shown[a.kind] < examples:
                lines.append(f"  {a.kind}: {a.message}")
            shown[a.kind] += 1
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "anomalies_by_kind": self.kinds(),
            "anomalies": [a.to_json() for a in self.anomalies],
            "stats": self.stats,
            "notes": self.notes,
        }


def check(
    ops: Sequence[Op], *, mode: str = "async", addresses: Sequence[str] = (), slack_s: float = 5.0
) -> Report:
    """Checks a history (see the module's docstring); returns the report.

    Args:
        ops: every op of every process, the final read's included (``process == FINAL``).
        mode: ``"async"``, ``"ssp"`` (every push adds 1) or ``"sync"`` (every completed step adds 1).
        addresses: the replicas' ``HOST:PORT`` (an error must name one; empty: not checked).
        slack_s: how far past its deadline a call may return.
    """
    report = Report()
    pushes = [op for op in ops if op.f == "push"]
    pulls = [op for op in ops if op.f == "pull" and op.ok]
    counters = sorted({v for op in pushes for v in op.writes} | {v for op in pulls for v in op.reads})
    report.stats = {
        "ops": len(ops),
        "pushes_ok": sum(op.ok for op in pushes),
        "pushes_failed": sum(op.outcome == "error" for op in pushes),
        "pushes_answered_false": sum(op.ok and op.applied is False for op in pushes),
        "pulls_ok": len(pulls),
        "status_reads": sum(op.f == "status" and op.ok for op in ops),
        "counters": len(counters),
    }
    _check_bounded(ops, slack_s, report)
    _check_errors(ops, addresses, report)
    _check_counts(pulls, report)
    model = _SyncModel(pushes) if mode == "sync" else _CountModel(pushes)
    _check_reads(pulls, model, report)
    _check_final(pulls, counters, model, report)
    _check_primaries([op for op in ops if op.f == "status" and op.ok], report)
    _note_regressions(pulls, report)
    return report


def _add(report: Report, kind: str, message: str, ops: Iterable[Op] = ()) -> None:
    report.anomalies.append(Anomaly(kind, message, list(ops)[:_EXAMPLES]))


def _check_bounded(ops: Sequence[Op], slack_s: float, report: Report) -> None:
    for op in ops:
        if op.complete is None:
            _add(
                report, "incomplete", f"{op.process}'s {op.f} invoked at {op.invoke:.3f} never returned", [op]
            )
        elif op.deadline_s > 0 and op.complete - op.invoke > op.deadline_s + slack_s:
            _add(
                report, "unbounded",
                f"{op.process}'s {op.f} took {op.complete - op.invoke:.1f} s (deadline {op.deadline_s:g} s "
                f"+ {slack_s:g} s slack): {op.outcome} {op.error_type}",
                [op],
            )  # fmt: skip


def _check_errors(ops: Sequence[Op], addresses: Sequence[str], report: Report) -> None:
    if not addresses:
        return
    for op in ops:
        if op.f not in ("push", "pull"):
            continue  # the test's own probes (status reads) are not client calls
        if op.outcome == "error" and not any(a in op.error for a in addresses):
            _add(
                report, "nameless_error",
                f"{op.process}'s {op.f}: {op.error_type}: {op.error[:300]!r} names none of {list(addresses)}",
                [op],
            )  # fmt: skip


def _check_counts(pulls: Sequence[Op], report: Report) -> None:
    for op in pulls:
        for v, count in op.reads.items():
            if not math.isfinite(count) or count != round(count):
                _add(report, "not_integral", f"{op.process} read {v} = {-count!r}: not a whole count", [op])
            elif v in op.versions and op.versions[v] != round(count):
                _add(
                    report, "version_mismatch",
                    f"{op.process} read {v}: count {count:g} but version {op.versions[v]}",
                    [op],
                )  # fmt: skip


class _CountModel:
    """Async and ssp: every push adds 1 to each counter it writes."""

    def __init__(self, pushes: Sequence[Op]) -> None:
        self.by_var: dict[str, list[Op]] = defaultdict(list)
        for op in pushes:
            for v in op.writes:
                self.by_var[v].append(op)

    def lower(self, var: str, before: float) -> tuple[int, list[Op]]:
        """Pushes to ``var`` acknowledged before ``before`` (each surely applied), and the last of them."""
        acked = [
            op for op in self.by_var[var] if _acked(op) and op.complete is not None and op.complete < before
        ]
        return len(acked), acked[-1:]

    def upper(self, var: str, before: float) -> int:
        """Pushes to ``var`` invoked before ``before`` (at most these can have been applied by then)."""
        return sum(op.invoke < before for op in self.by_var[var])

    def final_bounds(self, var: str) -> tuple[int, int, str]:
        ops = self.by_var[var]
        acked = sum(_acked(op) for op in ops)
        unknown = len(ops) - acked
        return acked, acked + unknown, f"{acked} acknowledged pushes, {unknown} of unknown outcome"


class _SyncModel:
    """Sync: the push of step ``s`` completes step ``s``; a counter counts completed steps."""

    def __init__(self, pushes: Sequence[Op]) -> None:
        self.by_var: dict[str, list[Op]] = defaultdict(list)
        for op in pushes:
            for v in op.writes:
                self.by_var[v].append(op)

    def lower(self, var: str, before: float) -> tuple[int, list[Op]]:
        acked = [op for op in self.by_var[var] if op.ok and op.complete is not None and op.complete < before]
        last = max(acked, key=lambda op: op.step, default=None)
        return (0, []) if last is None else (last.step + 1, [last])

    def upper(self, var: str, before: float) -> int:
        return max((op.step + 1 for op in self.by_var[var] if op.invoke < before), default=0)

    def final_bounds(self, var: str) -> tuple[int, int, str]:
        ops = self.by_var[var]
        low = max((op.step + 1 for op in ops if op.ok), default=0)
        high = max((op.step + 1 for op in ops), default=0)
        return low, high, f"steps acknowledged up to {low - 1}, pushed up to {high - 1}"


def _acked(op: Op) -> bool:
    """An acknowledged push: it returned. Async and ssp modes drop no push, so a push answered False was a
    retry the shard recognised as a duplicate: its first attempt was applied (and is on the backup)."""
    return op.ok


def _check_reads(pulls: Sequence[Op], model: _CountModel | _SyncModel, report: Report) -> None:
    for op in pulls:
        if op.process == FINAL:
            continue  # judged by _check_final (lost, applied twice)
        assert op.complete is not None
        for v, count in op.reads.items():
            low, witness = model.lower(v, op.invoke)
            if count < low:
                w = witness[0]
                _add(
                    report, "stale_read",
                    f"{op.process}'s pull [{op.invoke:.3f}, {op.complete:.3f}] read {v} = {count:g}, but "
                    f"{low} were acknowledged before it began (the last by {w.process}, step {w.step}, "
                    f"acknowledged at {w.complete:.3f})",
                    [op, *witness],
                )  # fmt: skip
            high = model.upper(v, op.complete)
            if count > high:
                _add(
                    report, "phantom_read",
                    f"{op.process}'s pull read {v} = {count:g}, but only {high} pushes began before it ended",
                    [op],
                )  # fmt: skip


def _check_final(
    pulls: Sequence[Op], counters: Sequence[str], model: _CountModel | _SyncModel, report: Report
) -> None:
    final = [op for op in pulls if op.process == FINAL]
    if not final:
        _add(report, "no_final_read", "no final read: exactly-once is not checked")
        return
    last = final[-1]
    for v in counters:
        if v not in last.reads:
            _add(report, "no_final_read", f"the final read has no {v}", [last])
            continue
        count = last.reads[v]
        low, high, what = model.final_bounds(v)
        report.stats.setdefault("final", {})[v] = count
        if count < low:
            _add(report, "lost", f"{v}: the final read counts {count:g}, but {what}", [last])
        elif count > high:
            _add(report, "applied_twice", f"{v}: the final read counts {count:g}, but {what}", [last])
        elif high > low:
            report.notes.append(f"{v}: final count {count:g} within [{low}, {high}] ({what})")


def _check_primaries(status: Sequence[Op], report: Report) -> None:
    """Overlapping sure serving intervals of two processes (see the module's docstring)."""
    spans: list[tuple[float, float, bool, Op]] = []  # (start, end, sure interval?, op)
    for op in status:
        if op.role != "primary" or op.lease_s == 0 or op.complete is None:
            continue
        if op.lease_s > 0:
            end = op.invoke + op.lease_s * (1 - RHO)
            if end > op.complete:
                spans.append((op.complete, end, True, op))
        else:
            spans.append((op.invoke, op.complete, False, op))
    spans.sort(key=lambda s: s[0])
    found = 0
    for i, (s0, e0, sure0, a) in enumerate(spans):
        for s1, e1, sure1, b in spans[i + 1 :]:
            if s1 >= (e0 if sure0 else s0 + 1e-9):
                break  # too late to overlap a (a point window lies only in a sure span starting with it)
            if a.address == b.address or not (sure0 or sure1):
                continue
            inside = (sure0 and sure1) or (sure0 and e1 <= e0) or (sure1 and e0 <= e1)
            if inside:
                found += 1
                if found <= _EXAMPLES:
                    _add(
                        report, "two_primaries",
                        f"{_served(a)} and {_served(b)} both served at once",
                        [a, b],
                    )  # fmt: skip


def _served(op: Op) -> str:
    return f"{op.address} (lease {op.lease_s:g} s, read in [{op.invoke:.3f}, {op.complete:.3f}])"


def _note_regressions(pulls: Sequence[Op], report: Report) -> None:
    last: dict[tuple[str, str], tuple[float, Op]] = {}
    regressions: list[str] = []
    for op in sorted(pulls, key=lambda o: o.invoke):
        for v, count in op.reads.items():
            prev = last.get((op.process, v))
            if prev is not None and count < prev[0]:
                regressions.append(
                    f"{op.process} read {v} = {prev[0]:g} at {prev[1].complete:.3f}, "
                    f"then {count:g} at {op.complete:.3f}"
                )
            last[(op.process, v)] = (count, op)
    if regressions:
        report.notes.append(
            f"{len(regressions)} reads went backwards (unacknowledged updates rolled back by a failover; "
            f"allowed): {'; '.join(regressions[:3])}"
        )
    report.stats["read_regressions"] = len(regressions)
