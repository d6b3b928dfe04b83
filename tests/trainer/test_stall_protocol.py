"""The stall path: one collective per steady-state checkpoint, a buffer pool sized
from the parts within its cap, and cached table/dense views that stay live. Real TorchRec DMP
over gloo ranks, real files."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import deck
from deck.config import StagingConfig
from deck.demo import ModelSpec, build_model, train_step
from deck.model import TableShard
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks
from deck.testing.staging import full_part_info
from deck.trainer.chain import gc_paused
from deck.trainer.staging import BufferPool, CheckpointStats, Stager
from deck.trainer.writer import RankPartWriter

SPEC = ModelSpec(num_tables=2, rows=2000, dim=8, batch=64, sharding="table_wise")


def test_pool_grows_to_the_part_within_its_cap_and_shrinks_back() -> None:
    pool = BufferPool(2, 4096, cap=5)
    assert not pool.size_for(4) and pool.count == 4
    held = [pool.acquire() for _ in range(4)]  # four at once: none of them waits
    assert pool.allocated_bytes == 4 * 4096 and pool.peak_in_use == 4
    for b in held:
        pool.release(b)
    assert pool.size_for(9) and pool.count == 5  # the cap wins, and says so
    assert not pool.size_for(1) and pool.count == 2  # never below the floor
    held = [pool.acquire() for _ in range(2)]
    for b in held:
        pool.release(b)  # more buffers than the pool holds now: freed as they come back
    assert pool.allocated_bytes == 2 * 4096
    pool.size_for(4)
    pool.prefault()  # the missing two, ahead of use
    assert pool.allocated_bytes == 4 * 4096


def test_a_waiting_acquire_takes_a_returning_buffer_of_a_shrunk_pool() -> None:
    """After a full borrowed buffers (the pool shrank back while they are still being written),
    the next part takes them as they come back instead of waiting for all of them."""
    pool = BufferPool(1, 4096, cap=4)
    pool.size_for(3)
    held = [pool.acquire() for _ in range(3)]
    pool.size_for(1)  # the full is handed on: one buffer to keep
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    deadline = time.monotonic() + 60
    while pool._waiting == 0:  # the waiter is blocked in acquire (allocated 3 >= count 1)
        assert time.monotonic() < deadline, "the acquire never blocked"
        time.sleep(0.001)
    pool.release(held[0])  # kept for the waiter, not freed
    waiter.join(timeout=60)
    assert len(got) == 1 and got[0] is held[0]
    for b in held[1:]:
        pool.release(b)  # nobody waits: freed down to the pool's size
    pool.release(got[0])
    assert pool.allocated_bytes == 1 * 4096 and pool.in_use == 0


def test_a_draining_full_leaves_the_deltas_buffers_warm() -> None:
    """While a full's borrowed buffers come back, the first ones (as many as the deltas use)
    stay in the pool, so the next delta takes them at once; the rest are freed."""
    pool = BufferPool(1, 4096, cap=6)
    pool.size_for(6)
    held = [pool.acquire() for _ in range(6)]  # the full's buffers, all being written
    pool.size_for(2)  # the full is handed on: the deltas use two
    for b in held[:3]:
        pool.release(b)
    assert pool.allocated_bytes == 5 * 4096  # two kept warm, one freed, three still written
    got = [pool.acquire() for _ in range(2)]  # the next delta: the warm ones, no wait
    assert {id(b) for b in got} == {id(b) for b in held[:2]}
    for b in held[3:] + got:
        pool.release(b)
    assert pool.allocated_bytes == 2 * 4096 and pool.in_use == 0


def _protocol(rank: int, world_size: int, root: str, cap: int) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=f"{root}/ck",
        delta_every_steps=1,
        lease_ttl_s=None,
        staging=deck.StagingConfig(chunk_bytes=4096, chunks_in_flight=1, snapshot_memory_bytes=cap),
    )
    calls: list[int] = []
    capped_said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: capped_said.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deck").addHandler(handler)
    with deck.enable(model, [opt], config) as ck:
        gather = ck.coord.gather

        def counted(values: list[float]) -> Any:
            calls.append(len(values))
            return gather(values)

        ck.coord.gather = counted  # type: ignore[method-assign]
        per_step = []
        for step in range(6):
            if step:
                train_step(model, opt, SPEC, step)
            before = len(calls)
            stats = ck.step(step)
            assert stats is not None
            per_step.append((stats.kind, len(calls) - before, stats.pool_capped))
            adapter = ck.adapter
            # The cached views are the live tables: equal to a fresh state_dict read, bitwise.
            cached, fresh = adapter.table_shards(), adapter._read_table_shards()
            assert cached is adapter.table_shards()
            for a, b in zip(cached, fresh, strict=True):
                for name in b.states:
                    assert torch.equal(a.states[name], b.states[name]), (step, a.table, name)
        ck.flush()
        states = [h.state for h in ck.history]

    assert per_step[0][0] == "full"
    # Steady state: one all-gather per delta (the vote), never an agreement before it.
    assert [(k, n) for k, n, _ in per_step[1:]] == [("delta", 1)] * 5, per_step
    capped = [c for _, _, c in per_step[1:]]
    assert all(capped) if cap == 4096 else not any(capped), per_step
    # Said once at most (a break-it finding: a WARNING per rank and checkpoint, waited or not)
    assert len([m for m in capped_said if "needs more chunk buffers" in m]) <= 1, capped_said
    assert set(states) == {"committed" if rank == 0 else "uploaded"}, states


@pytest.mark.slow
@pytest.mark.parametrize("cap", [4096, 2**30], ids=["capped", "default-cap"])
def test_one_collective_per_delta_and_the_pool_cap(tmp_path: Path, cap: int) -> None:
    """Each delta after the first checkpoint costs exactly one all-gather; a cap of one chunk
    buffer is reported as capped on every delta (and the deltas still commit), the default cap
    never is; the adapter's cached shard views equal a fresh state_dict read after every step."""
    run_ranks(_protocol, str(tmp_path), cap)


def _reallocated(rank: int, world_size: int) -> None:
    model, opt = build_model(SPEC)
    ck = deck.enable(model, None, deck.DeckConfig(uri="memory://deck-realloc"))
    try:
        adapter = ck.adapter
        first = adapter.dense_state()
        shards = adapter.table_shards()
        train_step(model, opt, SPEC, 1)  # in-place updates: the cached views stay
        assert adapter.table_shards() is shards and adapter.dense_state().keys() == first.keys()

        ptrs = {v.data_ptr() for v in first.values() if v.dim() == 2}
        param = next(p for p in model.parameters() if p.data_ptr() in ptrs)  # a dense weight
        old = param.data_ptr()
        keys = [k for k, v in first.items() if v.data_ptr() == old]
        assert keys
        param.data = param.data.clone() + 1  # new storage: the cached views are stale
        again = adapter.dense_state()
        for k in keys:
            assert again[k].data_ptr() == param.data_ptr() != old
            assert torch.equal(again[k], param.detach())

        # A submodule swapped for another: its tensors are read, not the old module's
        name, linear = next((n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear)
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        fresh = torch.nn.Linear(linear.in_features, linear.out_features)
        setattr(parent, name.rsplit(".", 1)[1], fresh)
        swapped = adapter.dense_state()
        assert any(v.data_ptr() == fresh.weight.data_ptr() for v in swapped.values())
        assert not any(v.data_ptr() == linear.weight.data_ptr() for v in swapped.values())

        # A buffer registered later is part of the dense state at once
        fresh.register_buffer("deck_test_extra", torch.ones(2))
        assert any(k.endswith("deck_test_extra") for k in adapter.dense_state())

        # A table's optimizer state given new storage: the shards are read again
        tbe = adapter._tbes[0]
        tbe.momentum1_host.data = tbe.momentum1_host.data.clone()
        assert adapter.table_shards() is not shards
    finally:
        ck.close()


@pytest.mark.slow
def test_cached_views_follow_reallocated_swapped_and_new_tensors() -> None:
    """dense_state() and table_shards() are cached while training updates tensors in place,
    and read again once a parameter gets new storage, a submodule is swapped, a buffer is
    registered, or a table's optimizer state is reallocated."""
    run_ranks(_reallocated, world_size=1)


def _local_stager(tmp_path: Path, chunks_in_flight: int = 1) -> tuple[Any, Stager]:
    """A local store and a one-rank stager of 64 KiB chunks (tables of a few hundred KiB make
    several chunks)."""
    storage = open_storage(str(tmp_path / "ck"))
    config = StagingConfig(chunk_bytes=16 * 4096, chunks_in_flight=chunks_in_flight)
    return storage, Stager(storage, config, rank=0)


def _shard(rows: int) -> TableShard:
    return TableShard.whole("m.t0.weight", {"weight": torch.randn(rows, 16)})


def _stage_part(
    stager: Any,
    storage: Any,
    step: int,
    ckpt_id: str,
    shard: Any,
    hold: bool = False,
    full: bool = False,
) -> Any:
    """Stage a one-rank part of ``shard`` by hand, as the checkpointer does, up to the seal (the
    moment the ranks vote); ``hold``: hold its writes whatever the stager's policy says;
    ``full``: size the pool as for a full."""
    staged = stager.begin(full_part_info(storage.uri, step, ckpt_id), reserved=0)
    writer = RankPartWriter(storage, step, ckpt_id, 0, 1, stager.cfg.chunk_bytes, sink=staged)
    stager.size_pool(staged, writer.buffers_needed([shard], [shard.rows]), full=full)
    if hold and not staged.holding:
        staged.hold()
    writer.write_part([shard], lambda s: None, {"dense.w": torch.ones(3)}, {"user": None})
    staged.seal()
    return staged, writer


def _commit(stager: Any, staged: Any) -> None:
    stats = CheckpointStats(step=staged.info.step, kind="full", id=staged.info.ckpt_id)
    stager.enqueue(staged, stats)
    assert stager.flush(timeout=120) and stats.state == "committed", stats.error


def test_a_steady_part_released_in_memory_is_written_only_after_the_vote(tmp_path: Path) -> None:
    """release=in_memory: a part the pool already has buffers for (a steady delta) is not
    written while the job is stalled (the background does not compete with the copy or the
    vote); a part the vote drops is never written and its buffers come back; a kept one is
    written and commits. A part larger than the warm pool (the first one, a full) writes as it
    fills, reusing its buffers. A held part whose pool runs out starts its writes instead of
    waiting for them."""
    storage, stager = _local_stager(tmp_path)
    shard = _shard(3000)
    try:

        def files(step: int) -> list[Path]:
            return [p for p in (tmp_path / "ck" / f"step-{step:012d}").rglob("*") if p.is_file()]

        first, _ = _stage_part(stager, storage, 1, "00000000000000a0", shard)
        assert not first.holding  # a cold pool: its buffers are new, it writes as it fills
        _commit(stager, first)

        staged, writer = _stage_part(stager, storage, 2, "00000000000000a1", shard)
        assert staged.holding and writer.chunks_written > 1
        assert stager.pool.in_use == writer.chunks_written
        assert files(2) == []  # held: not one chunk, state file or pending record yet
        stager.discard(staged)  # the vote dropped it
        assert stager.pool.in_use == 0 and files(2) == []

        staged, writer = _stage_part(stager, storage, 2, "00000000000000a2", shard)
        assert staged.holding and files(2) == []
        _commit(stager, staged)
        assert len([p for p in files(2) if p.suffix == ".chunk"]) == writer.chunks_written
    finally:
        stager.close()

    small = StagingConfig(
        chunk_bytes=16 * 4096, chunks_in_flight=1, snapshot_memory_bytes=16 * 4096
    )
    stager = Stager(open_storage(str(tmp_path / "small")), small, rank=0)
    try:
        staged, writer = _stage_part(stager, stager.storage, 1, "00000000000000a3", shard, True)
        assert writer.chunks_written > 1 and stager.pool.peak_in_use == 1
        assert staged.buffer_wait_s > 0  # it waited for written buffers, not forever
        _commit(stager, staged)
    finally:
        stager.close()


def test_the_first_delta_after_a_full_finds_its_buffers_warm(tmp_path: Path) -> None:
    """No delta has sized the pool after a process's first full: the pool keeps the buffers the
    full borrowed, so the first delta takes them (no wait, no new buffer); once that delta is
    handed on the pool settles to the delta's size and the extra buffers are freed. The pool
    makes no buffer the full did not take: a full whose writes returned buffers while it filled
    (so it took fewer than its chunks) leaves no more than it took."""
    storage, stager = _local_stager(tmp_path)
    big, small = _shard(12000), _shard(3000)
    gate = threading.Event()
    try:
        stager._writer.submit(gate.wait)  # the full's writes wait: it takes one buffer per chunk
        full, writer = _stage_part(stager, storage, 1, "00000000000000b0", big, full=True)
        borrowed = writer.chunks_written
        gate.set()
        _commit(stager, full)
        stager._syncer.submit(lambda: None).result(timeout=60)  # the settling has run
        assert stager.pool.allocated == borrowed > 2, borrowed  # kept for the first delta
        kept = {id(b) for b in stager.pool._free}

        delta, writer = _stage_part(stager, storage, 2, "00000000000000b1", small)
        assert writer.chunks_written < borrowed
        assert stager.pool.allocated == borrowed  # no new buffer
        held = {id(b) for _, b in delta._held or () if b is not None}
        assert held and held <= kept  # the full's, kept warm
        _commit(stager, delta)
        stager._syncer.submit(lambda: None).result(timeout=60)
        assert stager.pool.allocated == stager.pool.count == writer.chunks_written
    finally:
        stager.close()


def test_after_a_full_the_pool_makes_no_buffer_the_full_did_not_take(tmp_path: Path) -> None:
    """A full sizes the pool to its chunks, but buffers its writes return while it fills are
    taken again, so it may take fewer. Until a delta sizes the pool, handing a full on keeps what
    it took and faults in nothing more (hundreds of MiB of page faults on a background thread,
    competing with training, for buffers the first delta frees)."""
    storage, stager = _local_stager(tmp_path)
    try:
        staged = stager.begin(full_part_info(storage.uri, 1, "00000000000000e0"), reserved=0)
        stager.size_pool(staged, 10, full=True)  # a full of 10 chunks
        taken = [stager.pool.acquire() for _ in range(3)]  # its writes gave the rest back
        for buf in taken:
            stager.pool.release(buf)
        stager.enqueue(staged, CheckpointStats(step=1, kind="full", id="00000000000000e0"))
        stager._syncer.submit(lambda: None).result(timeout=60)  # any settling has run
        assert stager.pool.count == 10 and stager.pool.allocated == 3
    finally:
        stager.close()


def test_a_delta_does_not_wait_for_a_full_still_being_written(tmp_path: Path) -> None:
    """While a full's writes are still queued (the spool writer is held here), the next delta
    gets buffers of its own within the cap instead of waiting for the full's; once handed on,
    the pool keeps the full's buffers as they come back, so the delta after takes those (no new
    buffer), and then settles to the deltas' size."""
    storage, stager = _local_stager(tmp_path)
    big, small = _shard(12000), _shard(3000)
    gate = threading.Event()
    try:
        stager._writer.submit(gate.wait)  # every write queues behind this until it is set
        full, fw = _stage_part(stager, storage, 1, "00000000000000c0", big, full=True)
        stager.enqueue(full, CheckpointStats(step=1, kind="full", id="00000000000000c0"))
        assert stager.pool.in_use == fw.chunks_written  # nothing of the full written yet

        staged: list[Any] = []
        delta = threading.Thread(
            target=lambda: staged.append(_stage_part(stager, storage, 2, "00000000000000c1", small))
        )
        delta.start()
        delta.join(timeout=120)
        assert not delta.is_alive(), "the delta waited for the full's writes"
        d1, w1 = staged[0]
        assert stager.pool.allocated == fw.chunks_written + w1.chunks_written
        stager.enqueue(d1, CheckpointStats(step=2, kind="delta", id="00000000000000c1"))
        gate.set()
        assert stager.flush(timeout=120)
        stager._syncer.submit(lambda: None).result(timeout=60)
        grown = stager.pool.allocated
        assert grown == fw.chunks_written + w1.chunks_written  # the full's kept as they came back

        d2, w2 = _stage_part(stager, storage, 3, "00000000000000c2", small)
        assert stager.pool.allocated == grown  # taken from those, none new
        _commit(stager, d2)
        stager._syncer.submit(lambda: None).result(timeout=60)
        assert stager.pool.allocated == stager.pool.count == w2.chunks_written
    finally:
        gate.set()
        stager.close()


def test_no_garbage_collection_inside_the_stall_and_none_lost() -> None:
    """Inside ``gc_paused`` (the checkpoint call) the collector is off; it is back on after,
    also when the call raised, and stays off for a process that had turned it off itself."""
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed checkpoint")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_writer_starts_no_file_of_an_earlier_part_while_the_training_thread_is_stalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within a checkpoint's stall the first tier's writer starts no file queued before it (a
    full still being written would compete for the GIL with the stalled thread); a wait of the
    stalled thread for writes (start_writes: buffers, a first_tier release, a dropped part) and
    the end of the stall let it go on; another thread's start_writes (the commit thread's) does
    not. Files the stalled checkpoint writes as it fills (a full,
    first_tier) are not held back: their buffers come back and their writes overlap the copy."""
    import deck.trainer.staging.stager as stager_module

    monkeypatch.setattr(stager_module, "STALL_GATE_MAX_S", 600.0)  # no safety valve in this test
    storage, stager = _local_stager(tmp_path, chunks_in_flight=16)
    shard = _shard(3000)

    def stage_full(step: int) -> tuple[Any, RankPartWriter]:
        ckpt_id = f"{step:016x}"
        staged = stager.begin(full_part_info(storage.uri, step, ckpt_id), 0)
        writer = RankPartWriter(storage, step, ckpt_id, 0, 1, 16 * 4096, staged)
        stager.size_pool(staged, 8, full=True)  # a full: its writes are not held
        writer.write_shard(shard, None, full=True)
        return staged, writer

    try:
        for step, opened_by in ((1, "start_writes"), (2, "end of the stall")):
            hold = threading.Event()
            stager._writer.submit(hold.wait)  # the earlier part's files queue behind this
            earlier, writer = stage_full(step)
            with stager.stall():
                hold.set()
                after = stager._writer.submit(lambda: None)  # runs once they are written
                # The commit thread starting a part's writes does not open it (only the
                # stalled thread's own waits do)
                committer = threading.Thread(target=earlier.start_writes)
                committer.start()
                committer.join(timeout=120)
                with pytest.raises(concurrent.futures.TimeoutError):
                    after.result(timeout=0.5)  # cannot finish while the gate is shut
                if opened_by == "start_writes":
                    earlier.start_writes()
                    after.result(timeout=120)
            after.result(timeout=120)
            assert earlier.error() is None and len(earlier.files) == writer.chunks_written > 1
            stager.discard(earlier)
        with stager.stall():  # the stalled checkpoint's own files are written as it fills
            own, writer = stage_full(3)
            stager._writer.submit(lambda: None).result(timeout=120)
            assert own.error() is None and len(own.files) == writer.chunks_written > 1
        stager.discard(own)
    finally:
        stager.close()
