"""Managed-collision (ZCH) collections checkpointed exactly, on real gloo DMP ranks:
``ManagedCollisionEmbeddingCollection`` and ``ManagedCollisionEmbeddingBagCollection`` with
TorchRec's ``MCHManagedCollisionModule`` remappers, row_wise over 2 ranks (deck.testing.
managed_collision), with evictions (TorchRec's own eviction path, through the CPU kernel of
``fbgemm::reset_weight_momentum`` in deck.testing.fbgemm_cpu) and without.

Each scenario trains with deck (a full at step 0, a delta every 2 steps; evictions every 3
training forwards: at a checkpoint's step and between checkpoints), goes on training, and is
restored mid-run in fresh processes into a fresh build (other initial weights): the tables,
fused optimizer states, dense state, RNG and every remapper's state (its sorted id arrays and
metadata, and what TorchRec keeps outside its state_dict: iteration counters, the id history
since the last eviction) are bitwise equal to the uninterrupted run's at that step, the losses of
the steps after it are equal (evictions after the restore included), and so is the whole state at
the end; ``deck.load`` into another fresh build gives the same state. Restoring into 3 ranks is
refused before anything is written, on every rank, naming why.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import deck
from deck.demo import capture_state, diff_states
from deck.errors import IncompatibleModelError, UnsupportedError
from deck.testing.dist_harness import run_ranks
from deck.testing.managed_collision import MCSpec, build_mc, remapper_state, train_mc_step
from deck.trainer import cow

pytestmark = pytest.mark.slow

STEPS, EVERY, END = 8, 2, 12  # checkpoints at 0, 2, .., 8; training goes on to step 12
# name -> (spec, the step restored). Evictions at steps 3, 6, 9, 12: the step-6 restore lands on
# an eviction's step, the step-8 one in the middle of an interval (its id history restored).
SCENARIOS: dict[str, tuple[MCSpec, int]] = {
    "ec_no_evict": (MCSpec(collection="ec", eviction_interval=None, policy="lfu"), 8),
    "ebc_no_evict": (MCSpec(collection="ebc", eviction_interval=None, policy="lfu"), 6),
    "ec_evict": (MCSpec(collection="ec", eviction_interval=3, policy="distance_lfu"), 6),
    "ebc_evict": (MCSpec(collection="ebc", eviction_interval=3, policy="lru"), 8),
}


def _state(model: Any, dense: Any) -> dict[str, torch.Tensor]:
    """Everything a restore must reproduce: TorchRec's state_dict (tables, the remappers'
    sharded buffers), fused and dense optimizer state with every hyperparameter, RNG, and every
    remapper's state outside the state_dict."""
    out = capture_state(model, dense, full=True)
    out.update({f"mch|{k}": v for k, v in remapper_state(model).items()})
    return {k: v.contiguous() for k, v in out.items()}


def _evictions(model: Any) -> int:
    """Iteration of the last eviction of the first remapper (-1/0: none yet)."""
    state = remapper_state(model)
    return int(next(v for k, v in state.items() if k.endswith("._last_eviction_iter")))


def _without_the_test_op(rank: int, root: str) -> None:
    """What a plain CPU install does: TorchRec's first eviction fails (fbgemm has no CPU
    kernel for reset_weight_momentum). And a HashZch collection is refused at enable, naming
    why (fbgemm's CPU zero_collision_hash cannot insert ids: it cannot train on CPU)."""
    spec = MCSpec(eviction_interval=1)  # the first training forward evicts (fills slots)
    model, dense = build_mc(spec, cpu_eviction=False)
    with pytest.raises(NotImplementedError, match=r"fbgemm::reset_weight_momentum.*'CPU'"):
        train_mc_step(model, dense, spec, 1)
    hashed, hashed_dense = build_mc(MCSpec(remapper="hash"))
    with pytest.raises(
        UnsupportedError,
        match=r"module 'mc', table 't0': its managed-collision module is a "
        r"HashZchManagedCollisionModule.*cannot train on CPU",
    ):
        deck.enable(hashed, [hashed_dense], deck.DeckConfig(uri=f"{root}/hashed"))


def _train(rank: int, world_size: int, root: str) -> None:
    """Every scenario, uninterrupted: checkpoints to STEPS, training on to END. Saves the state
    at the restore step, the losses after it and the final state. In "ebc_evict" the rows of
    the step-8 delta are copied after the stall (copy-on-write) and that copy is held back while
    steps 9-12 train: the evictions of steps 9 and 12 must copy the rows they reset first."""
    _without_the_test_op(rank, root)  # before any scenario registers the test op in this process
    for name, (spec, restore_at) in SCENARIOS.items():
        model, dense = build_mc(spec, seed=0)
        config = deck.DeckConfig(uri=f"{root}/{name}", delta_every_steps=EVERY)
        losses = []
        gate = threading.Event()
        try:
            with deck.enable(model, [dense], config) as ck:
                for step in range(END + 1):
                    if step:
                        loss = train_mc_step(model, dense, spec, step)
                        if step > restore_at:
                            losses.append(loss)
                    if step == STEPS and name == "ebc_evict":
                        cow.FILL_GATE = gate
                    if step <= STEPS:
                        ck.step(step)
                    if step == restore_at:
                        save_file(_state(model, dense), f"{root}/{name}.at.{rank}")
                gate.set()
                kinds = [h.kind for h in ck.history]
                last = ck.history[-1]
        finally:
            gate.set()
            cow.FILL_GATE = None
        assert kinds == ["full"] + ["delta"] * (STEPS // EVERY), kinds
        assert last.rows > 0 and last.copied_after == last.rows, (name, last)
        # Evictions ran (or not) as the scenario says: the test op did TorchRec's resets.
        assert _evictions(model) == (12 if spec.eviction_interval else 0), name
        final = _state(model, dense)
        final["losses"] = torch.tensor(losses, dtype=torch.float64)
        save_file(final, f"{root}/{name}.end.{rank}")


def _restore(rank: int, world_size: int, root: str) -> None:
    """In fresh processes: a fresh build restores, equals the live run at that step bitwise,
    and trains on (checkpointing) to the same losses and final state."""
    for name, (spec, restore_at) in SCENARIOS.items():
        model, dense = build_mc(spec, seed=1)
        config = deck.DeckConfig(uri=f"{root}/{name}", delta_every_steps=EVERY)
        with deck.enable(model, [dense], config) as ck:
            assert diff_states(load_file(f"{root}/{name}.at.{rank}"), _state(model, dense))
            assert ck.restore(restore_at) == restore_at
            bad = diff_states(load_file(f"{root}/{name}.at.{rank}"), _state(model, dense))
            assert not bad, f"{name}, rank {rank}: restored state differs: {bad[:8]}"
            losses = []
            for step in range(restore_at + 1, END + 1):
                losses.append(train_mc_step(model, dense, spec, step))
                if step <= STEPS:
                    ck.step(step)
        end = load_file(f"{root}/{name}.end.{rank}")
        assert torch.equal(torch.tensor(losses, dtype=torch.float64), end.pop("losses")), name
        bad = diff_states(end, _state(model, dense))
        assert not bad, f"{name}, rank {rank}: state at step {END} differs: {bad[:8]}"
        if name == "ec_evict":  # deck.load (read-only, no checkpointer) restores it alike
            loaded, loaded_dense = build_mc(spec, seed=2)
            assert deck.load(loaded, [loaded_dense], f"{root}/{name}", step=restore_at) == 6
            bad = diff_states(load_file(f"{root}/{name}.at.{rank}"), _state(loaded, loaded_dense))
            assert not bad, f"deck.load of {name}, rank {rank}: {bad[:8]}"


def _restore_into_3(rank: int, world_size: int, root: str) -> None:
    """Every rank of a 3-rank job refuses, naming why, and its model is left as it was."""
    for name in ("ec_evict", "ebc_no_evict"):
        spec, restore_at = SCENARIOS[name]
        model, dense = build_mc(spec, seed=1)
        with deck.enable(model, [dense], deck.DeckConfig(uri=f"{root}/{name}")) as ck:
            before = _state(model, dense)
            with pytest.raises(
                IncompatibleModelError,
                match=r"saved by 2 ranks and this job has 3: the managed-collision "
                r"collection\(s\) \['mc'\] cannot change world size.*Restore it with 2 ranks",
            ):
                ck.restore(restore_at)
            assert not diff_states(before, _state(model, dense)), name


def test_managed_collision_restores_exactly(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(_train, root)
    run_ranks(_restore, root)
    run_ranks(_restore_into_3, root, world_size=3)
