"""A log-structured disk tier: a dynamic table piece's cold rows appended to segment files.

The other store of ``psserver.tier`` (``--table-tier-store log``), with the
same interface and guarantees as the LMDB one (``DiskTier``), built the way
DeepRec's ``SSDHASH`` is: nothing on disk is updated in place.

- A record is a row's id and its ``record_dtype`` record (bookkeeping, value,
  row slots) at a fixed length, appended to the newest of the piece's segment
  files. A segment's blocks are allocated whole when it is made
  (``posix_fallocate``), so a full disk is a ``TierFullError`` before a write,
  never a SIGBUS; it is written and read through a memory map (a batch of records
  is one numpy gather or scatter).
- An index in memory maps each id to its record's position (segment and offset:
  ``HashIndex``, numpy arrays, not an object per row). A write appends its
  records first, where no reader looks, then changes the index for all of them
  at once under a lock: a push's spills and deletions are visible together or
  not at all, and a failed write (``TierFullError``) leaves the tier as it was.
- Segments are immutable once their records are written, so an instant is a
  generation of the index: a view pins its generation (``_pin``), and while any
  view is open each write keeps the positions its ids had before it (an undo
  entry), from which a read as of an older generation resolves its ids. A
  lookup reads one instant in a worker thread; a checkpoint's or a backup's
  snapshot (``reader``) keeps its ids and reads them, in id order, as of its
  instant while pushes go on.
- A record overwritten or deleted leaves a dead one behind. A segment whose
  live records fall below ``_COMPACT_BELOW`` of it is compacted in a worker
  thread: its live records are appended again, ``_COMPACT_STEP_BYTES`` at most
  per step (the writer's lock is held for one step at a time, so a push waits
  for one step at most), then its file is removed, and its space comes back once
  the views older than that are closed (their reads may still look there). A
  compaction moves records, never changes one: no reader can tell. A write that
  would pass ``--table-disk-limit`` first compacts what it can, then fails typed.
- The tier is a spill space, as the LMDB one: wiped when its piece is created,
  never read back after a restart; rows are made durable by checkpoints and
  backups.

Disk space: the live records, plus the dead ones of segments not yet compacted
(each segment is compacted below half live: at most about 2x the live records'
bytes), plus one segment of headroom for the compaction itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pscore.errors import InternalError
from psserver.hashindex import HashIndex
from psserver.tier import (
    CHUNK_ROWS,
    NO_CUT,
    ColdTier,
    Cut,
    TierDirError,
    TierFullError,
    TierView,
    scratch_array,
)

_OFFSET_BITS = 32  # a position: the segment's number above these bits, the record's offset in it below
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_SEGMENT_MIN_BYTES = 256 << 10
_SEGMENT_MAX_BYTES = 64 << 20
_SEGMENTS_PER_LIMIT = 16  # a segment is at most this fraction of --table-disk-limit
_COMPACT_BELOW = 0.5  # a full segment whose live fraction is below this is compacted
_COMPACT_STEP_BYTES = 4 << 20  # records one compaction step reads and appends at most
_JOIN_S = 10.0  # how long closing waits for the compaction thread's step


@dataclasses.dataclass(eq=False, slots=True)
class _Segment:
    """One segment file, mapped: ``rows`` fixed-length records, ``used`` of them written."""

    no: int
    path: Path
    rows: int
    buf: mmap.mmap
    ids: np.ndarray  # the records' ids (a view of the map)
    recs: np.ndarray  # their records (a view of the map)
    stamps: np.ndarray | None  # with a TTL, a copy in memory of the records' expiry stamps
    used: int = 0
    live: int = 0  # records the index points at

    @property
    def nbytes(self) -> int:
        return len(self.buf)


@dataclasses.dataclass(slots=True)
class CompactionStats:
    """What compaction did since the piece was made (for tests and the benchmarks' results)."""

    segments: int = 0  # segments compacted and removed (or removed once nothing in them lived)
    moved: int = 0  # live records appended again


class _Snapshot:
    """``LogTier.reader``'s instant: its pin and the ids the tier held then (sorted on first use)."""

    def __init__(self, tier: LogTier, view: TierView, ids: np.ndarray) -> None:
        self.tier = tier
        self.view = view
        self.ids = ids
        self.sorted = False

    def abort(self) -> None:
        self.view.close()


class LogTier(ColdTier):
    """The cold rows of one dynamic table piece in append-only segment files (see the module docs).

    Args:
        path: the segments' directory (removed first: a new piece starts empty).
        record: the numpy structured dtype of one row's record (``record_dtype``).
        disk_bytes: the most bytes its segments may take on disk.
        table: the table's name (for messages).
        expiry: the record fields (``EXPIRY_KINDS``) a TTL orders by: their stamps are kept in memory
            per record, for ``expired``.

    Raises:
        TierDirError: the directory cannot be created.
    """

    def __init__(
        self, path: Path, record: np.dtype, disk_bytes: int, table: str, expiry: Iterable[str] = ()
    ) -> None:
        super().__init__(path, record, table, expiry)
        self.disk_bytes = disk_bytes
        self.slot = np.dtype([("id", "<i8"), ("rec", record)])
        try:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TierDirError(
                f"disk tier of table {table!r} cannot be created at {str(path)!r}: {err}"
            ) from None
        self.compaction = CompactionStats()
        self._index = HashIndex(0, self._index_zeros)
        self._segs: dict[int, _Segment] = {}  # by number: the current ones and those retired, still mapped
        self._active: _Segment | None = None  # the one appended to
        self._next_no = 0
        self._allocated = 0  # bytes of every segment still on disk or mapped
        self._gen = 0  # the index's generation: one more per write
        self._pins: dict[int, int] = {}  # generation -> views open at it
        # (generation, sorted ids, their positions before that generation's write)
        self._undo: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._retired: list[tuple[int, _Segment]] = []  # (generation, segment) removed, mapped until unpinned
        self._sorted: tuple[int, np.ndarray] | None = None  # (generation, its ids sorted): ``scan``
        self._lock = threading.Lock()  # the index, generations, pins, undo entries, segment table
        self._writer = threading.Lock()  # one writer at a time: writes, compaction steps, ``expired``
        self._compactor: threading.Thread | None = None
        self._compacting: tuple[_Segment, int] | None = None  # the segment under compaction, next offset
        self._closed = False

    # -- sizes ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Records on disk: cold rows, older copies of rows in memory, and expired records not yet deleted."""
        return len(self._index)

    @property
    def disk_used(self) -> int:
        """Bytes the segments take on disk (allocated whole; removed ones until their last view closes)."""
        return self._allocated

    def close(self, remove: bool = True) -> None:
        """Stops the compaction, drops the segments (and removes their files)."""
        self._closed = True
        thread = self._compactor
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
        with self._writer, self._lock:
            self._segs.clear()
            self._retired.clear()
            self._active = None
            self._index = HashIndex()
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)

    # -- reads ------------------------------------------------------------------------------------

    def _pin(self) -> int | None:
        with self._lock:
            if not len(self._index):
                return None
            gen = self._gen
            self._pins[gen] = self._pins.get(gen, 0) + 1
            return gen

    def _unpin(self, handle: int) -> None:
        with self._lock:
            left = self._pins[handle] - 1
            if left:
                self._pins[handle] = left
            else:
                del self._pins[handle]
            self._prune()

    def _prune(self) -> None:
        """Drops the undo entries and retired segments no open view can need (holds ``_lock``): a view
        pinned at generation ``g`` needs the undo entries of later generations and the segments retired
        at ``g`` or later."""
        if not self._pins:
            self._undo.clear()
            oldest = None
        else:
            oldest = min(self._pins)
            if self._undo and self._undo[0][0] <= oldest:
                self._undo = [u for u in self._undo if u[0] > oldest]
        if self._retired and (oldest is None or self._retired[0][0] < oldest):
            keep = []
            for gen, seg in self._retired:
                if oldest is None or gen < oldest:  # every view that may read it is closed: space comes back
                    self._segs.pop(seg.no, None)
                    self._allocated -= seg.nbytes
                else:
                    keep.append((gen, seg))
            self._retired = keep

    def _positions(self, ids: np.ndarray, gen: int) -> np.ndarray:
        """Each id's record position as of generation ``gen`` (-1: none); holds ``_lock``."""
        pos = self._index.get(ids)
        for at_gen, undo_ids, before in reversed(self._undo):  # newest first: the oldest after ``gen`` wins
            if at_gen <= gen:
                break
            at = np.minimum(np.searchsorted(undo_ids, ids), undo_ids.size - 1)
            hit = undo_ids[at] == ids
            if hit.any():
                pos[hit] = before[at[hit]]
        return pos

    def _gather(self, pos: np.ndarray) -> np.ndarray:
        """The records at positions ``pos`` (each valid, in pinned segments)."""
        out = np.empty(pos.size, self.record)
        if not pos.size:
            return out
        nos = pos >> _OFFSET_BITS
        offs = pos & _OFFSET_MASK
        first, last = int(nos.min()), int(nos.max())
        try:
            if first == last:
                out[...] = self._segs[first].recs[offs]
                return out
            for no in np.unique(nos).tolist():
                sel = np.flatnonzero(nos == no)
                out[sel] = self._segs[no].recs[offs[sel]]
        except KeyError:  # the piece was dropped (its tier closed) meanwhile
            raise InternalError(f"table {self.table!r}: its disk tier was closed") from None
        return out

    def _fetch(self, ids: np.ndarray, handle: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            pos = self._positions(ids, handle)
        got = pos >= 0
        return got, self._gather(pos[got])

    def scan(self, after: int | None, n: int) -> np.ndarray:
        """The first ``n`` ids of records that are ``> after`` (cold rows and older copies, not expired
        ones), ascending: from the ids sorted once per generation, ``n`` at a time, expired ones skipped."""
        if n <= 0:
            return np.zeros(0, np.int64)
        with self._lock:
            if self._sorted is None or self._sorted[0] != self._gen:
                self._sorted = (self._gen, np.sort(self._index.items()[0]))
            ids = self._sorted[1]
        if after is not None:
            ids = ids[int(np.searchsorted(ids, after, side="right")) :]
        if self.cut == NO_CUT:
            return ids[:n].copy()
        out: list[np.ndarray] = []
        got = 0
        for lo in range(0, ids.size, n):
            part = ids[lo : lo + n]
            found, _ = self.get(part)
            out.append(part[found])
            got += out[-1].size
            if got >= n:
                break
        return np.concatenate(out)[:n] if out else np.zeros(0, np.int64)

    def reader(self) -> _Snapshot:
        """The tier as it is now, whatever is written after (``items(txn=...)``): its ids (in a scratch
        file) and a pin on its instant. Usable from another thread; ``abort()`` it when done (the
        segments it may read stay on disk until then)."""
        with self._lock:
            gen = self._gen
            self._pins[gen] = self._pins.get(gen, 0) + 1
            ids = self._index.items()[0]
        view = TierView(gen, None, self._recent, self.cut, self._unpin)
        try:
            out = self.scratch((ids.size,), np.dtype(np.int64)) if ids.size else ids
        except BaseException:
            view.close()
            raise
        out[...] = ids
        return _Snapshot(self, view, out)

    def items(
        self, chunk: int | None = None, txn: Any = None, cut: Cut | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every record in ascending id order but the expired ones, ``chunk`` (default ``CHUNK_ROWS``) at
        a time: ``(ids, records)``.

        ``txn``: read as of that ``reader``, else as of now. ``cut``: the records before it are expired
        (default: the tier's cut now; ``NO_CUT``: every record).
        """
        return self._items(chunk or CHUNK_ROWS, txn, self.cut if cut is None else cut)

    def _items(self, chunk: int, snap: _Snapshot | None, cut: Cut) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if snap is None:
            own = self.reader()
            try:
                yield from self._items(chunk, own, cut)
            finally:
                own.abort()
            return
        if snap.view.handle is None:
            return
        if not snap.sorted:
            snap.ids.sort()
            snap.sorted = True
        gen = snap.view.handle
        for lo in range(0, snap.ids.size, chunk):
            ids = np.array(snap.ids[lo : lo + chunk])
            with self._lock:
                if snap.view.handle is None:
                    raise InternalError(f"table {self.table!r}: its disk tier's snapshot was closed")
                pos = self._positions(ids, gen)
            if np.any(pos < 0):
                raise InternalError(f"table {self.table!r}: a record of its disk tier's snapshot is missing")
            records = self._gather(pos)
            if cut != NO_CUT:
                live = self.live(records, cut)
                ids, records = ids[live], records[live]
            if ids.size:
                yield ids, records

    def expired(
        self, before_step: int | None, before_time: float | None, limit: int | None = None
    ) -> np.ndarray:
        """Ids of the records on disk last updated before push ``before_step`` or time ``before_time``
        (sorted, distinct), at most ``limit`` of each kind: from the stamps each segment keeps in memory,
        the live records' only.

        Raises:
            InternalError: a cut without its stamps (the piece was made without that TTL).
        """
        found: list[np.ndarray] = []
        kinds = 0
        with self._writer:  # no compaction moves records meanwhile
            for kind, cut in (("last_step", before_step), ("last_time", before_time)):
                if cut is None:
                    continue
                if kind not in self._expiry_kinds:
                    raise InternalError(f"table {self.table!r}: its disk tier has no expiry index by {kind}")
                kinds += 1
                taken = 0
                for seg in self._current():
                    assert seg.stamps is not None
                    offs = np.flatnonzero(seg.stamps[kind][: seg.used] < cut)
                    if not offs.size:
                        continue
                    ids = np.array(seg.ids[offs])
                    with self._lock:
                        current = self._index.get(ids) == (seg.no << _OFFSET_BITS) + offs
                    ids = ids[current]
                    if limit is not None:
                        ids = ids[: limit - taken]
                    found.append(ids)
                    taken += ids.size
                    if limit is not None and taken >= limit:
                        break
        ids = np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)
        return np.unique(ids) if kinds > 1 else ids

    def _current(self) -> list[_Segment]:
        """The segments the index may point at (not retired), oldest first."""
        retired = {seg.no for _, seg in self._retired}
        return [seg for no, seg in sorted(self._segs.items()) if no not in retired]

    def check(self) -> None:
        """Asserts that each segment's live count is what the index points at in it, and that the stamps
        kept in memory are the records' (for tests).

        Raises:
            AssertionError: they are not.
        """
        with self._writer, self._lock:
            ids, pos = self._index.items()
            nos = pos >> _OFFSET_BITS
            for seg in self._current():
                mine = nos == seg.no
                assert int(np.count_nonzero(mine)) == seg.live, f"segment {seg.no}: live count"
                offs = pos[mine] & _OFFSET_MASK
                assert np.all(offs < seg.used), f"segment {seg.no}: a position past its records"
                np.testing.assert_array_equal(seg.ids[offs], ids[mine])
                if seg.stamps is not None:
                    for kind in self._expiry_kinds:
                        np.testing.assert_array_equal(seg.stamps[kind][offs], seg.recs[kind][offs])
            assert int(np.count_nonzero(np.isin(nos, [s.no for s in self._current()]))) == ids.size

    # -- writes -----------------------------------------------------------------------------------

    def write(
        self,
        ids: np.ndarray,
        records: np.ndarray,
        delete: Iterable[np.ndarray] = (),
        older: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Appends ``records`` under ``ids`` (their older copies become dead records), deletes the
        ``delete`` ids: one change of the index, visible together. ``older`` is not needed here.

        Raises:
            TierFullError: the disk or the size limit is full (after compacting what could be); nothing
                was written.
        """
        ids = np.asarray(ids, np.int64)
        dels = [np.asarray(d, np.int64) for d in delete]
        dels = [d for d in dels if d.size]
        if not ids.size and not dels:
            return
        with self._writing_now([ids, *dels]), self._writer:
            self._reserve_index(ids.size)
            placed = self._append(ids, np.ascontiguousarray(records, self.record))
            gone = np.concatenate(dels) if dels else ids[:0]
            self._commit(ids, placed, gone)
        self.stats.spilled += ids.size

    def write_chunks(self, count: int, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Appends ``count`` rows given as ``(ids, records)`` chunks (distinct ids), then changes the index
        for all of them at once (a restore of more rows than memory holds: the records go to the segments
        a chunk at a time, the index takes 16 bytes a row).

        Raises:
            TierFullError: the disk or the size limit is full; nothing was written.
        """
        if not count:
            return
        all_ids: list[np.ndarray] = []
        all_pos: list[np.ndarray] = []
        with self._writing_now([]), self._writer:
            mark = self._mark()
            try:
                for ids, records in chunks:
                    ids = np.asarray(ids, np.int64)
                    if ids.size:
                        records = np.ascontiguousarray(records, self.record)
                        all_pos.append(self._append(ids, records, may_compact=False))
                        all_ids.append(ids)
            except BaseException:
                self._rollback(mark)
                raise
            ids = np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64)
            try:
                self._reserve_index(ids.size)
            except BaseException:
                self._rollback(mark)
                raise
            self._forget([ids])
            self._commit(ids, np.concatenate(all_pos) if all_pos else ids, ids[:0])
        self.stats.spilled += count

    def _index_zeros(self, size: int, dtype: type) -> np.ndarray:
        """The index's arrays: in files of the piece's directory (the page cache's pages, as the LMDB
        tier's B-tree pages are, not the shard's own memory: ``--table-memory`` bounds the rows in memory).

        Raises:
            OSError: the disk cannot hold them.
        """
        return scratch_array(self.path, (size,), np.dtype(dtype))

    def _reserve_index(self, more: int) -> None:
        """Grows the index ahead of a write of ``more`` ids, so its commit cannot fail (holds ``_writer``).

        Raises:
            TierFullError: the disk cannot hold the larger index; nothing changed.
        """
        if not self._index.needs_rebuild(more):
            return
        try:
            with self._lock:
                self._index.reserve(more)
        except OSError as err:
            raise TierFullError(
                f"table {self.table!r}: its disk tier is full (its index cannot grow at {str(self.path)!r}: "
                f"{err.strerror or err}); nothing was applied. Free disk space, raise --table-memory, or add "
                "shards"
            ) from None

    def _mark(self) -> tuple[int, int, int]:
        """Where appends are now (``_rollback``): the active segment's number and used records, the next
        segment number."""
        a = self._active
        return (-1 if a is None else a.no, 0 if a is None else a.used, self._next_no)

    def _rollback(self, mark: tuple[int, int, int]) -> None:
        """Forgets what was appended since ``mark`` (nothing points at it): the segments made since go."""
        no, used, next_no = mark
        for n in range(next_no, self._next_no):
            seg = self._segs.pop(n, None)
            if seg is not None:
                self._allocated -= seg.nbytes
                _unlink(seg.path)
        self._active = self._segs.get(no)
        if self._active is not None:
            self._active.used = used

    def _append(
        self, ids: np.ndarray, records: np.ndarray, compacting: bool = False, may_compact: bool = True
    ) -> np.ndarray:
        """Writes records after the last ones (holds ``_writer``); returns their positions. Nothing points
        at them yet. Makes the segments they need first; a push's write compacts to make room when the
        limit is near (``may_compact``), before anything of its own is appended.

        Raises:
            TierFullError: there is no room, even after compacting; nothing was appended.
        """
        n = ids.size
        plan = self._room(n, compacting, may_compact and not compacting)
        active = self._active
        mark = self._mark()
        try:
            for rows in plan:
                self._new_segment(rows)
        except BaseException:
            self._rollback(mark)
            raise
        out = np.empty(n, np.int64)
        done = 0
        for seg in ([active] if active is not None else []) + self._made_since(mark):
            take = min(n - done, seg.rows - seg.used)
            if take <= 0:
                continue
            lo, hi = seg.used, seg.used + take
            seg.ids[lo:hi] = ids[done : done + take]
            seg.recs[lo:hi] = records[done : done + take]
            if seg.stamps is not None:
                for kind in self._expiry_kinds:
                    seg.stamps[kind][lo:hi] = records[kind][done : done + take]
            out[done : done + take] = (seg.no << _OFFSET_BITS) + np.arange(lo, hi)
            seg.used = hi
            done += take
            if done == n:
                break
        assert done == n, "the segments made room for every record"
        return out

    def _made_since(self, mark: tuple[int, int, int]) -> list[_Segment]:
        return [self._segs[n] for n in range(mark[2], self._next_no) if n in self._segs]

    def _room(self, n: int, compacting: bool, may_compact: bool) -> list[int]:
        """The sizes (records) of the segments to make so that ``n`` more records fit after the last
        (holds ``_writer``). A push's write leaves one segment's headroom for compaction, and compacts
        first when it would need it.

        Raises:
            TierFullError: no room (nothing changed but what compaction moved).
        """
        while True:
            free = 0 if self._active is None else self._active.rows - self._active.used
            plan: list[int] = []
            while free < n:
                plan.append(self._segment_rows(n - free))
                free += plan[-1]
            nbytes = sum(plan) * self.slot.itemsize
            # Room for a compaction to move a victim's live records (under half of a segment's).
            headroom = 0 if compacting or not plan else self._segment_rows(0) // 2 * self.slot.itemsize
            if self._allocated + nbytes + headroom <= self.disk_bytes:
                return plan
            if plan:  # near the limit: one segment of just the records needed
                tight = max(16, n - (free - sum(plan)))
                if self._allocated + tight * self.slot.itemsize + headroom <= self.disk_bytes:
                    return [tight]
            if not may_compact or not self._compact_for_room():
                raise TierFullError(
                    f"table {self.table!r}: its disk tier is full (its segments take "
                    f"{self._allocated / 2**20:.1f} MiB of the limit of {self.disk_bytes / 2**20:.4g} MiB "
                    f"at {str(self.path)!r}, and {nbytes + headroom} more bytes are needed); nothing was "
                    "applied. Free disk space, raise --table-disk-limit or --table-memory, or add shards"
                )

    def _segment_rows(self, at_least: int) -> int:
        """A new segment's records: an eighth of the records held, within the bounds (and a sixteenth of
        the limit at most), and at least ``at_least`` (a large write's records in one segment)."""
        size = self.slot.itemsize
        want = max(len(self._index) * size // 8, _SEGMENT_MIN_BYTES)
        nbytes = min(want, _SEGMENT_MAX_BYTES, max(self.disk_bytes // _SEGMENTS_PER_LIMIT, 4096))
        return max(16, nbytes // size, min(at_least, _SEGMENT_MAX_BYTES // size))

    def _new_segment(self, rows: int) -> None:
        no = self._next_no
        path = self.path / f"segment-{no:08d}"
        nbytes = rows * self.slot.itemsize
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as err:
            raise TierFullError(
                f"table {self.table!r}: its disk tier cannot make a segment at {str(path)!r}: "
                f"{err.strerror or err}; nothing was applied"
            ) from None
        try:
            os.posix_fallocate(fd, 0, nbytes)
            buf = mmap.mmap(fd, nbytes)
        except OSError as err:
            _unlink(path)
            raise TierFullError(
                f"table {self.table!r}: its disk tier is full (cannot allocate {nbytes} bytes at "
                f"{str(path)!r}: {err.strerror or err}); nothing was applied. Free disk space, raise "
                "--table-memory, or add shards"
            ) from None
        finally:
            os.close(fd)
        arr = np.frombuffer(buf, self.slot)
        stamps = self.stamps
        seg = _Segment(
            no, path, rows, buf, arr["id"], arr["rec"], np.zeros(rows, stamps) if stamps is not None else None
        )
        self._next_no += 1
        self._allocated += nbytes
        with self._lock:
            self._segs[no] = seg
        self._active = seg

    def _commit(self, ids: np.ndarray, placed: np.ndarray, gone: np.ndarray) -> None:
        """Points the index at the appended records and drops the ``gone`` ids (deleted first): one
        generation. Keeps an undo entry while views are open. Nothing here fails."""
        with self._lock:
            if self._pins:
                touched = np.unique(np.concatenate([ids, gone]))
                self._undo.append((self._gen + 1, touched, self._index.get(touched)))
            dead: list[np.ndarray] = []
            if gone.size:
                at = self._index.positions(np.unique(gone))
                at = at[at >= 0]
                dead.append(self._index.vals[at])
                self._index.remove(at)
            if ids.size:
                at = self._index.positions(ids)
                old = at >= 0
                dead.append(self._index.vals[at[old]])
                self._index.vals[at[old]] = placed[old]
                self._index.insert(ids[~old], placed[~old])
                self._count_live(placed, 1)
            for d in dead:
                self._count_live(d, -1)
            self._gen += 1
            self._sorted = None
            due = self._retire_empty()
        if due:
            self._start_compaction()

    def _count_live(self, pos: np.ndarray, sign: int) -> None:
        if not pos.size:
            return
        nos, counts = np.unique(pos >> _OFFSET_BITS, return_counts=True)
        for no, count in zip(nos.tolist(), counts.tolist(), strict=True):
            self._segs[no].live += sign * count

    def _retire_empty(self) -> bool:
        """Retires the full segments nothing lives in (holds ``_lock``); whether any full one is due for
        compaction."""
        due = False
        for seg in self._current():
            if seg is self._active or seg.used < seg.rows:
                continue
            if not seg.live:
                self._retire(seg)
            elif seg.live < _COMPACT_BELOW * seg.rows:
                due = True
        return due

    def _retire(self, seg: _Segment) -> None:
        """Removes a segment nothing points at any more (holds ``_lock``): its file goes now, its map (and
        space) once the views that may read it are closed."""
        if self._compacting is not None and self._compacting[0] is seg:
            self._compacting = None
        _unlink(seg.path)
        self._retired.append((self._gen, seg))
        self.compaction.segments += 1
        self._prune()

    # -- compaction -------------------------------------------------------------------------------

    def _start_compaction(self) -> None:
        if self._compactor is None and not self._closed:
            self._compactor = threading.Thread(
                target=self._compact_loop, name=f"psserver-tier-compact-{self.table}", daemon=True
            )
            self._compactor.start()

    def _compact_loop(self) -> None:
        """The compaction thread: one bounded step at a time, the writer's lock released between them."""
        try:
            while not self._closed:
                with self._writer:
                    if self._closed or not self._compact_step():
                        return
        except TierFullError:
            return  # no room to move records now: a later write starts it again
        finally:
            self._compactor = None

    def _victim(self) -> _Segment | None:
        """The full segment with the lowest live fraction below ``_COMPACT_BELOW`` (holds ``_writer``)."""
        best = None
        for seg in self._current():
            if seg is self._active or seg.used < seg.rows or seg.live >= _COMPACT_BELOW * seg.rows:
                continue
            if best is None or seg.live * best.rows < best.live * seg.rows:
                best = seg
        return best

    def _compact_step(self, limit_bytes: int = _COMPACT_STEP_BYTES) -> bool:
        """Moves up to ``limit_bytes`` of the live records of the segment under compaction (or of the next
        victim) after the last records; holds ``_writer``. False: nothing to compact.

        Raises:
            TierFullError: no room to move them (nothing changed).
        """
        if self._compacting is None:
            seg = self._victim()
            if seg is None:
                return False
            self._compacting = (seg, 0)
        seg, start = self._compacting
        end = min(seg.used, start + max(1, limit_bytes // self.slot.itemsize))
        ids = np.array(seg.ids[start:end])
        offs = np.arange(start, end)
        with self._lock:
            keep = self._index.get(ids) == (seg.no << _OFFSET_BITS) + offs
        if keep.any():
            ids = ids[keep]
            placed = self._append(ids, seg.recs[offs[keep]], compacting=True)
            with self._lock:
                at = self._index.positions(ids)
                self._index.vals[at] = placed
                self._count_live(placed, 1)
                seg.live -= ids.size
            self.compaction.moved += ids.size
        with self._lock:
            if end >= seg.used or not seg.live:
                self._retire(seg)
                self._gen += 1  # views from now on cannot read it
                self._compacting = None
            else:
                self._compacting = (seg, end)
        return True

    def _compact_for_room(self) -> bool:
        """Compacts one victim whole for a write that needs room (holds ``_writer``); whether space came
        back (not while views older than it are open: their reads may still look there)."""
        before = self._allocated
        if self._compacting is None and self._victim() is None:
            return False
        while True:
            seg = self._compacting[0] if self._compacting is not None else None
            if not self._compact_step(_SEGMENT_MAX_BYTES):
                break
            if self._compacting is None or self._compacting[0] is not seg:
                break
        return self._allocated < before

    def compact_now(self) -> None:
        """Compacts every due segment at once (for tests and benchmarks: compaction otherwise runs in its
        thread, a bounded step at a time)."""
        with self._writer:
            while self._compact_step():
                pass


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def segment_bytes_bound(live_bytes: int) -> int:
    """The most disk a log tier of ``live_bytes`` of live records takes once compacted: each full
    segment at least ``_COMPACT_BELOW`` live, plus the active one and the headroom (for the docs' sums)."""
    return math.ceil(live_bytes / _COMPACT_BELOW) + 2 * _SEGMENT_MAX_BYTES
