"""Table export for serving: every row of an embedding table into ``.npy`` files (``psctl export``).

``export_table`` reads the table batch by batch (``PSClient.export``) and
appends each batch to ``ids.npy`` (int64 ``[n]``) and ``rows.npy`` (the
table's dtype, ``[n, dim]``) in the output folder, with ``table.json``
describing them, so memory stays O(batch) whatever the table's size. The
``.npy`` files are numpy's own format, written with the length left open:
numpy's header keeps room for the first axis to grow
(``numpy.lib.format.GROWTH_AXIS_MAX_DIGITS``), and it is rewritten in place
with the final length at the end. The files appear under their names only
when complete (written as ``*.part``, then renamed).

>>> ids = np.load("out/ids.npy"); rows = np.load("out/rows.npy", mmap_mode="r")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from numpy.lib import format as npy_format

from psclient._sync_client import PSClient
from pscore import codec
from pscore.errors import InvalidArgumentError, NotFoundError
from psproto.v1 import ps_pb2


@dataclass(frozen=True, slots=True)
class Progress:
    """Where an export stands (passed to ``export_table``'s ``progress``)."""

    table: str
    rows: int  # rows written so far
    expected: int  # rows the table held when the export started (a dynamic table's may change)
    bytes: int  # bytes of ids and rows written so far
    seconds: float


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What ``export_table`` wrote (also saved as ``table.json``)."""

    table: str
    kind: str  # "fixed" or "dynamic"
    key_type: str  # "int64" or "string" (ids are the keys' hashes: pscore.embedding.hash_keys)
    dim: int
    dtype: str
    rows: int
    num_rows: int | None  # a fixed table's size; None for a dynamic one
    ids_file: str
    rows_file: str
    bytes: int
    seconds: float


class _NpyAppender:
    """A ``.npy`` file written batch by batch along its first axis (see the module docs)."""

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.dtype, self.row_shape, self.length = np.dtype(dtype), row_shape, 0
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close)
        self._header()
        self.data_start = self.file.tell()

    def _header(self) -> None:
        header = {
            "descr": npy_format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (self.length, *self.row_shape),
        }
        npy_format.write_array_header_1_0(self.file, header)

    def append(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        if arr.shape[1:] != self.row_shape:
            raise ValueError(f"a batch of shape {arr.shape} does not fit rows of shape {self.row_shape}")
        self.file.write(memoryview(arr).cast("B"))
        self.length += arr.shape[0]

    def close(self) -> None:
        """Writes the final length into the header (same size: numpy leaves room for it)."""
        self.file.seek(0)
        self._header()
        if self.file.tell() != self.data_start:
            raise RuntimeError("the .npy header changed size; the file is not valid")
        self.file.close()


def export_table(
    client: PSClient,
    name: str,
    out_dir: str | os.PathLike[str],
    *,
    batch_rows: int | None = None,
    progress: Callable[[Progress], Any] | None = None,
) -> ExportSummary:
    """Writes every row of table ``name`` into ``out_dir`` (``ids.npy``, ``rows.npy``, ``table.json``).

    Args:
        client: a client of the cluster.
        name: the table (fixed or dynamic).
        out_dir: the folder (created if missing); existing files of these names are replaced.
        batch_rows: rows per batch read (default: ``PSClient.export``'s).
        progress: called after every batch with a ``Progress``.

    Returns:
        The summary (as ``table.json`` holds it).

    Raises:
        NotFoundError: no such table.
        InvalidArgumentError: ``name`` is not a table.
        PSError: a shard failed (nothing is left under the final file names).
        OSError: the folder cannot be written.
    """
    infos = client.list_variables([name]).get(name)
    if not infos:
        raise NotFoundError(f"export: no table {name!r} on the shards")
    spec = infos[0].spec
    if not (spec.HasField("table") or spec.HasField("dynamic")):
        raise InvalidArgumentError(f"export: {name!r} is not an embedding table")
    dynamic = spec.HasField("dynamic")
    dim = int(spec.dynamic.dim if dynamic else spec.table.dim)
    dtype = codec.numpy_dtype(spec.dtype)
    expected = sum(int(i.dynamic.rows) for i in infos) if dynamic else int(spec.table.num_rows)
    key_type = "string" if dynamic and spec.dynamic.key_type == ps_pb2.KEY_TYPE_STRING else "int64"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"ids": out / "ids.npy", "rows": out / "rows.npy"}
    parts = {k: p.with_name(p.name + ".part") for k, p in paths.items()}
    started = time.monotonic()
    ids_file = _NpyAppender(parts["ids"], np.dtype(np.int64), ())
    rows_file = _NpyAppender(parts["rows"], dtype, (dim,))
    written = nbytes = 0
    try:
        for ids, rows in client.export(name, batch_rows=batch_rows):
            ids_file.append(ids)
            rows_file.append(rows)
            written += ids.size
            nbytes += ids.nbytes + rows.nbytes
            if progress is not None:
                progress(Progress(name, written, expected, nbytes, time.monotonic() - started))
        ids_file.close()
        rows_file.close()
    except BaseException:
        for f in (ids_file, rows_file):
            f.file.close()
        for p in parts.values():
            p.unlink(missing_ok=True)
        raise
    for k in paths:
        os.replace(parts[k], paths[k])
    summary = ExportSummary(
        table=name,
        kind="dynamic" if dynamic else "fixed",
        key_type=key_type,
        dim=dim,
        dtype=dtype.name,
        rows=written,
        num_rows=None if dynamic else int(spec.table.num_rows),
        ids_file=paths["ids"].name,
        rows_file=paths["rows"].name,
        bytes=nbytes,
        seconds=round(time.monotonic() - started, 3),
    )
    (out / "table.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return summary
