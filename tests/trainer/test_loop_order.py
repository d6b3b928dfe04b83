"""A checkpoint taken while a forward pass still waits for its backward (``step()`` between
``model(batch)`` and ``loss.backward()``, a pipeline that looks the next batch up ahead, a
forward's output kept without a backward, in train or eval mode) would hold the rows of the step
before, and the claim would clear the rows its backward then updates, so later deltas would miss
them. It is refused on every rank with a CheckpointError that says where to call ``step()``, and
nothing is lost: the checkpoints after it, in the right place, restore bitwise. Forwards that no
backward follows (under ``no_grad``, or whose output is dropped, in any mode) do not count.
Real 2-rank TorchRec DMP models over gloo, real files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import deck
from deck import failpoints
from deck.demo import (
    ModelSpec,
    TrainState,
    build_model,
    capture_state,
    diff_states,
    make_batch,
    train_step,
)
from deck.errors import CheckpointError, ConfigError
from deck.testing.dist_harness import run_ranks
from deck.trainer import cow

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _restores_bitwise(
    config: deck.DeckConfig, live: dict, steps: tuple[int, ...], spec: ModelSpec = SPEC
) -> None:
    """Each of ``steps`` restores into a fresh model equal to ``live[step]``, bitwise."""
    for step in steps:
        restored, ropt = build_model(spec, seed=9)
        ruser = TrainState()
        with deck.enable(restored, [ropt], config, state=ruser) as again:
            assert again.restore(step) == step
            bad = diff_states(live[step], capture_state(restored, ropt, ruser, full=True))
        assert not bad, (step, bad[:5])


def _forward(model: torch.nn.Module, step: int) -> torch.Tensor:
    dense, kjt, labels = make_batch(SPEC, step, dist.get_rank())
    logits = model(dense, kjt).squeeze(-1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _orders(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=1, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.enable(model, [opt], config, state=user) as ckpt:
        for step in range(1, 7):
            loss = _forward(model, step)
            opt.zero_grad()
            if step == 2:  # the checkpoint between the forward and its backward
                with pytest.raises(CheckpointError, match="wait for their backward"):
                    ckpt.step(step)
            if step == 3:
                # Only rank 1 keeps a training-mode forward's output without a backward (a
                # forward is collective: both run it): every rank refuses (the vote), none
                # waits for the other in a collective.
                kept = _forward(model, 100) if rank == 1 else _forward(model, 100) and None
            loss.backward()
            opt.step()
            user.step = step
            if step == 3:
                why = "wait for their backward" if rank == 1 else r"rank\(s\) \[1\] failed"
                with pytest.raises(CheckpointError, match=why):
                    ckpt.step(step)
                # Dropped: no backward will come. With 2 ranks its graph is in a reference cycle
                # until the collector runs, which the next checkpoint does before refusing.
                kept = None  # noqa: F841
                continue
            if step == 5:
                # An evaluation under pause() in eval mode but with grad: its lookups are tracked
                # (a backward could follow), so predictions kept across a checkpoint are refused,
                # and the message says eval mode counts; dropped, the same step is taken.
                with ckpt.pause():
                    model.eval()
                    preds = _forward(model, 300)
                    model.train()
                with pytest.raises(CheckpointError, match="in train or eval mode"):
                    ckpt.step(step)
                del preds
            if step == 4:
                # Forwards no backward follows: under no_grad, in eval mode, output dropped.
                with torch.no_grad():
                    _forward(model, 200)
                model.eval()
                _forward(model, 201)
                model.train()
                _forward(model, 202)
            live[step] = capture_state(model, opt, user, full=True)
            ckpt.step(step)
        assert ckpt.flush()
        history = [(h.step, h.kind, h.state != "failed") for h in ckpt.history]
    # Step 2 is taken again where it belongs, after its optimizer step; step 3's rows (refused,
    # not taken again) go into step 4's delta.
    assert history == [(s, "delta" if s > 1 else "full", True) for s in (1, 2, 4, 5, 6)], history
    _restores_bitwise(config, live, (2, 4, 6))


def test_a_checkpoint_while_a_forward_awaits_its_backward_is_refused(tmp_path: Path) -> None:
    run_ranks(_orders, str(tmp_path), world_size=2)


def _interrupted(rank: int, world_size: int, root: str, point: str, alone: bool = False) -> None:
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=1, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.enable(model, [opt], config, state=user) as ckpt:
        for step in range(1, 7):
            user.losses.append(train_step(model, opt, SPEC, step))
            user.step = step
            live[step] = capture_state(model, opt, user, full=True)
            if step == 3:
                here = not alone or rank == 1
                if here:
                    failpoints.configure(f"{point}:1:interrupt")  # a Ctrl-C lands there
                # (on one rank alone: the others are told by the vote, and wait for nothing)
                with pytest.raises(KeyboardInterrupt if here else CheckpointError):
                    ckpt.step(step)
                failpoints.configure(None)
                continue  # the job caught it and trains on
            ckpt.step(step)
        # Not a step number (a break-it finding: 2.0 was saved as step 2, 3.5 ignored, True
        # taken for step 1, 7.25 failed deep in a pydantic model; and a Unix time in ms, past
        # the 12 digits of a step folder, was taken and failed in the background): refused at
        # the call
        for bad in (6.0, 3.5, True, -5, "7", 1_733_500_000_000):
            with pytest.raises(ConfigError, match=r"step=.*(an int|from 0|at most)"):
                ckpt.step(bad)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match=r"step=.*(an int|from 0|at most)"):
                ckpt.save(step=bad)  # type: ignore[arg-type]
            # (a negative step reached the store's folder naming as a bare ValueError)
            with pytest.raises(ConfigError, match=r"restore\(step=.*(an int|from 0|at most)"):
                ckpt.restore(bad)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match=r"deck.load\(step=.*(an int|from 0|at most)"):
                deck.load(model, [opt], config.uri, step=bad)  # type: ignore[arg-type]
        assert ckpt.flush()
        kinds = [(h.step, h.kind) for h in ckpt.history]
    # What the interrupted checkpoint had claimed is unknown: the next one is a full.
    assert kinds == [(1, "full"), (2, "delta"), (4, "full"), (5, "delta"), (6, "delta")], kinds
    _restores_bitwise(config, live, (4, 6))


@pytest.mark.parametrize(
    ("point", "alone"),
    [
        ("checkpointer.save.staged", False),
        ("checkpointer.save.enqueued", False),
        ("checkpointer.save.staged", True),
    ],
)
def test_a_checkpoint_interrupted_by_ctrl_c_makes_the_next_one_a_full(
    tmp_path: Path, point: str, alone: bool
) -> None:
    """A KeyboardInterrupt in the snapshot, or once its part is enqueued (deck.failpoints):
    the next checkpoint is a full and the steps after restore bitwise. Before: the claimed rows
    were lost to the next delta, whose restore differed from the live model. On one rank alone
    (raised by a user state's state_dict, a break-it finding): the other rank waited forever in
    the vote; now it fails the checkpoint with a CheckpointError."""
    run_ranks(_interrupted, str(tmp_path), point, alone, world_size=2)


def _untracked_modes(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=1, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.enable(model, [opt], config, state=user) as ckpt:
        for step in range(1, 6):
            if step in (2, 3):  # training in eval mode (BatchNorm frozen, say)
                model.eval()
                user.losses.append(train_step(model, opt, SPEC, step))
                model.train()
            elif step == 4:  # a training step under pause(), which is for evaluation
                with ckpt.pause():
                    user.losses.append(train_step(model, opt, SPEC, step))
            else:
                user.losses.append(train_step(model, opt, SPEC, step))
            user.step = step
            live[step] = capture_state(model, opt, user, full=True)
            ckpt.step(step)
        assert ckpt.flush()
    _restores_bitwise(config, live, (3, 5))


def test_training_in_eval_mode_or_under_pause_is_tracked(tmp_path: Path) -> None:
    """The fused optimizer updates rows in any mode: a lookup a backward follows is tracked in
    eval mode and under pause() too. Before: those steps' rows were missing from the deltas."""
    run_ranks(_untracked_modes, str(tmp_path), world_size=2)


def _rows_written_outside_a_lookup(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=2, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    key = next(k for k in model.state_dict() if k.endswith(".weight") and "t0" in k)
    gate = threading.Event()
    with deck.enable(model, [opt], config, state=user) as ckpt:
        for step in range(0, 5):
            if step:
                train_step(model, opt, SPEC, step)
            user.step = step
            if step == 3:
                # A max-norm clamp of some rows, outside any lookup: every 7th row halved, while
                # the copy of step 2's delta is still pending (its test hook holds it back):
                # marked before the write, step 2 keeps its values (a break-it finding: the
                # write reached the checkpoint just taken)
                ids = torch.arange(0, SPEC.rows, 7)
                marked = ckpt.mark_rows(key, ids)
                with torch.no_grad():
                    for shard in model.state_dict()[key].local_shards():
                        first = shard.metadata.shard_offsets[0]
                        mine = ids[(ids >= first) & (ids < first + shard.tensor.shape[0])]
                        shard.tensor[mine - first] *= 0.5
                gate.set()
                cow.FILL_GATE = None
                held = sum(s.tensor.shape[0] for s in model.state_dict()[key].local_shards())
                assert marked == (len(ids) if held else 0), (marked, held)
                with pytest.raises(ConfigError, match="no embedding table 'nope'"):
                    ckpt.mark_rows("nope", [0])
                with pytest.raises(ConfigError, match=f"did you mean '{key}'"):
                    ckpt.mark_rows("t0", [0])  # (a break-it finding: a table's short name)
                with pytest.raises(ConfigError, match="row ids of"):
                    ckpt.mark_rows(key, [SPEC.rows])
            live[step] = capture_state(model, opt, user, full=True)
            if step == 2:
                cow.FILL_GATE = gate
            ckpt.step(step)
            if step == 2:
                assert ckpt.history[-1].copied_after > 0, ckpt.history[-1]
        assert ckpt.flush()
    _restores_bitwise(config, live, (2, 4))


def test_rows_written_outside_a_lookup_and_marked_restore_bitwise(tmp_path: Path) -> None:
    """A break-it finding: rows a user changes outside a step's lookup (a max-norm clamp) are
    not tracked, so a delta restored them as they were before, silently. ``mark_rows`` records
    them: the next delta holds them and a restore of it is bitwise the live state."""
    run_ranks(_rows_written_outside_a_lookup, str(tmp_path))


def _loaded_mid_run(rank: int, world_size: int, root: str) -> None:
    spec = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="column_wise")
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=2, lease_ttl_s=None)
    model, opt = build_model(spec)
    other, other_opt = build_model(spec, seed=5)
    for step in (1, 2):  # (its optimizer holds state too)
        train_step(other, other_opt, spec, 100 + step)
    user = TrainState()
    live = {}
    with deck.enable(model, [opt], config, state=user) as ckpt:
        for step in range(0, 7):
            if step:
                train_step(model, opt, spec, step)
            user.step = step
            live[step] = capture_state(model, opt, user, full=True)
            ckpt.step(step)
            if step == 2:
                # A warm start mid-run, right after a delta whose rows may still be copied
                model.load_state_dict(other.state_dict())
                opt.load_state_dict(other_opt.state_dict())
        assert [h.kind for h in ckpt.history] == ["full", "delta", "delta", "delta"]
        assert ckpt.flush()
    _restores_bitwise(config, live, (2, 4, 6), spec)


def test_a_load_state_dict_mid_run_reaches_the_next_delta(tmp_path: Path) -> None:
    """A break-it finding: ``model.load_state_dict`` of sharded tables mid-run (a warm start)
    writes rows no lookup touched, so the next delta restored them as they were before,
    silently. Its rows are tracked now (and the checkpoint just taken keeps its own values):
    every checkpoint before and after the load restores bitwise."""
    run_ranks(_loaded_mid_run, str(tmp_path))
