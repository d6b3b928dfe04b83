"""Copy-on-write snapshots (deck/trainer/cow.py): a delta's rows are copied after the stall, and
a lookup copies the rows it is about to update first.

The background copy is held back with its test hook (``deck.trainer.cow.FILL_GATE``) while
training goes on, so every pending row a step updates is saved only by that step's
copy-before-update: a row it missed would be saved with a later step's value, and the bitwise
comparisons below would fail. Nothing waits on time: the gate is opened by the test.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from deck.kernels.gather import ChunkCopy, copy_chunks, copy_once, pending_slots, row_sources

import deck
import deck.trainer.cow as cow
from deck.demo import ModelSpec, capture_state, diff_states
from deck.errors import CheckpointError
from deck.testing.dist_harness import run_ranks
from deck.trainer.cow import DeferredCopy, RowSlice
from deck.trainer.tracker import TrackerStore
from tests.trainer.test_pipeline import _batches, _build, _loss, _pipeline


def _outs(rows: int, *widths: int) -> tuple[list[np.ndarray], list[memoryview]]:
    """Output arrays of ``rows`` rows of each width, and their bytes."""
    arrays = [np.zeros((rows, w), np.float32) for w in widths]
    return arrays, [memoryview(a).cast("B") for a in arrays]


def test_copy_once_copies_each_row_once_from_two_threads() -> None:
    """Two threads over overlapping rows with shared flags: every row lands, copied once."""
    table, state = torch.randn(5000, 16), torch.randn(5000, 1)
    sources = row_sources([table, state])
    assert sources is not None
    rows = np.sort(np.random.default_rng(0).choice(5000, 2000, replace=False)).astype(np.int64)
    flags = np.zeros(len(rows), np.uint8)
    arrays, outs = _outs(len(rows), 16, 1)
    picked = np.random.default_rng(1).choice(len(rows), 1500, replace=False)
    counts: list[int] = []
    other = threading.Thread(
        target=lambda: counts.append(
            copy_once(np.ascontiguousarray(rows[picked]), sources, outs, flags, 0, picked)
        )
    )
    other.start()
    counts.append(copy_once(rows, sources, outs, flags, 0))
    other.join()
    assert sum(counts) == len(rows)
    assert (flags == 2).all()
    assert np.array_equal(arrays[0], table.numpy()[rows])
    assert np.array_equal(arrays[1], state.numpy()[rows])


def test_copy_once_refuses_a_slot_outside_and_copies_nothing() -> None:
    table = torch.randn(10, 4)
    sources = row_sources([table])
    assert sources is not None
    flags = np.zeros(3, np.uint8)
    _, outs = _outs(3, 4)
    with pytest.raises(IndexError):
        copy_once(np.array([1, 2], np.int64), sources, outs, flags, 0, np.array([0, 3]))
    with pytest.raises(IndexError):
        copy_once(np.array([1, 12], np.int64), sources, outs, flags, 0)
    assert not flags.any()


def test_copy_chunks_copies_each_row_once_beside_copy_once_and_writes_the_ids() -> None:
    """Chunks copied in one call while another thread copies some of their rows: every row
    lands once, each chunk's ids are its rows plus its offset."""
    table = torch.randn(5000, 16)
    sources = row_sources([table])
    assert sources is not None
    rows = np.sort(np.random.default_rng(0).choice(5000, 2000, replace=False)).astype(np.int32)
    flags = np.zeros(len(rows), np.uint8)
    arrays, outs = _outs(len(rows), 16)
    ids = np.zeros(len(rows), np.int64)
    halves = [(0, 1200), (1200, 2000)]
    chunks = [
        ChunkCopy(rows[a:b], sources, [outs[0][a * 64 : b * 64]], ids[a:b], 7, a, 0)
        for a, b in halves
    ]
    picked = np.random.default_rng(1).choice(len(rows), 1500, replace=False)
    counts: list[int] = []
    other = threading.Thread(
        target=lambda: counts.append(
            copy_once(rows[picked].astype(np.int64), sources, outs, flags, 0, picked)
        )
    )
    other.start()
    counts.append(copy_chunks(flags, chunks))
    other.join()
    assert sum(counts) == len(rows)
    assert (flags == 2).all()
    assert np.array_equal(arrays[0], table.numpy()[rows])
    assert np.array_equal(ids, rows.astype(np.int64) + 7)


def test_copy_chunks_checks_every_chunk_before_writing_any() -> None:
    table = torch.randn(10, 4)
    sources = row_sources([table])
    assert sources is not None
    flags = np.zeros(4, np.uint8)
    _, outs = _outs(4, 4)
    ids = np.zeros(4, np.int64)
    good = ChunkCopy(np.array([1, 2], np.int64), sources, [outs[0][:32]], ids[:2], 0, 0, 0)
    for bad in (
        ChunkCopy(np.array([3, 12], np.int64), sources, [outs[0][32:]], ids[2:], 0, 2, 0),
        ChunkCopy(np.array([3, 4], np.int64), sources, [outs[0][32:]], ids[2:], 0, 3, 0),
    ):
        with pytest.raises(IndexError):
            copy_chunks(flags, [good, bad])
    with pytest.raises(ValueError):  # an out shorter than its rows
        copy_chunks(flags, [good._replace(outs=[outs[0][:16]])])
    assert not flags.any() and not ids.any()


@pytest.mark.parametrize("seed", range(6))
def test_pending_slots_finds_what_a_search_of_the_index_finds(seed: int) -> None:
    """Claims (int32 and int64 rows), spans and flags at random: the slots of the positions
    still pending (flag below 2), ascending, once each, with their positions."""
    rng = np.random.default_rng(seed)
    claims, slot = [], 0
    where: dict[int, int] = {}
    for k, dtype in enumerate([np.int64, np.int32, np.int64]):
        rows = np.sort(rng.choice(1000, 300, replace=False)) + 1000 * k
        claims.append((rows.astype(dtype), slot))
        where.update({int(r): slot + i for i, r in enumerate(rows)})
        slot += len(rows)
    spans = []
    for first, count in [(3000, 50), (3100, 80)]:
        spans.append((first, count, slot))
        where.update({first + i: slot + i for i in range(count)})
        slot += count
    flags = rng.integers(0, 4, slot).astype(np.uint8)
    positions = rng.integers(0, 3300, 2000)
    slots, pos = pending_slots(positions, claims, np.array(spans, np.int64), flags)
    want = sorted({(where[p], p) for p in positions.tolist() if p in where and flags[where[p]] < 2})
    assert list(zip(slots.tolist(), pos.tolist(), strict=True)) == want
    with pytest.raises(IndexError):
        pending_slots(positions, claims, np.array(spans, np.int64), flags[:10])


class _Buffers:
    """The pool of a unit test: plain byte buffers; ``acquire`` of the k-th waits for
    ``allow[k]`` when given."""

    def __init__(self, size: int, allow: list[threading.Event] | None = None) -> None:
        self.size, self.allow = size, allow
        self.taken: list[bytearray] = []
        self.released: list[bytearray] = []

    def acquire(self) -> bytearray:
        if self.allow is not None:
            self.allow[len(self.taken)].wait()
        buf = bytearray(self.size)
        self.taken.append(buf)
        return buf


def _segments(buf: bytearray, rows: int, width: int) -> tuple[np.ndarray, list[memoryview]]:
    ids = np.frombuffer(buf, np.int64, rows, 0)
    return ids, [memoryview(buf)[8 * rows : 8 * rows + 4 * width * rows]]


def _deferred(
    table: torch.Tensor,
    rows: np.ndarray | None,
    per_chunk: int,
    pool: _Buffers,
    free: int = 0,
    together: Callable[[], Any] = contextlib.nullcontext,
) -> tuple[DeferredCopy, list[tuple[int, bytearray]]]:
    """A DeferredCopy of ``rows`` of ``table`` (None: every row, as a full) in chunks of
    ``per_chunk``; returns it and the (chunk, buffer) hand-overs as they happen. With ``free``,
    that many buffers can be taken without waiting (batches); without, one chunk at a time."""
    sources = row_sources([table])
    assert sources is not None
    width = table.shape[1]
    handed: list[tuple[int, bytearray]] = []
    spare = [free]

    def try_acquire() -> bytearray | None:
        if not spare[0]:
            return None
        spare[0] -= 1
        return pool.acquire()

    d = DeferredCopy(pool.acquire, pool.released.append, try_acquire if free else None, together)
    n = len(table) if rows is None else len(rows)
    source = lambda: rows  # noqa: E731  (one per shard, as the writer's)
    for i, start in enumerate(range(0, n, per_chunk)):
        count = min(per_chunk, n - start)
        d.add_chunk(
            (start, count) if rows is None else RowSlice(source, start, start + count),
            0,
            0,
            sources,
            lambda buf, count=count: _segments(buf, count, width),
            lambda buf, i=i, count=count: handed.append((i, buf[: (8 + 4 * width) * count])),
        )
    d.seal()
    return d, handed


def _saved(handed: list[tuple[int, bytearray]], width: int) -> tuple[np.ndarray, np.ndarray]:
    ids, rows = [], []
    for _, buf in handed:
        n = len(buf) // (8 + 4 * width)  # the hand-over kept the chunk's rows only
        seg_ids, (seg,) = _segments(buf, n, width)
        ids.append(seg_ids.copy())
        rows.append(np.frombuffer(seg, np.float32).reshape(n, width))
    return np.concatenate(ids), np.concatenate(rows)


@pytest.mark.parametrize("full", [False, True])
def test_protect_saves_the_rows_as_they_were_while_the_copy_goes_on(full: bool) -> None:
    """The copy held back chunk by chunk: steps protect their rows, then update them, before
    any chunk has a buffer (rows saved aside), between chunks, and after: the saved rows are
    the values at the snapshot, and each chunk is handed over once, in order."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(4000, 8, generator=gen)
    at_snapshot = table.clone()
    rows = None if full else np.sort(np.random.default_rng(2).choice(4000, 900, replace=False))
    per_chunk = 500 if full else 128
    n = 4000 if full else 900
    chunks = -(-n // per_chunk)
    allow = [threading.Event() for _ in range(chunks)]
    pool = _Buffers(per_chunk * (8 + 4 * 8), allow)
    d, handed = _deferred(table, rows, per_chunk, pool)
    closed: list[bool] = []
    runner = threading.Thread(target=d.run, args=(lambda: closed.append(True),))
    runner.start()

    def steps(count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for step in range(count):
            touched = torch.randint(0, 4000, (300,), generator=g)
            d.protect(touched)
            table[touched] += 1.0 + step  # the update the lookup precedes

    steps(5, 1)  # no chunk has a buffer: saved aside
    for k in range(chunks // 2):
        allow[k].set()
    while len(handed) < chunks // 2:  # the first half handed over (no timing: it must happen)
        runner.join(0.01)
    steps(5, 2)
    for e in allow:
        e.set()
    steps(5, 3)  # racing the copy of the rest
    runner.join()
    assert closed == [True]
    assert [i for i, _ in handed] == list(range(chunks))
    assert not pool.released
    ids, saved = _saved(handed, 8)
    want = np.arange(4000) if rows is None else rows
    assert np.array_equal(ids, want)
    assert np.array_equal(saved, at_snapshot.numpy()[want])
    assert not torch.equal(table, at_snapshot)  # the steps did update saved rows
    d.protect(torch.arange(4000))  # after the copy: nothing to do


@pytest.mark.parametrize("full", [False, True])
def test_chunks_whose_buffers_are_free_are_copied_and_handed_over_together(full: bool) -> None:
    """With buffers free at once, chunks go in batches (one native copy, their hand-overs
    inside one ``together``), the first of each batch waiting for its buffer: the same bytes,
    handed over in order."""
    table = torch.randn(4000, 8)
    rows = None if full else np.sort(np.random.default_rng(2).choice(4000, 900, replace=False))
    per_chunk = 500 if full else 100
    chunks = -(-(4000 if full else 900) // per_chunk)
    pool = _Buffers(per_chunk * (8 + 4 * 8))
    batches: list[int] = []

    @contextlib.contextmanager
    def together() -> Any:
        before = len(handed)
        yield
        batches.append(len(handed) - before)

    d, handed = _deferred(table, rows, per_chunk, pool, free=chunks - 3, together=together)
    d.run(lambda: None)
    # 1 waited for + (chunks - 3) free: one batch of all but 2; then the 2 left one by one
    assert batches == [chunks - 2, 1, 1]
    assert [i for i, _ in handed] == list(range(chunks))
    ids, saved = _saved(handed, 8)
    want = np.arange(4000) if rows is None else rows
    assert np.array_equal(ids, want)
    assert np.array_equal(saved, table.numpy()[want])


def test_a_failed_batch_gives_back_every_buffer_it_held_and_hands_none() -> None:
    table = torch.randn(1000, 4)
    pool = _Buffers(50 * (8 + 16))
    d, handed = _deferred(table, np.arange(0, 1000, 3, dtype=np.int64), 50, pool, free=3)
    outside = np.array([5000] * d._chunks[2].count, np.int64)  # outside the table
    d._chunks[2].rows = RowSlice(lambda: outside, 0, len(outside))
    with pytest.raises(IndexError):
        d.run(lambda: None)
    assert not handed
    assert pool.released == pool.taken[:4]


def test_a_failed_copy_gives_back_the_buffer_it_held_and_stops_guarding() -> None:
    table = torch.randn(1000, 4)
    pool = _Buffers(50 * (8 + 16))
    d, handed = _deferred(table, np.arange(0, 1000, 3, dtype=np.int64), 50, pool)
    outside = np.array([5000] * d._chunks[3].count, np.int64)  # outside the table
    d._chunks[3].rows = RowSlice(lambda: outside, 0, len(outside))
    closed: list[bool] = []
    with pytest.raises(IndexError):
        d.run(lambda: closed.append(True))
    assert closed == [True]  # the guard came off
    assert [i for i, _ in handed] == [0, 1, 2]
    assert pool.released == [pool.taken[3]]
    d.protect(torch.arange(1000))  # closed: never writes into a buffer given back


def test_a_dropped_part_took_no_buffer() -> None:
    pool = _Buffers(64)
    d, handed = _deferred(torch.randn(100, 4), np.arange(0, 100, 2, dtype=np.int64), 10, pool)
    d.drop()
    d.protect(torch.arange(100))
    assert not pool.taken and not handed


class _LazyFuture(Future[Any]):
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._job = fn, args

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            fn, args = self._job
            try:
                self.set_result(fn(*args))
            except BaseException as e:
                self.set_exception(e)
        return super().result(timeout)


class _LazyRunner(Executor):
    """A guard runner that runs a job only when its result is asked for: a backward that did
    not wait for its lookup's guard would write the rows before they were copied."""

    def __init__(self) -> None:
        self.jobs: list[_LazyFuture] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        job = _LazyFuture(fn, args)
        self.jobs.append(job)
        return job


class _Update(torch.autograd.Function):
    """Stands for the fused optimizer's update in the lookup's backward (logs when it runs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[Any]) -> torch.Tensor:
        ctx.log = log
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.log.append("update")
        return grad * 2, None


def _looked_up(store: TrackerStore, rows: torch.Tensor, out: torch.Tensor) -> None:
    """What the lookup hook does for a lookup a backward follows (adapters/torchrec_hooks.py)."""
    store.await_backward(out, rows, store.guard(rows, in_background=True))


def test_a_lookup_guards_its_rows_beside_the_step_and_its_backward_waits_for_it() -> None:
    """With a backward to come, a lookup's guard is handed to the snapshot's thread and the
    gradient hook on the lookup's output waits for it: it runs before the update, whenever
    its thread gets to it (here: only when waited for). Its error is the backward's. Without
    a backward (no grad) it runs at once."""
    store = TrackerStore(10, ("a",))
    log: list[Any] = []

    def protect(pos: torch.Tensor) -> None:
        if pos.tolist() == [7]:
            raise OSError("the guard failed")
        log.append(pos.tolist())

    runner = _LazyRunner()
    store.add_guard(protect, runner)
    x = torch.ones(3, requires_grad=True)
    out = _Update.apply(x, log)
    _looked_up(store, torch.tensor([1, 2]), out)
    assert log == [] and len(runner.jobs) == 1  # not on the lookup
    out.sum().backward()
    assert log == [[1, 2], "update"]
    store.guard(torch.tensor([3]))  # no backward follows: now
    assert store.guard(torch.tensor([4])) == []
    assert log[-2:] == [[3], [4]] and len(runner.jobs) == 1
    failing = _Update.apply(x, log)
    _looked_up(store, torch.tensor([7]), failing)
    with pytest.raises(OSError, match="the guard failed"):
        failing.sum().backward()
    assert log[-1] == [4]  # the update did not run
    store.remove_guard(protect)
    _looked_up(store, torch.tensor([5]), _Update.apply(x, log))
    assert log[-1] == [4] and len(runner.jobs) == 2


def test_another_backward_through_a_kept_graph_guards_and_tracks_its_rows_again() -> None:
    """``backward(retain_graph=True)``, a checkpoint, then another backward through the same
    graph: that backward writes the lookup's rows again with no lookup before it. Its rows are
    guarded first (a snapshot still copying them saves them as they were) and pending again
    (the next delta has them)."""
    store = TrackerStore(10, ("a",))
    log: list[Any] = []
    x = torch.ones(3, requires_grad=True)
    out = _Update.apply(x, log)
    rows = torch.tensor([1, 2])
    store.record(rows)
    _looked_up(store, rows, out)
    out.sum().backward(retain_graph=True)
    assert store.awaiting_backward() == 0 and log == ["update"]
    tok = store.begin_read("a")  # the checkpoint after that step
    assert tok.rows.tolist() == [1, 2]
    store.commit(tok)
    store.add_guard(lambda pos: log.append(pos.tolist()), _LazyRunner())
    out.sum().backward()
    assert log == ["update", [1, 2], "update"]  # guarded, at once, before the update
    assert store.begin_read("a").rows.tolist() == [1, 2]


# ---- real 2-rank DMP models --------------------------------------------------------------------
SPEC = ModelSpec(num_tables=2, rows=501, dim=8, batch=16, pooling=2)
STEPS, EVERY, MORE = 9, 3, 2


def _train(model: Any, dense: Any, batches: Any) -> float:
    dense.zero_grad()
    batch = next(batches)
    loss, _ = model(batch)
    loss.backward()
    dense.step()
    return float(loss)


def _job(rank: int, world_size: int, root: str, pipeline: str | None) -> None:
    uri = f"{root}/ck"
    model, dense = _build(seed=0)
    it = _batches(rank, 1, STEPS + MORE)
    runner = _pipeline(pipeline, model, dense) if pipeline else None

    def step() -> float:
        return _loss(runner.progress(it)) if runner else _train(model, dense, it)

    gate, full_gate = threading.Event(), threading.Event()
    config = deck.DeckConfig(uri=uri, delta_every_steps=EVERY, staging={"copy_on_write": "all"})
    with deck.enable(model, [dense], config) as ck:
        for s in range(STEPS + 1):
            if s:
                step()
            if s == 0:
                cow.FILL_GATE = full_gate  # the full's copy waits while steps 1, 2 train
            if s == EVERY:
                full_gate.set()
                cow.FILL_GATE = None
            if s == STEPS:
                cow.FILL_GATE = gate  # the copy of this delta waits while training goes on
            ck.step(s)
            if s == 0:
                at_full = capture_state(model, dense)
        first, last = ck.history[0], ck.history[-1]
        assert first.kind == "full" and first.copied_after == first.rows > 0, first
        assert last.kind == "delta" and last.rows > 0
        assert last.copied_after == last.rows, (last.copied_after, last.rows)
        live = capture_state(model, dense)
        losses = [step() for _ in range(MORE)]  # each lookup copies its pending rows first
        assert diff_states(live, capture_state(model, dense))  # the saved rows did change
        gate.set()
        cow.FILL_GATE = None
        assert ck.flush()
    fresh, fresh_dense = _build(seed=1)
    with deck.enable(fresh, [fresh_dense], deck.DeckConfig(uri=uri)) as ck2:
        assert ck2.restore(0) == 0
        bad = diff_states(at_full, capture_state(fresh, fresh_dense))
        assert not bad, f"rank {rank}: the full restored differs: {bad[:8]}"
        assert ck2.restore() == STEPS
        bad = diff_states(live, capture_state(fresh, fresh_dense))
        assert not bad, f"rank {rank}: restored state differs: {bad[:8]}"
        fresh_it = _batches(rank, STEPS + 1, STEPS + MORE)
        again = [_train(fresh, fresh_dense, fresh_it) for _ in range(MORE)]
    if not pipeline:
        assert again == losses, (rank, again, losses)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [None, "TrainPipelineSparseDist"])
def test_copy_on_write_delta_restores_bitwise_while_training_went_on(
    tmp_path: Path, pipeline: str | None
) -> None:
    """2 ranks (t0 table_wise, t1 row_wise, fused rowwise Adagrad): the full of step 0 and the
    delta of step 9 are copied after the stall (every row), each copy held back while two more
    steps update its rows; both restore bitwise (weights, momentum, dense) into a fresh model,
    and training on gives the never-stopped run's losses."""
    run_ranks(_job, str(tmp_path), pipeline)


def _lazy_guard_job(rank: int, world_size: int, root: str) -> None:
    model, dense = _build(seed=0)
    it = _batches(rank, 1, EVERY + MORE)
    runner = _LazyRunner()
    gate = threading.Event()
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=EVERY)
    with deck.enable(model, [dense], config) as ck:
        for stager in ck._stagers:
            stager.guard_runner = runner  # type: ignore[assignment]
        try:
            for s in range(EVERY + 1):
                if s:
                    _train(model, dense, it)
                if s == EVERY:
                    cow.FILL_GATE = gate  # only the lookups' guards save the rows steps update
                ck.step(s)
            live = capture_state(model, dense)
            losses = [_train(model, dense, it) for _ in range(MORE)]
            # One guard per lookup of the two steps, each run by its backward's wait
            assert runner.jobs and all(j.done() for j in runner.jobs), runner.jobs
        finally:
            gate.set()
            cow.FILL_GATE = None
        assert ck.flush()
        assert ck.history[-1].copied_after == ck.history[-1].rows > 0
    fresh, fresh_dense = _build(seed=1)
    with deck.enable(fresh, [fresh_dense], deck.DeckConfig(uri=f"{root}/ck")) as ck2:
        assert ck2.restore() == EVERY
        bad = diff_states(live, capture_state(fresh, fresh_dense))
        assert not bad, f"rank {rank}: restored state differs: {bad[:8]}"
        fresh_it = _batches(rank, EVERY + 1, EVERY + MORE)
        assert [_train(fresh, fresh_dense, fresh_it) for _ in range(MORE)] == losses


@pytest.mark.slow
def test_a_real_backward_waits_for_its_lookups_guard_before_the_fused_update(
    tmp_path: Path,
) -> None:
    """2 ranks, a delta copied after the stall with its copy held back, and guards that run
    only when a backward waits for them: the fused optimizer's update in TorchRec's backward
    comes after the hook on the lookup's output, so the delta still restores bitwise."""
    run_ranks(_lazy_guard_job, str(tmp_path))


def _lookahead_job(rank: int, world_size: int, root: str) -> None:
    from torchrec.distributed.train_pipeline.runtime_forwards import (
        EmbeddingPipelinedForward,
        PrefetchPipelinedForward,
    )

    model, dense = _build(seed=0)
    it = _batches(rank, 1, 2 * STEPS + 4)
    ebc = model.module.get_submodule("model.sparse_arch.embedding_bag_collection")
    refused = []
    with deck.enable(
        model, [dense], deck.DeckConfig(uri=f"{root}/ck2", delta_every_steps=EVERY)
    ) as ck:
        for s in range(2 * STEPS + 1):
            if s:
                _train(model, dense, it)
            kind = (None, EmbeddingPipelinedForward, PrefetchPipelinedForward)[(s // EVERY) % 3]
            if s % EVERY == 0 and s > EVERY and kind is not None:
                # What TorchRec's semi-sync / prefetch pipelines install: looked up ahead
                ebc.forward = kind("ebc", None, ebc, None, None)
                with pytest.raises(CheckpointError, match="semi-sync or prefetch pipeline") as e:
                    ck.step(s)
                assert kind.__name__ in str(e.value)
                refused.append(s)
                ebc.__dict__.pop("forward", None)
                continue
            ck.step(s)
            if s % EVERY == 0:
                assert ck.history[-1].state != "failed" and ck.history[-1].step == s
        assert ck.flush()
        saved = [h.step for h in ck.history if h.state != "failed"]  # rank 0 commits them
        live = capture_state(model, dense)
    assert refused == [6, 12, 15], refused
    assert not set(refused) & set(saved) and saved[-1] == 2 * STEPS, saved
    # Nothing the refused checkpoints held was lost: the next ones took their rows
    fresh, fresh_dense = _build(seed=1)
    with deck.enable(fresh, [fresh_dense], deck.DeckConfig(uri=f"{root}/ck2")) as ck2:
        assert ck2.restore() == 2 * STEPS
        bad = diff_states(live, capture_state(fresh, fresh_dense))
        assert not bad, f"rank {rank}: restored state differs: {bad[:8]}"
    # Configurations that write the rows in the stall say so (once), on rank 0
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    chain_log = logging.getLogger("deck.trainer.chain")
    chain_log.addHandler(handler)
    chain_log.setLevel(logging.INFO)
    for i, (staging, said) in enumerate(
        [({"release": "first_tier"}, "release='first_tier'"), ({"bundle_bytes": 8 << 20}, "bundle")]
    ):
        cfg = deck.DeckConfig(uri=f"{root}/ck-{i}", delta_every_steps=1, staging=staging)
        with deck.enable(model, [dense], cfg) as ck:
            for s in range(3):
                if s:
                    _train(model, dense, it)
                ck.step(s)
            assert all(h.copied_after == 0 for h in ck.history), ck.history
        told = [r.getMessage() for r in records if said in r.getMessage()]
        assert len(told) == (1 if rank == 0 else 0), told  # rank 1 logs at DEBUG


@pytest.mark.slow
def test_pipelines_that_look_up_ahead_are_refused(tmp_path: Path) -> None:
    """Where a sharded module runs through TorchRec's semi-sync or prefetch forward (the next
    batch looked up before this batch's update: these pipelines need CUDA, so the forward they
    install is set by hand), each checkpoint is refused on every rank, naming the forward;
    without it the next commits, and the restore holds every row. Release modes that copy in
    the stall say so."""
    run_ranks(_lookahead_job, str(tmp_path))
