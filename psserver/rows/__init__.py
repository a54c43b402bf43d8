"""Dynamic embedding table pieces: 64-bit ids -> preallocated rows, with admission, eviction and expiry.

One shard's piece of a dynamic table (``ps_pb2.DynamicTable``; see
``pscore.placement`` for which shard holds an id) is a ``DynamicRows``:

- row storage preallocated for the shard's capacity (``ceil(capacity / S)``
  rows; an unbounded table starts small and doubles), with the optimizer's
  slots beside it, so memory is bounded by the capacity whatever ids arrive;
- an id -> slot map (``HashIndex``: buckets of 8 places, two buckets an id,
  no tombstones; a batch of ids looked up in one gather), and per slot its id, the
  table's push count at its last update (``last_step``), its number of
  updates (``hits``) and the time of its last update;
- with ``min_count > 1``, a count-min sketch (``CountMinSketch``) that counts
  the pushes of ids that have no row yet.

Every change happens when a push is applied (``prepare`` / ``write``), as a
function of the pushed ids, the table's push count and the push's time only:
lookups change nothing. So a backup replaying its primary's pushes (with the
primary's times) and a shard restored from a checkpoint and fed the same
pushes hold the same rows. An applied push, in order:

1. Rows of pushed ids that exist are marked updated (``last_step``, ``hits``, time).
2. Absent ids are counted in the sketch; those seen in at least ``min_count``
   pushes are admitted, the others' updates dropped (``dropped_updates``).
3. Every ``max(1, ttl_steps // 8)`` pushes (or ``ttl_seconds / 8`` seconds) a
   sweep removes the rows not updated for ``ttl_steps`` pushes (or
   ``ttl_seconds``): a row lives between its TTL and 9/8 of it.
4. If the admitted ids do not fit, rows are evicted: LRU (least recently
   updated first) or LFU (fewest updates, then least recent), ties by smallest
   id, never a row of this push; ``capacity // 64`` extra rows are evicted at
   once so that a stream of new ids pays the selection (one pass over the
   shard's rows) once per many pushes. A push with more new ids than the shard
   holds admits the smallest ids that fit and drops the rest.
5. New rows get the table's initializer row (a function of the table name
   and the id: the same on every process) and fresh optimizer slots; then the
   optimizer's row rule updates every kept row (``write``).

With a disk tier (``psserver.tier``; a shard started with ``--table-memory``,
for tables without a capacity) the rows live in two places: at most ``limit``
in memory (the piece's claim on the shard's budget, ``TierBudget``, which grows
while the budget has room), the others on disk, each row in exactly one.
Where a row lives changes nothing of the above: a push first fills its cold
rows back into memory (one batched read), claiming more of the budget or
spilling rows it does not touch by the eviction policy to make room, and
deleting the rows an expiry sweep removes from both tiers (one write
transaction, before anything else changes: ``tier_step``, its disk reads and
its write in a worker thread); then steps 1-5 run as for an unbounded table in
memory. So a tiered piece holds bit-for-bit the rows, slots and counters an
unbounded in-memory piece fed the same pushes holds. Lookups and scans read
cold rows without filling them.

A lookup of an id without a row returns its initializer row (what its row
would start from). The sketch's counters halve whenever it has counted as
many ids as it has columns, so admission counts recent pushes (an id must
recur within about ``width`` counted ids, ``2 x`` the shard's capacity).

The modules, one job each (``DynamicRows`` is made of their mixins, whose
methods call each other directly: no layer between them):

- ``config``: the piece's settings (``Config``), counters (``Stats``), ``Holder`` and ``Work``;
- ``piece``: ``DynamicRows``, its state (the id index, per-row bookkeeping, free rows) and counts;
- ``budget``: the bytes it holds in memory and a tiered piece's claim on the shard's budget;
- ``reads``: lookups and scans;
- ``push``: a push's plan and its steps 1-5 (``update``, ``plan``, ``prepare``);
- ``tiering``: the disk tier, a push's fill and spill (``tier_step``), rows as records; a tiered piece's
  id index is the index of both tiers (an id's row in memory, or its record's place in the tier's index:
  ``on_disk_entries``), so a fill and a spill change values, not entries;
- ``growth``: an unbounded piece's larger storage;
- ``export``: export and load (checkpoints, backups, ``ExportTable``);
- ``select``: choosing rows by the eviction policy's keys in one pass.

The id index (``psserver.hashindex``; the log tier's index too) and the
admission sketch (``psserver.sketch``; checkpoints' re-sharding merges them)
are modules of their own beside this package.
"""

from psserver.rows.config import Config, Holder, Stats, Work
from psserver.rows.export import Export
from psserver.rows.growth import Grown
from psserver.rows.piece import DynamicRows
from psserver.rows.push import PushPlan
from psserver.rows.reads import RowRead

__all__ = ["Config", "DynamicRows", "Export", "Grown", "Holder", "PushPlan", "RowRead", "Stats", "Work"]
