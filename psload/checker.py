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
  replicas (``addresses``); ``pair_only_error``: and not only inside the pair (``PRIMARY|BACKUP``): it
  names the replica that went silent or refused (with ``replica_named=False`` such errors are only
  counted, ``errors_naming_only_the_pair``, with an example in the notes).
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

import bisect
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
    ops: Sequence[Op],
    *,
    mode: str = "async",
    addresses: Sequence[str] = (),
    slack_s: float = 5.0,
    replica_named: bool = True,
) -> Report:
    """Checks a history (see the module's docstring); returns the report.

    Args:
        ops: every op of every process, the final read's included (``process == FINAL``).
        mode: ``"async"``, ``"ssp"`` (every push adds 1) or ``"sync"`` (every completed step adds 1).
        addresses: the replicas' ``HOST:PORT`` (an error must name one; empty: not checked).
        slack_s: how far past its deadline a call may return.
        replica_named: an error that names only the pair (``PRIMARY|BACKUP``), not one replica, is an
            anomaly (``pair_only_error``); False: it is only counted.
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
        "pulls_failed": sum(op.f == "pull" and op.outcome == "error" for op in ops),
        "status_reads": sum(op.f == "status" and op.ok for op in ops),
        "counters": len(counters),
    }
    _check_bounded(ops, slack_s, report)
    _check_errors(ops, addresses, replica_named, report)
    _check_counts(pulls, report)
    model = _Model(pushes, sync=mode == "sync")
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


def _check_errors(ops: Sequence[Op], addresses: Sequence[str], replica_named: bool, report: Report) -> None:
    """An error must contain a replica's address, and (``replica_named``) not only inside the pair."""
    if not addresses:
        return
    pairs = ["|".join(addresses), "|".join(reversed(addresses))]
    pair_only: list[Op] = []
    for op in ops:
        if op.f not in ("push", "pull") or op.outcome != "error":
            continue  # the test's own probes (status reads) are not client calls
        if not any(a in op.error for a in addresses):
            _add(
                report, "nameless_error",
                f"{op.process}'s {op.f}: {op.error_type}: {op.error[:300]!r} names none of {list(addresses)}",
                [op],
            )  # fmt: skip
            continue
        rest = op.error
        for pair in pairs:
            rest = rest.replace(pair, "")
        if not any(a in rest for a in addresses):
            pair_only.append(op)
            if replica_named:
                _add(
                    report, "pair_only_error",
                    f"{op.process}'s {op.f}: {op.error_type}: {op.error[:300]!r} names the pair, not the "
                    "replica that failed it",
                    [op],
                )  # fmt: skip
    report.stats["errors_naming_only_the_pair"] = len(pair_only)
    if pair_only and not replica_named:
        op = pair_only[0]
        report.notes.append(
            f"{len(pair_only)} errors name the pair, not the replica that failed them, e.g. "
            f"{op.error_type}: {op.error[:200]}"
        )


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


class _Prefix:
    """Events sorted by time with a running aggregate: what had happened strictly before an instant.

    Async and ssp count the events (every push adds 1); sync takes the largest ``step + 1`` (steps complete in
    order). ``at(t)`` is the aggregate over the events before ``t`` and the op that set it.
    """

    def __init__(self, events: Iterable[tuple[float, Op]], steps: bool) -> None:
        self.times: list[float] = []
        self.values: list[int] = []
        self.witness: list[Op] = []
        value, witness = 0, None
        for t, op in sorted(events, key=lambda e: e[0]):
            candidate = op.step + 1 if steps else value + 1
            if candidate > value or witness is None:
                value, witness = max(value, candidate), op
            self.times.append(t)
            self.values.append(value)
            self.witness.append(witness)

    def at(self, t: float) -> tuple[int, list[Op]]:
        i = bisect.bisect_left(self.times, t)
        return (0, []) if i == 0 else (self.values[i - 1], [self.witness[i - 1]])


class _Model:
    """What a counter can hold: at least what was acknowledged, at most what was invoked.

    Async and ssp: every push adds 1 to each counter it writes (acknowledged: a push that returned; these
    modes drop no push, so a push answered False was a retry the shard recognised as a duplicate: its
    first attempt was applied). Sync: the push of step ``s`` completes step ``s``, and a counter counts
    completed steps.
    """

    def __init__(self, pushes: Sequence[Op], sync: bool) -> None:
        self.sync = sync
        by_var: dict[str, list[Op]] = defaultdict(list)
        for op in pushes:
            for v in op.writes:
                by_var[v].append(op)
        self.by_var = dict(by_var)
        self._acked = {
            v: _Prefix(((op.complete, op) for op in ops if op.ok and op.complete is not None), sync)
            for v, ops in by_var.items()
        }
        self._invoked = {v: _Prefix(((op.invoke, op) for op in ops), sync) for v, ops in by_var.items()}

    def lower(self, var: str, before: float) -> tuple[int, list[Op]]:
        """The count surely applied before ``before`` (from the acknowledgements), and the op that says so."""
        prefix = self._acked.get(var)
        return (0, []) if prefix is None else prefix.at(before)

    def upper(self, var: str, before: float) -> int:
        """The most that can have been applied before ``before`` (from the invocations)."""
        prefix = self._invoked.get(var)
        return 0 if prefix is None else prefix.at(before)[0]

    def final_bounds(self, var: str) -> tuple[int, int, str]:
        low, high = self.lower(var, math.inf)[0], self.upper(var, math.inf)
        if self.sync:
            return low, high, f"steps acknowledged up to {low - 1}, pushed up to {high - 1}"
        return low, high, f"{low} acknowledged pushes, {high - low} of unknown outcome"


def _check_reads(pulls: Sequence[Op], model: _Model, report: Report) -> None:
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


def _check_final(pulls: Sequence[Op], counters: Sequence[str], model: _Model, report: Report) -> None:
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
