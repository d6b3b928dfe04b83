"""A run that restored nothing may not checkpoint over a URI's history: its first checkpoint
would start a new timeline there, replacing the records of the steps from its own on and
leaving the URI's latest state unrestorable (a break-it finding: a job restarted with a new
config that skipped restore() lost the old one silently). Refused at the call on every rank;
a step after the URI's newest, or a restore() first, goes on as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import deck
from deck.demo import ModelSpec, build_model, capture_state, diff_states, train_step
from deck.errors import CheckpointNotFoundError, ConfigError
from deck.read.catalog import quarantine, read_manifests
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=2, rows=300, dim=8, batch=16, sharding="table_wise")


def _history(config: deck.DeckConfig, steps: int) -> Any:
    """A first run checkpointing steps 0..steps-1; its state at the last."""
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], config) as ck:
        for step in range(steps):
            train_step(model, opt, SPEC, step)
            ck.step(step)
        assert ck.flush()
    return capture_state(model, opt)


def _restarts(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(uri=root, delta_every_steps=1)
    at_4 = _history(config, 5)

    # A new run on the same URI that skips restore(): its steps 0..4 are refused, saying why
    fresh, fresh_opt = build_model(SPEC, seed=3)
    with deck.enable(fresh, [fresh_opt], config) as ck:
        for step in (0, 4):
            with pytest.raises(ConfigError, match=r"history goes up to step 4 \(its latest"):
                ck.step(step)
        with pytest.raises(ConfigError, match=r"restore\(\) before training"):
            ck.save("full", step=2)
        # After the URI's newest step it is a new timeline's full: nothing of the old replaced
        train_step(fresh, fresh_opt, SPEC, 5)
        assert ck.step(5) is not None
        assert ck.flush()
    steps = {c.step: c for c in deck.list_checkpoints(root)}
    assert sorted(steps) == [0, 1, 2, 3, 4, 5]
    assert steps[5].kind == "full" and steps[5].epoch > steps[4].epoch == steps[0].epoch
    again, again_opt = build_model(SPEC, seed=4)
    with deck.enable(again, [again_opt], config) as ck:
        assert ck.restore(4) == 4
        assert not diff_states(at_4, capture_state(again, again_opt))
        # Restored: the steps after it are this run's (a rollback's new timeline)
        train_step(again, again_opt, SPEC, 5)
        assert ck.step(5) is not None
        assert ck.flush()


def _nothing_restorable(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(uri=root, delta_every_steps=1)
    _history(config, 3)
    if rank == 0:  # the chains' full found damaged: no step restores
        storage = open_storage(root)
        quarantine(storage, read_manifests(storage)[0], "damaged (test)")
    dist.barrier()
    fresh, fresh_opt = build_model(SPEC, seed=3)
    # What to do instead is said (a break-it finding: restore() was advised, which fails)
    with (
        deck.enable(fresh, [fresh_opt], config) as ck,
        pytest.raises(CheckpointNotFoundError, match=r"URI of its own, or start its steps"),
    ):
        ck.restore()
    # Nothing a new run could lose: it starts over (a new timeline's full at its first step)
    again, again_opt = build_model(SPEC, seed=4)
    with deck.enable(again, [again_opt], config) as ck:
        train_step(again, again_opt, SPEC, 0)
        stats = ck.step(0)
        assert stats is not None and stats.kind == "full"
        assert ck.flush()
        assert ck.restore() == 0


def _lost_base(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(uri=root, delta_every_steps=1)
    _history(config, 3)
    record = Path(root) / "step-000000000000" / "manifest.json"
    kept = record.read_bytes()
    dist.barrier()
    if rank == 0:  # the chains' full loses its commit record: no step restores until it is back
        record.unlink()
    dist.barrier()
    fresh, fresh_opt = build_model(SPEC, seed=3)
    with deck.enable(fresh, [fresh_opt], config) as ck:
        with pytest.raises(deck.CorruptCheckpointError, match=r"manifest.json was lost"):
            ck.restore()
        # A run that skips restore() may not save over what the record's return restores (a
        # break-it finding: it did, and the record put back then broke its new steps)
        with pytest.raises(ConfigError, match=r"history goes up to step 2 "):
            ck.step(0)
    dist.barrier()
    if rank == 0:
        record.write_bytes(kept)
    dist.barrier()
    assert sorted(c.step for c in deck.list_checkpoints(root)) == [0, 1, 2]
    again, again_opt = build_model(SPEC, seed=4)
    with deck.enable(again, [again_opt], config) as ck:
        assert ck.restore() == 2


@pytest.mark.slow
def test_a_run_may_not_save_over_steps_a_lost_record_put_back_restores(tmp_path: Path) -> None:
    run_ranks(_lost_base, str(tmp_path / "ck"), world_size=2)


@pytest.mark.slow
def test_a_run_with_no_restorable_step_before_it_may_start_over(tmp_path: Path) -> None:
    run_ranks(_nothing_restorable, str(tmp_path / "ck"), world_size=2)


@pytest.mark.slow
def test_a_run_that_restored_nothing_may_not_checkpoint_over_the_history(tmp_path: Path) -> None:
    run_ranks(_restarts, str(tmp_path / "ck"), world_size=2)
