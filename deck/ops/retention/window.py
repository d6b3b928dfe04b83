"""Where GC's decisions about the newest part of a lineage can be made from that part alone.

A GC run that reads only the newest records (as a restore does: :mod:`deck.read.window`) can
delete only what is in them, and only if its plan of those records decides about each of them
exactly what the plan of every record decides. :func:`is_cut` says when a step ``floor`` is such
a place, from the records at or above it and three facts about those below (the newest trainer
record below it, and whether a full below it shares its ``keep_fulls_every`` period):

1. the trainer's record at ``floor`` is a usable full committed before the grace period began
   (every moment of it saw that record), and no checkpoint at or above ``floor``
   applies on a state below it: no path into a state at or above ``floor`` passes below it, so
   every cheapest chain, restricted chain and restorability question about those states has the
   same answer in both graphs;
2. at least ``keep_last_fulls`` fulls that could be rollback points, each newer (epoch, step),
   and the trainer record of its state too, than every trainer record and full below ``floor`` and committed before the grace period began: the newest
   fulls, the latest step and its active window are above ``floor`` at every moment of the grace
   period, as is the merger's work in progress;
3. with ``keep_fulls_every``: no full below ``floor`` in its period, so the oldest full of each
   period above it is the same in both;
4. the chain-budget walk is reset by the full at ``floor`` (every trainer full is kept and starts
   the count again), so it keeps the same fulls above it;
5. with a grace period: no checkpoint at or above ``floor`` is of an older timeline than the
   newest record below it, so no timeline begun below it within the period holds back one of
   them (what older timelines hold from where a timeline began within the period stays).

Quarantined checkpoints below ``floor`` change nothing above it (chains above do not pass
below it: (1)). An unreadable commit record below it does: the plan of every record then keeps
every checkpoint after it that has no complete chain; so the plan of the part above keeps every
checkpoint there without one (``plan_lineage(unread_below=floor)``), whether or not a record
below is damaged. What is below ``floor`` is left for a run that reads every record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from deck.format.manifest import Kind
from deck.read.lineage import LineageNode

__all__ = ["is_cut"]


def is_cut(
    floor: int,
    above: Iterable[LineageNode],
    *,
    newest_below: tuple[int, int] | None,
    full_in_period_below: bool,
    keep_last_fulls: int,
    keep_fulls_every: int | None,
    cutoff: float | None,
    when: Callable[[str], float],
) -> bool:
    """Whether GC's plan of the checkpoints ``above`` (every checkpoint of a step at or above
    ``floor``, quarantine marks included) decides about each of them what the plan of the whole
    lineage decides (see the module doc). ``newest_below``: the newest (epoch, step) of the
    trainer records and the fulls below ``floor`` (None: none); ``full_in_period_below``: a usable full below ``floor``
    in ``floor``'s ``keep_fulls_every`` period; ``cutoff``: the grace period's start on the clock
    of ``when`` (a checkpoint's commit time), None when no grace period applies."""
    nodes = list(above)
    trainer = {n.step: n for n in nodes if not n.merged}
    anchor = trainer.get(floor)
    if anchor is None or anchor.kind is not Kind.FULL or anchor.quarantined is not None:
        return False
    if cutoff is not None and when(anchor.id) > cutoff:
        return False  # (a moment of the grace period saw another record of its step, or none)
    if any(n.start is not None and n.start[0] < floor for n in nodes):
        return False
    if keep_fulls_every is not None and full_in_period_below:
        return False
    if (
        cutoff is not None
        and newest_below is not None
        and any(n.epoch < newest_below[0] for n in nodes)
    ):
        # A newer timeline below may have begun within the grace period: what the older ones
        # hold from its first step on, some of it here, stays for the period
        # (plan.abandoned_in_period), which only its records below can say
        return False
    rollback_points = {
        n.state
        for n in nodes
        if n.kind is Kind.FULL
        and n.quarantined is None
        and (t := trainer.get(n.step)) is not None
        and t.state == n.state
        # newer than all below as a full (the newest fulls) and as a trainer record (the latest)
        and (newest_below is None or min((n.epoch, n.step), (t.epoch, t.step)) > newest_below)
        and (cutoff is None or when(n.id) <= cutoff)
    }
    return len(rollback_points) >= keep_last_fulls
