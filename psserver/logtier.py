"""A log-structured disk tier: a dynamic table piece's cold rows appended to segment files.

The other store of ``psserver.tier`` (``--table-tier-store log``), with the
same interface and guarantees as the LMDB one (``DiskTier``), built the way
DeepRec's ``SSDHASH`` is: nothing on disk is updated in place.

- A record is a row's id and its ``record_dtype`` record (bookkeeping, value,
  row slots) at a fixed length, appended to the piece's active segment. The
  segments are fixed-size regions of one sparse file, mapped once (as LMDB maps
  its file): a batch of records is one numpy gather or scatter, whatever
  segments it spans (a file and a map per segment made a read loop over them:
  50 segments for a million rows). Blocks are allocated before records are
  written into them (``posix_fallocate``, ahead in steps), so a full disk is a
  ``TierFullError`` before a write, never a SIGBUS.
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
- A record overwritten or deleted leaves a dead one behind. Once the segments
  hold more than ``1 / _COMPACT_BELOW`` (2x) their live records, or take more
  than ``_EAGER_NEAR_LIMIT`` of the limit, the full segment with the fewest
  live ones (below ``_COMPACT_BELOW`` of it) is compacted in a worker thread.
  A segment is not compacted as soon as it falls below half live: meanwhile
  more of its records die, and fewer are moved (a log-structured store's
  greedy cleaning; a tenth to a quarter of the moves in ``bench_tier_push.py``).
  Its live records are appended again, ``_COMPACT_STEP_BYTES`` at most per
  step (the writer's lock is held for one step at a time, so a push waits for
  one step at most), then it is removed: once the views older than that are
  closed (their reads may still look there), its region's blocks are punched out
  (``MADV_REMOVE``) and the region is reused. A
  compaction moves records, never changes one: no reader can tell. A write that
  would pass ``--table-disk-limit`` first compacts what it can, then fails typed.
- The tier is a spill space, as the LMDB one: wiped when its piece is created,
  never read back after a restart; rows are made durable by checkpoints and
  backups.

Disk space: the live records, plus the dead ones of segments not yet compacted
(at most about 2x the live records' bytes, plus the segment under compaction;
``compact_now`` and a write that needs room compact every full segment below
half live), plus the active segment's and half a segment of headroom for the
compaction itself; a segment is 1/16 of ``--table-disk-limit``, between 64
KiB and 64 MiB. The index (about 50 bytes a record held: ids and positions in
a table at most 3/4 full, doubled as it grows) lives in files of the piece's
directory too (the page cache's pages, like LMDB's B-tree; not counted in the
limit), and with a TTL each segment keeps its records' stamps in memory (8 bytes
a record per TTL kind) and which of them live (1 byte a record).

Expiry (``expired``): with a TTL, each segment keeps, per block of
``_EXPIRY_BLOCK`` records, a lower bound of its live records' stamps (per TTL
kind). A call for a cut looks only into the blocks whose bound is before it,
from where the last call for the same cut stopped (the blocks before hold no
live record before it: a write that appends one there moves the place back),
and takes at most ``limit`` ids: its cost is the batch, not the records on disk.
A block looked into that holds no live record before the cut gets its bound
raised to its live records' least stamp, so dead records (overwritten,
deleted) are looked at once, not at every cut.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import mmap
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from pscore.errors import InternalError
from psserver.hashindex import EMPTY, HashIndex
from psserver.tier import (
    NO_CUT,
    ColdTier,
    Cut,
    TierDirError,
    TierFullError,
    TierView,
)

_REGION_MIN_BYTES = 64 << 10
_REGION_MAX_BYTES = 64 << 20
_REGIONS_PER_LIMIT = 16  # a segment's region is at most this fraction of --table-disk-limit
_ALLOC_STEP_BYTES = 1 << 20  # blocks allocated ahead in a segment at least this much at a time
_SPARE_REGIONS = 4  # regions mapped beyond the limit's (a new segment while old ones wait for their views)
_COMPACT_BELOW = 0.5  # a full segment whose live fraction is below this is compacted
# Past this fraction of --table-disk-limit (or of what the filesystem's free space leaves it), a segment is
# compacted as soon as it falls below half live again: else a push's write near the limit would compact a
# whole segment itself (``_compact_for_room``), or one on a disk near full fail.
_EAGER_NEAR_LIMIT = 0.75
_COMPACT_STEP_BYTES = 4 << 20  # records one compaction step reads and appends at most
_JOIN_S = 10.0  # how long closing waits for the compaction thread's step
_EXPIRY_BLOCK = 4096  # records per block of a segment's expiry bounds (``expired``)


@dataclasses.dataclass(eq=False, slots=True)
class _Segment:
    """One segment: region ``no`` of the records file, ``rows`` fixed-length records, ``used`` written."""

    no: int
    base: int  # the position (record number in the file) of its first record
    rows: int
    ids: np.ndarray  # the records' ids (a view of the map)
    recs: np.ndarray  # their records (a view of the map)
    stamps: np.ndarray | None  # with a TTL, a copy in memory of the records' expiry stamps
    alive: np.ndarray | None  # with a TTL, which records the index points at
    bounds: np.ndarray | None  # with a TTL, per block of ``_EXPIRY_BLOCK``: at most its live records' stamps
    used: int = 0
    live: int = 0  # records the index points at
    reserved: int = 0  # bytes of its region allocated on disk, from its start


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
        self.slot = np.dtype([("rec", record), ("id", "<i8")])
        size = self.slot.itemsize
        unit = mmap.PAGESIZE // math.gcd(size, mmap.PAGESIZE)  # records whose bytes fill whole pages
        target = min(_REGION_MAX_BYTES, max(_REGION_MIN_BYTES, disk_bytes // _REGIONS_PER_LIMIT))
        self.segment_rows = max(unit, target // size // unit * unit)  # a segment's records (its region)
        regions = disk_bytes // (self.segment_rows * size) + _SPARE_REGIONS
        try:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)
            # One sparse file as large as the regions, mapped once (as LMDB maps its file): a batch of
            # records is one gather or scatter; blocks are allocated before they are written (``_reserve``).
            self._fd = os.open(path / "records", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(self._fd, regions * self.segment_rows * size)
                self._map = mmap.mmap(self._fd, regions * self.segment_rows * size)
            except OSError:
                os.close(self._fd)
                raise
        except OSError as err:
            raise TierDirError(
                f"disk tier of table {table!r} cannot be created at {str(path)!r}: {err}"
            ) from None
        records = np.frombuffer(self._map, self.slot)
        self._all_ids = records["id"]
        self._all_recs = records["rec"]
        self._all_bytes = np.frombuffer(self._map, np.uint8).reshape(-1, size)  # a record a row: ``_gather``
        self._free = list(range(regions))  # region numbers not in use (a heap: the lowest first)
        self._held: dict[int, int] = {}  # bytes still allocated in a free region (its blocks not given back)
        self.compaction = CompactionStats()
        self._index = HashIndex(0, self.index_zeros)
        self._segs: dict[int, _Segment] = {}  # by region: the current ones and those retired, still pinned
        self._active: _Segment | None = None  # the one appended to
        self._allocated = 0  # bytes allocated on disk in the regions
        self._marks: list[list[_Segment]] = []  # the segments made since each open ``_mark``
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
        # Per TTL kind, the cut of the last ``expired`` and the position from which a call for the same cut
        # looks: the blocks before it hold no live record before the cut (``_append`` moves it back).
        self._expiring: dict[str, tuple[float, int]] = {}
        self._closed = False
        self.index_epoch = 0

    # -- sizes ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Records on disk: cold rows, older copies of rows in memory, and expired records not yet deleted."""
        return len(self._index)

    @property
    def disk_used(self) -> int:
        """Bytes the segments take on disk (allocated ahead of their records; removed ones until their last
        view closes)."""
        return self._allocated

    def close(self, remove: bool = True) -> None:
        """Stops the compaction, drops the segments (and removes the file; a read still under way reads the
        map, which goes with its last reference)."""
        self._closed = True
        thread = self._compactor
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
        with self._writer, self._lock:
            self._segs.clear()
            self._retired.clear()
            self._active = None
            self._index = HashIndex()
            os.close(self._fd)
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
                    self._release(seg)
                else:
                    keep.append((gen, seg))
            self._retired = keep

    def _release(self, seg: _Segment) -> None:
        """Gives a segment's region back (holds ``_lock``): its blocks to the disk, its number to new ones."""
        if self._segs.get(seg.no) is not seg:
            return  # given back already (a rollback within a rollback)
        del self._segs[seg.no]
        if seg.reserved:
            start = seg.base * self.slot.itemsize
            try:
                self._map.madvise(mmap.MADV_REMOVE, start, seg.reserved)  # punches the blocks out
                self._allocated -= seg.reserved
            except (OSError, ValueError):  # a filesystem that cannot: the blocks stay, for the next segment
                self._held[seg.no] = seg.reserved
        heapq.heappush(self._free, seg.no)

    def _positions(
        self, ids: np.ndarray, gen: int, hints: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each id's record position as of generation ``gen`` (-1: none), and its place in the index now
        (-1: none; ``ColdTier.read``'s places; ``hints``: places known before, checked); holds ``_lock``."""
        index = self._index
        places = index.positions(ids) if hints is None else index.positions_hinted(ids, hints)
        pos = np.take(self._index.vals, places)
        pos[places < 0] = -1
        for at_gen, undo_ids, before in reversed(self._undo):  # newest first: the oldest after ``gen`` wins
            if at_gen <= gen:
                break
            at = np.minimum(np.searchsorted(undo_ids, ids), undo_ids.size - 1)
            hit = undo_ids[at] == ids
            if hit.any():
                pos[hit] = before[at[hit]]
        return pos, places

    def _gather(self, pos: np.ndarray) -> np.ndarray:
        """The records at positions ``pos`` (each valid, in pinned segments): one gather from the map, of
        whole rows of bytes (a gather of the structured records copied them field by field: 3x slower)."""
        rows = np.take(self._all_bytes, pos, axis=0)[:, : self.record.itemsize]
        return np.ascontiguousarray(rows).view(self.record).reshape(-1)

    def places_of(self, ids: np.ndarray) -> np.ndarray:
        """Each id's place in the index now (-1: none)."""
        with self._lock:
            return self._index.positions(ids)

    def _fetch(
        self, ids: np.ndarray, handle: int, hints: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            pos, places = self._positions(ids, handle, hints)
        got = pos >= 0
        return got, self._gather(pos[got]), places[got]

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
                pos, _ = self._positions(ids, gen)
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
        (sorted, distinct), at most ``limit`` of each kind.

        Looks into the blocks of records whose stamps may be before a cut (see the module docs), from
        where the last call for the same cut stopped (a push each while an expiry drains): a bounded batch,
        whatever the records on disk.

        Raises:
            InternalError: a cut without its stamps (the piece was made without that TTL).
        """
        found: list[np.ndarray] = []
        kinds = 0
        with self._writer:  # no write or compaction meanwhile
            for kind, cut in (("last_step", before_step), ("last_time", before_time)):
                if cut is None:
                    continue
                if kind not in self._expiry_kinds:
                    raise InternalError(f"table {self.table!r}: its disk tier has no expiry index by {kind}")
                kinds += 1
                found.append(self._expired_batch(kind, cut, limit))
        ids = np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)
        return np.unique(ids) if kinds > 1 else ids

    def _expired_batch(self, kind: str, cut: float, limit: int | None) -> np.ndarray:
        """``expired`` of one kind (holds ``_writer``): the live records before ``cut`` in the blocks whose
        bounds are before it, from the place where the last call for ``cut`` stopped (``_expiring``)."""
        last = self._expiring.get(kind)
        start = last[1] if last is not None and last[0] == cut else 0
        out: list[np.ndarray] = []
        taken, first, block = 0, None, _EXPIRY_BLOCK
        for seg in self._current():  # in region order: the order of positions
            if seg.base + seg.used <= start or (limit is not None and taken >= limit):
                continue
            assert seg.stamps is not None and seg.alive is not None and seg.bounds is not None
            stamps, alive, bounds = seg.stamps[kind], seg.alive, seg.bounds[kind]
            b0 = max(0, start - seg.base) // block
            for b in (np.flatnonzero(bounds[b0 : -(-seg.used // block)] < cut) + b0).tolist():
                lo, hi = b * block, min(seg.used, (b + 1) * block)
                live = alive[lo:hi]
                hit = np.flatnonzero((stamps[lo:hi] < cut) & live)
                if not hit.size:  # its dead records are not looked at again (until records are appended)
                    rest = stamps[lo:hi][live]
                    bounds[b] = rest.min() if rest.size else _highest(bounds.dtype)
                    continue
                if first is None:  # those returned are looked at again by the next call (deleted or not)
                    first = seg.base + lo
                if limit is not None:
                    hit = hit[: limit - taken]
                out.append(np.array(seg.ids[lo + hit]))
                taken += hit.size
                if limit is not None and taken >= limit:
                    break
        self._expiring[kind] = (cut, self._all_ids.size if first is None else first)
        return np.sort(np.concatenate(out)) if out else np.zeros(0, np.int64)

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
            nos = pos // self.segment_rows
            for seg in self._current():
                mine = nos == seg.no
                assert int(np.count_nonzero(mine)) == seg.live, f"segment {seg.no}: live count"
                offs = pos[mine] - seg.base
                assert np.all(offs < seg.used), f"segment {seg.no}: a position past its records"
                np.testing.assert_array_equal(seg.ids[offs], ids[mine])
                if seg.stamps is not None:
                    assert seg.alive is not None and seg.bounds is not None
                    alive = np.zeros(seg.rows, bool)
                    alive[offs] = True
                    np.testing.assert_array_equal(seg.alive, alive, f"segment {seg.no}: live records")
                    for kind in self._expiry_kinds:
                        np.testing.assert_array_equal(seg.stamps[kind][offs], seg.recs[kind][offs])
                        blocks = offs // _EXPIRY_BLOCK
                        assert np.all(seg.bounds[kind][blocks] <= seg.stamps[kind][offs]), "expiry bounds"
            assert int(np.count_nonzero(np.isin(nos, [s.no for s in self._current()]))) == ids.size

    # -- writes -----------------------------------------------------------------------------------

    def write(
        self,
        ids: np.ndarray,
        records: np.ndarray,
        delete: Iterable[np.ndarray] = (),
        older: tuple[np.ndarray, np.ndarray] | None = None,
        places: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Appends ``records`` under ``ids`` (their older copies become dead records), deletes the
        ``delete`` ids: one change of the index, visible together. ``older`` is not needed here;
        ``places`` (hints of the ids' places in the index, from the reads of their older copies) spare
        the index lookups of the ids whose hint still holds. Returns the ids' places in the index now.

        Raises:
            TierFullError: the disk or the size limit is full (after compacting what could be); nothing
                was written.
        """
        ids = np.asarray(ids, np.int64)
        dels = [np.asarray(d, np.int64) for d in delete]
        dels = [d for d in dels if d.size]
        if not ids.size and not dels:
            return np.zeros(0, np.int64)
        with self._writing_now([ids, *dels]), self._writer:
            self._reserve_index(ids.size)
            placed = self._append(ids, np.ascontiguousarray(records, self.record))
            gone = np.concatenate(dels) if dels else ids[:0]
            out = self._commit(ids, placed, gone, places)
        self.stats.spilled += ids.size
        return out

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
                ids = np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64)
                self._reserve_index(ids.size)
            except BaseException:
                self._rollback(mark)
                raise
            finally:
                self._unmark(mark)
            self._forget([ids])
            self._commit(ids, np.concatenate(all_pos) if all_pos else ids, ids[:0])
        self.stats.spilled += count

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
                self.index_epoch += 1  # every place moved (``ColdTier.index_epoch``)
        except OSError as err:
            raise TierFullError(
                f"table {self.table!r}: its disk tier is full (its index cannot grow at {str(self.path)!r}: "
                f"{err.strerror or err}); nothing was applied. Free disk space, raise --table-memory, or add "
                "shards"
            ) from None

    def _mark(self) -> tuple[_Segment | None, int, list[_Segment]]:
        """Where appends are now (``_rollback``): the active segment, its used records, and a list that
        collects the segments made from now on, until ``_unmark``."""
        made: list[_Segment] = []
        self._marks.append(made)
        return self._active, 0 if self._active is None else self._active.used, made

    def _unmark(self, mark: tuple[_Segment | None, int, list[_Segment]]) -> None:
        popped = self._marks.pop()  # marks nest: a restore's, then each of its appends'
        assert popped is mark[2], "marks are undone in the reverse order"

    def _rollback(self, mark: tuple[_Segment | None, int, list[_Segment]]) -> None:
        """Forgets what was appended since ``mark`` (nothing points at it): the segments made since go."""
        active, used, made = mark
        with self._lock:
            for seg in made:
                self._release(seg)
        made.clear()
        self._active = active
        if active is not None:
            active.used = used

    def _append(
        self, ids: np.ndarray, records: np.ndarray, compacting: bool = False, may_compact: bool = True
    ) -> np.ndarray:
        """Writes records after the last ones (holds ``_writer``); returns their positions. Nothing points
        at them yet. First checks the limit (a push's write compacts to make room when it is near:
        ``may_compact``), then makes the segments and allocates the blocks the records need.

        Raises:
            TierFullError: there is no room, even after compacting; nothing was appended.
        """
        n = ids.size
        self._room(n, compacting, may_compact and not compacting)
        mark = self._mark()
        spans: list[tuple[_Segment, int, int]] = []
        try:
            seg, start, left = self._active, 0 if self._active is None else self._active.used, n
            while left:
                if seg is None or start == seg.rows:
                    seg, start = self._new_segment(), 0
                take = min(left, seg.rows - start)
                self._reserve(seg, start + take)
                spans.append((seg, start, start + take))
                start += take
                left -= take
        except BaseException:
            self._rollback(mark)
            raise
        finally:
            self._unmark(mark)
        out = np.empty(n, np.int64)
        done = 0
        size = self.slot.itemsize
        for seg, lo, hi in spans:
            take = hi - lo
            # Written with pwrite, not through the map: a first store to each page of the map faulted it in
            # (and had the filesystem convert its allocated extent), 3.5 us a record of 288 bytes.
            buf = np.empty(take, self.slot)
            buf["id"] = ids[done : done + take]
            buf["rec"] = records[done : done + take]
            _pwrite_all(self._fd, memoryview(buf).cast("B"), (seg.base + lo) * size)
            if seg.stamps is not None:
                self._stamp(seg, lo, hi, records[done : done + take])
            out[done : done + take] = np.arange(seg.base + lo, seg.base + hi)
            seg.used = hi
            done += take
        return out

    def _stamp(self, seg: _Segment, lo: int, hi: int, records: np.ndarray) -> None:
        """Keeps the stamps of ``seg``'s records ``lo:hi`` (just appended) and lowers their blocks' bounds;
        an expiry under way looks from the first block that took one before its cut (holds ``_writer``)."""
        assert seg.stamps is not None and seg.bounds is not None
        block = _EXPIRY_BLOCK
        for kind in self._expiry_kinds:
            stamps = seg.stamps[kind]
            stamps[lo:hi] = records[kind]
            bounds = seg.bounds[kind]
            for b in range(lo // block, (hi - 1) // block + 1):
                least = stamps[max(lo, b * block) : min(hi, (b + 1) * block)].min()
                if least < bounds[b]:
                    bounds[b] = least
            last = self._expiring.get(kind)
            if last is not None and seg.base + lo < last[1]:
                early = np.flatnonzero(bounds[lo // block : (hi - 1) // block + 1] < last[0])
                if early.size:
                    at = seg.base + (lo // block + int(early[0])) * block
                    self._expiring[kind] = (last[0], min(last[1], at))

    def _room(self, n: int, compacting: bool, may_compact: bool) -> None:
        """Checks that ``n`` more records fit under the limit (holds ``_writer``). A push's write leaves
        room for a compaction to move a victim's live records (under half a segment's), and compacts
        first when it would need it.

        Raises:
            TierFullError: no room (nothing changed but what compaction moved).
        """
        size = self.slot.itemsize
        while True:
            a = self._active
            ahead = 0 if a is None else max(0, a.reserved - a.used * size)  # allocated, not yet written
            need = max(0, n * size - ahead)
            headroom = 0 if compacting or not need else self.segment_rows // 2 * size
            if self._allocated + need + headroom <= self.disk_bytes:
                return
            if not may_compact or not self._compact_for_room():
                raise TierFullError(
                    f"table {self.table!r}: its disk tier is full (its segments take "
                    f"{self._allocated / 2**20:.1f} MiB of the limit of {self.disk_bytes / 2**20:.4g} MiB "
                    f"at {str(self.path)!r}, and {need + headroom} more bytes are needed); nothing was "
                    "applied. Free disk space, raise --table-disk-limit or --table-memory, or add shards"
                )

    def _reserve(self, seg: _Segment, rows: int) -> None:
        """Allocates the blocks of ``seg``'s first ``rows`` records, ahead in steps where the limit allows
        (holds ``_writer``): the map is then written where the disk has room, never a SIGBUS.

        Raises:
            TierFullError: the disk has no room for them.
        """
        size = self.slot.itemsize
        end = rows * size
        if end <= seg.reserved:
            return
        region = seg.rows * size
        ahead = min(max(end, seg.reserved + _ALLOC_STEP_BYTES), region)
        if self._allocated + ahead - seg.reserved > self.disk_bytes:
            ahead = end  # near the limit: just what the records need
        start = seg.base * size
        try:
            try:
                os.posix_fallocate(self._fd, start + seg.reserved, ahead - seg.reserved)
            except OSError:
                if ahead == end:
                    raise
                ahead = end  # no room ahead: what these records need, or TierFullError
                os.posix_fallocate(self._fd, start + seg.reserved, ahead - seg.reserved)
        except OSError as err:
            raise TierFullError(
                f"table {self.table!r}: its disk tier is full (cannot allocate {ahead - seg.reserved} bytes "
                f"at {str(self.path)!r}: {err.strerror or err}); nothing was applied. Free disk space, raise "
                "--table-memory, or add shards"
            ) from None
        self._allocated += ahead - seg.reserved
        seg.reserved = ahead

    def _new_segment(self) -> _Segment:
        """A new segment on the lowest free region; the active one from now on (holds ``_writer``).

        Raises:
            TierFullError: every region is in use (segments removed but still pinned by views).
        """
        with self._lock:
            if not self._free:
                raise TierFullError(
                    f"table {self.table!r}: its disk tier is full (every region of {str(self.path)!r} is in "
                    "use, some by views still open); nothing was applied. Raise --table-disk-limit or "
                    "--table-memory, or add shards"
                )
            no = heapq.heappop(self._free)
            base = no * self.segment_rows
            end = base + self.segment_rows
            stamps = self.stamps
            seg = _Segment(
                no,
                base,
                self.segment_rows,
                self._all_ids[base:end],
                self._all_recs[base:end],
                np.zeros(self.segment_rows, stamps) if stamps is not None else None,
                np.zeros(self.segment_rows, bool) if stamps is not None else None,
                _bounds(-(-self.segment_rows // _EXPIRY_BLOCK), stamps) if stamps is not None else None,
                reserved=self._held.pop(no, 0),
            )
            self._segs[no] = seg
        for made in self._marks:
            made.append(seg)
        self._active = seg
        return seg

    def _commit(
        self, ids: np.ndarray, placed: np.ndarray, gone: np.ndarray, hints: np.ndarray | None = None
    ) -> np.ndarray:
        """Points the index at the appended records and drops the ``gone`` ids (deleted first): one
        generation. Keeps an undo entry while views are open, from the same lookups. ``hints``: the ids'
        places in the index as their reads found them (``HashIndex.positions_hinted``). Returns the ids'
        places. Nothing here fails."""
        index = self._index
        with self._lock:
            gone = np.unique(gone) if gone.size else gone
            at_gone = index.positions(gone) if gone.size else gone
            # A removal moves no other entry: the ids' places found now hold after the removals (an id
            # also deleted is found again, absent).
            at_ids = index.positions(ids) if hints is None else index.positions_hinted(ids, hints)
            if self._pins:  # the positions before this write of every id it touches, from the lookups
                touched = np.concatenate([gone, ids])
                where = np.concatenate([at_gone, at_ids])
                before = np.take(index.vals, where)
                before[where < 0] = -1
                touched, first = np.unique(touched, return_index=True)  # a deleted id: its position first
                self._undo.append((self._gen + 1, touched, before[first]))
            dead: list[np.ndarray] = []
            if gone.size:
                at = at_gone[at_gone >= 0]
                dead.append(index.vals[at])
                index.remove(at)
            if ids.size:
                old = at_ids >= 0
                if gone.size:  # an id deleted, then written again: absent now (its place emptied)
                    old &= np.take(index.keys, np.where(old, at_ids, index.size)) == ids
                    old &= (ids != EMPTY) | index.has_empty_id
                dead.append(index.vals[at_ids[old]])
                index.vals[at_ids[old]] = placed[old]
                at_ids = np.where(old, at_ids, -1)
                at_ids[~old] = index.insert(ids[~old], placed[~old])
                self._count_live(placed, 1)
            for d in dead:
                self._count_live(d, -1)
            self._gen += 1
            self._sorted = None
            due = self._retire_empty()
        if due:
            self._start_compaction()
        return at_ids

    def _count_live(self, pos: np.ndarray, sign: int) -> None:
        """Counts the records at ``pos`` in (``sign`` 1: the index points at them now) or out (-1) of their
        segments' live records (with a TTL, their ``alive`` too)."""
        if not pos.size:
            return
        nos = pos // self.segment_rows
        counts = np.bincount(nos)  # segment numbers are few (regions): no sort, as np.unique would
        uniq = np.flatnonzero(counts)
        counts = counts[uniq]
        for no, count in zip(uniq.tolist(), counts.tolist(), strict=True):
            seg = self._segs[no]
            seg.live += sign * count
            if seg.alive is not None:
                seg.alive[(pos if uniq.size == 1 else pos[nos == no]) - seg.base] = sign > 0

    def _retire_empty(self) -> bool:
        """Retires the full segments nothing lives in (holds ``_lock``); whether compaction is due."""
        for seg in self._current():
            if seg is not self._active and seg.used == seg.rows and not seg.live:
                self._retire(seg)
        return self._victim() is not None

    def _retire(self, seg: _Segment) -> None:
        """Removes a segment nothing points at any more (holds ``_lock``): its file goes now, its map (and
        space) once the views that may read it are closed."""
        if self._compacting is not None and self._compacting[0] is seg:
            self._compacting = None
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

    def _victim(self, eager: bool = False) -> _Segment | None:
        """The full segment with the lowest live fraction below ``_COMPACT_BELOW`` (holds ``_writer`` or
        ``_lock``): ``eager``, whenever there is one; else only while the segments hold more than
        ``1 / _COMPACT_BELOW`` times their live records, or take more than ``_EAGER_NEAR_LIMIT`` of the
        limit or of their bytes and the filesystem's free space (``disk_fill``). A segment is then
        compacted when the space is wanted, not as soon as it falls below the fraction: meanwhile more
        of its records die, and fewer are moved (a log-structured store's greedy cleaning: at 2x the
        live records, each compacted segment far less than half live where the rows are rewritten at
        random)."""
        best = None
        held = live = 0
        for seg in self._current():
            held += seg.used
            live += seg.live
            if seg is self._active or seg.used < seg.rows or seg.live >= _COMPACT_BELOW * seg.rows:
                continue
            if best is None or seg.live * best.rows < best.live * seg.rows:
                best = seg
        if best is None or eager or held * _COMPACT_BELOW > live or self.disk_fill() > _EAGER_NEAR_LIMIT:
            return best
        return None

    def disk_fill(self) -> float:
        """The fraction the segments take of the limit, or of their bytes and the free space of the
        filesystem where that is less (a disk whose free space cannot be read counts as full: 1.0)."""
        room = self.disk_bytes
        try:
            st = os.fstatvfs(self._fd)
            room = min(room, self._allocated + st.f_bavail * st.f_frsize)
        except OSError:
            return 1.0
        return self._allocated / room if room else 1.0

    def _compact_step(self, limit_bytes: int = _COMPACT_STEP_BYTES, eager: bool = False) -> bool:
        """Moves up to ``limit_bytes`` of the live records of the segment under compaction (or of the next
        victim, ``_victim(eager)``) after the last records; holds ``_writer``. False: nothing to compact.

        Raises:
            TierFullError: no room to move them (nothing changed).
        """
        if self._compacting is None:
            seg = self._victim(eager)
            if seg is None:
                return False
            self._compacting = (seg, 0)
        seg, start = self._compacting
        end = min(seg.used, start + max(1, limit_bytes // self.slot.itemsize))
        ids = np.array(seg.ids[start:end])
        offs = np.arange(start, end)
        with self._lock:
            at = self._index.positions(ids)
            keep = (at >= 0) & (np.take(self._index.vals, at) == seg.base + offs)
        if keep.any():
            ids, at = ids[keep], at[keep]  # their places hold: only the writer (this step) changes the index
            placed = self._append(ids, seg.recs[offs[keep]], compacting=True)
            with self._lock:
                self._index.vals[at] = placed
                self._count_live(placed, 1)
                self._count_live(seg.base + offs[keep], -1)
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
        if self._compacting is None and self._victim(eager=True) is None:
            return False
        while True:
            seg = self._compacting[0] if self._compacting is not None else None
            if not self._compact_step(self.segment_rows * self.slot.itemsize, eager=True):
                break
            if self._compacting is None or self._compacting[0] is not seg:
                break
        return self._allocated < before

    def compact_now(self) -> None:
        """Compacts every due segment at once (for tests and benchmarks: compaction otherwise runs in its
        thread, a bounded step at a time)."""
        with self._writer:
            while self._compact_step(eager=True):
                pass


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Writes all of ``data`` at ``offset`` (into allocated blocks: a short write is not a full disk).

    Raises:
        OSError: the write failed.
    """
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _highest(dtype: np.dtype) -> np.generic:
    """The largest value of a stamp's dtype (a block with no live record: no bound)."""
    return np.finfo(dtype).max if dtype.kind == "f" else np.iinfo(dtype).max


def _bounds(blocks: int, stamps: np.dtype) -> np.ndarray:
    """A new segment's expiry bounds (``_Segment.bounds``): none yet, each kind's largest value."""
    out = np.empty(blocks, stamps)
    for kind in stamps.names or ():
        out[kind] = _highest(stamps[kind])
    return out


def segment_bytes_bound(live_bytes: int) -> int:
    """The most disk a log tier of ``live_bytes`` of live records takes once compacted: each full
    segment at least ``_COMPACT_BELOW`` live, plus the active one and the headroom (for the docs' sums)."""
    return math.ceil(live_bytes / _COMPACT_BELOW) + 2 * _REGION_MAX_BYTES
