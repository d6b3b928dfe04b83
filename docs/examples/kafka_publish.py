"""Publish a small DLRM's updates to a Kafka topic, for the loading service (`deck follow`).

Run on 2 CPU ranks (from the repository root, after ``make install``; a broker at the address,
e.g. the local one of docs/operations.md, "Run a broker locally")::

    .venv/bin/torchrun --standalone --nproc-per-node 2 docs/examples/kafka_publish.py \\
        kafka://127.0.0.1:9092/deck-updates /tmp/deck-kafka
    .venv/bin/deck follow kafka://127.0.0.1:9092/deck-updates --out /tmp/serving --once

Checkpoints go to ``<folder>/ckpt``; a publish every 2 steps (a full every 10) sends the rows to
the topic and the rest (dense and user state, manifests) to ``<folder>/state``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.processes import end_rank


def main(topic_uri: str, folder: str, steps: int = 20) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    spec = ModelSpec(num_tables=2, rows=2000, dim=8, batch=64)
    model, dense_opt = build_model(spec)
    config = deck.DeckConfig(
        uri=f"{folder}/ckpt",
        delta_every_steps=10,
        publish=deck.PublishConfig(
            uri=topic_uri,
            state_uri=f"{folder}/state",  # a shared path or object store in production
            every_steps=2,
            full_every_steps=10,  # a loader that lost a step moves on at the next full
        ),
    )
    with deck.enable(model, [dense_opt], config) as ckpt:
        start = ckpt.restore() or 0
        for step in range(start + 1, start + steps + 1):
            train_step(model, dense_opt, spec, step)
            ckpt.step(step)
        ckpt.flush()
    if dist.get_rank() == 0:
        print(f"published steps {start + 2}..{start + steps} to {topic_uri}", flush=True)
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
