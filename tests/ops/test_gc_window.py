"""GC's plan of the newest part of a lineage, cut where :func:`deck.ops.retention.window.is_cut`
allows, decides about each checkpoint in it exactly what the plan of every record decides
(the retention plan's keep set and what the run deletes, grace period included; but a
checkpoint without a complete chain, which it keeps: a record below the cut it did not read may
be unreadable, and the plan of every record keeps such a checkpoint then), on the
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
from deck.testing.synth_lineage import LineageSim
from tests.ops.test_grace_incremental import draw_any_lineage, draw_policy, draw_times, hyp


def _decisions(
    graph: LineageGraph,
    policy: RetentionPolicy,
    now: float | None,
    times: dict[str, float | None],
    unread_below: int | None = None,
) -> tuple[set[str], set[str], set[str]]:
    """(the plan's keep set, what GC deletes, what it holds for want of the records below
    ``unread_below``): GC's decisions before it reads any file."""
    plan = plan_lineage(graph, policy, unread_below=unread_below)
    protected = grace_protected(graph, policy, now, times)
    doomed = {i for i in plan.delete if i not in plan.keep and i not in protected}
    return plan.keep, doomed, plan.unread


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
    return assert_cuts_decide_alike(sim, now, times, draw_policy(data, sim.clock))


def assert_cuts_decide_alike(
    sim: LineageSim, now: float | None, times: dict[str, float | None], policy: RetentionPolicy
) -> int:
    """Every cut of ``sim``'s lineage decides as the whole; returns how many there are."""
    ms = sim.manifests()
    graph = build_graph(ms)
    keep, doomed, _ = _decisions(graph, policy, now, times)
    cuts = _cuts(graph, policy, now, times)
    for floor in cuts:
        part = build_graph(_above(ms, floor))
        ids = set(part.nodes)
        w_keep, w_doomed, held = _decisions(
            part, policy, now, {i: times.get(i) for i in ids}, floor
        )
        # The same, but what lacks a chain: a record below the cut may be unreadable, and the
        # plan of every record keeps that (tests/ops/test_gc_newest.py)
        assert w_keep - held == keep & ids, f"cut at {floor}: another keep set"
        assert w_doomed == (doomed & ids) - held, (
            f"cut at {floor}: deletes {w_doomed ^ (doomed & ids)}"
        )
        assert not held & keep, "what the plan keeps anyway is not held"
    return len(cuts)


@hyp
@given(st.data())
def test_a_cut_lineage_decides_as_the_whole(data: st.DataObject) -> None:
    event(f"cuts tried: {min(check_every_cut(data), 3)}+")


def test_a_cut_below_a_full_saved_again_during_the_grace_period() -> None:
    """Found by the test above (15,000 examples): the full at the cut was committed during the
    grace period (a rollback saved its step again), so a moment of the period saw another
    record there, whose chain went below the cut; the cut's plan protected a checkpoint the
    whole plan deletes. A cut's full is now one committed before the period began."""
    sim = LineageSim(seed=473)
    sim.save("full", nbytes=2)

    def delta() -> None:
        sim.train()
        sim.save("delta", nbytes=1)

    def merged(i: int, j: int) -> None:
        states = sorted(m.state for m in sim.trainer.values())
        start, end = states[i], states[j]
        sim.commit_merger(Kind.MERGED, start=start, state=end, first_step=1, layer=1, nbytes=1)

    delta()
    sim.quarantine("01c49fc10dc7becd")
    delta()
    delta()
    merged(0, 1)
    sim.rollback(0)
    sim.train()
    sim.save("delta", nbytes=2)
    delta()
    delta()
    sim.commit_merger(Kind.FULL, start=None, state=(0, "57bf3cef56199df3"), nbytes=1)
    delta()
    delta()
    sim.train()
    sim.save("full", nbytes=2)
    delta()
    merged(0, 1)
    delta()
    sim.commit_merger(Kind.FULL, start=None, state=(6, "48aace495fdad0ef"), nbytes=4)
    sim.commit_merger(Kind.FULL, start=None, state=(0, "57bf3cef56199df3"), nbytes=1)
    sim.quarantine("01b310a1e5867a9c")
    delta()
    delta()
    sim.rollback(7)
    sim.train()
    sim.save("delta", nbytes=2)
    delta()
    ids = sorted(sim.committed_at)
    times: dict[str, float | None] = {i: sim.committed_at[i] for i in ids}
    times[ids[5]] = sim.committed_at["01b310a1e5867a9c"]
    policy = RetentionPolicy(
        keep_last_fulls=1,
        keep_fulls_every=None,
        keep_all_steps=False,
        chain_delta_budget=None,
        keep_merged_deltas=False,
        grace_s=0.5,
        max_clock_skew_s=None,
    )
    assert assert_cuts_decide_alike(sim, 10.0, times, policy) >= 1
