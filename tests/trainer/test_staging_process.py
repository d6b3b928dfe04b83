"""The staging process (``StagingConfig(mode="process")``): its checkpoints restore bitwise in
every tier, a staging process that dies fails the next checkpoint on every rank (naming its
step), a new one starts and the checkpoint after is a full; a training process killed with -9
leaves no staging process behind. Real TorchRec DMP models over gloo, real files; the death
comes from a failpoint in the staging process, never from timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import deck
from deck import failpoints
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.errors import CheckpointError
from deck.read.catalog import read_manifests
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _config(root: str, tiers: str = "local", **staging: Any) -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=f"{root}/ck",
        delta_every_steps=1,
        lease_ttl_s=None,
        staging=deck.StagingConfig(
            mode="process",
            chunk_bytes=4096,
            tiers=tiers,  # type: ignore[arg-type]
            spool_dir=f"{root}/spool",
            **staging,
        ),
    )


def _train(model: Any, opt: Any, user: TrainState, step: int) -> dict[str, Any]:
    if step:
        user.losses.append(train_step(model, opt, SPEC, step))
        user.step = step
    return capture_state(model, opt, user)


def _restores_bitwise(config: deck.DeckConfig, live: dict[int, Any], steps: list[int]) -> None:
    for step in steps:
        model, opt = build_model(SPEC, seed=100 + step)
        user = TrainState()
        with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
            assert ck.restore(step) == step
        bad = diff_states(live[step], capture_state(model, opt, user))
        assert not bad, f"step {step}: {bad[:5]}"


# ---- every tier, every release ------------------------------------------------------------------


def _tiers(rank: int, world_size: int, root: str, tiers: str, release: str, cow: str) -> None:
    config = _config(root, tiers, release=release, copy_on_write=cow)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        assert ck.stager.pid is not None  # type: ignore[union-attr]
        for step in range(5):
            live[step] = _train(model, opt, user, step)
            assert ck.step(step) is not None
        assert ck.flush(timeout=120)
        want = "committed" if rank == 0 else "uploaded"
        assert [(h.kind, h.state) for h in ck.history] == [("full", want)] + [("delta", want)] * 4
    dist.barrier()
    _restores_bitwise(config, live, list(range(5)))


@pytest.mark.parametrize(
    "tiers,release,cow",
    [
        ("local", "in_memory", "deltas"),
        ("local", "first_tier", "off"),
        ("cpu-ssd-remote", "in_memory", "all"),
        ("cpu-remote", "in_memory", "off"),
    ],
)
def test_parts_staged_by_a_process_restore_bitwise(
    tmp_path: Path, tiers: str, release: str, cow: str
) -> None:
    run_ranks(_tiers, str(tmp_path), tiers, release, cow)


# ---- a staging process that dies -----------------------------------------------------------------


def _dies(rank: int, world_size: int, root: str) -> None:
    config = _config(root, "cpu-ssd-remote")
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        for step in range(2):
            live[step] = _train(model, opt, user, step)
            ck.step(step)
        assert ck.flush(timeout=120)
        first = ck.stager.pid  # type: ignore[union-attr]
        if rank == 1:
            # Rank 1's staging process dies alone, writing step 2's first file
            failpoints.configure("stager.spool.before_write:1:kill-self")
        live[2] = _train(model, opt, user, 2)
        assert ck.step(2) is not None  # staged: the death comes after, in the background
        if rank == 1:
            deadline = time.monotonic() + 120
            while ck.stager.dead is None:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the staging process did not die"
                time.sleep(0.01)
            failpoints.configure(None)
        dist.barrier()
        live[3] = _train(model, opt, user, 3)
        with pytest.raises(CheckpointError) as e:
            ck.step(3)
        assert "step 3" in str(e.value) and "rank(s) [1]" in str(e.value), e.value
        if rank == 1:
            assert "staging process" in str(e.value) and "died" in str(e.value), e.value
            assert ck.stager.pid != first  # type: ignore[union-attr]
            with pytest.raises(ProcessLookupError):
                os.kill(first, 0)  # reaped
        live[4] = _train(model, opt, user, 4)
        stats = ck.step(4)
        assert stats is not None and stats.kind == "full"
        assert not ck.flush(timeout=120)  # step 2 failed since the last flush
        states = {h.step: h.state for h in ck.history}
        assert states[2] == "failed" and states[4] in ("committed", "uploaded"), states
    dist.barrier()
    committed = sorted(read_manifests(LocalStorage(f"{root}/ck")))
    assert committed == [0, 1, 4], committed
    _restores_bitwise(config, live, [1, 4])


def test_a_dead_staging_process_fails_the_next_checkpoint_on_every_rank(tmp_path: Path) -> None:
    run_ranks(_dies, str(tmp_path))


# ---- kill -9 of the training process -------------------------------------------------------------

ORPHAN_JOB = """
import os, sys, time
from deck.processes import free_port, init_process_group
import deck
from deck.demo import ModelSpec, build_model
init_process_group(0, 1, free_port())
model, opt = build_model(ModelSpec(num_tables=2, rows=400, dim=8, batch=32))
cfg = deck.DeckConfig(uri=sys.argv[1], lease_ttl_s=None,
                      staging=deck.StagingConfig(mode="process"))
ck = deck.enable(model, [opt], cfg)
ck.step(0)
print("STAGER", ck.stager.pid, flush=True)
time.sleep(3600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie has exited
    except FileNotFoundError:
        return True


def test_a_training_process_killed_leaves_no_staging_process(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_JOB, str(tmp_path / "ck")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("STAGER"):
                break
        assert line.startswith("STAGER"), line
        child = int(line.split()[1])
        assert not _gone(child)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while not _gone(child):
            assert time.monotonic() < deadline, f"staging process {child} outlived its trainer"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
