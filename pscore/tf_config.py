"""TF_CONFIG, the cluster layout TensorFlow, Kubeflow and our deploy files set: parsed in one place.

>>> tf = read_tf_config({"TF_CONFIG": '{"cluster": {"ps": ["p:1"], "chief": ["c:1"], "worker": ["w:1"]},'
...                      ' "task": {"type": "worker", "index": 0}}'})
>>> tf.ps, tf.workers, tf.worker_rank()
(['p:1'], ['c:1', 'w:1'], 1)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TFConfig:
    """The cluster (task type -> addresses) and this process's task."""

    cluster: dict[str, list[str]]
    task_type: str | None
    task_index: int | None

    @property
    def ps(self) -> list[str]:
        return list(self.cluster.get("ps", []))

    @property
    def workers(self) -> list[str]:
        """The training workers in rank order: the chief (if any), then the ``worker`` tasks."""
        return list(self.cluster.get("chief", [])) + list(self.cluster.get("worker", []))

    def worker_rank(self) -> int:
        """This task's rank among ``workers`` (the chief is rank 0).

        Raises:
            ValueError: this task is not a chief or worker task of the cluster.
        """
        if self.task_type not in ("chief", "worker") or self.task_index is None:
            raise ValueError(f"TF_CONFIG task type is {self.task_type!r}; expected 'chief' or 'worker'")
        rank = self.task_index + (len(self.cluster.get("chief", [])) if self.task_type == "worker" else 0)
        if not 0 <= rank < len(self.workers):
            raise ValueError(
                f"TF_CONFIG task {self.task_type}:{self.task_index} is not in the cluster's "
                f"{len(self.workers)} worker(s)"
            )
        return rank


def read_tf_config(environ: Mapping[str, str] = os.environ, *, unset_hint: str = "") -> TFConfig:
    """Parses ``TF_CONFIG`` from ``environ``.

    Args:
        environ: where to read it (tests pass a dict).
        unset_hint: appended to the error when TF_CONFIG is not set (what to give instead).

    Raises:
        ValueError: TF_CONFIG is unset or malformed.
    """
    raw = environ.get("TF_CONFIG")
    if not raw:
        raise ValueError("TF_CONFIG is not set" + (f" ({unset_hint})" if unset_hint else ""))
    try:
        parsed = json.loads(raw)
        cluster = {str(k): [str(a) for a in v] for k, v in dict(parsed["cluster"]).items()}
        task = parsed.get("task") or {}
        task_type = task.get("type")
        task_index = None if task.get("index") is None else int(task["index"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"TF_CONFIG is malformed: {err!r}") from err
    return TFConfig(cluster, None if task_type is None else str(task_type), task_index)
