"""A 2-rank training job the staging tests drive from outside (outage, kill -9, restart).

    python tests/trainer/staging_job.py run    --uri U --options JSON --spool DIR --markers DIR --then die|resume
    python tests/trainer/staging_job.py verify --uri U --options JSON --spool DIR --markers DIR

``run``: steps 0..10 (delta every 5), flush, marker ``phase1``; waits for marker ``outage``;
steps 11..20 (their uploads cannot finish while the store is down), marker ``phase2``; then
``die``: waits to be killed; ``resume``: waits for marker ``resumed``, flushes, verifies.
``verify``: a fresh job on the same URI and spool (restart recovery) restores every step and
compares it bitwise with what ``run`` captured.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch.distributed as dist
from safetensors.torch import load_file, save_file

import deck
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=3, rows=2000, dim=16, batch=64)
STEPS = (0, 5, 10, 15, 20)


def _wait(path: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"marker {path} did not appear")
        time.sleep(0.05)


def _config(a: argparse.Namespace) -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=a.uri,
        delta_every_steps=5,
        storage_options=json.loads(a.options),
        # first_tier: the test counts pending records and kills the job as soon as every rank's
        # step() returned, so those parts must be in the spool by then (with the default
        # in_memory release the spool writer may still be writing them).
        staging=deck.StagingConfig(
            chunk_bytes=16384,
            spool_dir=a.spool,
            retry_initial_s=0.2,
            retry_max_s=1.0,
            release="first_tier",
        ),
    )


def _verify_all(rank: int, a: argparse.Namespace, config: deck.DeckConfig) -> None:
    for step in STEPS:
        model, opt = build_model(SPEC, seed=99 + step)
        user = TrainState()
        with deck.enable(model, [opt], config, state=user) as ck:
            assert ck.restore(step) == step
        want = load_file(os.path.join(a.markers, f"state-{step}-{rank}.safetensors"))
        bad = diff_states(want, capture_state(model, opt, user))
        assert not bad, f"rank {rank} step {step}: {bad[:5]}"


def _run(rank: int, world_size: int, a: argparse.Namespace) -> None:
    config = _config(a)
    model, opt = build_model(SPEC)
    user = TrainState()
    ck = deck.enable(model, [opt], config, state=user)
    for step in range(0, 21):
        if step:
            train_step(model, opt, SPEC, step)
            user.step = step
        if ck.step(step) is not None:
            save_file(
                capture_state(model, opt, user),
                os.path.join(a.markers, f"state-{step}-{rank}.safetensors"),
            )
        if step == 10:
            assert ck.flush(timeout=120)
            assert all(h.state == "committed" or rank > 0 for h in ck.history), ck.history
            dist.barrier()
            if rank == 0:
                open(os.path.join(a.markers, "phase1"), "w").close()
            _wait(os.path.join(a.markers, "outage"))
    # Steps 11..20 ran and staged their checkpoints while the store was down.
    assert [h.step for h in ck.history] == list(STEPS)
    dist.barrier()
    if rank == 0:
        open(os.path.join(a.markers, "phase2"), "w").close()
    if a.then == "die":
        time.sleep(3600)
    _wait(os.path.join(a.markers, "resumed"))
    flushed = ck.flush(timeout=240)
    assert flushed, [(h.step, h.state, h.error) for h in ck.history]
    states = [h.state for h in ck.history]
    assert states == ["committed"] * 5 or rank > 0, states
    ck.close()
    dist.barrier()
    _verify_all(rank, a, config)


def _verify(rank: int, world_size: int, a: argparse.Namespace) -> None:
    config = _config(a)
    model, opt = build_model(SPEC, seed=5)
    with deck.enable(model, [opt], config) as ck:
        # The constructor found the spooled parts of steps 15 and 20 and finishes them.
        assert sorted(s.step for s in ck.recovered) == [15, 20], ck.recovered
        assert ck.restore() == 20
    dist.barrier()
    _verify_all(rank, a, config)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["run", "verify"])
    p.add_argument("--uri", required=True)
    p.add_argument("--options", default="{}")
    p.add_argument("--spool", required=True)
    p.add_argument("--markers", required=True)
    p.add_argument("--then", choices=["die", "resume"], default="resume")
    a = p.parse_args()
    run_ranks(_run if a.mode == "run" else _verify, a)


if __name__ == "__main__":
    main()
