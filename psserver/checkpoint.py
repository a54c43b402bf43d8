"""A shard's checkpointer: consistent snapshots of its state, saved atomically, restored at start.

The file format and the resharding of a set of files are ``psserver.ckptfile``'s.

A save writes a temporary file in the same directory, fsyncs it, renames it
into place and fsyncs the directory, so a reader only ever sees whole files: a
``kill -9`` at any moment, during a save too, leaves at worst a stale
``.ckpt-tmp-*`` file (removed at the next start). The last ``keep`` files of
each shard are kept.

Restore (at start): shard ``i`` of ``M`` loads its own newest file (shard ``i``
of ``M``) when that is the newest state there is; a file that fails validation
(a CRC, a shape, a truncated zip) is skipped for the next older one. When the
newest complete set of files was written by a different shard count, the shard
loads its part of that set, resharded (``ckptfile.reshard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pscore.errors import InternalError
from psserver import tables
from psserver.ckptfile import (
    TMP_PREFIX,
    CheckpointError,
    CheckpointFile,
    Snapshot,
    StoredTensor,
    list_files,
    read,
    read_manifest,
    reshard,
    write,
)
from psserver.modes import Mode
from psserver.rows import Export
from psserver.store import Store, Variable

log = logging.getLogger(__name__)

DEFAULT_KEEP = 3


@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    path: Path
    id: int
    num_variables: int
    nbytes: int
    seconds: float


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
    # A tiered table's copy of its rows in memory goes into scratch pages written before updates are held.
    tiered = [v for v in store.variables() if v.dyn is not None and v.dyn.tier is not None]
    staged = await asyncio.to_thread(_stage_exports, tiered)
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
        exports = await asyncio.to_thread(_begin_exports, dynamic_vars, staged)
    # A tiered table's cold rows are read after updates resume (its export pinned them as they were).
    exported = await asyncio.to_thread(_finish_exports, exports)
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


def _stage_exports(variables: list[Variable]) -> dict[str, dict[str, np.ndarray]]:
    """``DynamicRows.stage_export`` of each tiered piece, by name.

    Raises:
        CheckpointError: a disk tier's directory cannot hold the scratch files.
    """
    out = {}
    for v in variables:
        assert v.dyn is not None
        try:
            out[v.spec.name] = v.dyn.stage_export(v)
        except OSError as err:
            raise CheckpointError(f"cannot snapshot dynamic table piece {v.spec.name!r}: {err}") from err
    return out


def _begin_exports(
    variables: list[Variable], staged: Mapping[str, dict[str, np.ndarray]]
) -> list[tuple[Variable, int, int, Export]]:
    """Begins the export of each dynamic table piece (``DynamicRows.begin_export``), with its version.

    Raises:
        CheckpointError: a disk tier's directory cannot hold the export's scratch files.
    """
    out: list[tuple[Variable, int, int, Export]] = []
    try:
        for v in variables:
            assert v.dyn is not None
            out.append((v, v.version, v.iterations, v.dyn.begin_export(v, staged.get(v.spec.name))))
    except (OSError, InternalError) as err:
        for *_, export in out:
            export.close()
        raise CheckpointError(f"cannot snapshot dynamic table piece {v.spec.name!r}: {err}") from err
    return out


def _finish_exports(exports: list[tuple[Variable, int, int, Export]]) -> list[StoredTensor]:
    """Compact copies of dynamic table pieces (``DynamicRows.export``) from their begun exports.

    Raises:
        CheckpointError: a disk tier could not be read, or its directory cannot hold the scratch files.
    """
    out = []
    try:
        for v, version, iterations, export in exports:
            try:
                value, slots, meta = export()
            except (OSError, InternalError) as err:
                raise CheckpointError(f"cannot snapshot dynamic table piece {v.spec.name!r}: {err}") from err
            out.append(StoredTensor(v.spec, value, version, slots, iterations=iterations, rows=meta))
    finally:
        for *_, export in exports:
            export.close()
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
        # (store.changes, variables) at the last save. A store that is still empty and unchanged has nothing
        # to save: a fresh shard writes no empty checkpoint before its variables are created.
        self._saved_at: tuple[int, int] | None = (0, 0)
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
        prefix = f"{TMP_PREFIX}shard{self.shard:05d}-"
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
            # A tiered table's rows may exceed memory: they are re-cut into scratch files of the tier's.
            alloc = self.store.tier.scratch if self.store.tier is not None else np.empty
            return reshard(snaps, self.shard, self.num_shards, alloc)
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
