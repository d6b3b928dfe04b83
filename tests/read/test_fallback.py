"""Damaged checkpoints on a real 2-rank DMP run: restore names the damaged file and step;
``restore(allow_fallback=True)`` quarantines it and restores the newest older step that has a
valid chain, bitwise; a trainer whose last chain was broken takes a new full next."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

import deck
from deck.demo import (
    ModelSpec,
    TrainState,
    build_model,
    capture_state,
    diff_states,
    train_step,
    train_with_checkpoints,
)
from deck.errors import CorruptCheckpointError
from deck.read.catalog import read_manifests
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=3, rows=600, dim=8, batch=32)


def _restore(config: deck.DeckConfig, step: int | None, **kw: bool) -> tuple[int | None, object]:
    model, opt = build_model(SPEC, seed=99)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        got = ck.restore(step, **kw)
        return got, (ck.last_restore, capture_state(model, opt, user))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _job(rank: int, world_size: int, root: str) -> None:
    uri = f"{root}/ck"
    config = deck.DeckConfig(uri=uri, delta_every_steps=5, lease_ttl_s=None)
    # Nothing committed yet: no fallback is offered (a break-it finding: it was)
    with pytest.raises(deck.CheckpointNotFoundError) as empty:
        _restore(config, 6)
    assert str(empty.value).endswith(f"; nothing is committed at {uri}"), empty.value
    model, opt = build_model(SPEC)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        live = train_with_checkpoints(ck, model, opt, SPEC, user, 20)

        # Damage one chunk of the delta of step 15 (rank 0 does it; every rank then restores).
        chunk = sorted((Path(uri) / "step-000000000015").rglob("*.chunk"))[0]
        if rank == 0:
            _flip(chunk)
        dist.barrier()

        # A plain restore of the latest step fails on every rank, each naming the file (the
        # rank that read it, or the others quoting it: rank 0's log is the one read) and what
        # to do (a break-it finding: the others said "see their errors", nothing to do)
        with pytest.raises(CorruptCheckpointError) as info:
            _restore(config, None)
        said = str(info.value)
        assert chunk.name in said and "step 15" in said, said
        assert "restore(allow_fallback=True) restores the newest valid step" in said, said

        # With fallback: steps 20 and 15 need the damaged delta; step 10 is the newest valid one.
        got, (stats, state) = _restore(config, None, allow_fallback=True)
        assert got == 10
        assert stats.fallback and "instead of step 20" in stats.fallback, stats.fallback
        if rank == 0:
            assert chunk.name in stats.fallback, stats.fallback
        bad = diff_states(live[10], state)
        assert not bad, f"rank {rank}: {bad[:5]}"
        manifests = read_manifests(open_storage(uri))
        assert list(manifests.quarantined) == [manifests[15].id]

        # The trainer was at step 20, a delta of 15: its next checkpoint must be a full.
        for step in range(21, 26):
            train_step(model, opt, SPEC, step)
            user.step = step
        stats25 = ck.step(25)
        assert stats25 is not None and stats25.kind == "full", stats25
        live[25] = capture_state(model, opt, user)
        ck.flush()

    got, (_, state) = _restore(config, None)
    assert got == 25
    assert not diff_states(live[25], state)

    # Step 10 removed (as retention would): a fallback from it goes to an older step, never to
    # a newer one (25 is committed and valid, yet newer than asked).
    if rank == 0:
        shutil.rmtree(Path(uri) / "step-000000000010")
    dist.barrier()
    got, (stats, state) = _restore(config, 10, allow_fallback=True)
    assert got == 5, got
    assert stats.fallback and "instead of step 10" in stats.fallback, stats.fallback
    assert not diff_states(live[5], state)

    # A commit record lost after step 25 (step 30's: a sync that missed it). Step 35 builds on
    # it: a plain restore of the latest refuses on every rank, naming the steps it would give
    # up and the record to put back (a break-it finding: a restarted job restored step 25 with
    # a warning and saved steps 30 and 35 again over what the record's return restores).
    model, opt = build_model(SPEC)
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        assert ck.restore() == 25
        for step in range(26, 36):
            train_step(model, opt, SPEC, step)
            user.step = step
            ck.step(step)
        live[35] = capture_state(model, opt, user)
        assert ck.flush()
    record = Path(uri) / "step-000000000030" / "manifest.json"
    kept = record.read_bytes()
    dist.barrier()
    if rank == 0:
        record.unlink()
    dist.barrier()
    with pytest.raises(CorruptCheckpointError) as lost:
        _restore(config, None)
    said = str(lost.value)
    assert "steps [35]" in said and "after step 25" in said, said
    assert "step-000000000030/manifest.json was lost" in said, said
    assert "allow_fallback=True) restores step 25" in said, said
    if rank:
        assert "on rank 0" in said, said
    got, (_, state) = _restore(config, None, allow_fallback=True)
    assert got == 25 and not diff_states(live[25], state)
    dist.barrier()
    if rank == 0:
        record.write_bytes(kept)
    dist.barrier()
    got, (_, state) = _restore(config, None)
    assert got == 35 and not diff_states(live[35], state)


def test_fallback_and_new_full(tmp_path: Path) -> None:
    run_ranks(_job, str(tmp_path))
