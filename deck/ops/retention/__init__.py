"""Retention and garbage collection: what stays restorable, and deleting everything else.

Two modules: :mod:`deck.ops.retention.plan` decides (:class:`RetentionPolicy`, pure functions of
the lineage graph), :mod:`deck.ops.retention.gc` acts (:func:`collect_garbage`: lists, checks,
deletes). Both are re-exported here, the names users import.

Retention rules (:class:`RetentionPolicy`; docs/operations.md, "Retention and GC"):

- ``keep_all_steps`` (the default): every trainer checkpoint that is restorable now stays
  restorable (IncrCP's "recover any checkpoint"), through the kept fulls and the trainer's
  deltas, with a full kept wherever the deltas since the previous one add up to
  ``chain_delta_budget`` fulls (so old steps restore from a bounded chain). GC deletes what the
  merger superseded (merged deltas consumed by the next layer, merger fulls no longer needed)
  and orphans. Deleting training history is an operator's decision, as in Orbax's and
  torchsnapshot's defaults, never the library's.
- Bounded (``keep_all_steps=False``, DECK fig. 9) keeps only:

  - **the active window**: the newest restorable trainer checkpoint ("latest"), every trainer
    checkpoint between it and its newest full (a merger full or the trainer's), and the
    checkpoints of latest's cheapest chain: every step of the window restores, the latest
    fastest;
  - **rollback fulls**: the newest ``keep_last_fulls`` fulls, and with ``keep_fulls_every = N``
    the oldest full of every N-step period, each with the trainer checkpoint of its step (whose
    folder holds that step's dense and extra state).

Everything committed that no retained step needs is deleted -- only ever because something
committed replaces it, and never what the lineage *grace_s* seconds ago needed (a trainer that
just restored, or a restore in progress, may still be reading it). Deleting a checkpoint removes
its ``manifest.json`` first, so a crash mid-way leaves an orphan folder, never a broken record.

Orphans: attempt folders no record references (failed or crashed saves, merger attempts),
uncommitted step folders once a later step is committed, uncommitted merger folders, and
partition records of committed merger checkpoints -- all only once every file in them is older
than ``grace_s`` (their writer may still be running).
"""

from deck.ops.retention.gc import GcReport, collect_garbage, file_age_s
from deck.ops.retention.plan import (
    RetentionPlan,
    RetentionPolicy,
    grace_protected,
    plan_lineage,
    plan_retention,
    replacements,
)

__all__ = [
    "GcReport",
    "RetentionPlan",
    "RetentionPolicy",
    "collect_garbage",
    "file_age_s",
    "grace_protected",
    "plan_lineage",
    "plan_retention",
    "replacements",
]
