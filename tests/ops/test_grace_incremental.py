"""The retention plan, cheapest chains and GC's grace-period protection make exactly the
decisions of the frozen reference (deck/testing/grace_reference.py: every moment of the grace
period planned from scratch, paths as whole tuples), on generated lineages.

Lineages: :class:`deck.testing.synth_lineage.LineageSim` (the writers' records without data):
trainer deltas and fulls, rollbacks (abandoned timelines, steps saved again), merger passes of
the real planner with drawn strides and full policies (committing all or some of what is ready),
quarantined checkpoints; commit times on a drawn clock (equal times, times after ``now``,
unknown times), every :class:`RetentionPolicy` field, damaged records and unusable checkpoints
for the plan. ``DECK_GRACE_EXAMPLES`` (default 40) sets the examples per test; each failure
found is pinned below as a regular test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deck.format.manifest import Kind
from deck.merge.policy import FullPolicy, MergeConfig
from deck.ops.retention import gc as gc_module
from deck.ops.retention.gc import collect_garbage
from deck.ops.retention.grace import _Replay
from deck.ops.retention.plan import RetentionPolicy, grace_protected, plan_lineage, takeovers
from deck.read.lineage import LineageGraph, build_graph
from deck.storage import LocalStorage
from deck.testing.grace_reference import (
    reference_chain_ids,
    reference_grace_protected,
    reference_moment,
    reference_plan_lineage,
    reference_takeovers,
)
from deck.testing.synth_lineage import LineageSim

EXAMPLES = int(os.environ.get("DECK_GRACE_EXAMPLES", "40"))
RANDOM = os.environ.get("DECK_FUZZ_RANDOM") == "1"

hyp = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def draw_lineage(data: st.DataObject, max_ops: int = 40) -> LineageSim:
    """A trainer and merger workers' history: saves, rollbacks, merges, quarantines."""
    sim = LineageSim(
        seed=data.draw(st.integers(0, 2**16), label="seed"),
        full_bytes=data.draw(st.sampled_from([100, 4_000_000]), label="full_bytes"),
        # Tiny sizes make equal costs (ties) common, the tie-breaks then decide
        delta_fraction=data.draw(st.sampled_from([(0.01, 0.04), (0.1, 0.1), (0.2, 0.5)])),
        # A merged delta as large as its inputs costs what they do: more ties
        merged_fraction=data.draw(st.sampled_from([(0.55, 0.95), (1.0, 1.0), (0.5, 0.5)])),
    )
    stride = data.draw(st.integers(2, 4), label="stride")
    full = data.draw(
        st.sampled_from(
            [
                FullPolicy(every=None, max_live_fraction=None),
                FullPolicy(every=3, max_live_fraction=None),
                FullPolicy(every=7, max_live_fraction=None),
                FullPolicy(),
                FullPolicy(max_live_fraction=None, cost_ratio=3.0),
            ]
        ),
        label="full policy",
    )
    config = MergeConfig(stride=stride, full=full)
    sim.save("full")
    alphabet = st.sampled_from(
        ["delta"] * 5 + ["merge"] * 2 + ["full", "rollback", "merge_some", "quarantine", "same"]
    )
    for _ in range(data.draw(st.integers(4, max_ops), label="ops")):
        op = data.draw(alphabet)
        if op in ("delta", "full", "same"):
            sim.train()
            # "same": committed at the same store time as the commit before it
            sim.save("full" if op == "full" else "delta", at=sim.clock if op == "same" else None)
        elif op == "rollback":
            steps = sorted(sim.trainer)
            sim.rollback(data.draw(st.sampled_from(steps), label="rollback to"))
            sim.train()
            sim.save(data.draw(st.sampled_from(["delta", "full"]), label="kind after rollback"))
        elif op in ("merge", "merge_some"):
            limit = None if op == "merge" else data.draw(st.integers(1, 3), label="items")
            sim.merge(config, max_items=limit)
        else:
            ids = sorted(sim.committed_at)
            sim.quarantine(data.draw(st.sampled_from(ids), label="quarantined"))
    return sim


def draw_wild_lineage(data: st.DataObject, max_nodes: int = 30) -> LineageSim:
    """A lineage the writers would hardly make, for the tie-breaks: sizes of 1 to 3 bytes (equal
    costs and lengths everywhere), merged deltas and merger fulls between any states of the
    trainer's records, several of them per state."""
    sim = LineageSim(seed=data.draw(st.integers(0, 2**16), label="seed"))
    sim.save("full", nbytes=data.draw(st.integers(2, 4)))
    for _ in range(data.draw(st.integers(2, max_nodes), label="nodes")):
        op = data.draw(st.sampled_from(["delta", "delta", "full", "rollback", "merged", "mfull"]))
        states = sorted(m.state for m in sim.trainer.values())
        if op in ("delta", "full"):
            sim.train()
            sim.save(
                op, nbytes=data.draw(st.integers(1, 3) if op == "delta" else st.integers(2, 4))
            )
        elif op == "rollback":
            sim.rollback(data.draw(st.sampled_from(sorted(sim.trainer))))
            sim.train()
            sim.save(data.draw(st.sampled_from(["delta", "full"])), nbytes=2)
        elif op == "merged" and len(states) >= 2:
            i = data.draw(st.integers(0, len(states) - 2))
            j = data.draw(st.integers(i + 1, len(states) - 1))
            start, end = states[i], states[j]
            sim.commit_merger(
                Kind.MERGED,
                start=start,
                state=end,
                first_step=data.draw(st.integers(start[0] + 1, end[0])),
                layer=data.draw(st.integers(1, 3)),
                nbytes=data.draw(st.integers(1, 3)),
            )
        elif op == "mfull":
            sim.commit_merger(
                Kind.FULL,
                start=None,
                state=data.draw(st.sampled_from(states)),
                nbytes=data.draw(st.integers(1, 4)),
            )
        if data.draw(st.integers(0, 9)) == 0:
            sim.quarantine(data.draw(st.sampled_from(sorted(sim.committed_at))))
    return sim


def draw_any_lineage(data: st.DataObject) -> LineageSim:
    if data.draw(st.integers(0, 2), label="wild") == 0:
        return draw_wild_lineage(data)
    return draw_lineage(data)


def draw_times(
    data: st.DataObject, sim: LineageSim
) -> tuple[float | None, dict[str, float | None]]:
    """``now`` and the commit times GC would read (the store's clock): the simulator's, with
    some unknown (None or absent), some moved (after ``now``, or equal to another's)."""
    clock = sim.clock
    now = data.draw(
        st.sampled_from([None, clock, clock + 0.5, clock - 1.0, clock / 2])
        | st.floats(0.0, clock + 3.0, allow_nan=False),
        label="now",
    )
    times: dict[str, float | None] = {}
    ids = sorted(sim.committed_at)
    for cid in ids:
        how = data.draw(
            st.sampled_from(["own"] * 8 + ["unknown", "absent", "future", "equal"]), label="time"
        )
        if how == "own":
            times[cid] = sim.committed_at[cid]
        elif how == "unknown":
            times[cid] = None
        elif how == "future":
            times[cid] = (now if now is not None else clock) + data.draw(st.floats(0.1, 5.0))
        elif how == "equal":
            times[cid] = sim.committed_at[data.draw(st.sampled_from(ids))]
    return now, times


def draw_policy(data: st.DataObject, horizon: float) -> RetentionPolicy:
    return RetentionPolicy(
        keep_last_fulls=data.draw(st.integers(1, 3), label="keep_last_fulls"),
        keep_fulls_every=data.draw(st.none() | st.integers(1, 12), label="keep_fulls_every"),
        keep_all_steps=data.draw(st.booleans(), label="keep_all_steps"),
        chain_delta_budget=data.draw(
            st.none() | st.sampled_from([0.05, 0.5, 1.0, 4.0]), label="chain_delta_budget"
        ),
        keep_merged_deltas=data.draw(st.booleans(), label="keep_merged_deltas"),
        grace_s=data.draw(
            st.sampled_from([0.0, 0.5, 1.0, 3.0, horizon / 2, horizon + 5.0])
            | st.floats(0.0, horizon + 5.0),
            label="grace_s",
        ),
        max_clock_skew_s=data.draw(st.none() | st.just(900.0), label="max_clock_skew_s"),
        verify_replacements=data.draw(st.booleans(), label="verify_replacements"),
    )


def assert_same_plan(graph: LineageGraph, policy: RetentionPolicy, **kw: object) -> None:
    new = plan_lineage(graph, policy, **kw)  # type: ignore[arg-type]
    ref = reference_plan_lineage(graph, policy, **kw)  # type: ignore[arg-type]
    assert new == ref


def assert_same_protection(
    graph: LineageGraph,
    policy: RetentionPolicy,
    now: float | None,
    times: dict[str, float | None],
) -> None:
    new = grace_protected(graph, policy, now, times)
    ref = reference_grace_protected(graph, policy, now, times)
    assert new == ref, (sorted(new - ref), sorted(ref - new))
    # What GC uses of it
    plan = plan_lineage(graph, policy)
    assert new & set(plan.delete) == ref & set(plan.delete)


@hyp
@given(st.data())
def test_grace_protection_and_plan_match_the_reference(data: st.DataObject) -> None:
    sim = draw_any_lineage(data)
    graph = sim.graph()
    now, times = draw_times(data, sim)
    policy = draw_policy(data, sim.clock)
    assert_same_protection(graph, policy, now, times)
    assert_same_plan(graph, policy)
    # The plan with damaged trainer records and checkpoints found unusable (GC's replans)
    ids = sorted(graph.nodes)
    unusable = {i: "damaged (drawn)" for i in data.draw(st.lists(st.sampled_from(ids)))}
    damaged = {
        s: "could not be read (drawn)"
        for s in data.draw(st.lists(st.integers(0, max(graph.trainer, default=0) + 1)))
    }
    assert_same_plan(graph, policy, damaged=damaged, unusable=unusable)
    # The trainer deltas GC checks before deleting merger checkpoints (any doomed set)
    plan = plan_lineage(graph, policy)
    doomed = {i: "drawn" for i in data.draw(st.lists(st.sampled_from(ids)), label="doomed")}
    doomed.update(plan.delete)
    assert takeovers(graph, plan, doomed) == reference_takeovers(graph, plan, doomed)


def test_a_takeover_from_a_trainer_full_reads_that_full_in_the_reference_too() -> None:
    """Found by ``make fuzz-gc GC_EXAMPLES=300 FUZZ_SEED=3162808934``: the reference of the
    takeovers still left out the trainer full a takeover's chain starts from, which GC reads
    whole since a damaged one took over from a deleted merger full."""
    sim = LineageSim(seed=0)
    sim.save("full")
    for _ in range(6):
        sim.train()
        sim.save("delta")
    sim.merge(MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None)))
    graph = sim.graph()
    merged = [i for i, n in graph.nodes.items() if n.merged and n.kind is not Kind.FULL]
    assert merged
    plan = plan_lineage(graph, RetentionPolicy(grace_s=0.0, keep_all_steps=True))
    doomed = dict.fromkeys(merged, "drawn")
    got = takeovers(graph, plan, doomed)
    assert got == reference_takeovers(graph, plan, doomed)
    assert any(graph.nodes[i].kind is Kind.FULL for i in got)


def test_a_merger_full_below_which_everything_is_quarantined_opens_the_states_after_it() -> None:
    """Found by ``make fuzz-gc GC_EXAMPLES=300 FUZZ_SEED=3013470780``: with the only trainer
    full quarantined no state had a way in, and the replay took the first update that found one
    (a merger full committed later, at step 1) for the first of all, which needs no following:
    the delta of step 2 built on step 1 stayed unreachable, the latest was step 1 and its chain
    went unprotected. Every moment now matches the reference."""
    sim = LineageSim(seed=0)
    full = sim.save("full")
    sim.quarantine(full.id)
    sim.train()
    one = sim.save("delta")
    sim.train()
    sim.save("delta")
    sim.commit_merger(Kind.FULL, start=None, state=one.state, nbytes=1)
    graph = sim.graph()
    times = {i: t for i, t in sim.committed_at.items() if i in graph.nodes}
    policy = RetentionPolicy(grace_s=sim.clock, keep_all_steps=False)
    replay = _Replay(graph, policy, set())
    for moment in sorted(set(times.values())):
        replay.add([n for n in graph.nodes.values() if times[n.id] == moment])
        ref = reference_moment(graph.as_of(moment, times.__getitem__), policy)
        assert (replay.latest.step if replay.latest else None) == ref.latest
        assert {st: b.path for st, b in replay.any.best.items()} == ref.paths
    assert ref.latest == 2
    assert_same_protection(graph, policy, sim.clock + 1.0, dict(times))


def test_a_rollback_to_a_quarantined_full_leaves_no_latest_in_the_reference_either() -> None:
    """Found by ``make fuzz-gc GC_EXAMPLES=3000 FUZZ_SEED=1937953168``: a rollback from step 8
    to step 0, whose full was then quarantined. The steps the rollback left (5 to 8) are no
    latest any more (a rollback's timeline made unrestorable must not send the latest back
    onto the one it left), so the plan has no latest and keeps everything; the reference still
    took step 8 for the latest and would have deleted steps 5 to 7."""
    sim = LineageSim(seed=8, full_bytes=100)
    full = sim.save("full")
    for _ in range(7):
        sim.train()
        sim.save("delta")
    sim.train()
    sim.save("full")
    sim.rollback(0)
    for _ in range(4):
        sim.train()
        sim.save("delta")
    sim.quarantine(full.id)
    graph = sim.graph()
    policy = RetentionPolicy(keep_last_fulls=1, grace_s=0.0)
    assert graph.abandoned() >= {5, 6, 7, 8}
    assert_same_plan(graph, policy)
    plan = plan_lineage(graph, policy)
    assert plan.latest is None and not plan.delete


def test_a_moment_a_rollback_left_without_a_latest_protects_everything_before_it() -> None:
    """Found by ``make fuzz-gc GC_EXAMPLES=3000 FUZZ_SEED=1937953168`` once the latest skipped
    the steps a newer timeline left: with the only full quarantined, a rollback to it left the
    moment without a latest after moments that had one. The plan of such a moment keeps
    everything; the replay protected only that moment's commits (it took "no latest" to mean
    that no moment before had one either) and let the quarantined full go."""
    sim = LineageSim(seed=7, full_bytes=100)
    full = sim.save("full")

    def deltas(n: int) -> None:
        for _ in range(n):
            sim.train()
            sim.save("delta")

    deltas(2)
    sim.quarantine(full.id)
    deltas(2)
    for to, after in ((2, 15), (0, 5)):
        sim.rollback(to)
        deltas(after)
    sim.train()
    sim.save("full")
    deltas(1)
    sim.rollback(0)
    deltas(2)
    graph = sim.graph()
    policy = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=3.0)
    times: dict[str, float | None] = dict(sim.committed_at)
    assert full.id in reference_grace_protected(graph, policy, sim.clock, times)
    assert_same_protection(graph, policy, sim.clock, times)


@hyp
@given(st.data())
def test_each_moment_of_the_replay_matches_the_reference(data: st.DataObject) -> None:
    """White box: after every moment of the grace period, the replay's latest, window, kept
    fulls, restricted set and cheapest paths (both) are the reference's for that moment's
    lineage, and what it protected so far is the union of the reference's moments so far."""
    sim = draw_any_lineage(data)
    graph = sim.graph()
    times = {i: t for i, t in sim.committed_at.items() if i in graph.nodes}
    policy = draw_policy(data, sim.clock)
    moments = sorted(set(times.values()))
    start = data.draw(st.sampled_from(moments), label="first moment")
    replay = _Replay(graph, policy, set())
    union: set[str] = set()
    for moment in [m for m in moments if m >= start]:
        replay.add(
            [
                n
                for n in graph.nodes.values()
                if times[n.id] == moment or (moment == start and times[n.id] < start)
            ]
        )
        then = graph.as_of(moment, times.__getitem__)
        ref = reference_moment(then, policy)
        union |= ref.protected
        assert replay.protected == union, (moment, sorted(replay.protected ^ union))
        assert (replay.latest.step if replay.latest else None) == ref.latest
        if ref.latest is None:
            continue
        assert sorted(w.step for w in replay.window) == ref.window
        assert replay.anchor == ref.anchor
        assert sorted(f.id for f in replay.kept.values()) == ref.kept_fulls
        assert replay.excluded & set(then.nodes) == ref.restricted
        assert {st: b.path for st, b in replay.any.best.items()} == ref.paths
        assert {st: b.path for st, b in replay.restricted.best.items()} == ref.restricted_paths


@hyp
@given(st.data())
def test_cheapest_chains_match_the_reference(data: st.DataObject) -> None:
    sim = draw_any_lineage(data)
    graph = sim.graph()
    ids = sorted(graph.nodes)
    exclude = frozenset(data.draw(st.lists(st.sampled_from(ids), max_size=6), label="exclude"))
    for ex in (frozenset(), exclude):
        for step in sorted(graph.trainer):
            want = reference_chain_ids(graph, step, ex)
            # From the part of the lineage the chain can come from (a graph whose paths are not
            # known: a restore's), and, after a few asked, from every path computed once
            assert sim.graph()._chain_ids(step, ex) == want, step
            assert graph._chain_ids(step, ex) == want, step


@settings(
    max_examples=max(3, EXAMPLES // 8),
    deadline=None,
    derandomize=not RANDOM,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_gc_dry_run_reports_what_the_reference_makes_it_report(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """GC end to end at a local store (records with their commit times as file times): the
    same report with the product's protection and with the reference's."""
    sim = draw_lineage(data, max_ops=25)
    storage = LocalStorage(tmp_path_factory.mktemp("gc") / "store")
    sim.write(storage, files=False)
    policy = draw_policy(data, sim.clock)
    now = sim.clock + data.draw(st.floats(-3.0, 3.0), label="now after the last commit")
    new = collect_garbage(storage, policy, dry_run=True, now=now)
    saved = gc_module.grace_protected
    try:
        gc_module.grace_protected = reference_grace_protected  # type: ignore[assignment]
        ref = collect_garbage(storage, policy, dry_run=True, now=now)
    finally:
        gc_module.grace_protected = saved
    assert new == ref


def test_the_simulator_commits_what_the_planner_would_build(tmp_path: Path) -> None:
    """The block layout of :meth:`LineageSim.merge_blocks` (the benchmark's long histories) is
    the planner's: the same merged deltas and merger fulls, ids included, as passes of the real
    planner after every save."""
    for seed, stride, every in [(0, 2, None), (1, 3, 5), (2, 4, 9), (3, 2, 17)]:
        a, b = LineageSim(seed=seed), LineageSim(seed=seed)
        config = MergeConfig(stride=stride, full=FullPolicy(every=every, max_live_fraction=None))
        for i in range(60):
            for sim in (a, b):
                sim.train()
            kind = "full" if i % 37 == 36 else "delta"
            a.save(kind)
            while a.merge(config):
                pass
            b.merge_blocks(b.save(kind), stride=stride, full_every=every)
        assert set(a.merged) == set(b.merged), (seed, stride, every)


def test_a_long_job_with_a_merger_and_rollbacks_protects_what_the_reference_does() -> None:
    """The benchmark's job in small (benchmarks/bench_history_scale.py): a delta a second, a
    full every 50 steps, a merger of stride 4 with a full every 32 deltas 5 saves behind, a
    rollback every 150 saves; 500 checkpoints, grace periods over the last 100 commits and the
    last 15, three policy shapes."""
    sim = LineageSim(seed=7)
    last = sim.save("full")
    saves = 0
    while len(sim.committed_at) < 500:
        saves += 1
        if saves % 150 == 0:
            sim.rollback(sim.step - 30)
        sim.train()
        last = sim.save("full" if sim.step % 50 == 0 else "delta")
        sim.merge_blocks(last, stride=4, full_every=32, lag=5)
    graph = sim.graph()
    now = sim.clock + 1.0
    for grace in (100.0, 15.0):
        for policy in (
            RetentionPolicy(grace_s=grace),
            RetentionPolicy(grace_s=grace, keep_merged_deltas=False, chain_delta_budget=1.0),
            RetentionPolicy(grace_s=grace, keep_all_steps=False, keep_fulls_every=200),
        ):
            assert_same_protection(graph, policy, now, dict(sim.committed_at))


def test_the_active_window_ends_on_merged_records_naming_each_other() -> None:
    """Hostile storage: two merged records naming each other as inputs (forged or damaged)
    end the window walk's look through merged deltas instead of looping for ever."""
    from dataclasses import replace

    from deck.ops.retention.active import _merged_trainer

    sim = LineageSim(seed=5)
    sim.save("full", nbytes=2)
    for _ in range(2):
        sim.train()
        sim.save("delta", nbytes=1)
    graph = build_graph(sim.manifests())
    a, b = (
        replace(n, merged=True, inputs=(other,))
        for n, other in [(graph.trainer[1], "b"), (graph.trainer[2], "a")]
    )
    graph.nodes["a"], graph.nodes["b"] = replace(a, id="a"), replace(b, id="b")
    assert _merged_trainer(graph, graph.nodes["a"]) == []
