"""A history of client calls, Jepsen's way: every call's invocation and outcome, with their times.

A history is a list of ``Op``: one per call (a push, a pull, a status read), each with the
``time.monotonic()`` of its invocation and of its completion (one clock for every process and every
network namespace of a machine), its outcome (``"ok"``, or ``"error"`` with the error's type and
message) and what it wrote or read. ``psload.checker`` proves properties of a history. Each client
process records its own calls with a ``Recorder`` and writes them as JSON lines; ``load`` reads them back.

The workload the checker understands: every variable is a counter (SGD, learning rate 1, gradients of
ones), so a variable's value is minus the number of updates applied to it. A push names the variables it
adds 1 to (``writes``); a pull returns the counts it read (``reads``: name -> minus the value).

Example:
    rec = Recorder("c0", deadline_s=20.0)
    with rec.call("push", writes=["nem/c0"]) as op:
        op.applied = client.push({"nem/c0": ones})
    rec.dump("c0.jsonl")
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class Op:
    """One call: who made it, what it did, when it began and ended, and how it ended.

    Attributes:
        process: the client (or monitor) that made the call.
        f: ``"push"``, ``"pull"`` or ``"status"``.
        invoke: ``time.monotonic()`` when the call began.
        complete: ``time.monotonic()`` when it returned or raised (None: it never did).
        outcome: ``"ok"``, ``"error"`` (it raised), or ``""`` while it runs.
        deadline_s: the call's deadline (the client's ``timeout``).
        writes: a push's counters (each +1 if applied).
        step: a push's step (sync and ssp modes).
        applied: what a push returned (False: a duplicate or a dropped stale step).
        reads: a pull's counts (name -> minus the value read).
        versions: a pull's versions (name -> update count).
        error_type, error: a failed call's exception class name and message.
        address, role, lease_s, peer: a status read: the process asked, its role, lease left and peer
            (``GetStatus``).
    """

    process: str
    f: str
    invoke: float
    complete: float | None = None
    outcome: str = ""
    deadline_s: float = 0.0
    writes: list[str] = field(default_factory=list)
    step: int = 0
    applied: bool | None = None
    reads: dict[str, float] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    error_type: str = ""
    error: str = ""
    address: str = ""
    role: str = ""
    lease_s: float = 0.0
    peer: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def duration(self) -> float | None:
        return None if self.complete is None else self.complete - self.invoke

    def to_json(self) -> dict[str, Any]:
        """The op as a JSON-able dict, without the fields left at their defaults."""
        blank = Op(self.process, self.f, self.invoke)
        return {
            k: v for k, v in asdict(self).items() if k in ("process", "f", "invoke") or v != getattr(blank, k)
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Op:
        return cls(**data)


class Recorder:
    """Records one process's calls (thread-safe); ``call`` wraps each one.

    Args:
        process: the name every op of this recorder carries.
        deadline_s: the calls' deadline (recorded with each op: the checker bounds their duration by it).
        errors: the exceptions ``call`` records and swallows (others are recorded and propagate).
    """

    def __init__(
        self, process: str, deadline_s: float, errors: tuple[type[BaseException], ...] = (Exception,)
    ) -> None:
        self.process = process
        self.deadline_s = deadline_s
        self.errors = errors
        self.ops: list[Op] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def call(self, f: str, **fields: Any) -> Iterator[Op]:
        """Records a call: the body fills in what it returned; an exception marks the op ``"error"``.

        The recorder's ``errors`` are swallowed (a client under a nemesis goes on after an error); any
        other exception is recorded too, and propagates.
        """
        op = Op(self.process, f, time.monotonic(), deadline_s=self.deadline_s, **fields)
        with self._lock:
            self.ops.append(op)
        try:
            yield op
        except BaseException as err:  # recorded: the checker judges it
            op.complete = time.monotonic()
            op.outcome = "error"
            op.error_type = type(err).__name__
            op.error = str(err)[:2000]
            if not isinstance(err, self.errors):
                raise
            return
        op.complete = time.monotonic()
        op.outcome = "ok"

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Writes the ops as JSON lines (atomically: a reader never sees half a history)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f, self._lock:
            for op in self.ops:
                f.write(json.dumps(op.to_json()) + "\n")
        os.replace(tmp, path)


def load(paths: Iterable[str | os.PathLike[str]]) -> list[Op]:
    """Reads JSON-lines histories (of several processes) into one list, ordered by invocation."""
    ops: list[Op] = []
    for path in paths:
        with open(path) as f:
            ops.extend(Op.from_json(json.loads(line)) for line in f if line.strip())
    ops.sort(key=lambda op: op.invoke)
    return ops


def dump(ops: Iterable[Op], path: str | os.PathLike[str]) -> None:
    """Writes ops as JSON lines."""
    with open(path, "w") as f:
        for op in ops:
            f.write(json.dumps(op.to_json()) + "\n")
