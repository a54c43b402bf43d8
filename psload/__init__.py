"""psload: load-test a paramserver cluster with simulated workers (processes) and a synthetic model.

``psload`` (``python -m psload``) drives a running cluster, or starts a local
one, with W worker processes that push gradients and read values of a model
given as a count and size of variables, in async, sync or ssp mode, for a
bounded time. It prints live progress each second and reports throughput
(GB/s, steps/s), latency percentiles, errors and per-shard balance, as text,
JSON and a PNG plot. Imports no TensorFlow.

Under faults: ``psload.chaos`` (``--chaos``: primaries killed on a local cluster), and
``psload.nemesis`` (partitions, packet loss, pauses and kills on the cluster in a box,
``bench/bench_nemesis.py``), whose clients record every call (``psload.history``) for a
checker that proves what the history must satisfy (``psload.checker``).
"""

from psload.runner import LoadConfig, run_load
from psload.spec import ModelSpec

__all__ = ["LoadConfig", "ModelSpec", "run_load"]
