"""Shard checkpoints: atomic, self-describing files that restore into any shard count.

Each save of shard ``i`` of ``n`` writes one file in the checkpoint directory::

    ckpt-<id:010d>-shard<i:05d>-of-<n:05d>.npz

an uncompressed numpy ``.npz`` (a zip of ``.npy`` arrays, loaded with
``allow_pickle=False``) holding:

- ``manifest``: UTF-8 JSON as a ``uint8`` array (see ``FORMAT_VERSION``)::

      {"format": "psserver-checkpoint", "format_version": 1, "id": 7,
       "created_unix": 1700000000.0, "shard": 0, "num_shards": 2, "mode": "async",
       "mode_state": {...},
       "dedup_sessions": {"<worker_id>": [[session, floor, [seq, ...]], ...]},
       "dedup": {"<worker_id>": [floor, [seq, ...]]},
       "variables": [{"spec": <VariableSpec as protobuf JSON>, "version": 42,
                      "iterations": 40, "value": "a0", "slots": {"momentum": "a1"},
                      "crc32": {"a0": 123, "a1": 456}}, ...]}

  A file written by a cut of the whole cluster (``psserver.cut``: ``psctl save
  --consistent``, or a sync-mode periodic checkpoint at a common step) also
  holds ``"cut"``: ``{"id": "<cut id>", "num_shards": n}`` or ``{"step": k}``.

  ``dedup_sessions`` is the push dedup table: per worker id its client
  sessions, oldest first (the last is the current one), each with its window of
  applied sequence numbers. ``dedup`` is the current session's window alone,
  what files written before sessions existed hold (such a file loads as session
  0, the session of clients that send none; a newer client's session then
  takes over). ``iterations`` is the optimizer's step count (``Variable.iterations``:
  pushes since the optimizer was last replaced); files without it were written
  when it always equalled the version, and load so.

- ``a0``, ``a1``, ...: the stored tensors (values and optimizer slots, shaped as
  stored: partitions are 1-D) named by the manifest.

A dynamic table piece (spec ``dynamic``, stored shape ``[0, dim]``) is saved
compact: ``value`` and its row slots hold its ``n`` live rows ``[n, dim]`` in
ascending id order, and its entry's ``"dynamic"`` names the bookkeeping arrays
(``psserver.dynamic.DynamicRows.export``): ``ids`` ``[n]``, ``last_step``,
``hits``, ``last_time``, ``clock``, ``last_sweep`` and, with admission, the
count-min ``sketch`` and ``sketch_added``.

A save writes a temporary file in the same directory, fsyncs it, renames it
into place and fsyncs the directory, so a reader only ever sees whole files: a
``kill -9`` at any moment, during a save too, leaves at worst a stale
``.ckpt-tmp-*`` file (removed at the next start). The last ``keep`` files of
each shard are kept.

Restore (at start): shard ``i`` of ``M`` loads its own newest file (shard ``i``
of ``M``) when that is the newest state there is; a file that fails validation
(a CRC, a shape, a truncated zip) is skipped for the next older one. When the
newest complete set of files was written by a different shard count ``n``
(every shard ``0..n-1`` has a file), shard ``i`` re-places every variable of
that set: it runs ``pscore.placement.plan`` over all variables with ``M``
shards and keeps the pieces placed on it, cut from the reassembled full values
and slots (versions: the largest of the variable's old pieces; dedup tables:
merged). An embedding table's rows are re-cut by the row rule with ``M``
(row ``i`` to shard ``i % M``), with their slots; a dynamic table's rows go
to ``dynamic_row_shard(id, M)`` (a shard given more rows than its new capacity
keeps those its eviction policy keeps longest), with their bookkeeping, and
its admission sketches are summed. Clients learn the new placement from
``ListVariables``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from google.protobuf import json_format

from pscore import codec
from pscore.placement import DEFAULT_PARTITION_BYTES, dynamic_row_shard, plan, table_piece_name, table_rows
from psproto.v1 import ps_pb2
from psserver import dynamic, optimizers, tables
from psserver.ledger import SessionState
from psserver.modes import Mode
from psserver.store import Store, Variable

log = logging.getLogger(__name__)

FORMAT = "psserver-checkpoint"
FORMAT_VERSION = 1
DEFAULT_KEEP = 3
_NAME = re.compile(r"^ckpt-(\d{10})-shard(\d{5})-of-(\d{5})\.npz$")
_TMP_PREFIX = ".ckpt-tmp-"


class CheckpointError(Exception):
    """A checkpoint could not be written, or no valid one could be read; the message says which file."""


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointFile:
    """A checkpoint file found in the directory (by name; not yet validated)."""

    path: Path
    id: int
    shard: int
    num_shards: int


@dataclasses.dataclass(slots=True)
class StoredTensor:
    """One stored tensor of a checkpoint, with its optimizer slots."""

    spec: ps_pb2.VariableSpec
    value: np.ndarray
    version: int
    slots: dict[str, np.ndarray]
    iterations: int | None = None  # the optimizer's step count; None: equal to ``version``
    # A dynamic table piece: its bookkeeping arrays (``DynamicRows.export``); value and slots are compact.
    rows: dict[str, np.ndarray] | None = None

    @property
    def step(self) -> int:
        """The optimizer's step count (``iterations``, or the version for older snapshots)."""
        return self.version if self.iterations is None else self.iterations


@dataclasses.dataclass(slots=True)
class Snapshot:
    """The state of one shard at one instant (what a checkpoint file holds)."""

    shard: int
    num_shards: int
    mode: str
    tensors: list[StoredTensor]
    dedup: dict[str, SessionState]  # worker_id -> [(session, floor, seqs)], oldest first
    mode_state: dict[str, Any]
    id: int = 0
    created_unix: float = 0.0
    # Set when the snapshot is one shard's part of a cut of the whole cluster (psserver.cut: a
    # consistent save, or a sync step boundary): {"id": ..., "num_shards": n} or {"step": k, ...}.
    cut: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.value.nbytes + sum(s.nbytes for s in t.slots.values()) for t in self.tensors)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    path: Path
    id: int
    num_variables: int
    nbytes: int
    seconds: float


def file_name(ckpt_id: int, shard: int, num_shards: int) -> str:
    """The file name of checkpoint ``ckpt_id`` of shard ``shard`` of ``num_shards``."""
    return f"ckpt-{ckpt_id:010d}-shard{shard:05d}-of-{num_shards:05d}.npz"


def list_files(directory: str | os.PathLike[str]) -> list[CheckpointFile]:
    """Every checkpoint file in ``directory`` (newest id first); an absent directory has none."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = _NAME.match(name)
        if m:
            ckpt_id, shard, n = (int(g) for g in m.groups())
            if 0 <= shard < n:
                found.append(CheckpointFile(Path(directory) / name, ckpt_id, shard, n))
    return sorted(found, key=lambda f: (-f.id, f.shard))


# -- writing --------------------------------------------------------------------


def dump(snapshot: Snapshot, f: BinaryIO, ckpt_id: int) -> None:
    """Writes ``snapshot`` in the checkpoint format to the binary file ``f`` (no fsync, no rename)."""
    arrays: dict[str, np.ndarray] = {}
    entries = []
    for t in snapshot.tensors:
        key = f"a{len(arrays)}"
        arrays[key] = np.asarray(t.value, order="C")  # not ascontiguousarray: it makes a scalar 1-D
        slots = {}
        for slot, arr in sorted(t.slots.items()):
            slots[slot] = f"a{len(arrays)}"
            arrays[slots[slot]] = np.asarray(arr, order="C")
        extra = {}
        for part, arr in sorted((t.rows or {}).items()):
            extra[part] = f"a{len(arrays)}"
            arrays[extra[part]] = np.asarray(arr, order="C")
        keys = [key, *slots.values(), *extra.values()]
        entry = {
            "spec": json_format.MessageToDict(t.spec, preserving_proto_field_name=True),
            "version": int(t.version),
            "iterations": int(t.step),
            "value": key,
            "slots": slots,
            "crc32": {k: _crc(arrays[k]) for k in keys},
        }
        if t.rows is not None:
            entry["dynamic"] = extra
        entries.append(entry)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "id": ckpt_id,
        "created_unix": snapshot.created_unix or time.time(),
        "shard": snapshot.shard,
        "num_shards": snapshot.num_shards,
        "mode": snapshot.mode,
        "mode_state": snapshot.mode_state,
        **({"cut": snapshot.cut} if snapshot.cut else {}),
        "dedup_sessions": {
            w: [[int(session), int(floor), [int(s) for s in seen]] for session, floor, seen in entries]
            for w, entries in snapshot.dedup.items()
        },
        "dedup": {  # for readers from before sessions: the current session's window
            w: [int(entries[-1][1]), [int(s) for s in entries[-1][2]]]
            for w, entries in snapshot.dedup.items()
            if entries
        },
        "variables": entries,
    }
    arrays["manifest"] = np.frombuffer(json.dumps(manifest, sort_keys=True).encode(), dtype=np.uint8)
    np.savez(f, **arrays)  # type: ignore[arg-type]


def write(snapshot: Snapshot, directory: str | os.PathLike[str], ckpt_id: int) -> Path:
    """Writes ``snapshot`` as checkpoint ``ckpt_id`` atomically (temp file, fsync, rename, fsync dir).

    Raises:
        CheckpointError: the file could not be written (disk full, permissions).
    """
    directory = Path(directory)
    final = directory / file_name(ckpt_id, snapshot.shard, snapshot.num_shards)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}shard{snapshot.shard:05d}-", dir=directory)
    except OSError as err:
        raise CheckpointError(f"cannot write a checkpoint in {directory}: {err}") from err
    try:
        with os.fdopen(fd, "wb") as f:
            dump(snapshot, f, ckpt_id)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise CheckpointError(f"cannot write checkpoint {final}: {err}") from err
        raise
    return final


def _crc(arr: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------


def _parse_manifest(z: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    manifest = json.loads(bytes(z["manifest"]).decode())
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {manifest.get('format_version')}; "
            f"this psserver reads version {FORMAT_VERSION}"
        )
    return manifest


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads only the manifest of a checkpoint file.

    Raises:
        CheckpointError: not a readable checkpoint file.
    """
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            return _parse_manifest(z, path)
    except CheckpointError:
        raise
    except Exception as err:  # OS, zipfile, numpy, json, unicode errors: all mean "not a valid file"
        raise CheckpointError(f"checkpoint {path} is unreadable: {err!r}") from err


def read(path: str | os.PathLike[str]) -> Snapshot:
    """Reads and validates a whole checkpoint file (CRCs, dtypes, shapes, slot names).

    Raises:
        CheckpointError: the file is unreadable, truncated or inconsistent.
    """
    try:
        with open(path, "rb") as f:
            return load(f, str(path))
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: {err!r}") from err


def load(f: BinaryIO, label: str) -> Snapshot:
    """Reads and validates a checkpoint from the binary file ``f``; ``label`` names it in errors.

    Raises:
        CheckpointError: the data is truncated or inconsistent.
    """
    path = label
    try:
        with np.load(f, allow_pickle=False) as z:
            manifest = _parse_manifest(z, path)
            tensors = [_read_tensor(z, entry) for entry in manifest["variables"]]
        dedup = _read_dedup(manifest)
        snap = Snapshot(
            shard=int(manifest["shard"]),
            num_shards=int(manifest["num_shards"]),
            mode=str(manifest["mode"]),
            tensors=tensors,
            dedup=dedup,
            mode_state=dict(manifest.get("mode_state") or {}),
            id=int(manifest["id"]),
            created_unix=float(manifest["created_unix"]),
            cut=manifest.get("cut"),
        )
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: {err!r}") from err
    names = [t.spec.name for t in snap.tensors]
    if len(set(names)) != len(names):
        raise CheckpointError(f"checkpoint {path} lists a variable twice")
    return snap


def _read_tensor(z: Any, entry: Mapping[str, Any]) -> StoredTensor:
    spec = json_format.ParseDict(entry["spec"], ps_pb2.VariableSpec())
    crcs = entry["crc32"]

    def load(key: str) -> np.ndarray:
        arr = z[key]
        if _crc(arr) != int(crcs[key]):
            raise CheckpointError(f"variable {spec.name!r}: array {key} fails its CRC check")
        return arr

    dtype = codec.numpy_dtype(spec.dtype)
    shape = tuple(int(d) for d in spec.shape)
    rows = None
    if spec.HasField("dynamic"):  # saved compact: its live rows
        rows = {str(part): load(key) for part, key in entry["dynamic"].items()}
        if "ids" not in rows:
            raise CheckpointError(f"variable {spec.name!r}: a dynamic table piece without its ids")
        shape = (rows["ids"].size, int(spec.dynamic.dim))
    value = load(entry["value"])
    if value.dtype != dtype or value.shape != shape:
        raise CheckpointError(
            f"variable {spec.name!r}: stored as {value.dtype}{list(value.shape)}, "
            f"spec says {dtype}{list(shape)}"
        )
    slots = {str(name): load(key) for name, key in entry["slots"].items()}
    try:  # most slots have the variable's shape; some (Nadam's u_product, Adafactor's r and c) do not
        expected = optimizers.from_spec(spec.optimizer).slot_shapes(shape)
    except ValueError:
        expected = {}
    for name, arr in slots.items():
        want = expected.get(name, shape)
        if arr.shape != want:
            raise CheckpointError(f"variable {spec.name!r}: slot {name!r} has shape {arr.shape}, not {want}")
    iterations = entry.get("iterations")  # absent in files from before optimizer replacement
    return StoredTensor(
        spec=spec,
        value=value,
        version=int(entry["version"]),
        slots=slots,
        iterations=None if iterations is None else int(iterations),
        rows=rows,
    )


# -- resharding -------------------------------------------------------------------


def _variable_of(spec: ps_pb2.VariableSpec) -> str:
    if spec.HasField("table"):
        return spec.table.table
    if spec.HasField("dynamic"):
        return spec.dynamic.table
    return spec.partition.variable if spec.HasField("partition") else spec.name


def _reshard_table(name: str, old: list[StoredTensor], shard: int, num_shards: int) -> StoredTensor:
    """Shard ``shard``'s rows of table ``name`` under ``num_shards``, re-cut from every old piece.

    Rows keep their values and their slots of the row's shape (row ``i`` moves
    from shard ``i % n`` to ``i % num_shards``); scalar slots are taken from
    the first piece; versions and step counts are the largest of the pieces'.

    Raises:
        CheckpointError: pieces missing, or disagreeing about the table.
    """
    first = old[0].spec.table
    num_rows, dim, count = first.num_rows, first.dim, first.count
    dtype = codec.numpy_dtype(old[0].spec.dtype)
    indices = sorted(t.spec.table.index for t in old)
    if indices != list(range(count)) or any(
        (t.spec.table.num_rows, t.spec.table.dim, t.spec.table.count) != (num_rows, dim, count) for t in old
    ):
        raise CheckpointError(
            f"table {name!r}: the checkpoint holds pieces {indices} of {count}, or they disagree"
        )
    value = np.empty((num_rows, dim), dtype=dtype)
    row_slots = [k for k, a in old[0].slots.items() if a.shape == old[0].value.shape]
    slots = {k: np.empty((num_rows, dim), dtype=old[0].slots[k].dtype) for k in row_slots}
    for t in old:
        i = t.spec.table.index
        value[i::count] = t.value
        for k in row_slots:
            slots[k][i::count] = t.slots[k]
    rows = table_rows(num_rows, shard, num_shards)
    spec = ps_pb2.VariableSpec(
        name=table_piece_name(name, shard),
        dtype=old[0].spec.dtype,
        shape=[rows, dim],
        optimizer=old[0].spec.optimizer,
    )
    spec.table.CopyFrom(first)  # its initializer too
    spec.table.index, spec.table.count, spec.table.rows = shard, num_shards, rows
    return StoredTensor(
        spec=spec,
        value=np.ascontiguousarray(value[shard::num_shards]),
        version=max(t.version for t in old),
        iterations=max(t.step for t in old),
        slots={
            **{k: np.ascontiguousarray(a[shard::num_shards]) for k, a in slots.items()},
            **{k: a.copy() for k, a in old[0].slots.items() if k not in slots},
        },
    )


def _reshard_dynamic(name: str, old: list[StoredTensor], shard: int, num_shards: int) -> StoredTensor:
    """Shard ``shard``'s piece of dynamic table ``name`` under ``num_shards``, from every old piece.

    Its rows are those of every old piece whose id the new shard rule gives it
    (``dynamic_row_shard``), with their slots and bookkeeping; more rows than
    its capacity are left for the load to evict. The push count and last sweep
    are the largest of the pieces', the sketches summed (``CountMinSketch.merged``).

    Raises:
        CheckpointError: pieces missing, or disagreeing about the table.
    """
    first = old[0].spec.dynamic
    count = first.count
    indices = sorted(t.spec.dynamic.index for t in old)

    def settings(t: StoredTensor) -> ps_pb2.DynamicTable:
        d = ps_pb2.DynamicTable()
        d.CopyFrom(t.spec.dynamic)
        d.index = 0
        return d

    if indices != list(range(count)) or any(settings(t) != settings(old[0]) for t in old):
        raise CheckpointError(
            f"dynamic table {name!r}: the checkpoint holds pieces {indices} of {count}, or they disagree"
        )
    rows = [t.rows or {} for t in old]
    ids = np.concatenate([r["ids"] for r in rows])
    mine = np.flatnonzero(dynamic_row_shard(ids, num_shards) == shard)
    mine = mine[np.argsort(ids[mine], kind="stable")]
    spec = ps_pb2.VariableSpec()
    spec.CopyFrom(old[0].spec)
    spec.name = table_piece_name(name, shard)
    spec.dynamic.index, spec.dynamic.count = shard, num_shards
    dim = int(first.dim)
    row_slots = [k for k, a in old[0].slots.items() if a.ndim == 2 and a.shape[1] == dim]
    meta = {
        part: np.concatenate([r[part] for r in rows])[mine]
        for part in ("ids", "last_step", "hits", "last_time")
    }
    meta["clock"] = np.array(max(int(r["clock"]) for r in rows), np.int64)
    meta["last_sweep"] = np.max(np.stack([np.asarray(r["last_sweep"], np.float64) for r in rows]), axis=0)
    if all("sketch" in r for r in rows):
        try:
            width = dynamic.Config.of(spec).sketch_width
        except ValueError as err:
            raise CheckpointError(f"dynamic table {name!r}: {err}") from None
        sketch = dynamic.CountMinSketch(width)
        parts = []
        for r in rows:
            part = dynamic.CountMinSketch(r["sketch"].shape[1])
            part.table = np.asarray(r["sketch"], np.uint16)
            part.added = int(r.get("sketch_added", 0))
            parts.append(part)
        sketch.merged(parts)
        meta["sketch"], meta["sketch_added"] = sketch.table, np.array(sketch.added, np.int64)
    return StoredTensor(
        spec=spec,
        value=np.concatenate([t.value for t in old])[mine],
        version=max(t.version for t in old),
        iterations=max(t.step for t in old),
        slots={
            **{k: np.concatenate([t.slots[k] for t in old])[mine] for k in row_slots},
            **{k: a.copy() for k, a in old[0].slots.items() if k not in row_slots},
        },
        rows=meta,
    )


def reshard(snapshots: list[Snapshot], shard: int, num_shards: int) -> Snapshot:
    """The part of a whole model (every old shard's snapshot) that shard ``shard`` of ``num_shards`` owns.

    Placement is ``pscore.placement.plan`` over all variables with the default
    partition size; partitions are re-cut from the reassembled full arrays.

    Raises:
        CheckpointError: the snapshots disagree (a variable with two specs, missing pieces).
    """
    groups: dict[str, list[StoredTensor]] = {}
    table_groups: dict[str, list[StoredTensor]] = {}
    dynamic_groups: dict[str, list[StoredTensor]] = {}
    for snap in snapshots:
        for t in snap.tensors:
            if t.spec.HasField("dynamic"):
                into = dynamic_groups
            else:
                into = table_groups if t.spec.HasField("table") else groups
            into.setdefault(_variable_of(t.spec), []).append(t)
    shapes = {}
    for name, pieces in groups.items():
        first = pieces[0].spec
        full = tuple(first.partition.full_shape) if first.HasField("partition") else tuple(first.shape)
        covered = sum(p.value.size for p in pieces)
        if covered != math.prod(full):
            raise CheckpointError(
                f"variable {name!r}: the checkpoint holds {covered} of its {math.prod(full)} elements"
            )
        shapes[name] = (full, codec.numpy_dtype(first.dtype))
    placement = plan(shapes, num_shards, DEFAULT_PARTITION_BYTES)
    tensors = [_reshard_table(name, old, shard, num_shards) for name, old in sorted(table_groups.items())]
    tensors += [
        _reshard_dynamic(name, old, shard, num_shards) for name, old in sorted(dynamic_groups.items())
    ]
    for name, new_pieces in sorted(placement.items()):
        mine = [p for p in new_pieces if p.shard == shard]
        if not mine:
            continue
        old = sorted(
            groups[name], key=lambda t: t.spec.partition.offset if t.spec.HasField("partition") else 0
        )
        full_shape, dtype = shapes[name]
        slot_names = sorted(old[0].slots)
        value = (
            np.concatenate([t.value.reshape(-1) for t in old]) if len(old) > 1 else old[0].value.reshape(-1)
        )
        # Slots of the value's shape are cut like the value; a scalar slot (Nadam's
        # u_product) is the same in every piece; other shapes (Adafactor's factored
        # moments) belong to a whole variable and are only carried over whole.
        slots = {}
        shaped = {}
        for s in slot_names:
            if all(t.slots[s].size == t.value.size for t in old):
                slots[s] = (
                    np.concatenate([t.slots[s].reshape(-1) for t in old])
                    if len(old) > 1
                    else old[0].slots[s].reshape(-1)
                )
            elif len(old) == 1 and (old[0].slots[s].ndim == 0 or len(mine) == len(new_pieces) == 1):
                shaped[s] = old[0].slots[s]
            else:
                raise CheckpointError(
                    f"variable {name!r}: slot {s!r} of shape {list(old[0].slots[s].shape)} cannot be cut "
                    f"into partitions for {num_shards} shards"
                )
        version = max(t.version for t in old)
        iterations = max(t.step for t in old)
        for piece in mine:
            spec = ps_pb2.VariableSpec(
                name=piece.stored_name, dtype=old[0].spec.dtype, shape=piece.stored_shape
            )
            spec.optimizer.CopyFrom(old[0].spec.optimizer)
            if piece.partitioned:
                spec.partition.CopyFrom(
                    ps_pb2.Partition(
                        variable=name,
                        full_shape=full_shape,
                        index=piece.index,
                        count=piece.count,
                        offset=piece.offset,
                    )
                )
            sl = slice(piece.offset, piece.offset + piece.size)
            tensors.append(
                StoredTensor(
                    spec=spec,
                    value=value[sl].reshape(piece.stored_shape).astype(dtype, copy=True),
                    version=version,
                    iterations=iterations,
                    slots={
                        **{s: a[sl].reshape(piece.stored_shape).copy() for s, a in slots.items()},
                        **{s: a.copy() for s, a in shaped.items()},
                    },
                )
            )
    by_index = {s.shard: s for s in snapshots}
    source = by_index.get(shard, snapshots[0])
    return Snapshot(
        shard=shard,
        num_shards=num_shards,
        mode=source.mode,
        tensors=tensors,
        dedup=_merge_dedup([source, *(s for s in snapshots if s is not source)]),
        mode_state=source.mode_state,
    )


def _merge_dedup(snapshots: list[Snapshot]) -> dict[str, SessionState]:
    """The union of dedup tables (windows of one session merged); ``snapshots[0]`` orders the sessions.

    A worker id's sessions keep the order of their first appearance, the first
    snapshot's first, so its current session stays the current one.
    """
    merged: dict[str, dict[int, tuple[int, set[int]]]] = {}
    for snap in reversed(snapshots):  # the first snapshot last: its order wins
        for worker, entries in snap.dedup.items():
            sessions = merged.setdefault(worker, {})
            for session, floor, seen in entries:
                f0, s0 = sessions.pop(session, (-1, set()))
                sessions[session] = (max(f0, floor), s0 | set(seen))
    return {
        w: [(session, f, sorted(s for s in seen if s > f)) for session, (f, seen) in sessions.items()]
        for w, sessions in merged.items()
    }


def _read_dedup(manifest: Mapping[str, Any]) -> dict[str, SessionState]:
    if "dedup_sessions" in manifest:
        return {
            str(w): [(int(session), int(fl), [int(s) for s in seen]) for session, fl, seen in entries]
            for w, entries in manifest["dedup_sessions"].items()
        }
    # Written before client sessions existed: one window per worker id, as session 0.
    return {str(w): [(0, int(fl), [int(s) for s in seen])] for w, (fl, seen) in manifest["dedup"].items()}


# -- the shard's checkpointer -----------------------------------------------------


async def take_snapshot(
    store: Store,
    mode: Mode,
    shard: int,
    num_shards: int,
    *,
    while_quiesced: Callable[[], None] | None = None,
) -> Snapshot:
    """A consistent snapshot of a shard: no update runs while values, slots and the dedup table are read.

    ``while_quiesced`` runs at the snapshot's instant, with updates held back
    (replication attaches its backup there, so it gets every later update).

    Raises:
        TimeoutError: updates in progress did not finish (``UpdateGate.quiesced``).
    """
    async with store.gate.quiesced() as held:
        variables = [v for v in store.variables() if v.dyn is None]
        dynamic_vars = [v for v in store.variables() if v.dyn is not None]
        states = [(v.spec, *v.state, v.iterations) for v in variables]
        exclude = set(held) | set(mode.pending_claims())
        dedup = {
            worker: [
                (session, floor, [s for s in seen if (worker, session, s) not in exclude])
                for session, floor, seen in entries
            ]
            for worker, entries in store.ledger.dedup_state().items()
        }
        mode_state = mode.state_dict()
        if while_quiesced is not None:
            while_quiesced()
        # Slots (and table values) change in place under apply, which cannot run now: copy them
        # off the event loop.
        slots = await asyncio.to_thread(_copy_slots, variables)
        tables_now = await asyncio.to_thread(_copy_in_place_values, states)
        states = [
            (spec, tables_now.get(i, value), version, it)
            for i, (spec, value, version, it) in enumerate(states)
        ]
        exported = await asyncio.to_thread(_export_dynamic, dynamic_vars)
    return Snapshot(
        shard=shard,
        num_shards=num_shards,
        mode=mode.name,
        tensors=[
            StoredTensor(spec=spec, value=value, version=version, slots=s, iterations=iterations)
            for (spec, value, version, iterations), s in zip(states, slots, strict=True)
        ]
        + exported,
        dedup=dedup,
        mode_state=mode_state,
        created_unix=time.time(),
    )


def _copy_in_place_values(states: list[tuple[Any, np.ndarray, int, int]]) -> dict[int, np.ndarray]:
    """Copies of the values updated in place (writable: embedding table pieces), by position."""
    return {i: value.copy() for i, (_, value, _, _) in enumerate(states) if value.flags.writeable}


def _export_dynamic(variables: list[Variable]) -> list[StoredTensor]:
    """Compact copies of dynamic table pieces (``DynamicRows.export``)."""
    out = []
    for v in variables:
        assert v.dyn is not None
        value, slots, meta = v.dyn.export(v)
        out.append(StoredTensor(v.spec, value, v.version, slots, iterations=v.iterations, rows=meta))
    return out


def _copy_slots(variables: list[Variable]) -> list[dict[str, np.ndarray]]:
    return [{k: a.copy() for k, a in v.slots.items()} for v in variables]


class Checkpointer:
    """Saves and restores one shard's state in a checkpoint directory.

    Args:
        directory: the checkpoint directory (shared by the shards of a cluster).
        store: the shard's variables.
        mode: the shard's mode (its state is saved too).
        shard: this shard's index.
        num_shards: the shard count.
        keep: how many of this shard's files to keep.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        store: Store,
        mode: Mode,
        *,
        shard: int,
        num_shards: int,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        self.directory = Path(directory)
        self.store = store
        self.mode = mode
        self.shard = shard
        self.num_shards = num_shards
        self.keep = max(1, keep)
        self._lock = asyncio.Lock()
        self._saved_at: tuple[int, int] | None = None  # (store.changes, variables) at the last save
        self._pending_marker: tuple[int, int] | None = None
        self.on_saved: Callable[[float], None] | None = None  # called with time.time() after each save
        self._next_id = 1 + max((f.id for f in list_files(self.directory)), default=0)
        self.saves = 0

    # -- save -------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        """Takes a consistent snapshot: no update runs while values, slots and dedup table are read."""

        def mark() -> None:
            self._pending_marker = (self.store.changes, len(self.store))

        return await take_snapshot(self.store, self.mode, self.shard, self.num_shards, while_quiesced=mark)

    @property
    def dirty(self) -> bool:
        """True when variables were created, updated, assigned or given an optimizer since the last save."""
        return self._saved_at != (self.store.changes, len(self.store))

    @property
    def next_id(self) -> int:
        """The id the next checkpoint of this shard gets (a consistent cut may pick a larger one)."""
        return self._next_id

    async def save(self) -> SaveResult:
        """Writes a checkpoint now; returns once it is durable. Saves run one at a time.

        Raises:
            CheckpointError: the file could not be written.
            TimeoutError: updates in progress did not finish (``UpdateGate.quiesced``).
        """
        async with self._lock:
            started = time.monotonic()
            snap = await self.snapshot()
            return await self._write(snap, self._next_id, started)

    async def write_snapshot(self, snap: Snapshot, ckpt_id: int, started: float | None = None) -> SaveResult:
        """Writes a snapshot taken earlier (``snapshot``) as checkpoint ``ckpt_id``; returns once durable.

        A consistent cut writes the same id on every shard; later saves of this
        shard get larger ids. ``started`` (``time.monotonic()``) counts in the
        reported seconds.

        Raises:
            CheckpointError: the file could not be written.
        """
        async with self._lock:
            return await self._write(snap, ckpt_id, time.monotonic() if started is None else started)

    async def _write(self, snap: Snapshot, ckpt_id: int, started: float) -> SaveResult:
        self._next_id = max(self._next_id, ckpt_id + 1)
        path = await asyncio.to_thread(write, snap, self.directory, ckpt_id)
        self._saved_at = self._pending_marker
        self.saves += 1
        if self.on_saved is not None:
            self.on_saved(time.time())
        await asyncio.to_thread(self.prune)
        result = SaveResult(path, ckpt_id, len(snap.tensors), snap.nbytes, time.monotonic() - started)
        log.info(
            "shard %d: checkpoint %d written: %s (%d tensors, %.1f MiB, %.2fs)%s",
            self.shard, ckpt_id, path.name, result.num_variables, result.nbytes / 2**20, result.seconds,
            f" (cut {snap.cut})" if snap.cut else "",
        )  # fmt: skip
        return result

    def prune(self) -> None:
        """Deletes this shard's files beyond the newest ``keep``."""
        mine = [
            f for f in list_files(self.directory) if (f.shard, f.num_shards) == (self.shard, self.num_shards)
        ]
        for f in mine[self.keep :]:
            with contextlib.suppress(OSError):
                f.path.unlink()

    async def run_periodic(self, every_s: float) -> None:
        """Saves every ``every_s`` seconds while something changed; runs until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            if not self.dirty:
                continue
            try:
                await self.save()
            except (CheckpointError, TimeoutError) as err:
                log.error("shard %d: periodic checkpoint failed: %s", self.shard, err)

    # -- restore ----------------------------------------------------------------

    def _remove_stale_temps(self) -> None:
        prefix = f"{_TMP_PREFIX}shard{self.shard:05d}-"
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                if name.startswith(prefix):
                    log.info("shard %d: removing %s (a save that was interrupted)", self.shard, name)
                    with contextlib.suppress(OSError):
                        os.unlink(self.directory / name)

    def choose(self) -> Snapshot | None:
        """Reads the snapshot this shard should start from (None: start empty).

        Raises:
            CheckpointError: this shard has checkpoint files but none is valid,
                or a different-count set has no valid file for some shard.
        """
        files = list_files(self.directory)
        own = [f for f in files if (f.shard, f.num_shards) == (self.shard, self.num_shards)]
        others: dict[int, dict[int, list[CheckpointFile]]] = {}
        for f in files:
            if f.num_shards != self.num_shards:
                others.setdefault(f.num_shards, {}).setdefault(f.shard, []).append(f)
        # The newest complete set written by another shard count, by creation time.
        best_other: tuple[float, int] | None = None
        for n, by_shard in others.items():
            if len(by_shard) != n:
                continue
            created = max(_created(fs[0]) for fs in by_shard.values())
            if best_other is None or created > best_other[0]:
                best_other = (created, n)
        own_created = _created(own[0]) if own else None
        if own and (best_other is None or own_created >= best_other[0]):
            return _first_valid(
                self._complete_cut_first(own, files), f"shard {self.shard} of {self.num_shards}"
            )
        if best_other is not None:
            n = best_other[1]
            snaps = [_first_valid(others[n][i], f"shard {i} of {n}") for i in range(n)]
            log.info(
                "shard %d: re-placing the %d-shard checkpoint (ids %s) onto %d shards",
                self.shard, n, [s.id for s in snaps], self.num_shards,
            )  # fmt: skip
            return reshard(snaps, self.shard, self.num_shards)
        return None

    def _complete_cut_first(
        self, own: list[CheckpointFile], files: list[CheckpointFile]
    ) -> list[CheckpointFile]:
        """``own`` (newest first); the newest complete cut first when the newest file is part of a torn one.

        When this shard's newest file belongs to a cut of the whole cluster
        (``Snapshot.cut``) that another shard's files lack (the cluster stopped
        while the cut was written), and the directory holds every shard's files
        (a shared one), the newest cut that every shard holds is restored
        instead, so that a restart of every shard gives one version of the model.
        """
        newest = _manifest_or_none(own[0])
        if newest is None or not newest.get("cut"):
            return own
        complete = _complete_cuts(files, self.num_shards)
        if complete is None:
            return own  # not every shard's files are here (one directory per shard): nothing to compare
        if _cut_key(newest["cut"]) in complete:
            return own
        for i, f in enumerate(own):
            m = _manifest_or_none(f)
            if m is not None and m.get("cut") and _cut_key(m["cut"]) in complete:
                log.warning(
                    "shard %d: the newest checkpoint %s is part of a cut of the cluster that another shard "
                    "did not finish writing; restoring %s, the newest cut every shard holds",
                    self.shard, own[0].path.name, f.path.name,
                )  # fmt: skip
                return [f, *own[i + 1 :]]
        return own

    async def restore(self) -> bool:
        """Loads the newest valid checkpoint into the (empty) store and mode; False if there is none.

        Raises:
            CheckpointError: checkpoint files exist but none valid (see ``choose``),
                or the file disagrees with this shard's configuration.
        """
        self._remove_stale_temps()
        snap = await asyncio.to_thread(self.choose)
        if snap is None:
            log.info("shard %d: no checkpoint in %s; starting empty", self.shard, self.directory)
            return False
        load_into(snap, self.store, self.mode)
        self._saved_at = (self.store.changes, len(self.store))
        resharded = snap.id == 0  # re-placed from another shard count's files
        if snap.cut is not None and not resharded:
            await asyncio.to_thread(self._remove_abandoned_cuts, snap)
        log.info(
            "shard %d: restored %d tensors (%.1f MiB) from %s",
            self.shard, len(snap.tensors), snap.nbytes / 2**20,
            "a checkpoint of another shard count" if resharded else f"checkpoint {snap.id}",
        )  # fmt: skip
        if resharded:  # start this shard count's own files at once
            self._saved_at = None
            await self.save()
        return True

    def _remove_abandoned_cuts(self, restored: Snapshot) -> None:
        """Deletes this shard's files of cuts newer than ``restored`` (torn: another shard lacks them).

        Training goes on from the restored cut, so those files hold a timeline
        that no longer exists. Kept, one of them could later pair with another
        shard's file of the same sync step written on the new timeline, and a
        second restart would restore two versions of the model; they would also
        push the new timeline's checkpoints out of the newest ``keep``.
        """
        files = list_files(self.directory)
        complete = _complete_cuts(files, self.num_shards)
        if complete is None:
            return
        for f in files:
            if f.shard != self.shard or f.num_shards != self.num_shards or f.id <= restored.id:
                continue
            m = _manifest_or_none(f)
            if m is None or not m.get("cut") or _cut_key(m["cut"]) in complete:
                continue  # unreadable, not a cut, or a whole cut that failed to load: left for a person
            log.warning(
                "shard %d: removing checkpoint %s (a cut another shard did not finish writing; training goes "
                "on from checkpoint %d)",
                self.shard, f.path.name, restored.id,
            )  # fmt: skip
            with contextlib.suppress(FileNotFoundError):
                f.path.unlink()


def _manifest_or_none(f: CheckpointFile) -> dict[str, Any] | None:
    try:
        return read_manifest(f.path)
    except CheckpointError:
        return None


def _complete_cuts(files: list[CheckpointFile], num_shards: int) -> set[str] | None:
    """The cuts (``_cut_key``) that every one of ``num_shards`` shards holds a file of; None when some
    shard has no cut file here (one directory per shard: nothing to compare)."""
    by_shard: dict[int, set[str]] = {}
    for f in files:
        if f.num_shards == num_shards:
            m = _manifest_or_none(f)
            if m is not None and m.get("cut"):
                by_shard.setdefault(f.shard, set()).add(_cut_key(m["cut"]))
    if len(by_shard) != num_shards:
        return None
    return set.intersection(*by_shard.values())


def _cut_key(cut: Mapping[str, Any]) -> str:
    """What identifies one cut of the cluster in every shard's file (its id, or its sync step)."""
    return json.dumps({k: v for k, v in cut.items() if k in ("id", "step")}, sort_keys=True)


def _created(f: CheckpointFile) -> float:
    try:
        return float(read_manifest(f.path)["created_unix"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return float("-inf")


def _first_valid(files: list[CheckpointFile], what: str) -> Snapshot:
    errors = []
    for f in files:
        try:
            return read(f.path)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", f.path.name, err)
            errors.append(str(err))
    raise CheckpointError(f"no valid checkpoint for {what}: " + "; ".join(errors))


def load_into(snap: Snapshot, store: Store, mode: Mode, *, restored: bool = True) -> None:
    """Puts a snapshot's tensors, versions, slots, dedup table and mode state into an empty store.

    ``restored``: from a checkpoint (``Mode.load_state_dict``); False: a backup's catch-up snapshot.

    Raises:
        CheckpointError: a tensor the store rejects, or slots that do not match its optimizer.
    """
    if len(store):
        raise CheckpointError("restore needs an empty store")
    try:
        # A table piece with an initializer takes its rows from the checkpoint (as made), not anew.
        made = {t.spec.name: t.value for t in snap.tensors if tables.made_here(t.spec)}
        store.create(
            [t.spec for t in snap.tensors],
            {t.spec.name: t.value for t in snap.tensors if t.rows is None and t.spec.name not in made},
            made,
        )
    except Exception as err:
        raise CheckpointError(f"checkpoint {snap.id} does not load: {err}") from err
    for t in snap.tensors:
        var = store.get(t.spec.name)
        if set(var.slots) != set(t.slots):
            raise CheckpointError(
                f"variable {t.spec.name!r}: checkpoint has slots {sorted(t.slots)}, "
                f"its optimizer {var.optimizer.name} uses {sorted(var.slots)}"
            )
        if var.dyn is not None:
            try:
                var.dyn.load(var, var.optimizer, t.value, t.slots, t.rows or {})
            except (ValueError, KeyError, IndexError) as err:
                raise CheckpointError(f"dynamic table piece {t.spec.name!r} does not load: {err!r}") from err
            var.state = (var.state[0], t.version)
            var.iterations = t.step
            continue
        store.assign(t.spec.name, t.value, t.version)
        var.iterations = t.step
        for k, a in t.slots.items():
            if a.size != var.slots[k].size:
                raise CheckpointError(
                    f"variable {t.spec.name!r}: checkpoint slot {k!r} has shape {list(a.shape)}, "
                    f"its optimizer {var.optimizer.name} expects {list(var.slots[k].shape)}"
                )
        var.slots = {
            k: np.array(a, dtype=var.slots[k].dtype, copy=True).reshape(var.slots[k].shape)
            for k, a in t.slots.items()
        }
    store.ledger.load_dedup_state(snap.dedup)
    mode.load_state_dict(snap.mode_state, restored=restored)
