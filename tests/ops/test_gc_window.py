"""GC's plan of the newest part of a lineage, cut where :func:`deck.ops.retention.window.is_cut`
allows, decides about each checkpoint in it exactly what the plan of every record decides
(the retention plan's keep set and what the run deletes, grace period included), on the
generated lineages of tests/ops/test_grace_incremental.py: every cut of every lineage is
tried. ``DECK_GRACE_EXAMPLES`` sets the examples, as there."""

from __future__ import annotations

from hypothesis import event, given
from hypothesis import strategies as st

from deck.format.manifest import Kind
from deck.ops.retention.plan import RetentionPolicy, grace_protected, plan_lineage
from deck.ops.retention.window import is_cut
from deck.read.catalog import ManifestSet
from deck.read.lineage import LineageGraph, build_graph
from tests.ops.test_grace_incremental import draw_any_lineage, draw_policy, draw_times, hyp


def _decisions(
    graph: LineageGraph,
    policy: RetentionPolicy,
    now: float | None,
    times: dict[str, float | None],
) -> tuple[set[str], set[str]]:
    """(the plan's keep set, what GC deletes): GC's decisions before it reads any file."""
    plan = plan_lineage(graph, policy)
    protected = grace_protected(graph, policy, now, times)
    return plan.keep, {i for i in plan.delete if i not in plan.keep and i not in protected}


def _above(ms: ManifestSet, floor: int) -> ManifestSet:
    merged = {i: m for i, m in ms.merged.items() if m.step >= floor}
    trainer = {s: m for s, m in ms.items() if s >= floor}
    ids = {m.id for m in trainer.values()} | set(merged)
    return ManifestSet(trainer, merged, {i: r for i, r in ms.quarantined.items() if i in ids})


def _cuts(
    graph: LineageGraph, policy: RetentionPolicy, now: float | None, times: dict[str, float | None]
) -> list[int]:
    cutoff = now - policy.grace_s if now is not None and policy.grace_s > 0 else None

    def when(cid: str) -> float:
        t = times.get(cid)
        return (now if now is not None else 0.0) if t is None else t

    out = []
    for f in sorted(s for s, n in graph.trainer.items() if n.kind is Kind.FULL):
        below = [
            n for n in graph.nodes.values() if n.step < f and (not n.merged or n.kind is Kind.FULL)
        ]
        every = policy.keep_fulls_every
        if is_cut(
            f,
            [n for n in graph.nodes.values() if n.step >= f],
            newest_below=max(((n.epoch, n.step) for n in below), default=None),
            full_in_period_below=every is not None
            and any(
                n.kind is Kind.FULL and n.quarantined is None and f - f % every <= n.step < f
                for n in graph.nodes.values()
            ),
            keep_last_fulls=policy.keep_last_fulls,
            keep_fulls_every=every,
            cutoff=cutoff,
            when=when,
        ):
            out.append(f)
    return out


def check_every_cut(data: st.DataObject) -> int:
    sim = draw_any_lineage(data)
    now, times = draw_times(data, sim)
    policy = draw_policy(data, sim.clock)
    ms = sim.manifests()
    graph = build_graph(ms)
    keep, doomed = _decisions(graph, policy, now, times)
    cuts = _cuts(graph, policy, now, times)
    for floor in cuts:
        part = build_graph(_above(ms, floor))
        ids = set(part.nodes)
        w_keep, w_doomed = _decisions(part, policy, now, {i: times.get(i) for i in ids})
        assert w_keep == keep & ids, f"cut at {floor}: another keep set"
        assert w_doomed == doomed & ids, f"cut at {floor}: deletes {w_doomed ^ (doomed & ids)}"
    return len(cuts)


@hyp
@given(st.data())
def test_a_cut_lineage_decides_as_the_whole(data: st.DataObject) -> None:
    event(f"cuts tried: {min(check_every_cut(data), 3)}+")
