"""Lineage, merger workers, and GC running next to them (the retention rules and GC's own
guarantees: tests/ops/test_retention.py).

Most tests use synthetic checkpoints in the exact on-disk format (deck/testing/synth.py: the real
writer and commit, plain tensors instead of TorchRec) so that many steps, merges, crashes and
collections run in seconds; the last test runs the real 2-rank TorchRec job and ``deck merge``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deck import cli, failpoints
from deck.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from deck.format import treecodec
from deck.format.manifest import MANIFEST, CheckpointManifest, Kind, load_model
from deck.merge.build import ItemBuilder, WorkStats
from deck.merge.plan import plan
from deck.merge.policy import FullPolicy, MergeConfig, full_every_for_bound, stride_for_velocity
from deck.merge.worker import MergeWorker
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import read_manifests
from deck.read.lineage import (
    best_valid_chain,
    build_graph,
    chain_bytes,
    chain_for,
    cheapest_chain,
    latest_restorable,
    needs_new_full,
)
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage, Storage
from deck.testing.lineage_checks import check_all_restore, mem, merge_all
from deck.testing.synth import (
    State,
    SynthTrainer,
    restore_state,
    same,
    saved_chain,
    snapshot,
    zero_a_chunk,
)

NO_FULLS = FullPolicy(every=None, max_live_fraction=None)


# ---- unit tests of the pieces ------------------------------------------------------------------


def test_merged_manifest_fields_round_trip_and_trainer_records_unchanged() -> None:
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.train()
    m = tr.save()
    raw = storage.get(f"step-{m.step:012d}/{MANIFEST}")
    for key in (b"first_step", b"layer", b"inputs", b"state_id"):
        assert key not in raw  # format v1 readers without merging can still read it
    assert load_model(CheckpointManifest, raw, "x") == m
    bad = m.model_dump() | {"kind": "merged"}
    with pytest.raises(CorruptCheckpointError, match="state_id"):
        load_model(CheckpointManifest, dump_model_dict(bad), "x")


def test_merge_once_on_a_store_that_refuses_writes_exits_2_with_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's break-it run: `deck merge --once` on a store that refuses writes (a
    read-only mount) exited 1, "some work is left", where the docs say 2 with the error; it
    exits 2 naming the store's error now, and merges once the store takes writes again."""
    storage = LocalStorage(tmp_path / "ck")
    saved_chain(storage, 4)
    failpoints.configure("storage.local.write:1+:enospc")  # every write refused
    try:
        assert cli.main(["merge", storage.uri, "--once", "--stride", "2"]) == 2
    finally:
        failpoints.configure(None)
    err = capsys.readouterr().err
    assert "No space left" in err or "full" in err, err
    assert not read_manifests(storage).merged
    assert cli.main(["merge", storage.uri, "--once", "--stride", "2"]) == 0
    assert read_manifests(storage).merged


def test_a_following_worker_outlives_a_store_outage(caplog: pytest.LogCaptureFixture) -> None:
    """From an operator's break-it run: `deck merge --follow` exited (status 2) when the store
    was down for a minute, where `deck follow` waits it out. A pass the store fails is said
    once and tried again; the worker merges once the store answers."""
    import threading

    from deck.errors import StorageError
    from deck.storage.wrapper import StorageWrapper

    storage = mem()
    saved_chain(storage, 4)
    stop = threading.Event()

    class Down(StorageWrapper):
        """Every listing fails for the first 5 tries (the store down), then works; the worker
        is stopped once it committed something."""

        fails = 5

        def _up(self, prefix: str) -> None:
            if self.fails:
                self.fails -= 1
                raise StorageError(f"could not list {prefix!r}: connection refused")
            if any(k.endswith(MANIFEST) for k in self.inner.list("merged/")):
                stop.set()

        def list(self, prefix: str = "") -> list[str]:
            self._up(prefix)
            return self.inner.list(prefix)

        def list_dir(self, prefix: str = "") -> list[str]:
            self._up(prefix)
            return self.inner.list_dir(prefix)

    down = Down(storage)
    worker = MergeWorker(down, MergeConfig(stride=2, full=NO_FULLS))
    with caplog.at_level(logging.DEBUG, logger="deck.merge.worker"):
        worker.follow(stop, poll_s=0.001)
    assert down.fails == 0 and any(k.endswith(MANIFEST) for k in storage.list("merged/"))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in said if "connection refused" in m]) == 1, said
    assert any("going on" in r.getMessage() for r in caplog.records)


def test_a_worker_waiting_for_one_that_never_comes_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A break-it finding: one of `deck merge --follow --workers 2`'s workers stopped with
    SIGSTOP (as if hung; or one never started on another host) held all merging, while the
    other said only "waiting for other workers", at DEBUG. Past ``stall_warn_s`` with nothing
    of anyone's changing, a WARNING names the worker, what it waits for and what to check,
    once per stall."""
    import threading

    storage = mem()
    saved_chain(storage, 4)
    stop = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING:
                stop.set()

    worker = MergeWorker(
        storage, MergeConfig(stride=2, full=NO_FULLS, worker_index=0, num_workers=2)
    )
    worker.stall_warn_s = 0.05
    watch = Watch()
    logging.getLogger("deck.merge.worker").addHandler(watch)
    try:
        with caplog.at_level(logging.WARNING, logger="deck.merge.worker"):
            timer = threading.Timer(120, stop.set)  # (a bound, should it never be said)
            timer.start()
            worker.follow(stop, poll_s=0.01)
            timer.cancel()
    finally:
        logging.getLogger("deck.merge.worker").removeHandler(watch)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "worker 0 of 2 has waited" in said[0], said
    assert "is a worker stopped, hung or not started (every index 0..1 must run)?" in said[0]


def dump_model_dict(d: dict) -> bytes:
    import json

    return json.dumps(d).encode()


def test_cheapest_chain_prefers_merged_and_checks_ids() -> None:
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(8):
        tr.train(2)
        tr.save()
    history = {s.id: s.state for s in tr.saved.values()}
    naive = chain_for(dict(read_manifests(storage)), 16)  # plain dict: parent links only
    assert len(naive) == 9
    assert merge_all(storage, MergeConfig(stride=2, full=NO_FULLS)) == 4 + 2 + 1
    manifests = read_manifests(storage)
    chain = chain_for(manifests, 16)
    assert [(m.kind, m.layer) for m in chain] == [(Kind.FULL, 0), (Kind.MERGED, 3), (Kind.DELTA, 0)]
    assert chain_bytes(chain) < chain_bytes(naive)
    # Every step, latest included, restores bitwise through the cheapest chain.
    assert check_all_restore(storage, history) == sorted(tr.saved)
    assert latest_restorable(manifests) == 16
    g = build_graph(manifests)
    top = chain[1]
    assert g.nodes[top.id].covers == (2, 16) and len(g.parents(top.id)) == 2
    assert {n.id for n in g.children(chain[0].id)} >= {manifests[2].id}
    assert g.to_dict()["chains"]["16"] == [m.id for m in chain]


def test_deck_lineage_is_the_module_and_lineage_graph_reads_a_uri(tmp_path: Path) -> None:
    """``import deck.read.lineage`` gives the module (its functions reachable as attributes, the way
    the docs use them); ``deck.lineage_graph(uri)`` builds the graph of a URI."""
    import importlib

    import deck
    import deck.read.lineage

    assert deck.read.lineage is importlib.import_module("deck.read.lineage")
    assert callable(deck.read.lineage.cheapest_chain) and callable(deck.read.lineage.chain_bytes)
    # The URI edge (deck/api.py) opens the store; the library function takes the Storage.
    assert deck.lineage_graph is deck.api.lineage_graph
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(3):
        tr.train(2)
        tr.save()
    graph = deck.lineage_graph(str(tmp_path / "ck"))
    assert isinstance(graph, deck.LineageGraph) and graph.latest() == 6
    chain = deck.read.lineage.cheapest_chain(graph, 6)
    assert [m.step for m in chain] == [0, 2, 4, 6] and chain[0].kind is Kind.FULL
    (tmp_path / "empty").mkdir()
    assert not deck.lineage_graph(str(tmp_path / "empty")).nodes
    assert deck.read.lineage.lineage_graph(storage).to_dict() == graph.to_dict()


def test_a_pass_with_nothing_new_plans_nothing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph and a plan are functions of the records: a pass that reads the same records
    takes the last pass's (a follower polling a long history built a node per checkpoint every
    poll), and a pass after a new commit plans again and merges it."""
    import deck.merge.worker as worker_module

    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(5):
        tr.train(2)
        tr.save()
    built: list[int] = []
    real = worker_module.build_graph

    def counted(m: Any) -> Any:
        built.append(len(m))
        return real(m)

    monkeypatch.setattr(worker_module, "build_graph", counted)
    w = MergeWorker(storage, MergeConfig(stride=2, full=NO_FULLS))
    while w.run_pass().progressed:
        pass
    planned = len(built)
    assert not w.run_pass().progressed and len(built) == planned  # nothing new: no new graph
    tr.train(2)
    tr.save()  # step 12: pairs with step 10
    while w.run_pass().progressed:
        pass
    assert built[planned] == 7  # planned again, with the new step
    covers = {n.covers for n in build_graph(read_manifests(storage)).nodes.values()}
    assert (10, 12) in covers


def test_rollback_timelines_never_mix() -> None:
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(6):
        tr.train()
        tr.save()
    history = {s.id: s.state for s in tr.saved.values()}
    merge_all(storage, MergeConfig(stride=2, full=NO_FULLS))
    tr.rollback(3)
    for _ in range(3):
        tr.train()
        history[tr.save().id] = snapshot(tr.shards)
    merge_all(storage, MergeConfig(stride=2, full=NO_FULLS))
    manifests = read_manifests(storage)
    graph = build_graph(manifests)
    # Steps 4-6 were saved again: merged deltas of the old timeline end in states whose
    # trainer checkpoints are gone; nothing of it may be used by the new timeline.
    for step in (4, 5, 6):
        ids = {m.id for m in chain_for(manifests, step)}
        old = [n for n in graph.nodes.values() if n.merged and n.covers[1] >= 4 and n.epoch == 0]
        assert not ids & {n.id for n in old}
    assert check_all_restore(storage, history) == list(range(7))
    assert graph.latest() == 6


def test_policy_helpers() -> None:
    assert full_every_for_bound(4, 0.5, bound=10) >= 4
    assert full_every_for_bound(2, 0.9, bound=1.5) >= 1
    assert stride_for_velocity(0.3, 5.0) is not None
    with pytest.raises(ConfigError, match="stride"):
        MergeConfig(stride=1)
    with pytest.raises(ConfigError, match="worker index"):
        MergeConfig(worker_index=2, num_workers=2)
    with pytest.raises(ConfigError, match="max_live_fraction"):
        FullPolicy(max_live_fraction=0)
    assert FullPolicy(every=3).want_full(3, None, 100)
    assert FullPolicy(max_live_fraction=0.5).want_full(1, 60, 100)
    assert not FullPolicy(max_live_fraction=0.5).want_full(1, 40, 100)
    assert FullPolicy(max_live_fraction=None, cost_ratio=10).want_full(1, 30, 100)


def test_corrupt_or_missing_delta_in_the_active_chain(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(6):
        tr.train()
        tr.save()
    history = {s.id: s.state for s in tr.saved.values()}
    merge_all(storage, MergeConfig(stride=3, full=NO_FULLS))

    def corrupt(m: CheckpointManifest) -> str:
        chunk = sorted((tmp_path / "ck" / m.folder).rglob("*.chunk"))[0]
        data = bytearray(chunk.read_bytes())
        data[3] ^= 0xFF
        chunk.write_bytes(bytes(data))
        return chunk.name

    # A corrupt delta in the chain of step 5 (full, merged 1..3, delta 4, delta 5): the restore
    # names the file; there is no other way to step 5, and the fallback says so.
    chain5 = chain_for(read_manifests(storage), 5)
    assert [(m.kind, m.covers) for m in chain5] == [
        (Kind.FULL, (0, 0)),
        (Kind.MERGED, (1, 3)),
        (Kind.DELTA, (4, 4)),
        (Kind.DELTA, (5, 5)),
    ]
    d4 = chain5[2]
    name = corrupt(d4)
    with pytest.raises(CorruptCheckpointError, match=name):
        restore_state(storage, chain5)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointNotFoundError, match=d4.id):
        best_valid_chain(storage, 5)
    assert "damaged" in caplog.text
    # Step 6 goes around it through merged 4..6, and the quarantine makes plain restores do so.
    manifests = read_manifests(storage)
    assert d4.id in manifests.quarantined
    assert latest_restorable(manifests) == 6
    chain6 = chain_for(manifests, 6)
    assert [(m.kind, m.covers) for m in chain6] == [
        (Kind.FULL, (0, 0)),
        (Kind.MERGED, (1, 3)),
        (Kind.MERGED, (4, 6)),
        (Kind.DELTA, (6, 6)),
    ]
    got, _ = restore_state(storage, chain6)
    assert not same(got, history[chain6[-1].id])
    # A corrupt merged delta in the active chain: the best valid chain replays the deltas.
    name = corrupt(chain6[1])
    vc = best_valid_chain(storage, 6)
    assert chain6[1].id in vc.rejected and name in vc.rejected[chain6[1].id][0]
    assert [m.covers for m in vc.chain] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 6), (6, 6)]
    got, _ = restore_state(storage, vc.chain)
    assert not same(got, history[chain6[-1].id])
    with pytest.raises(CheckpointNotFoundError, match=f"step {d4.step}"):
        chain_for(read_manifests(storage), d4.step)
    # The trainer's next checkpoint after step 6 may be a delta (6 is restorable); one whose
    # parent is the damaged step 4 (say, after restoring it) must be a full.
    assert needs_new_full(storage, (6, chain6[-1].id)) is None
    assert "4" in (needs_new_full(storage, (4, d4.id)) or "")
    assert needs_new_full(storage, None)

    # A missing delta (its manifest lost) inside a merged stretch: later steps still restore.
    os.remove(tmp_path / "ck" / f"step-{5:012d}" / MANIFEST)
    manifests = read_manifests(storage)
    assert latest_restorable(manifests) == 6
    got, _ = restore_state(storage, chain_for(manifests, 6))
    assert not same(got, history[manifests[6].id])
    # Even step 6's own record missing: merged 4..6 ends in its state, so step 7 restores.
    os.remove(tmp_path / "ck" / f"step-{6:012d}" / MANIFEST)
    tr.train()
    history[tr.save().id] = snapshot(tr.shards)
    assert latest_restorable(read_manifests(storage)) == 7
    # A missing delta nothing covers: latest falls back to the step before it, and says why.
    tr.train()
    history[tr.save().id] = snapshot(tr.shards)
    os.remove(tmp_path / "ck" / f"step-{7:012d}" / MANIFEST)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert latest_restorable(read_manifests(storage)) == 3
    assert "step 8 cannot be restored" in caplog.text and "missing" in caplog.text
    assert check_all_restore(storage, history) == [0, 1, 2, 3]


def test_merger_quarantines_a_corrupt_input(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ck")
    saved_chain(storage, 4)
    m = read_manifests(storage)[3]
    zero_a_chunk(storage, m)
    w = MergeWorker(storage, MergeConfig(stride=2, full=NO_FULLS))
    w.run_once(wait_s=0)
    manifests = read_manifests(storage)
    assert m.id in manifests.quarantined
    assert latest_restorable(manifests) == 2  # 3 is damaged and nothing covers it yet
    assert all(not verify_checkpoint(storage, x).problems for x in manifests.merged.values())


def test_merge_is_bounded_memory_and_sorted(tmp_path: Path) -> None:
    """Merged chunks are sorted by global row id, cut like the writer's, and a merge reads one
    chunk per input at a time (checked by counting live chunk buffers)."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage, chunk_bytes=4096)
    tr.save("full")
    for _ in range(4):
        tr.train(rows=120)
        tr.save()
    merge_all(storage, MergeConfig(stride=4, full=NO_FULLS, chunk_bytes=4096))
    manifests = read_manifests(storage)
    (merged,) = manifests.merged.values()
    from deck.read.catalog import read_rank_manifests

    for part in read_rank_manifests(storage, merged):
        for rec in part.shards:
            last = -1
            for c in rec.chunks:
                assert c.nbytes <= 4096
                ids = torch.frombuffer(
                    bytearray(storage.get(f"{merged.folder}/{c.path}")),
                    dtype=torch.int64,
                    count=c.rows,
                )
                assert int(ids[0]) > last and bool(torch.all(ids[1:] > ids[:-1]))
                last = int(ids[-1])


# ---- the state machine -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "full", [FullPolicy(every=3, max_live_fraction=None), FullPolicy(max_live_fraction=0.3)]
)
def test_merger_behind_builds_only_the_newest_full(full: FullPolicy) -> None:
    """A backlog where the policy plans a full every few deltas: one pass builds the newest
    full only (from the committed full and the chain across the skipped ones, reusing the
    merged delta already committed), never the older ones, and every step restores bitwise."""
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    cfg = MergeConfig(stride=2, full=full, chunk_bytes=4096)
    tr.train(1, rows=4)
    tr.save()
    tr.train(1, rows=4)
    tr.save()
    merge_all(storage, cfg)  # keeping up so far: every=3 merges steps 1..2 (no full yet);
    # the live rule wants a full of every step (one delta is ~half a synthetic full) and
    # builds only the newest of the two
    graph = build_graph(read_manifests(storage))
    early = sorted((n.step, n.kind) for n in graph.nodes.values() if n.merged)
    if full.every:
        assert early == [(2, Kind.MERGED)]
    else:
        assert early == [(2, Kind.FULL)]
    base = max((n for n in graph.nodes.values() if n.kind is Kind.FULL), key=lambda n: n.step)
    early_merged = [n.id for n in graph.nodes.values() if n.kind is Kind.MERGED]
    for _ in range(18):
        tr.train(1, rows=30)
        tr.save()
    graph = build_graph(read_manifests(storage))
    p = plan(graph, cfg)
    fulls = [it for it in p.wanted if it.kind is Kind.FULL]
    assert len(fulls) == 1, [it.describe() for it in fulls]
    newest = fulls[0]
    assert newest.step >= 15  # the newest of several: a full every <= 3 deltas
    assert newest.inputs[0] == base.id  # made from the newest committed full...
    if early_merged:  # ...and the merged delta that already exists
        assert newest.inputs[1] == early_merged[0]
    assert all(i in graph.nodes for i in newest.inputs)  # ready now
    assert all(it.step > newest.step for it in p.wanted if it.kind is Kind.MERGED)

    r = MergeWorker(storage, cfg).run_pass()
    assert not r.stats.failed
    graph = build_graph(read_manifests(storage))
    made = [n for n in graph.nodes.values() if n.merged and n.kind is Kind.FULL and n.step > 2]
    assert [(n.id, n.step) for n in made] == [(newest.id, newest.step)]
    merge_all(storage, cfg)
    graph = build_graph(read_manifests(storage))
    made = [n for n in graph.nodes.values() if n.merged and n.kind is Kind.FULL and n.step > 2]
    assert all(n.step >= newest.step for n in made)  # no older full, ever
    history = {s.id: s.state for s in tr.saved.values()}
    assert check_all_restore(storage, history) == list(range(21))
    chain = cheapest_chain(graph, 20)
    assert chain[0].is_merged and chain[0].kind is Kind.FULL


class SimulatedCrash(BaseException):
    """kill -9 at this write: nothing after it runs, nothing is cleaned up."""


class FaultyStorage(Storage):
    """Wraps a store; when armed, the n-th write (put or delete) crashes -- before or after it
    takes effect, like a process killed around a syscall."""

    def __init__(self, inner: Storage):
        self.inner = inner
        self.countdown: int | None = None
        self.after = False

    @property
    def uri(self) -> str:
        return self.inner.uri

    def arm(self, n: int, after: bool) -> None:
        self.countdown, self.after = n, after

    def disarm(self) -> None:
        self.countdown = None

    def _tick(self) -> bool:
        if self.countdown is None:
            return False
        self.countdown -= 1
        return self.countdown <= 0

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        crash = self._tick()
        if crash and not self.after:
            raise SimulatedCrash(path)
        self.inner.put(path, data)
        if crash:
            raise SimulatedCrash(path)

    def delete(self, path: str) -> None:
        crash = self._tick()
        if crash and not self.after:
            raise SimulatedCrash(path)
        self.inner.delete(path)
        if crash:
            raise SimulatedCrash(path)

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.get(path, start, end)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)


class LineageMachine(RuleBasedStateMachine):
    """Trainer saves, merges (1 or 2 workers), new fulls, GC, rollbacks and crashes of the
    merger and of GC, against an exact record of every saved state."""

    def __init__(self) -> None:
        super().__init__()
        self.storage = FaultyStorage(mem())
        self.tr = SynthTrainer(self.storage, chunk_bytes=4096)
        self.history: dict[str, State] = {}
        self.seen: set[tuple[str, ...]] = set()
        self.verified: set[str] = set()
        self.keep = RetentionPolicy()

    @initialize(
        stride=st.sampled_from([2, 3]),
        every=st.sampled_from([None, 4, 7]),
        live=st.sampled_from([None, 0.8]),
        deltas=st.integers(2, 8),
        keep_all=st.booleans(),
    )
    def setup(
        self, stride: int, every: int | None, live: float | None, deltas: int, keep_all: bool
    ) -> None:
        # The default retention (every step stays restorable) and the bounded one (DECK fig. 9).
        self.keep = RetentionPolicy(keep_last_fulls=2, keep_all_steps=keep_all, grace_s=0)
        self.cfg = MergeConfig(
            stride=stride, full=FullPolicy(every=every, max_live_fraction=live), chunk_bytes=4096
        )
        self._save("full")
        for _ in range(deltas):
            self.tr.train(1)
            self._save("delta")

    def _save(self, kind: str) -> None:
        m = self.tr.save(kind)
        self.history[m.id] = snapshot(self.tr.shards)

    @rule(steps=st.integers(1, 3), rows=st.sampled_from([4, 30]), count=st.integers(1, 6))
    def produce_deltas(self, steps: int, rows: int, count: int) -> None:
        for _ in range(count):
            self.tr.train(steps, rows=rows)
            self._save("delta")

    @rule()
    def trainer_full(self) -> None:
        self.tr.train(1)
        self._save("full")

    @rule(workers=st.sampled_from([1, 2]))
    def merge(self, workers: int) -> None:
        n = merge_all(self.storage, self.cfg, workers)
        event(f"merge committed {'0' if not n else '1-3' if n < 4 else '4+'}")
        p = plan(build_graph(read_manifests(self.storage)), self.cfg)
        assert not p.ready, [it.describe() for it in p.ready]

    @rule(n=st.integers(1, 25), after=st.booleans(), worker=st.sampled_from([(0, 1), (1, 2)]))
    def crash_merger(self, n: int, after: bool, worker: tuple[int, int]) -> None:
        cfg = MergeConfig(
            stride=self.cfg.stride,
            full=self.cfg.full,
            chunk_bytes=4096,
            worker_index=worker[0],
            num_workers=worker[1],
        )
        self.storage.arm(n, after)
        try:
            MergeWorker(self.storage, cfg).run_once(wait_s=0)
        except SimulatedCrash:
            event("merger crashed")
        finally:
            self.storage.disarm()

    @rule()
    def gc(self) -> None:
        before = build_graph(read_manifests(self.storage)).restorable_steps()
        rep = collect_garbage(self.storage, self.keep)
        assert not rep.errors
        # Every step GC promised to keep restores (bitwise: checked by the invariant).
        graph = build_graph(read_manifests(self.storage))
        steps = graph.restorable_steps()
        assert set(rep.retained_steps) <= set(steps), (rep.retained_steps, steps)
        if self.keep.keep_all_steps:
            assert set(before) <= set(steps), sorted(set(before) - set(steps))
        assert rep.latest == self.tr.step
        # The merger never wants back what GC just deleted (no build / delete loop).
        gone = {folder for folder, _ in rep.deleted}
        assert not [it.folder for it in plan(graph, self.cfg).wanted if it.folder in gone]

    @rule(n=st.integers(1, 30), after=st.booleans())
    def crash_gc(self, n: int, after: bool) -> None:
        self.storage.arm(n, after)
        try:
            collect_garbage(self.storage, self.keep)
        except SimulatedCrash:
            event("gc crashed")
        finally:
            self.storage.disarm()

    @precondition(lambda self: len(self.tr.saved) > 2)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """Restore an older step and train on from it: a new epoch, a new timeline. (A real
        trainer saves within the GC grace period after restoring; here GC has no grace, so the
        restore and the next save are one step.)"""
        graph = build_graph(read_manifests(self.storage))
        ours = [s for s in graph.restorable_steps() if s in self.tr.saved and s < self.tr.step]
        if not ours:
            return
        step = data.draw(st.sampled_from(ours))
        assert graph.trainer[step].id == self.tr.saved[step].id
        self.tr.rollback(step)
        self.tr.train(1)
        self._save("delta")

    @invariant()
    def every_retained_step_restores_bitwise(self) -> None:
        if not self.tr.saved:
            return
        steps = check_all_restore(self.storage, self.history, self.seen)
        # What the trainer saved last is always restorable.
        assert self.tr.step in steps
        manifests = read_manifests(self.storage)
        for m in manifests.merged.values():
            if m.id not in self.verified:
                assert not verify_checkpoint(self.storage, m).problems
                self.verified.add(m.id)
            event(f"merged layer {m.layer}" if m.kind is Kind.MERGED else "merger full")


TestLineageMachine = LineageMachine.TestCase
TestLineageMachine.settings = settings(
    max_examples=int(os.environ.get("DECK_LINEAGE_EXAMPLES", "20")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# ---- real processes: concurrent workers, kill -9 -------------------------------------------------


def _deck(*args: str, **kw: object) -> subprocess.Popen[str]:
    exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    return subprocess.Popen(
        [exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def _written(root: Path, deltas: int, seed: int = 0) -> dict[str, State]:
    storage = LocalStorage(root)
    tr = SynthTrainer(storage, seed=seed)
    tr.save("full")
    history = {tr.saved[0].id: tr.saved[0].state}
    for _ in range(deltas):
        tr.train(2, rows=20)
        history[tr.save().id] = snapshot(tr.shards)
    return history


# --wait: how long a worker waits, without progress, for another worker's partitions: far
# longer than the other takes to start (import torch) and merge on a busy machine. It ends as
# soon as the work is done, so it costs nothing when all goes well.
MERGE_ARGS = ("--stride", "2", "--full-every", "8", "--full-live-fraction", "0", "--wait", "300")


def _assert_complete_and_exact(root: Path, history: dict[str, State]) -> None:
    storage = LocalStorage(root)
    manifests = read_manifests(storage)
    for m in manifests.all():
        assert not verify_checkpoint(storage, m).problems, m.folder
    graph = build_graph(manifests)
    cfg = MergeConfig(stride=2, full=FullPolicy(every=8, max_live_fraction=None))
    left = plan(graph, cfg)
    assert not left.ready and all(it.id in graph.nodes for it in left.wanted)
    assert check_all_restore(storage, history) == sorted(manifests)
    # Merged checkpoint ids are a function of their inputs: racing workers made no duplicates.
    folders = [m.folder for m in manifests.merged.values()]
    assert len(folders) == len(set(folders))


@pytest.mark.slow
@pytest.mark.parametrize("partitions", ["same-by-mistake", "different"])
def test_two_worker_processes_on_one_uri(tmp_path: Path, partitions: str) -> None:
    root = tmp_path / "ck"
    history = _written(root, 20)
    if partitions == "different":
        extra = [
            ("--worker-index", "0", "--num-workers", "2"),
            ("--worker-index", "1", "--num-workers", "2"),
        ]
    else:
        extra = [("--worker-index", "0", "--num-workers", "1")] * 2
    procs = [_deck("merge", str(root), "--once", *MERGE_ARGS, *e) for e in extra]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
    _assert_complete_and_exact(root, history)


class _OtherWorkerAfterListing(LocalStorage):
    """A local store where, right after this worker's first full listing, another worker on the
    same partition does all the work: the pass then runs on a stale plan."""

    other: MergeWorker | None = None

    def list(self, prefix: str = "") -> list[str]:
        keys = super().list(prefix)
        other, self.other = self.other, None
        if prefix == "" and other is not None:
            other.run_once(wait_s=0)
        return keys


def test_single_worker_goes_on_when_another_committed_during_its_pass(tmp_path: Path) -> None:
    """Two workers that each believe they are alone (the same partition by mistake): one that
    finds its items committed by the other during a pass plans again instead of stopping with
    work left (what `deck merge --once` reports as failure)."""
    root = tmp_path / "ck"
    history = _written(root, 20)
    config = MergeConfig(stride=2, full=FullPolicy(every=8, max_live_fraction=None))
    racing = _OtherWorkerAfterListing(root)
    racing.other = MergeWorker(LocalStorage(root), config)
    _, left = MergeWorker(racing, config).run_once(wait_s=0)
    assert racing.other is None  # the other worker did run, after the first listing
    assert left == 0
    _assert_complete_and_exact(root, history)


def _built_by_another(
    root: Path, graph: Any, ready: list[Any], config: MergeConfig
) -> dict[str, ItemBuilder]:
    """Another worker's builders of the ``ready`` items, every partition built (not committed),
    by folder."""
    others = {}
    for item in ready:
        other = ItemBuilder(
            LocalStorage(root), item, [graph.nodes[i].manifest for i in item.inputs], config
        )
        for part in other.mine():
            other.build_partition(part, WorkStats())
        others[item.folder] = other
    return others


class _OtherWorkerCommitsFirst(LocalStorage):
    """A local store where another worker on the same partition already built every partition
    of the ready items, and commits each one right when this worker writes its first rank
    manifest of it (this worker's commit under way): so this worker's whole pass writes no
    partition and commits nothing, while the other's commits make later items ready."""

    others: dict[str, Any] = {}  # folder of a ready item -> the other worker's builder

    def put(self, key: str, data: Any) -> None:
        super().put(key, data)
        for folder in list(self.others):
            if key.startswith(f"{folder}/") and "/rank-" in key:
                self.others.pop(folder).try_commit(WorkStats())


def test_single_worker_goes_on_when_another_committed_its_items_during_its_commits(
    tmp_path: Path,
) -> None:
    """The same race as above, caught at the commit instead of at the pass's start: a worker
    whose every commit of a pass finds the other's record (it stands) plans again instead of
    stopping with work left -- `deck merge --once` exited 1 in the two-process test on a busy
    machine."""
    root = tmp_path / "ck"
    history = _written(root, 20)
    config = MergeConfig(stride=2, full=FullPolicy(every=8, max_live_fraction=None))
    racing = _OtherWorkerCommitsFirst(root)
    graph = build_graph(read_manifests(racing))
    ready = plan(graph, config).ready
    assert ready and len(plan(graph, config).wanted) > len(ready)  # later items wait for them
    racing.others = _built_by_another(root, graph, ready, config)
    _, left = MergeWorker(racing, config).run_once(wait_s=0)
    assert not racing.others  # the other worker committed every ready item, during the pass
    assert left == 0
    _assert_complete_and_exact(root, history)


class _OtherWorkerCommitsInTheWindow(LocalStorage):
    """A local store where another worker's commit of an item lands between this worker's last
    check that the item is uncommitted and its own commit record."""

    others: dict[str, Any] = {}
    ids: dict[str, str] = {}  # folder -> the id of the other worker's record

    def put_if_absent(self, key: str, data: Any) -> bool:
        folder = key.rsplit("/", 1)[0]
        other = self.others.pop(folder, None)
        if other is not None and key.endswith(f"/{MANIFEST}"):
            other.try_commit(WorkStats())
            self.ids[folder] = load_model(CheckpointManifest, self.get(key), key).id
        return super().put_if_absent(key, data)


def test_a_commit_that_loses_the_race_leaves_the_winners_record_and_counts_nothing(
    tmp_path: Path,
) -> None:
    """Of two workers committing one item at once, one record stands (the first's) and only its
    worker says it committed the item."""
    root = tmp_path / "ck"
    history = _written(root, 20)
    config = MergeConfig(stride=2, full=FullPolicy(every=8, max_live_fraction=None))
    racing = _OtherWorkerCommitsInTheWindow(root)
    graph = build_graph(read_manifests(racing))
    ready = plan(graph, config).ready
    racing.others = _built_by_another(root, graph, ready, config)
    racing.ids = {}
    stats = WorkStats()
    for item in ready:
        b = ItemBuilder(racing, item, [graph.nodes[i].manifest for i in item.inputs], config)
        assert b.try_commit(stats)
    assert not racing.others and len(racing.ids) == len(ready)
    assert stats.committed == [] and stats.items_committed == 0
    for folder, won in racing.ids.items():
        record = (root / folder / MANIFEST).read_bytes()
        assert load_model(CheckpointManifest, record, folder).id == won
    _, left = MergeWorker(LocalStorage(root), config).run_once(wait_s=0)
    assert left == 0
    _assert_complete_and_exact(root, history)


@pytest.mark.slow
def test_workers_option_runs_processes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    history = _written(root, 12)
    # GC next to merger workers needs a grace period longer than a merge takes (it must not
    # take a half-built merged checkpoint for an abandoned one): far longer, on a busy machine.
    p = _deck("merge", str(root), *MERGE_ARGS, "--workers", "2", "--gc", "--grace", "600")
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, out + err
    assert "committed by workers 0..1 of 2" in out
    storage = LocalStorage(root)
    assert latest_restorable(read_manifests(storage)) == 24
    assert check_all_restore(storage, history)[-1] == 24
    # The default keeps every step restorable; bounded retention (DECK fig. 9) keeps the two
    # newest fulls and the active window.
    p = _deck("gc", str(root), "--grace", "0")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, out + err
    assert check_all_restore(storage, history) == list(range(0, 25, 2))
    p = _deck("gc", str(root), "--grace", "0", "--no-keep-all-steps")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, out + err
    p = _deck("gc", str(root), "--dry-run", "--grace", "0", "--no-keep-all-steps")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "would delete 0 checkpoint(s) and 0 orphan(s)" in out, out + err
    steps = check_all_restore(storage, history)
    assert steps == [0, 16, 18, 20, 22, 24]  # two newest fulls (0, 16) + the window from 16


# The merger's crash points (deck/merge/build.py, deck/merge/stream.py) and, for each, whether a kill there leaves a
# merged folder without its commit record behind (the "middle of a merge").
MERGER_POINTS = {
    "merger.partition.before_read": False,  # the item's first partition wrote nothing yet
    "merger.chunk.after_put": True,
    "merger.partition.after_read": False,  # small partitions put their chunks at close
    "merger.partition.after_chunks": False,  # a partition without changed rows puts nothing
    "merger.partition.after_record": True,
    "merger.commit.before_rank_manifests": True,
    "merger.commit.before_manifest": True,
    "merger.commit.after_manifest": False,  # committed: the kill lands between two items
}


def _uncommitted_merged(root: Path) -> set[str]:
    merged = root / "merged"
    if not merged.exists():
        return set()
    return {d.name for d in merged.iterdir() if d.is_dir() and not (d / MANIFEST).exists()}


def _hits_of_a_merge(root: Path, probe: Path, point: str) -> int:
    """How often `deck merge --once` of ``root`` reaches ``point``, counted in this process on a
    copy (armed with an unreachable nth, so nothing fires)."""
    shutil.copytree(root, probe)
    failpoints.configure(f"{point}:{10**9}")
    try:
        assert cli.main(["merge", str(probe), "--once", *MERGE_ARGS]) == 0
        return failpoints.hits()[point]
    finally:
        failpoints.configure(None)
        shutil.rmtree(probe)


@pytest.mark.slow
def test_kill_9_at_any_moment_leaves_a_valid_lineage(tmp_path: Path) -> None:
    """`deck merge` SIGKILLed at the merger's crash points (a seeded choice of point and hit,
    armed with DECK_FAILPOINTS, so where each kill lands does not depend on timing): whatever
    was committed verifies and every step restores exactly; a final merge completes and GC
    leaves no temp files."""
    root = tmp_path / "ck"
    storage = LocalStorage(root)
    tr = SynthTrainer(storage)
    tr.save("full")
    history = {tr.saved[0].id: tr.saved[0].state}
    rng = random.Random(5)
    points = sorted(MERGER_POINTS)
    # Every point once, in a seeded order, then seeded picks, each killed at a seeded hit among
    # the first three that attempt reaches.
    schedule = rng.sample(points, len(points)) + [rng.choice(points) for _ in range(2)]
    mid_merge = 0
    for attempt, point in enumerate(schedule):
        for _ in range(6):  # the trainer goes on between the merger's crashes
            tr.train(2, rows=20)
            history[tr.save().id] = snapshot(tr.shards)
        # The merger is deterministic: a probe run on a copy counts how often this attempt
        # reaches the point (how many items, partitions, chunks the plan has), so the seeded hit
        # is always one the real run reaches.
        reached = _hits_of_a_merge(root, tmp_path / f"probe-{attempt}", point)
        assert reached >= 1, (attempt, point, "the merge never reaches this point")
        nth = rng.randint(1, min(3, reached))
        marker = tmp_path / f"killed-{attempt}"
        env = {
            **os.environ,
            failpoints.ENV: f"{point}:{nth}",
            failpoints.MARKER_ENV: str(marker),
        }
        p = _deck("merge", str(root), "--once", *MERGE_ARGS, env=env)
        out, err = p.communicate(timeout=240)
        # The kill landed exactly there, every time.
        assert p.returncode == -signal.SIGKILL, (point, nth, p.returncode, out + err)
        assert marker.read_text().strip() == f"{point}:{nth}"
        if MERGER_POINTS[point]:
            assert _uncommitted_merged(root), (point, nth, "no half-built merged folder")
            mid_merge += 1
        # Whatever was committed is complete and exact; the rest does not exist yet.
        manifests = read_manifests(storage)
        for m in manifests.merged.values():
            assert not verify_checkpoint(storage, m).problems, (attempt, m.folder)
        check_all_restore(storage, history)
    assert mid_merge >= len([p for p in points if MERGER_POINTS[p]])
    p = _deck("merge", str(root), "--once", *MERGE_ARGS)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, out + err
    _assert_complete_and_exact(root, history)
    # GC afterwards removes the killed attempts' files and keeps every retained step.
    p = _deck("gc", str(root), "--grace", "0", "--keep-all-steps")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, out + err
    assert not [f for f in root.rglob("*") if f.is_file() and ".tmp-" in f.name]
    assert all((d / MANIFEST).exists() for d in (root / "merged").iterdir())
    _assert_complete_and_exact(root, history)


# ---- the real thing: 2-rank TorchRec DMP, `deck merge`, restore through merged chains ------------

TR_STEPS, TR_EVERY = 32, 2


def _tr_spec() -> Any:
    from deck.demo import ModelSpec

    return ModelSpec(num_tables=4, rows=3000, dim=16, batch=128, pooling=2)


def _tr_config(uri: str) -> Any:
    import deck

    return deck.DeckConfig(
        uri=uri,
        delta_every_steps=TR_EVERY,
        staging=deck.StagingConfig(chunk_bytes=64 * 1024),
    )


def _tr_train(rank: int, world_size: int, uri: str, out: str) -> None:
    import deck
    from deck.demo import TrainState, build_model, capture_state, train_step

    spec = _tr_spec()
    model, opt = build_model(spec)
    user = TrainState()
    with deck.enable(model, [opt], _tr_config(uri), state=user) as ck:
        for step in range(TR_STEPS + 1):
            if step:
                loss = train_step(model, opt, spec, step)
                user.step, user.losses = step, [*user.losses, loss]
            if ck.step(step) is not None and step in (16, 26, TR_STEPS):
                Path(out, f"r{rank}-{step}.st").write_bytes(
                    treecodec.encode(capture_state(model, opt, user), "captured")
                )


def _tr_restore(rank: int, world_size: int, uri: str, out: str) -> None:
    import deck
    from deck.demo import TrainState, build_model, capture_state, diff_states, train_step

    spec = _tr_spec()
    naive = {s: s // TR_EVERY + 1 for s in (16, 26, TR_STEPS)}
    for step in (16, 26, TR_STEPS):
        model, opt = build_model(spec, seed=spec.seed + 100 + step)
        user = TrainState()
        with deck.enable(model, [opt], _tr_config(uri), state=user) as ck:
            assert ck.restore(None if step == TR_STEPS else step) == step
            used = ck.last_restore.checkpoints
            expected = treecodec.decode(Path(out, f"r{rank}-{step}.st").read_bytes(), "captured")
            bad = diff_states(expected, capture_state(model, opt, user))
            assert not bad, f"rank {rank} step {step}: {bad[:5]}"
            assert used < naive[step], (step, used, naive[step])
            if step == TR_STEPS:
                # Training on from a restore through merged checkpoints: the next deltas chain
                # onto it and restore bitwise too.
                for s in range(step + 1, step + 5):
                    train_step(model, opt, spec, s)
                    user.step = s
                    ck.step(s)
                after = capture_state(model, opt, user)
        if step == TR_STEPS:
            model2, opt2 = build_model(spec, seed=7)
            user2 = TrainState()
            with deck.enable(model2, [opt2], _tr_config(uri), state=user2) as ck2:
                assert ck2.restore() == TR_STEPS + 4
            bad = diff_states(after, capture_state(model2, opt2, user2))
            assert not bad, f"rank {rank} after training on: {bad[:5]}"


@pytest.mark.slow
def test_torchrec_two_ranks_merge_and_restore_bitwise(tmp_path: Path) -> None:
    from deck.testing.dist_harness import run_ranks

    uri, out = str(tmp_path / "ck"), str(tmp_path / "captured")
    os.makedirs(out)
    policy = ("--stride", "2", "--full-every", "8", "--full-live-fraction", "0")
    # A merger worker follows the URI while the trainer writes to it (no coordination between
    # them but the files): neither may disturb the other. It is stopped by its own pid.
    follower = _deck("merge", uri, "--follow", "--poll", "0.05", *policy)
    try:
        run_ranks(_tr_train, uri, out)
        # Stop it only once it has committed a merged checkpoint: it is following by then
        # (its SIGTERM handler is installed) and has done work, however slow the machine.
        storage = LocalStorage(uri)
        deadline = time.monotonic() + 300
        while not read_manifests(storage).merged:
            assert follower.poll() is None, follower.communicate()
            assert time.monotonic() < deadline, "the follower committed nothing in 300 s"
            time.sleep(0.05)
    finally:
        follower.send_signal(signal.SIGTERM)
        stdout, stderr = follower.communicate(timeout=120)
    assert follower.returncode == 0, stdout + stderr
    storage = LocalStorage(uri)
    for m in read_manifests(storage).all():
        assert not verify_checkpoint(storage, m).problems, m.folder
    p = _deck("merge", uri, "--once", *policy)  # catch up on what came after the last pass
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stdout + stderr
    graph = build_graph(read_manifests(LocalStorage(uri)))
    kinds = {(n.kind, n.merged) for n in graph.nodes.values()}
    assert (Kind.FULL, True) in kinds and (Kind.MERGED, True) in kinds
    first = cheapest_chain(graph, TR_STEPS)[0]
    assert first.kind is Kind.FULL and first.is_merged
    run_ranks(_tr_restore, uri, out)


def test_merge_pass_and_gc_run_each_log_one_info_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from deck.ops.retention import RetentionPolicy, collect_garbage

    storage = LocalStorage(tmp_path / "ck")
    saved_chain(storage, 4)
    with caplog.at_level(logging.INFO, logger="deck"):
        w = MergeWorker(storage, MergeConfig(stride=2, full=NO_FULLS))
        w.run_once(wait_s=0)
        passes = [r.getMessage() for r in caplog.records if "merge pass" in r.getMessage()]
        # Each pass that merged says what it committed (the level-1 merges, then the level-2
        # one over them); the idle pass that ends run_once says nothing, nor does each item.
        assert [p.split(": ")[1].split(" (")[0] for p in passes] == ["2 committed", "1 committed"]
        assert str(storage.uri) in passes[0], passes
        assert not [r for r in caplog.records if "deck merge: committed" in r.getMessage()]
        caplog.clear()
        collect_garbage(storage, RetentionPolicy(keep_all_steps=False, grace_s=0))
        gc_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("deck gc")]
        assert len(gc_lines) == 1 and "deleted" in gc_lines[0], gc_lines
