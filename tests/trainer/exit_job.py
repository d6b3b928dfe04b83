"""A training script that ends without ``close()``: one rank of it, started as its own Python
process (as torchrun starts ranks), so that the process really exits the way the mode says.

    python tests/trainer/exit_job.py train MODE ROOT RANK WORLD WHERE
    python tests/trainer/exit_job.py restore ROOT RANK WORLD WHERE MODE...

``train`` checkpoints a delta every 2 steps of 8 and writes the live state at the end to
``ROOT/MODE/live-RANK.safetensors``, then leaves by MODE:

- ``fall_off``: destroys the process group and falls off the end of the script (a module global
  holds the checkpointer);
- ``raise``: an exception escapes the script (the process exits 1);
- ``dropped``: the checkpointer's last reference goes when ``main()`` returns, then as fall_off;
- ``end_rank``: ``deck.processes.end_rank()`` (which ends with ``os._exit``).

``restore`` restores the latest step of each MODE's URI and prints ``RESTORED MODE STEP
DIFFERENCES`` (DIFFERENCES: the state keys that differ from the live file, ``-`` for none).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import warnings

import torch.distributed as dist
from safetensors.torch import load_file, save_file

import deck
from deck.at_exit import still_open
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.processes import end_rank, init_process_group

SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")
STEPS = 8
KEPT: list[deck.DeltaCheckpointer] = []


def _config(root: str, mode: str) -> deck.DeckConfig:
    return deck.DeckConfig(uri=f"{root}/{mode}/ck", delta_every_steps=2)


def _forked_child() -> None:
    # Leaves without the exit hooks: with the parent's checkpointers still registered here,
    # they would hang this child (it waits for the parent's threads), so say so instead.
    os._exit(3 if still_open() else 0)


def train(mode: str, root: str, rank: int) -> None:
    model, opt = build_model(SPEC)
    user = TrainState()
    ckpt = deck.enable(model, [opt], _config(root, mode), state=user)
    if mode != "dropped":
        KEPT.append(ckpt)
    for step in range(1, STEPS + 1):
        train_step(model, opt, SPEC, step)
        user.step = step
        ckpt.step(step)
    save_file(capture_state(model, opt, user, full=True), f"{root}/{mode}/live-{rank}.safetensors")
    # A child forked now (a DataLoader worker) leaves the parent's checkpointers, still
    # staging, to the parent: closing its copies at its exit would wait for threads it does not
    # have, or give back the parent's writer lease.
    child = multiprocessing.get_context("fork").Process(target=_forked_child)
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the forked child: exit code {child.exitcode}"
    print(f"TRAINED {mode} rank {rank}", flush=True)
    if mode == "raise":
        raise RuntimeError("an error of the user's after the last checkpoint")
    if mode == "end_rank":
        end_rank()
    dist.destroy_process_group()  # what a script does last; deck's exit hook needs no collective


def restore(root: str, rank: int, modes: list[str]) -> None:
    for mode in modes:
        model, opt = build_model(SPEC, seed=1)
        user = TrainState()
        with deck.enable(model, [opt], _config(root, mode), state=user) as ckpt:
            step = ckpt.restore()
            live = load_file(f"{root}/{mode}/live-{rank}.safetensors")
            bad = diff_states(live, capture_state(model, opt, user, full=True))
        print(f"RESTORED {mode} {step} {','.join(bad) or '-'}", flush=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    what, args = sys.argv[1], sys.argv[2:]
    if what == "train":
        mode, root, rank, world, where = args[0], args[1], int(args[2]), int(args[3]), args[4]
    else:
        root, rank, world, where, modes = args[0], int(args[1]), int(args[2]), args[3], args[4:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_process_group(rank, world, where)
    if what == "train":
        train(mode, root, rank)
    else:
        restore(root, rank, modes)
        end_rank()


if __name__ == "__main__":
    main()
