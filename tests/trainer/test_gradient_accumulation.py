"""Checkpoints save no gradients: one taken while a dense parameter holds a gradient no
optimizer step has applied (inside a gradient-accumulation window, or between ``backward()``
and ``optimizer.step()``) is refused on every rank, never saved to restore into a run that
trains on differently (a break-it finding: the accumulated half-window was lost silently)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import deck
from deck.demo import ModelSpec, build_model, capture_state, diff_states, make_batch, train_step
from deck.errors import CheckpointError
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _backward(model: torch.nn.Module, step: int) -> None:
    """One micro-batch's forward and backward, no optimizer step."""
    dense, kjt, labels = make_batch(SPEC, step, dist.get_rank())
    logits = model(dense, kjt).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()


def _accumulating(rank: int, world_size: int, root: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(uri=root, delta_every_steps=1)
    with deck.enable(model, [opt], config) as ck:
        train_step(model, opt, SPEC, 0)
        ck.step(0)
        # Half a window: refused on every rank, saying what to do
        opt.zero_grad()
        _backward(model, 1)
        with pytest.raises(CheckpointError, match=r"no optimizer step has applied.*accumulation"):
            ck.step(1)
        # The window's optimizer step applies it: the same step checkpoints now
        _backward(model, 2)
        opt.step()
        assert ck.step(1) is not None
        # Gradients zeroed in place without a step (a discarded micro-batch) hold nothing
        _backward(model, 3)
        opt.zero_grad(set_to_none=False)
        assert ck.step(2) is not None
        # A step a loss scaler skipped (AMP's GradScaler found an overflow; the next zero_grad
        # drops the gradients): checkpointed (a break-it finding: refused, blaming accumulation)
        _backward(model, 4)
        grad = next(p.grad for p in opt.param_groups[0]["params"] if p.grad is not None)
        grad.view(-1)[0] = float("inf")
        assert ck.step(3) is not None
        opt.zero_grad()
        assert ck.flush()
        live = capture_state(model, opt)
    fresh, fresh_opt = build_model(SPEC, seed=9)
    with deck.enable(fresh, [fresh_opt], config) as ck:
        assert ck.restore() == 3
        assert not diff_states(live, capture_state(fresh, fresh_opt))


@pytest.mark.slow
def test_a_checkpoint_inside_a_gradient_accumulation_window_is_refused(tmp_path: Path) -> None:
    run_ranks(_accumulating, str(tmp_path / "ck"), world_size=2)
