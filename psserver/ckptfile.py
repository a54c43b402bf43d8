"""The checkpoint file format of a shard, and the resharding of a set of files to another shard count.

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
(``psserver.rows.DynamicRows.export``): ``ids`` ``[n]``, ``last_step``,
``hits``, ``last_time``, ``clock``, ``last_sweep`` and, with admission, the
count-min ``sketch`` and ``sketch_added``.

Resharding (``reshard``): when the newest complete set of files was written by
a different shard count ``n`` (every shard ``0..n-1`` has a file), shard ``i``
of ``M`` re-places every variable of that set: it runs ``pscore.placement.plan``
over all variables with ``M`` shards and keeps the pieces placed on it, cut from the reassembled full values
and slots (versions: the largest of the variable's old pieces; dedup tables:
merged). An embedding table's rows are re-cut by the row rule with ``M``
(row ``i`` to shard ``i % M``), with their slots; a dynamic table's rows go
to ``dynamic_row_shard(id, M)`` (a shard given more rows than its new capacity
keeps those its eviction policy keeps longest), with their bookkeeping, and
its admission sketches are summed. Clients learn the new placement from
``ListVariables``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import mmap
import os
import re
import struct
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from google.protobuf import json_format

from pscore import codec
from pscore.errors import InternalError
from pscore.placement import DEFAULT_PARTITION_BYTES, dynamic_row_shard, plan, table_piece_name, table_rows
from psproto.v1 import ps_pb2
from psserver import optimizers
from psserver.ledger import SessionState
from psserver.rows import Config
from psserver.sketch import CountMinSketch
from psserver.tier import CHUNK_ROWS

log = logging.getLogger(__name__)

FORMAT = "psserver-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{10})-shard(\d{5})-of-(\d{5})\.npz$")
TMP_PREFIX = ".ckpt-tmp-"


class CheckpointError(InternalError):
    """A checkpoint could not be written, or no valid one could be read; the message says which file.

    A ``PSError`` (INTERNAL), as the shard answers a save that failed with it."""


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
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}shard{snapshot.shard:05d}-", dir=directory)
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
            return load(f, str(path), mapped=True)
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: {err!r}") from err


def load(f: BinaryIO, label: str, *, mapped: bool = False) -> Snapshot:
    """Reads and validates a checkpoint from the binary file ``f``; ``label`` names it in errors.

    ``mapped`` (``f`` is a file on disk): the arrays of dynamic table pieces
    are read-only memory maps of the file (read as used, through the page
    cache), not copies in memory: a table larger than memory restores.

    Raises:
        CheckpointError: the data is truncated or inconsistent.
    """
    path = label
    try:
        maps = {}
        if mapped:
            start = f.tell()
            maps = _mapped_arrays(f)
            f.seek(start)
        with np.load(f, allow_pickle=False) as z:
            manifest = _parse_manifest(z, path)
            tensors = [_read_tensor(z, entry, maps) for entry in manifest["variables"]]
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


def _mapped_arrays(f: BinaryIO) -> dict[str, np.ndarray]:
    """Read-only memory maps of the ``.npy`` members ``np.savez`` stored uncompressed in the file ``f``.

    A member whose header this cannot read (another ``.npy`` version, Fortran
    order, objects) is left out: it is read the usual way.
    """
    with zipfile.ZipFile(f) as zf:
        infos = [i for i in zf.infolist() if i.compress_type == zipfile.ZIP_STORED]
    infos = [i for i in infos if i.filename.endswith(".npy")]
    if not infos:
        return {}
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    out = {}
    for info in infos:
        local = buf[info.header_offset : info.header_offset + 30]
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            continue
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            continue
        if fortran or dtype.hasobject:
            continue
        count = math.prod(shape)
        if f.tell() + count * dtype.itemsize > len(buf):
            continue  # truncated: the usual read reports it
        out[info.filename.removesuffix(".npy")] = np.frombuffer(buf, dtype, count, f.tell()).reshape(shape)
    return out


def _read_tensor(z: Any, entry: Mapping[str, Any], maps: Mapping[str, np.ndarray]) -> StoredTensor:
    spec = json_format.ParseDict(entry["spec"], ps_pb2.VariableSpec())
    crcs = entry["crc32"]
    # A dynamic table piece is copied into the table when loaded: its arrays may be memory maps. Other
    # values become the variables' own arrays (some updated in place): read into memory.
    mapped = maps if spec.HasField("dynamic") else {}

    def load(key: str) -> np.ndarray:
        arr = mapped[key] if key in mapped else z[key]
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


Alloc = Callable[[tuple[int, ...], np.dtype], np.ndarray]
"""Makes an array for resharded rows (``np.empty``, or a scratch file's: ``psserver.tier.scratch_array``)."""


def _gather(parts: list[np.ndarray], picks: np.ndarray, alloc: Alloc) -> np.ndarray:
    """``np.concatenate(parts)[picks]`` in an ``alloc`` array, a chunk at a time, never concatenating."""
    ends = np.cumsum([len(a) for a in parts])
    out = alloc((picks.size, *parts[0].shape[1:]), parts[0].dtype)
    for start in range(0, picks.size, CHUNK_ROWS):
        sel = picks[start : start + CHUNK_ROWS]
        which = np.searchsorted(ends, sel, side="right")
        chunk = out[start : start + sel.size]
        for i in np.unique(which):
            hit = which == i
            chunk[hit] = parts[i][sel[hit] - (ends[i] - len(parts[i]))]
    return out


def _reshard_dynamic(
    name: str, old: list[StoredTensor], shard: int, num_shards: int, alloc: Alloc = np.empty
) -> StoredTensor:
    """Shard ``shard``'s piece of dynamic table ``name`` under ``num_shards``, from every old piece.

    Its rows are those of every old piece whose id the new shard rule gives it
    (``dynamic_row_shard``), with their slots and bookkeeping; more rows than
    its capacity are left for the load to evict. The push count and last sweep
    are the largest of the pieces', the sketches summed (``CountMinSketch.merged``).
    The old pieces' arrays are read a chunk at a time (they may be memory maps
    of the files) into ``alloc``'s arrays: in memory this holds only the new
    piece's positions (8 bytes a row).

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
    picked, offset = [], 0
    for r in rows:
        for start in range(0, r["ids"].size, CHUNK_ROWS):
            ids = np.asarray(r["ids"][start : start + CHUNK_ROWS], np.int64)
            picked.append(offset + start + np.flatnonzero(dynamic_row_shard(ids, num_shards) == shard))
        offset += r["ids"].size
    mine = np.concatenate(picked) if picked else np.zeros(0, np.int64)
    mine = mine[np.argsort(_gather([r["ids"] for r in rows], mine, np.empty), kind="stable")]
    spec = ps_pb2.VariableSpec()
    spec.CopyFrom(old[0].spec)
    spec.name = table_piece_name(name, shard)
    spec.dynamic.index, spec.dynamic.count = shard, num_shards
    dim = int(first.dim)
    row_slots = [k for k, a in old[0].slots.items() if a.ndim == 2 and a.shape[1] == dim]
    per_row = ("ids", "last_step", "hits", "last_time")
    meta = {part: _gather([r[part] for r in rows], mine, alloc) for part in per_row}
    meta["clock"] = np.array(max(int(r["clock"]) for r in rows), np.int64)
    meta["last_sweep"] = np.max(np.stack([np.asarray(r["last_sweep"], np.float64) for r in rows]), axis=0)
    if all("sketch" in r for r in rows):
        try:
            width = Config.of(spec).sketch_width
        except ValueError as err:
            raise CheckpointError(f"dynamic table {name!r}: {err}") from None
        sketch = CountMinSketch(width)
        parts = []
        for r in rows:
            part = CountMinSketch(r["sketch"].shape[1])
            part.table = np.asarray(r["sketch"], np.uint16)
            part.added = int(r.get("sketch_added", 0))
            parts.append(part)
        sketch.merged(parts)
        meta["sketch"], meta["sketch_added"] = sketch.table, np.array(sketch.added, np.int64)
    return StoredTensor(
        spec=spec,
        value=_gather([t.value for t in old], mine, alloc),
        version=max(t.version for t in old),
        iterations=max(t.step for t in old),
        slots={
            **{k: _gather([t.slots[k] for t in old], mine, alloc) for k in row_slots},
            **{k: a.copy() for k, a in old[0].slots.items() if k not in row_slots},
        },
        rows=meta,
    )


def reshard(snapshots: list[Snapshot], shard: int, num_shards: int, alloc: Alloc = np.empty) -> Snapshot:
    """The part of a whole model (every old shard's snapshot) that shard ``shard`` of ``num_shards`` owns.

    Placement is ``pscore.placement.plan`` over all variables with the default
    partition size; partitions are re-cut from the reassembled full arrays.
    A dynamic table's rows go into ``alloc``'s arrays (``_reshard_dynamic``).

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
    whole = set()  # kept whole as their creator placed them: an optimizer that needs all of the variable
    for name, pieces in groups.items():
        first = pieces[0].spec
        if len(pieces) == 1 and optimizers.from_spec(first.optimizer).needs_whole_variable:
            whole.add(name)
        full = tuple(first.partition.full_shape) if first.HasField("partition") else tuple(first.shape)
        covered = sum(p.value.size for p in pieces)
        if covered != math.prod(full):
            raise CheckpointError(
                f"variable {name!r}: the checkpoint holds {covered} of its {math.prod(full)} elements"
            )
        shapes[name] = (full, codec.numpy_dtype(first.dtype))
    placement = plan(shapes, num_shards, DEFAULT_PARTITION_BYTES, whole)
    tensors = [_reshard_table(name, old, shard, num_shards) for name, old in sorted(table_groups.items())]
    tensors += [
        _reshard_dynamic(name, old, shard, num_shards, alloc) for name, old in sorted(dynamic_groups.items())
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
