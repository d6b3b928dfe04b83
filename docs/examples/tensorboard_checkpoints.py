"""Checkpoint metrics in TensorBoard: deck's per-checkpoint events fed to a SummaryWriter.

Run on 2 CPU ranks (from the repository root, after ``make install``)::

    .venv/bin/torchrun --nproc-per-node 2 docs/examples/tensorboard_checkpoints.py /tmp/ckpt /tmp/tb
    .venv/bin/tensorboard --logdir /tmp/tb

Rank 0 writes one point per committed checkpoint: ``deck/checkpoint/stall_s`` (how long
training paused), ``.../committed_s`` (snapshot to commit record), ``.../durable_local_s``,
``.../rows`` and ``.../bytes``, at the checkpoint's step. The callback runs in deck's commit
thread; ``SummaryWriter`` is thread-safe (it queues to its own writer thread).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.processes import end_rank


def main(uri: str, logdir: str, steps: int = 30, every: int = 5) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    spec = ModelSpec(num_tables=2, rows=2000, dim=8, batch=64)
    model, dense_opt = build_model(spec)
    writer = SummaryWriter(logdir) if dist.get_rank() == 0 else None

    def to_tensorboard(event: deck.CheckpointEvent) -> None:
        if writer is not None and event.state == "committed":
            for name, value in event.scalars().items():
                writer.add_scalar(name, value, global_step=event.step)

    config = deck.DeckConfig(uri=uri, delta_every_steps=every)
    with deck.enable(model, [dense_opt], config, on_checkpoint=to_tensorboard) as ckpt:
        start = ckpt.restore() or 0
        for step in range(start + 1, steps + 1):
            train_step(model, dense_opt, spec, step)
            ckpt.step(step)
        ckpt.flush()  # every event is delivered before flush() returns
    if writer is not None:
        writer.close()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
