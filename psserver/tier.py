"""The disk tier of a dynamic table piece: its cold rows in a local store, log-structured or LMDB.

A shard started with ``--table-memory BYTES`` keeps the hot rows (values,
optimizer slots, bookkeeping) of its dynamic table pieces in memory under that
budget, all pieces together (``TierBudget``: each piece claims a share as it
grows; ``psserver.rows``), and their cold rows on disk, one store per piece
under ``--table-dir`` (``TierConfig.open_piece``). ``--table-tier-store``
picks it: ``log`` (``psserver.logtier.LogTier``: fixed-length records appended
to segments, an index in memory, compaction in a thread) or ``lmdb``
(``DiskTier``, here: an LMDB environment, picked in issue 21 by measurement
against RocksDB, ``bench/results/kv_tier.md``: 5-9x faster batched random
reads, transactions all or nothing, no compaction threads). Both are a
``ColdTier``: the same reads, writes, instants and guarantees, and every test of
the tier runs on both (``tests/unit/test_tier.py``,
``tests/integration/test_disk_tier.py``); ``bench/results/tier_stores.md``
compares them. What follows is the LMDB store's; ``psserver.logtier`` says how
the log does the same.

A record is one row: its bookkeeping (``last_step``, ``hits``, ``last_time``),
its value and its row slots, as one numpy structured record; the key is the
id's 8 bytes, big-endian with the sign bit flipped, so LMDB's key order is
the ids' order (``scan``). Every write (a spill of rows, the deletion of
expired rows) is one transaction: it commits whole or not at all, and a
failed one (``TierFullError``: the disk or the tier's size limit is full)
leaves the tier as it was. A row filled back into memory keeps its record
here (an older copy the piece skips: ``DynamicRows.on_disk``) until it is
spilled again, over it, so a fill writes nothing.

The environment is opened with ``writemap`` (pages written in place in the
map: a commit copies nothing), whose data file is sparse and as large as the
map; every write transaction first has the disk allocate the blocks it can
reach (``posix_fallocate``), so a full disk is a ``TierFullError`` before the
transaction, never a SIGBUS while writing the map.

A piece whose table has a TTL keeps an expiry index beside its records: one
LMDB database per TTL kind (``ttl_steps``, ``ttl_seconds``) whose keys are a
record's ``last_step`` (or ``last_time``), order-preserving, then its id, written
in the same transaction as the record. A sweep raises the tier's cut
(``cut``): from then on every read skips the records last updated before it
(``get``, ``scan``, ``items``), and each push deletes a bounded batch of them
(``expired`` reads the index from its start up to the cut, ``limit`` entries
at most), so a sweep's cost is bounded however many rows expire at once, and
never depends on the tier's size. Until the batches have deleted them, expired
records still count in ``len`` (and in a table's row count).

The tier is a spill space, not a durable store: durability comes from
checkpoints (which read every cold row) and backups (which have their own
tier), so it is written without fsync and wiped when a piece is created.

A table past memory is also saved and restored past memory: a snapshot pins
the tier as it is (``reader``: one read transaction, LMDB's copy-on-write
keeps what it sees while later pushes spill), and its arrays, like those a
restore re-cuts, live in ``scratch_array`` files (the page cache's pages, not
the shard's memory); a restore writes its cold rows ``chunk`` at a time.

One writer at a time (a piece's updates hold its lock), in any thread: a push
writes in a worker thread (``DynamicRows.tier_step``) while the event loop
reads (``get``, ``scan``), each read in its own read transaction, as a
checkpoint snapshot's export reads in another thread. A read that a write
overlaps does not keep its records for the next (``remember``): they may be
what the write changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import math
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import lmdb
import numpy as np

from pscore.errors import InternalError, ResourceExhaustedError

_RESERVE_STEP = 64 << 20  # disk blocks allocated ahead of the tier's writes at least this much at a time
_REMEMBER_BYTES = 16 << 20  # the most record bytes a lookup leaves for the next push (``DiskTier.get``)
_REMEMBER_READS = 4  # the remembering reads whose records are kept (the newest), while they take that
CHUNK_ROWS = 1 << 16  # rows a restore's write or an export's read handles at once
DEFAULT_DISK_BYTES = 1 << 40  # a piece's LMDB map size (address space reserved, disk used as written)
_SIGN = np.uint64(1 << 63)
Cut = tuple[int | None, float | None]  # records last updated before push ``[0]`` or time ``[1]`` are expired
NO_CUT: Cut = (None, None)
_MAX_READERS = 4096  # read transactions open at once per piece (64 bytes of its lock file each)
ReadCost = tuple[float, int]  # a read's seconds, and 1 if it read the disk (not only remembered records)
# The records of the last remembering reads, newest first: each read's (sorted ids, their records, their
# ``places``).
Remembered = tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
_META = [("last_step", "<i8"), ("hits", "<i8"), ("last_time", "<f8")]
# The record fields an expiry index can order by (a table with ttl_steps, with ttl_seconds).
EXPIRY_KINDS = ("last_step", "last_time")
_ROWS_DB = b"rows"
STORES = ("log", "lmdb")  # ``--table-tier-store``: append-only segment files, or an LMDB environment
DEFAULT_STORE = "log"  # measured: bench/results/tier_stores.md
_MAP_NORESERVE = 0x4000  # Linux's mmap flag (the mmap module names it from Python 3.13 on)


class TierFullError(ResourceExhaustedError):
    """A dynamic table's disk tier cannot take a write: its disk is full, or it hit ``--table-disk-limit``.

    The push (or restore) that hit it was not applied: the table is unchanged.
    Retryable once space is freed; more shards or a larger limit make room.
    """


class TierDirError(ValueError):
    """The ``--table-dir`` cannot hold a disk tier (not creatable or not writable); the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class TierConfig:
    """A shard's disk tier settings (``--table-memory``, ``--table-dir``, ``--table-disk-limit``).

    Attributes:
        directory: where the pieces' LMDB environments live (one subdirectory each).
        memory_bytes: the in-memory budget of the shard's tiered pieces' hot rows, all together.
        disk_bytes: the most bytes one piece's environment may hold on disk.
        owner: names the process's own subdirectory (``shard0``, ``shard0-backup``): the shards and
            backups of one machine may share a directory.
        store: how a piece keeps its cold rows (``--table-tier-store``): ``log``, append-only segment
            files (``psserver.logtier``), or ``lmdb``, an LMDB environment (``DiskTier``).
    """

    directory: str
    memory_bytes: int
    disk_bytes: int = DEFAULT_DISK_BYTES
    owner: str = "shard"
    store: str = DEFAULT_STORE

    def __post_init__(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"--table-tier-store must be one of {', '.join(STORES)}, got {self.store!r}")
        if self.memory_bytes < 1 << 16:
            raise ValueError(f"--table-memory must be at least 64 KiB, got {self.memory_bytes} bytes")
        if self.disk_bytes < 1 << 20:
            raise ValueError(f"--table-disk-limit must be at least 1 MiB, got {self.disk_bytes} bytes")

    @property
    def root(self) -> Path:
        """The directory this process owns under ``directory`` (wiped at start-up)."""
        return Path(self.directory) / f"psserver-tier-{self.owner}"

    def open(self) -> int:
        """Claims the directory for this process at start-up; returns the lock's file descriptor.

        Creates it, takes an exclusive lock on this owner's part of it (two processes
        of one owner, e.g. two shard 0 primaries, cannot share it), removes what an
        earlier process left there (the tier is rebuilt from checkpoints, never
        reused) and writes a probe file. The lock is held until the process exits
        (or the file descriptor returned is closed).

        Raises:
            TierDirError: it cannot be created or written, or another process holds it (the
                message names the path and the reason).
        """
        path = Path(self.directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / f".psserver-tier-{self.owner}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise TierDirError(f"--table-dir {self.directory!r} cannot hold the disk tier: {err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise TierDirError(
                f"--table-dir {self.directory!r} is in use by another {self.owner} process (two "
                "processes of one shard and role cannot share it)"
            ) from None
        try:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir()
            probe = self.root / ".probe"
            with open(probe, "wb") as f:
                f.write(b"x" * 4096)
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as err:
            os.close(fd)
            raise TierDirError(f"--table-dir {self.directory!r} cannot hold the disk tier: {err}") from None
        return fd

    def scratch(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zeroed array in a file of this process's directory (``scratch_array``)."""
        return scratch_array(self.root, shape, dtype)

    def open_piece(self, name: str, record: np.dtype, table: str, expiry: Iterable[str] = ()) -> ColdTier:
        """A new, empty store for piece ``name``'s cold rows (``store``), in its own directory.

        Raises:
            TierDirError: it cannot be created there.
        """
        if self.store == "lmdb":
            return DiskTier(self.piece_dir(name), record, self.disk_bytes, table, expiry)
        from psserver.logtier import LogTier  # it builds on this module

        return LogTier(self.piece_dir(name), record, self.disk_bytes, table, expiry)

    def piece_dir(self, name: str) -> Path:
        """The directory of piece ``name``'s environment (a readable prefix and a hash: any name is safe)."""
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:48]
        return self.root / f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


class TierBudget:
    """A shard's in-memory budget for the hot rows of all its tiered pieces (``--table-memory``).

    A piece claims bytes as it grows (``claim``): first its floor at creation,
    then more whenever a push needs room, for as long as the budget has any
    left. Once it is spent, a piece under an equal share (``fair``) may still
    claim up to that share (``overdraw``), and the pieces over it give the
    difference back at once, spilling rows (``psserver.store``: the store's
    reclaim after the update); the others spill their own colder rows. A
    restore gives each piece up to an equal share. Claims return when a piece is
    dropped. Where a row lives changes nothing a client sees, so the split among
    pieces is a matter of speed only.

    Args:
        total: the budget in bytes.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.claimed = 0
        self.pieces = 0  # pieces holding a claim

    @property
    def free(self) -> int:
        """Bytes not claimed by any piece."""
        return self.total - self.claimed

    @property
    def owed(self) -> int:
        """Bytes claimed beyond the budget (``overdraw``), which pieces over an equal share give back."""
        return max(0, self.claimed - self.total)

    def claim(self, nbytes: int, unit: int = 1, overdraw: bool = False) -> int:
        """Claims up to ``nbytes`` in whole ``unit``s (a row's bytes), as many as are free (``overdraw``: all
        of them, free or not); returns the bytes claimed."""
        got = max(0, nbytes if overdraw else min(nbytes, self.free)) // unit * unit
        self.claimed += got
        return got

    def release(self, nbytes: int) -> None:
        """Gives back bytes a piece claimed."""
        self.claimed -= nbytes

    def fair(self) -> int:
        """An equal share of the budget among the pieces holding a claim."""
        return self.total // max(1, self.pieces)


def anonymous_array(shape: int | tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array in a private anonymous mapping of its own: its pages take memory only once written,
    go back to the system with the array (not to malloc's heap, which ``pscore.memory.tune_malloc`` keeps),
    and its rows can be given back early (``release_rows``)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else shape
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return np.zeros(shape, dtype)
    # MAP_NORESERVE: the kernel does not count the whole mapping against memory up front (the pieces of a
    # shard map one budget each), only the pages written, as the budget does.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_MAP_NORESERVE if sys.platform == "linux" else 0)
    buf = mmap.mmap(-1, nbytes, flags=flags)
    return np.frombuffer(buf, dtype).reshape(shape)


def release_rows(arr: np.ndarray, start: int) -> None:
    """Gives the memory of rows ``start:`` of an ``anonymous_array`` back to the system (the whole pages
    past row ``start``); they read as zeros after. Does nothing to another array."""
    owner: object = arr
    while not isinstance(owner, mmap.mmap):
        owner = owner.obj if isinstance(owner, memoryview) else getattr(owner, "base", None)
        if owner is None:
            return
    lo = -(-start * arr.strides[0] // mmap.PAGESIZE) * mmap.PAGESIZE
    if lo < len(owner):
        owner.madvise(mmap.MADV_DONTNEED, lo, len(owner) - lo)


def parse_bytes(text: str) -> int:
    """Bytes from ``"2GiB"``, ``"512MiB"``, ``"1.5G"``, ``"1000000"`` (K/M/G/T: powers of 1024).

    >>> parse_bytes("2GiB"), parse_bytes("64m"), parse_bytes("4096")
    (2147483648, 67108864, 4096)

    Raises:
        ValueError: not a size.
    """
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = 1
    for i, unit in enumerate("kmgt", start=1):
        if s.endswith(unit):
            s, scale = s[:-1], 1024**i
            break
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 2GiB, 512MiB, 1000000)") from None
    if not value >= 0:
        raise ValueError(f"{text!r} is not a size (e.g. 2GiB, 512MiB, 1000000)")
    return int(value * scale)


def scratch_array(directory: Path, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array backed by a file in ``directory`` that is already removed.

    Its pages are the page cache's (written back and dropped as the kernel
    needs memory), not the process's own memory, and its disk space is freed
    with the array (or the process). The file's blocks are allocated first, so
    a full disk is an ``OSError`` here, never a SIGBUS when the array is written.

    Raises:
        OSError: the directory cannot hold it (full, not writable).
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return np.zeros(shape, dtype)
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".scratch-", dir=directory)
    try:
        os.unlink(name)
        os.posix_fallocate(fd, 0, nbytes)
        buf = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return np.frombuffer(buf, dtype).reshape(shape)


def spool(tier: TierConfig | None) -> BinaryIO:
    """A file for a snapshot in the checkpoint format (a backup's catch-up): with a disk tier, a removed
    file in its directory (a tiered table's state may exceed memory), else one in memory. The caller
    closes it."""
    if tier is None:
        return io.BytesIO()
    return tempfile.TemporaryFile(dir=tier.root)


def higher_cut(a: Cut, b: Cut) -> Cut:
    """The later of two cuts, kind by kind (``None``: no cut of that kind)."""
    return (
        a[0] if b[0] is None else b[0] if a[0] is None else max(a[0], b[0]),
        a[1] if b[1] is None else b[1] if a[1] is None else max(a[1], b[1]),
    )


def _keys(ids: np.ndarray) -> list[bytes]:
    keys: list[bytes] = _ordered(ids).astype(">u8").view("V8").tolist()
    return keys


def _ids(keys: list[bytes]) -> np.ndarray:
    return _from_ordered(np.frombuffer(b"".join(keys), ">u8"))


def _from_ordered(keys: np.ndarray) -> np.ndarray:
    """Ids from their keys' 8 bytes (``_ordered`` of the ids, big-endian)."""
    return (keys.astype(np.uint64) ^ _SIGN).view(np.int64)


def _ordered(values: np.ndarray) -> np.ndarray:
    """Ids, or stamps (int64 steps, float64 times), as uint64 whose unsigned order is their order."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        bits = (values.astype(np.float64) + 0.0).view(np.uint64)  # + 0.0: -0.0 is 0.0
        return np.where(bits & _SIGN, ~bits, bits | _SIGN)
    return np.ascontiguousarray(values, np.int64).view(np.uint64) ^ _SIGN


def _stamp_keys(stamps: np.ndarray, ids: np.ndarray) -> list[bytes]:
    """An expiry index's keys: 8 bytes of the stamp (``_ordered``, big-endian), then the id's 8."""
    keys = np.empty(ids.size, [("stamp", ">u8"), ("id", ">u8")])
    keys["stamp"] = _ordered(stamps)
    keys["id"] = _ordered(ids)
    out: list[bytes] = keys.view("V16").tolist()
    return out


@dataclasses.dataclass(slots=True)
class TierStats:
    """Counters of one piece's tier since the shard started (metrics, ``psctl status``)."""

    spilled: int = 0  # rows written out of memory
    filled: int = 0  # rows read back into memory by a push
    cold_reads: int = 0  # rows a lookup or scan read from disk (not filled)
    hot_hits: int = 0  # ids of pushes and lookups found in memory
    cold_hits: int = 0  # ids of pushes and lookups found on disk
    read_seconds: float = 0.0  # time in batched disk reads
    reads: int = 0  # batched disk reads


@dataclasses.dataclass(slots=True)
class TierView:
    """A disk tier as it was at one instant (``ColdTier.view``), for one read, in any thread."""

    handle: Any  # the store's pin on its records then (LMDB: a read transaction; a log: a generation)
    writes: int | None  # writes begun by then (None: one was under way): a read keeps its records if equal
    recent: Remembered  # the records remembered then
    cut: Cut  # its expiry cut then
    release: Callable[[Any], None] | None = None  # unpins ``handle``

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            if self.release is not None:
                self.release(handle)


class ColdTier:
    """What the disk tier stores have in common (``DiskTier`` on LMDB, ``psserver.logtier.LogTier``).

    A store keeps the cold rows of one dynamic table piece as records (``record_dtype``) under their ids,
    and gives: batched reads as of an instant (``view``, ``read``), writes that become visible whole or not
    at all (``write``, ``write_chunks``), an expiry cut and its deletion batches (``cut``, ``expiring``,
    ``expired``), id-ordered walks (``scan``, ``items`` as of a ``reader``'s instant) and ``stats``. The
    records a lookup read are remembered for the push that follows it (``get(remember=True)``); here.

    Args:
        path: the store's directory (removed first: a new piece starts empty).
        record: the numpy structured dtype of one row's record.
        table: the table's name (for messages).
        expiry: the record fields (``EXPIRY_KINDS``) a table's TTL orders by.
    """

    key_ordered = False  # whether a write goes faster with its ids in ascending order (LMDB's pages)
    # How many times the store's id index moved its entries (grew into another table): the places it gave
    # before (``read``, ``write``) are stale since. A store without places: always 0.
    index_epoch = 0

    def __init__(self, path: Path, record: np.dtype, table: str, expiry: Iterable[str]) -> None:
        self.path = path
        self.record = record
        self._raw = np.dtype((np.void, record.itemsize))  # a record as opaque bytes (``_read``)
        self.table = table
        self.stats = TierStats()
        self._expiry_kinds = tuple(kind for kind in EXPIRY_KINDS if kind in tuple(expiry))
        # The records the last lookups read (``Remembered``): the push of the same ids that usually
        # follows fills from them instead of reading again. A worker looks up the next batch before it
        # pushes this one, so a push's ids are those of the lookup before the last: the last
        # ``_REMEMBER_READS`` reads are kept as they were read (no merge), while they take at most
        # ``_REMEMBER_BYTES``. A write drops the ids it changes; a read that a write overlapped keeps
        # nothing. One tuple: a read in another thread sees one whole.
        self._recent: Remembered = ()
        self._writes = 0  # writes begun
        self._writing = False
        self._write_lock = threading.Lock()  # ``_writes``, ``_writing`` and a read's keeping of its records
        # Expiry (module docs): records before the cut are expired, skipped by reads; ``expiring``: some
        # of them may still be on disk, for the next pushes to delete (``DynamicRows._tier_in``).
        self.cut: Cut = NO_CUT
        self.expiring = False

    # -- what each store implements ---------------------------------------------------------------

    def __len__(self) -> int:
        """Records on disk: cold rows, older copies of rows in memory, and expired records not yet deleted."""
        raise NotImplementedError

    @property
    def disk_used(self) -> int:
        """Bytes the store's files take on disk."""
        raise NotImplementedError

    def close(self, remove: bool = True) -> None:
        """Closes the store (and removes its files)."""
        raise NotImplementedError

    def _pin(self) -> Any:
        """Pins the records as they are now for a later ``_fetch`` (None: there are none)."""
        raise NotImplementedError

    def _unpin(self, handle: Any) -> None:
        """Releases a ``_pin``."""
        raise NotImplementedError

    def places_of(self, ids: np.ndarray) -> np.ndarray:
        """Each id's place in the store's id index now (-1: none, or a store without places)."""
        return np.full(np.size(ids), -1, np.int64)

    def _fetch(
        self, ids: np.ndarray, handle: Any, hints: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Which ``ids`` had a record at ``handle``'s instant, those records in order (expired or not), and
        their ``places`` (-1 where the store keeps none). ``hints``: each id's place as known before (-1:
        not known; ``read``'s ``places``), checked before use."""
        raise NotImplementedError

    def write(
        self,
        ids: np.ndarray,
        records: np.ndarray,
        delete: Iterable[np.ndarray] = (),
        older: tuple[np.ndarray, np.ndarray] | None = None,
        places: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Puts ``records`` under ``ids`` (over older copies), deletes the ``delete`` ids: visible together.
        Returns each id's place in the store's id index now (-1: not known), or None (a store without
        places).

        ``older``: with an expiry index, the ids among ``ids`` that have an older copy on disk and that
        copy's stamps (``stamps``); a store that needs them uses them. ``places``: each id's place in the
        store's id index as a read of its older copy gave it (``read``; -1: none known), a hint a store
        with such an index checks and uses instead of looking the id up.

        Raises:
            TierFullError: the disk or the size limit is full; nothing was written.
        """
        raise NotImplementedError

    def write_chunks(self, count: int, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Puts ``count`` rows given as ``(ids, records)`` chunks, visible together, built a chunk at a time
        (a restore of more rows than memory holds).

        Raises:
            TierFullError: the disk or the size limit is full; nothing was written.
        """
        raise NotImplementedError

    def scan(self, after: int | None, n: int) -> np.ndarray:
        """The first ``n`` ids of records that are ``> after`` (cold rows and older copies, not expired
        ones), ascending."""
        raise NotImplementedError

    def reader(self) -> Any:
        """The tier as it is now, whatever is written after (``items(txn=...)``), usable from another
        thread; ``abort()`` it when done."""
        raise NotImplementedError

    def items(
        self, chunk: int | None = None, txn: Any = None, cut: Cut | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every record in ascending id order but the expired ones, ``chunk`` (default ``CHUNK_ROWS``) at
        a time: ``(ids, records)``.

        ``txn``: read as of that ``reader``, else as of now. ``cut``: the records before it are expired
        (default: the tier's cut now; ``NO_CUT``: every record).
        """
        return self._items(chunk or CHUNK_ROWS, txn, self.cut if cut is None else cut)

    def _items(self, chunk: int, txn: Any, cut: Cut) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``items`` with its defaults filled in."""
        raise NotImplementedError

    def expired(
        self, before_step: int | None, before_time: float | None, limit: int | None = None
    ) -> np.ndarray:
        """Ids of the records on disk last updated before push ``before_step`` or time ``before_time``
        (sorted, distinct), at most ``limit`` of each kind (then fewer than ``limit`` ids means there are
        no more).

        Raises:
            InternalError: a cut without its index (the piece was made without that TTL).
        """
        raise NotImplementedError

    def check(self) -> None:
        """Asserts the store's own consistency (for tests).

        Raises:
            AssertionError: it is not consistent.
        """
        raise NotImplementedError

    # -- common -----------------------------------------------------------------------------------

    def live(self, records: np.ndarray, cut: Cut | None = None) -> np.ndarray:
        """Which ``records`` are not expired at ``cut`` (default: the tier's)."""
        step, when = self.cut if cut is None else cut
        keep = np.ones(records.size, bool)
        if step is not None:
            keep &= records["last_step"] >= step
        if when is not None:
            keep &= records["last_time"] >= when
        return keep

    def get(self, ids: np.ndarray, remember: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One batched read: ``(found, records)``: which ids have a cold row, and their records in order.

        Ids the last remembering reads found (``_REMEMBER_READS``) are answered from
        their records (still what the disk holds: writes drop the ids they change).
        ``remember``: keep this read's records for the next reads (a lookup's, for the
        push that follows); such a read reads the disk for all of its ids. Expired
        records (before ``cut``) are not found.
        """
        found, records, _ = self.lookup(ids, remember)
        return found, records

    def lookup(self, ids: np.ndarray, remember: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``get``, and the ids whose records it found expired (a push deletes them)."""
        found, records, dead, cost, _ = self.read(ids, remember)
        self.count_read(cost)
        return found, records, dead

    def read(
        self,
        ids: np.ndarray,
        remember: bool = False,
        at: TierView | None = None,
        places: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReadCost, np.ndarray]:
        """``lookup``, not counted in ``stats`` yet: it may run in a worker thread (a push's read, a large
        lookup's), and its cost (seconds, disk reads) is counted on the event loop (``count_read``).
        Last, the records' ``places``: where the store's id index held each of their ids when it was read
        (-1: not known; a hint for ``write``, which checks it).

        ``at``: read the tier as it was when ``view`` made it (a lookup's instant); it is closed.
        ``places``: each id's place as known before (-1: not known; the piece's index keeps the places
        of its ids on disk, ``psserver.rows.tiering``), hints that spare the store's index lookups where
        they hold.
        """
        ids = np.asarray(ids, np.int64)
        view = self.view() if at is None else at
        try:
            found, records, places, cost = self._read(ids, remember, view, places)
        finally:
            view.close()
        if view.cut == NO_CUT or not records.size:
            return found, records, ids[:0], cost, places
        live = self.live(records, view.cut)
        if live.all():
            return found, records, ids[:0], cost, places
        at_ = np.flatnonzero(found)[~live]
        found[at_] = False
        return found, records[live], ids[at_], cost, places[live]

    def view(self) -> TierView:
        """The tier as it is now (its records, cut and remembered records), for one ``read`` later, in
        any thread (a lookup's, made on the event loop at its instant; a push's, made where it reads,
        under the piece's lock)."""
        with self._write_lock:
            writes = None if self._writing else self._writes  # None: a write is under way
        return TierView(self._pin(), writes, self._recent, self.cut, self._unpin)

    def _read(
        self, ids: np.ndarray, remember: bool, view: TierView, hints: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReadCost]:
        if not ids.size or view.handle is None:
            return np.zeros(ids.size, bool), np.zeros(0, self.record), np.zeros(0, np.int64), (0.0, 0)
        t0 = time.perf_counter()
        writes = view.writes
        # Records are moved as opaque bytes (a void dtype): numpy copies a structured record field by field.
        raw = self._raw
        ask = np.arange(ids.size)  # the positions in ``ids`` not answered yet
        # (positions in ``ids``, their raw records, their places)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        # A lookup (``remember``) rarely asks for what the last lookups read (the next batches' ids): it
        # reads the disk; a push asks for what the lookup before the last read.
        for recent_ids, recent, recent_places in () if remember else view.recent:  # newest first
            if not ask.size:
                break
            want = ids[ask]
            at = np.searchsorted(recent_ids, want)
            np.minimum(at, recent_ids.size - 1, out=at)
            known = recent_ids[at] == want
            if known.any():
                parts.append((ask[known], _raw(recent, raw)[at[known]], recent_places[at[known]]))
                ask = ask[~known]
        fetched = ask.size > 0
        if fetched:
            got, records, places = self._fetch(ids[ask], view.handle, None if hints is None else hints[ask])
            ask = ask[got]
        if not parts:  # all fetched, in order
            found = np.zeros(ids.size, bool)
            found[ask] = True
        else:
            if fetched and ask.size:
                parts.append((ask, _raw(records, raw), places))
            found = np.zeros(ids.size, bool)
            for pos, _, _ in parts:
                found[pos] = True
            slot = np.cumsum(found) - 1
            n = int(slot[-1]) + 1 if ids.size else 0
            out = np.empty(n, raw)
            places = np.empty(n, np.int64)
            for pos, recs, at_places in parts:
                out[slot[pos]] = recs
                places[slot[pos]] = at_places
            records = out.view(self.record)
        if remember:
            keep = records.nbytes <= _REMEMBER_BYTES
            if keep:
                kept_ids = ids[found]
                order = np.argsort(kept_ids)
                kept = (kept_ids[order], _raw(records, raw)[order].view(self.record), places[order])
            with self._write_lock:
                if writes is not None and writes == self._writes and not self._writing:
                    # No write overlapped the read: it is the newest, and the older ones as room allows.
                    self._recent = _remembered(kept, self._recent) if keep else ()
        return found, records, places, (time.perf_counter() - t0, int(fetched))  # 0: remembered records only

    def count_read(self, cost: ReadCost) -> None:
        """Counts a read's cost (``read``) in ``stats``; call it on the event loop."""
        self.stats.read_seconds += cost[0]
        self.stats.reads += cost[1]

    @contextlib.contextmanager
    def _writing_now(self, changed: list[np.ndarray]) -> Iterator[None]:
        """Marks a write under way (reads meanwhile keep nothing) and drops the remembered records of the
        ``changed`` ids first (a failed write may have changed nothing, or not)."""
        with self._write_lock:  # reads from now on keep nothing (``_read``)
            self._writing = True
            self._writes += 1
        try:
            self._forget(changed)
            yield
        finally:
            with self._write_lock:
                self._writing = False

    def _forget(self, changed: list[np.ndarray]) -> None:
        """Drops the remembered records of the ``changed`` ids (the writer's: reads keep none meanwhile)."""
        changed = [c for c in changed if c.size]
        if self._recent and changed:
            gone = np.sort(np.concatenate(changed))  # once, for a search per remembered read
            kept = []
            for ids, recs, places in self._recent:
                at = np.searchsorted(gone, ids)
                np.minimum(at, gone.size - 1, out=at)
                keep = gone[at] != ids
                if keep.all():
                    kept.append((ids, recs, places))
                elif keep.any():
                    kept.append((ids[keep], recs[keep], places[keep]))
            self._recent = tuple(kept)

    @property
    def stamps(self) -> np.dtype | None:
        """The structured dtype of a record's expiry stamps (the fields its indexes order by), or None."""
        return np.dtype([(k, self.record[k]) for k in self._expiry_kinds]) if self._expiry_kinds else None

    def scratch(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zeroed array in a file of the directory that holds this tier's store (``scratch_array``;
        not the store's own directory, which goes with the piece)."""
        return scratch_array(self.path.parent, shape, dtype)

    def index_zeros(self, size: int, dtype: type) -> np.ndarray:
        """An id index's arrays (``HashIndex``'s ``zeros``: the log's, and a tiered piece's, which holds
        the ids on disk too) in files of the store's directory: the page cache's pages, as LMDB's B-tree
        pages are, not the shard's own memory (``--table-memory`` bounds the rows in memory).

        Raises:
            OSError: the disk cannot hold them.
        """
        return scratch_array(self.path, (size,), np.dtype(dtype))


class DiskTier(ColdTier):
    """The cold rows of one dynamic table piece in an LMDB environment (see the module docs).

    Args:
        path: the environment's directory (removed first: a new piece starts empty).
        record: the numpy structured dtype of one row's record (``record_dtype``).
        disk_bytes: the environment's size limit.
        table: the table's name (for messages).
        expiry: the record fields (``EXPIRY_KINDS``) to keep an expiry index by: ``last_step`` for a
            table with ``ttl_steps``, ``last_time`` with ``ttl_seconds``.

    Raises:
        TierDirError: the environment cannot be created there.
    """

    key_ordered = True  # a page of the B-tree is written once, the next is near

    def __init__(
        self, path: Path, record: np.dtype, disk_bytes: int, table: str, expiry: Iterable[str] = ()
    ) -> None:
        super().__init__(path, record, table, expiry)
        self.disk_bytes = disk_bytes
        try:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(
                str(path),
                map_size=disk_bytes,
                subdir=True,
                sync=False,  # a spill space: checkpoints and backups make rows durable, not this
                metasync=False,
                readahead=False,  # random reads: the kernel's readahead would read pages never used
                # A reader slot per read transaction open at once: a lookup's view (held while it waits for a
                # worker thread: one per lookup in flight), a checkpoint's export, a backup's snapshot.
                max_readers=_MAX_READERS,
                lock=True,
                # Pages are written in place in the map: a commit copies nothing (without it, writing
                # the dirty pages was half of a spill's cost). The data file is then as large as the
                # map, sparse: writes go only to blocks ``_reserve`` allocated first, so a full disk is a
                # TierFullError before a transaction, never a SIGBUS in one.
                writemap=True,
                max_dbs=1 + len(EXPIRY_KINDS),
            )
            self._rows = self.env.open_db(_ROWS_DB)
            self._expiry = {kind: self.env.open_db(kind.encode()) for kind in self._expiry_kinds}
            self._fd = os.open(path / "data.mdb", os.O_RDWR)
        except (OSError, lmdb.Error) as err:
            raise TierDirError(
                f"disk tier of table {table!r} cannot be created at {str(path)!r}: {err}"
            ) from None
        self._page = int(self.env.stat()["psize"])
        self._reserved = 0  # bytes of the data file allocated (posix_fallocate) from its start
        self._count = 0

    def __len__(self) -> int:
        """Records on disk: cold rows, older copies of rows in memory, and expired records not yet deleted."""
        return self._count

    @property
    def disk_used(self) -> int:
        """Bytes the environment's data file takes on disk."""
        try:
            return os.stat(self.path / "data.mdb").st_blocks * 512
        except OSError:
            return 0

    def close(self, remove: bool = True) -> None:
        """Closes the environment (and removes its files)."""
        self.env.close()
        os.close(self._fd)
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)

    def _pin(self) -> lmdb.Transaction | None:
        if not self._count:
            return None
        try:
            return self.env.begin(buffers=False)
        except lmdb.Error as err:
            raise InternalError(f"table {self.table!r}: cannot read its disk tier: {err}") from None

    def _unpin(self, handle: lmdb.Transaction) -> None:
        handle.abort()

    def _fetch(
        self, ids: np.ndarray, handle: lmdb.Transaction, hints: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        vals = [handle.get(k, db=self._rows) for k in _keys(ids)]
        got = np.array([v is not None for v in vals], bool)
        records = np.frombuffer(b"".join(v for v in vals if v is not None), self.record)
        return got, records, np.full(records.size, -1, np.int64)  # a B-tree: no places

    def write(
        self,
        ids: np.ndarray,
        records: np.ndarray,
        delete: Iterable[np.ndarray] = (),
        older: tuple[np.ndarray, np.ndarray] | None = None,
        places: np.ndarray | None = None,
    ) -> None:
        """``ColdTier.write`` in one transaction; ``older``'s index entries go (``places``: not used, a
        B-tree's keys are its index).

        Raises:
            TierFullError: the disk or the size limit is full; nothing was written.
            InternalError: another LMDB failure, or ``older`` is not what the disk holds; nothing was written.
        """
        ids = np.asarray(ids, np.int64)
        if np.any(ids[1:] < ids[:-1]):  # in key order: a page of the tree is written once, the next is near
            order = np.argsort(ids)
            ids, records = ids[order], records[order]
        dels = [np.asarray(d, np.int64) for d in delete]
        if ids.size or any(d.size for d in dels):
            self._transaction(ids.size, [(ids, records, older)] if ids.size else [], dels)

    def write_chunks(self, count: int, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Puts ``count`` rows given as ``(ids, records)`` chunks: one transaction, built a chunk at a time
        (a restore of more rows than memory holds). Into an empty tier, ids in ascending order are
        appended: full pages, about half the disk of random inserts.

        Raises:
            TierFullError: the disk or the size limit is full; nothing was written.
            InternalError: another LMDB failure; nothing was written.
        """
        if count:
            self._transaction(count, ((i, r, None) for i, r in chunks), [], fresh=not self._count)

    def _transaction(
        self,
        count: int,
        chunks: Iterable[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]],
        dels: list[np.ndarray],
        fresh: bool = False,
    ) -> None:
        """One write transaction: the deletes, then the chunks' puts (``count`` rows in all), each with its
        expiry index entries. A chunk: ``(ids, records, older)`` (``write``). ``fresh``: the tier is empty
        (no older copies; ascending ids are appended)."""
        with self._writing_now(dels):
            self._write(count, chunks, dels, fresh)

    def _write(
        self,
        count: int,
        chunks: Iterable[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]],
        dels: list[np.ndarray],
        fresh: bool,
    ) -> None:
        self._reserve((count + sum(d.size for d in dels)) * (1 + 2 * len(self._expiry)))
        last: int | None = None
        append = fresh
        try:
            with self.env.begin(write=True) as txn:
                for d in dels:
                    keys = _keys(d)
                    if self._expiry:
                        olds = [txn.pop(k, db=self._rows) for k in keys]
                        had = np.array([v is not None for v in olds], bool)
                        if had.any():
                            gone = np.frombuffer(b"".join(v for v in olds if v is not None), self.record)
                            self._unindex(txn, d[had], gone)
                    else:
                        for k in keys:
                            txn.delete(k, db=self._rows)
                cur = txn.cursor(db=self._rows)
                for ids, records, older in chunks:
                    ids = np.asarray(ids, np.int64)
                    if not ids.size:
                        continue
                    self._forget([ids])
                    keys = _keys(ids)
                    if self._expiry and older is not None:  # the older copies' index entries go
                        self._unindex(txn, *older)
                    # Appended while every chunk so far ascends from the last: a put out of order would fail.
                    append = append and bool(np.all(ids[1:] > ids[:-1])) and (last is None or ids[0] > last)
                    last = int(ids[-1])
                    records = np.ascontiguousarray(records, self.record)
                    rec = records.view(f"V{self.record.itemsize}")
                    items = list(zip(keys, rec.tolist(), strict=True))
                    consumed, _ = cur.putmulti(items, overwrite=True, append=append)
                    if consumed != len(items):
                        raise lmdb.Error(f"{consumed} of {len(items)} rows written")
                    for kind, db in self._expiry.items():
                        entries = [(k, b"") for k in _stamp_keys(records[kind], ids)]
                        consumed, _ = txn.cursor(db=db).putmulti(entries)
                        if consumed != len(entries):
                            raise lmdb.Error(f"{consumed} of {len(entries)} expiry index entries written")
                entries = int(txn.stat(self._rows)["entries"])
        except (lmdb.MapFullError, lmdb.DiskError) as err:
            raise TierFullError(
                f"table {self.table!r}: its disk tier is full ({type(err).__name__}: {err}; limit "
                f"{self.disk_bytes / 2**30:.1f} GiB at {str(self.path)!r}); nothing was applied. Free disk "
                "space, raise --table-disk-limit or --table-memory, or add shards"
            ) from None
        except lmdb.Error as err:
            raise InternalError(
                f"table {self.table!r}: disk tier write failed ({type(err).__name__}: {err}); "
                "nothing was applied"
            ) from None
        self._count = entries
        self.stats.spilled += count

    def _unindex(self, txn: lmdb.Transaction, ids: np.ndarray, stamps: np.ndarray) -> None:
        """Deletes the expiry index entries of ``ids``' records, whose stamps (or records) are ``stamps``."""
        for kind, db in self._expiry.items():
            for k in sorted(_stamp_keys(stamps[kind], ids)):  # in key order: each page is written once
                if not txn.delete(k, db=db):
                    raise lmdb.Error(f"an expiry index entry ({kind}) is missing")

    def _reserve(self, ops: int) -> None:
        """Allocates disk blocks for a transaction of ``ops`` puts and deletes, before it runs.

        A transaction writes at most a copy of every page of the tree it touches (each
        page once: at most ``5 x ops``, at most every page there is) plus its new
        records' pages (at least half full: ``2 x`` their bytes) plus the free list's;
        LMDB puts them at the end of the used pages or into freed ones. Allocated in
        steps of at least ``_RESERVE_STEP`` bytes, up to the map size.

        Raises:
            TierFullError: the disk has not that much space (nothing was written).
        """
        used = int(self.env.info()["last_pgno"]) + 1
        pages = used + min(5 * ops, used) + 2 * ops * self.record.itemsize // self._page + 64
        end = min(pages * self._page, self.disk_bytes)
        if end <= self._reserved:
            return
        ahead = min(max(end, self._reserved + _RESERVE_STEP), self.disk_bytes)
        try:
            try:
                os.posix_fallocate(self._fd, self._reserved, ahead - self._reserved)
                end = ahead
            except OSError:  # not that much room ahead: what this transaction needs, or TierFullError
                os.posix_fallocate(self._fd, self._reserved, end - self._reserved)
        except OSError as err:
            raise TierFullError(
                f"table {self.table!r}: its disk tier is full (cannot allocate {end - self._reserved} bytes "
                f"at {str(self.path)!r}: {err.strerror or err}); nothing was applied. Free disk space, raise "
                "--table-memory, or add shards"
            ) from None
        self._reserved = end

    def scan(self, after: int | None, n: int) -> np.ndarray:
        """The first ``n`` ids of records that are ``> after`` (cold rows and older copies, not expired
        ones), ascending. Reads ``n`` records at a time (``_items``), their expiry checked together: a scan
        right after a mass expiry walks many expired ones."""
        if n <= 0 or not self._count or after == np.iinfo(np.int64).max:
            return np.zeros(0, np.int64)
        start = None if after is None else _keys(np.array([after + 1]))[0]
        out: list[np.ndarray] = []
        with contextlib.closing(self._items(n, None, self.cut, start)) as batches:
            for ids, _ in batches:
                out.append(ids)
                if sum(x.size for x in out) >= n:
                    break
        return np.concatenate(out)[:n] if out else np.zeros(0, np.int64)

    def reader(self) -> lmdb.Transaction:
        """A read transaction: the tier as it is now, whatever is written after (``items(txn=...)``).

        Usable from another thread; abort it when done (it keeps the pages it
        sees from being reused, so the file grows while it is open).
        """
        try:
            return self.env.begin(buffers=False)
        except lmdb.Error as err:
            raise InternalError(f"table {self.table!r}: cannot read its disk tier: {err}") from None

    def _items(
        self, chunk: int, txn: lmdb.Transaction | None, cut: Cut, start: bytes | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``items``, from the key ``start`` (default: the first)."""
        if txn is None:
            with self.env.begin(buffers=False) as own:
                yield from self._items(chunk, own, cut, start)
            return
        keys: list[bytes] = []
        vals: list[bytes] = []

        def batch() -> tuple[np.ndarray, np.ndarray]:
            ids, records = _ids(keys), np.frombuffer(b"".join(vals), self.record)
            if cut == NO_CUT:
                return ids, records
            live = self.live(records, cut)
            return ids[live], records[live]

        try:
            cursor = txn.cursor(db=self._rows)
            if start is not None and not cursor.set_range(start):
                return  # no key from ``start`` on (an unplaced cursor would iterate from the first)
            for k, v in cursor:
                keys.append(k)
                vals.append(v)
                if len(keys) == chunk:
                    yield batch()
                    keys, vals = [], []
        except lmdb.Error as err:  # e.g. the piece was dropped (its environment closed) meanwhile
            raise InternalError(f"table {self.table!r}: cannot read its disk tier: {err}") from None
        if keys:
            yield batch()

    def expired(
        self, before_step: int | None, before_time: float | None, limit: int | None = None
    ) -> np.ndarray:
        """Ids of the records on disk last updated before push ``before_step`` or time ``before_time``
        (sorted, distinct).

        Reads the expiry indexes from their start up to the cuts: as many entries as it finds, at most
        ``limit`` from each (then fewer than ``limit`` ids means there are no more).

        Raises:
            InternalError: a cut without its index (the piece was made without that TTL).
        """
        found: list[bytes] = []  # index keys: the stamp's 8 bytes, then the id's
        kinds = 0
        with self.env.begin() as txn:
            for kind, cut in (("last_step", before_step), ("last_time", before_time)):
                if cut is None:
                    continue
                if kind not in self._expiry:
                    raise InternalError(f"table {self.table!r}: its disk tier has no expiry index by {kind}")
                stamp = np.array([cut], np.float64 if kind == "last_time" else np.int64)
                end = _stamp_keys(stamp, np.array([np.iinfo(np.int64).min]))[0]  # the cut's first key
                kinds += 1
                keys = txn.cursor(db=self._expiry[kind]).iternext(keys=True, values=False)
                for taken, key in enumerate(keys):
                    if key >= end or taken == limit:
                        break
                    found.append(key)
        ids = np.sort(_from_ordered(np.frombuffer(b"".join(found), ">u8").reshape(-1, 2)[:, 1]))
        return np.unique(ids) if kinds > 1 else ids

    def check(self) -> None:
        """Asserts that each expiry index holds exactly one entry per record, from its stamp (for tests).

        Raises:
            AssertionError: it does not.
        """
        ids, records = zip(*self.items(cut=NO_CUT), strict=True) if self._count else ((), ())
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        all_records = np.concatenate(records) if records else np.zeros(0, self.record)
        with self.env.begin() as txn:
            for kind, db in self._expiry.items():
                have = [bytes(k) for k in txn.cursor(db=db).iternext(keys=True, values=False)]
                assert have == sorted(_stamp_keys(all_records[kind], all_ids)), f"expiry index {kind}"


def _remembered(new: tuple[np.ndarray, np.ndarray, np.ndarray], old: Remembered) -> Remembered:
    """The reads remembered after a remembering read ``new`` (sorted ids, records, places): it first, then the
    newest of ``old`` while they are at most ``_REMEMBER_READS`` reads and ``_REMEMBER_BYTES`` in all."""
    out = [new] if new[0].size else []  # a read that found nothing: nothing to answer from
    nbytes = new[1].nbytes
    for read in old[: _REMEMBER_READS - 1]:
        nbytes += read[1].nbytes
        if nbytes > _REMEMBER_BYTES:
            break
        out.append(read)
    return tuple(out)


def _raw(records: np.ndarray, raw: np.dtype) -> np.ndarray:
    """Structured records as opaque bytes of their size (a copy only where they are not contiguous)."""
    return np.ascontiguousarray(records).view(raw)


def record_dtype(dim: int, dtype: np.dtype, slots: dict[str, np.dtype]) -> np.dtype:
    """The structured dtype of a cold row: bookkeeping, value, then each row slot (sorted by name)."""
    fields = [*_META, ("value", np.dtype(dtype), (dim,))]
    fields += [(f"slot_{k}", np.dtype(slots[k]), (dim,)) for k in sorted(slots)]
    return np.dtype(fields)
