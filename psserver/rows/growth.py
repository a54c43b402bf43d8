"""An unbounded piece's growth in memory: larger storage holding every row, slot and counter, made
where it may run in another thread (``grown``), then taken at once (``adopt``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from psserver.hashindex import HashIndex
from psserver.rows.config import Holder, pow2
from psserver.tier import anonymous_array


@dataclasses.dataclass(frozen=True)
class Grown:
    """A piece's larger storage (``DynamicRows.grown``), for ``DynamicRows.adopt``."""

    old: int  # rows allocated when it was made
    values: np.ndarray
    slots: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray]  # the per-row bookkeeping arrays, by attribute name
    free: np.ndarray
    index: HashIndex


class Growth:
    """``DynamicRows``' storage: made for its rows, and grown."""

    def new_storage(self, optimizer: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Zeroed row storage and slots for the allocated rows (pages stay untouched until written)."""
        return self._storage(optimizer, self.allocated)

    def _storage(
        self, optimizer: Any, rows: int, zeros: Callable[..., np.ndarray] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        dim = self.config.dim
        zeros = zeros or (anonymous_array if self.hot_rows else np.zeros)
        small = optimizer.init_slots(np.zeros((1, dim), self.dtype))
        slots = {k: (zeros((rows, dim), a.dtype) if a.shape == (1, dim) else a) for k, a in small.items()}
        return zeros((rows, dim), self.dtype), slots

    def grown(self, holder: Holder, optimizer: Any, rows: int) -> Grown:
        """Storage of ``rows`` rows holding every row, slot and counter of the piece, for ``adopt``.

        Reads the piece and changes nothing: it may run in another thread while nothing updates the
        piece (lookups read the old storage meanwhile).
        """
        assert self.tier is None, "a tiered piece claims rows of its mapped arrays (``_claim``)"
        old = self.allocated
        # np.empty, then two assignments: numpy lets go of the GIL for those (not for np.zeros's memset of
        # reused heap memory), so the event loop runs on while another thread grows the piece.
        values, slots = self._storage(optimizer, rows, np.empty)
        for new, now in [(values, holder.state[0]), *((slots[k], a) for k, a in holder.slots.items())]:
            if now.shape == (old, self.config.dim):
                new[:old] = now
                new[old:] = 0
        slots.update({k: a for k, a in holder.slots.items() if a.shape != (old, self.config.dim)})
        arrays = {}
        names = ("slot_ids", "last_step", "hits", "last_time", "live", "on_disk", "disk_place", "disk_stamps")
        for name in names:
            arr = getattr(self, name)
            if arr is not None:
                arrays[name] = np.empty(rows, arr.dtype)
                arrays[name][:old] = arr
                arrays[name][old:] = 0
        free = np.empty(rows, np.int64)
        free[: rows - old] = np.arange(rows - 1, old - 1, -1)
        free[rows - old : rows - old + self.nfree] = self.free[: self.nfree]
        index = HashIndex(rows)  # sized for the new rows, as a new piece's: no rebuild on the way to them
        index.insert(*self.index.items())
        return Grown(old, values, slots, arrays, free, index)

    def adopt(self, holder: Holder, grown: Grown) -> None:
        """Takes the larger storage ``grown`` made (nothing may have changed the piece since)."""
        assert grown.old == self.allocated, "the piece changed while its larger storage was made"
        for name, arr in grown.arrays.items():
            setattr(self, name, arr)
        rows = grown.values.shape[0]
        self.index = grown.index
        self.free = grown.free
        self.nfree += rows - grown.old
        self.limit = rows
        holder.state = (grown.values, holder.state[1])
        holder.slots = grown.slots

    def _grow(self, holder: Holder, optimizer: Any, rows_needed: int) -> None:
        """Unbounded tables in memory: more rows (at least doubling), keeping every row, slot and counter."""
        self.adopt(holder, self.grown(holder, optimizer, max(2 * self.allocated, pow2(rows_needed))))
