"""GC of the newest steps on random histories (rollbacks near and far, merger lag, pauses,
abandoned attempts) with random policies, grace periods and store times: each run deletes the
whole run's deletions at and above its cut (but what it leaves for want of a chain), and after
it ran every step the whole plan retained still restores, and a windowed restore plans the
chain every record plans. Written by a break-it run; ``DECK_GC_SEEDS`` histories (default 8)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import deck.read.indexed
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.ops.retention.gc import GcReport
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph, cheapest_chain
from deck.read.window import read_window
from deck.storage import LocalStorage
from deck.testing.synth_lineage import CheckpointFiles, LineageSim, writer_checkpoint
from tests.ops.test_gc_newest import label_step


@pytest.fixture(scope="module")
def files() -> CheckpointFiles:
    return writer_checkpoint(world_size=2)


def _history(
    rng: random.Random, root: Path, files: CheckpointFiles
) -> tuple[LineageSim, LocalStorage]:
    sim = LineageSim(seed=rng.getrandbits(32), files=files)
    n = rng.randint(250, 450)
    full_every = rng.choice([10, 25, 40, 1000])
    merge_full = rng.choice([None, 16, 8])
    lag = rng.randint(0, 6)
    merging = rng.random() < 0.8
    last = sim.save("full")
    saves = 1
    while saves < n:
        r = rng.random()
        if r < 0.03 and sim.step > 20:  # a rollback (to a step a restore can reach)
            ok = sorted(sim.graph().restorable_steps())
            far = [s for s in ok if s < sim.step // 2]
            near = [s for s in ok if sim.step - 6 <= s < sim.step]
            pick = far if r < 0.01 else near
            if pick:
                sim.rollback(rng.choice(pick))
        sim.train()
        at = None
        if rng.random() < 0.02:
            at = sim.clock + rng.choice([50.0, 500.0, 3000.0])  # a pause
        last = sim.save("full" if sim.step % full_every == 0 else "delta", at=at)
        saves += 1
        if merging:
            sim.merge_blocks(last, stride=4, full_every=merge_full, lag=lag)
    storage = LocalStorage(str(root))
    sim.write(storage, durable=False)
    sim.write_log(storage, rng.choice([5, 10, 30]))
    # abandoned attempts (crashed saves) with random file times
    (part,) = [k for k in storage.list(f"step-{0:012d}/") if k.endswith("rank-00000.json")][:1]
    for _ in range(rng.randint(0, 4)):
        s = rng.choice(sorted(sim.trainer))
        key = f"step-{s:012d}/{rng.getrandbits(64):016x}/rank-00000.json"
        storage.put(key, storage.get(part))
        t = rng.uniform(0, sim.clock + 100)
        os.utime(storage.local_path(key), (t, t))
    return sim, storage


def _policy(rng: random.Random, span: float) -> RetentionPolicy:
    return RetentionPolicy(
        keep_last_fulls=rng.choice([1, 2, 3]),
        keep_fulls_every=rng.choice([None, None, 50, 100]),
        keep_all_steps=rng.random() < 0.5,
        chain_delta_budget=rng.choice([None, 0.3, 4.0]),
        keep_merged_deltas=rng.random() < 0.7,
        grace_s=rng.choice([0.0, 1.0, 30.0, span / 4, span / 2, span * 2]),
    )


@pytest.mark.parametrize("seed", range(int(os.environ.get("DECK_GC_SEEDS", "8"))))
def test_gc_of_the_newest_steps_on_random_histories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: CheckpointFiles, seed: int
) -> None:
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    rng = random.Random(seed)
    sim, storage = _history(rng, tmp_path / "uri", files)
    for run in range(3):
        policy = _policy(rng, sim.clock)
        now = sim.clock + rng.choice([0.5, 10.0, 100.0, 1000.0]) + run * 200
        whole, newest = compare(storage, policy, now)
        want = set(whole.retained_steps)
        done = collect_garbage(storage, policy, now=now)
        assert done.floor == newest.floor
        assert {d[0] for d in done.deleted} == {d[0] for d in newest.deleted}
        graph = build_graph(read_manifests(storage))
        lost = want - set(graph.restorable_steps())
        assert not lost, (run, newest.floor, sorted(lost)[:20])
        got = read_window(storage)
        if got is not None and graph.latest() is not None:
            latest = graph.latest()
            assert latest == build_graph(got).latest()
            assert [m.id for m in cheapest_chain(build_graph(got), latest)] == [
                m.id for m in cheapest_chain(graph, latest)
            ]


def compare(
    storage: LocalStorage, policy: RetentionPolicy, now: float
) -> tuple[GcReport, GcReport]:
    """Dry runs over the whole store and of the newest steps: the latter deletes the former's
    deletions at its steps but what it leaves for want of a chain, and the same orphans
    there."""
    whole = collect_garbage(storage, policy, dry_run=True, now=now, whole=True)
    newest = collect_garbage(storage, policy, dry_run=True, now=now)
    if newest.floor is None:
        assert set(newest.deleted) == set(whole.deleted)
        assert set(newest.orphans) == set(whole.orphans)
        return whole, newest
    w_del = {d[0] for d in whole.deleted if label_step(d[0]) >= newest.floor}
    n_del = {d[0] for d in newest.deleted}
    assert n_del <= {d[0] for d in whole.deleted}, (
        f"default (floor {newest.floor}) deletes what whole keeps: "
        f"{sorted(n_del - {d[0] for d in whole.deleted})}"
    )
    left = {d[0] for d in newest.left}
    assert n_del == w_del - left, (newest.floor, sorted(w_del - n_del), sorted(n_del - w_del))
    w_orph = {
        o[0]
        for o in whole.orphans
        if not o[0].startswith("quarantine/") and label_step(o[0]) >= newest.floor
    }
    n_orph = {o[0] for o in newest.orphans if not o[0].startswith("quarantine/")}
    assert n_orph <= {o[0] for o in whole.orphans}, sorted(n_orph - {o[0] for o in whole.orphans})
    assert n_orph == w_orph, (sorted(w_orph - n_orph), sorted(n_orph - w_orph))
    return whole, newest
