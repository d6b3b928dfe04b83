"""Ranks spawned over gloo leave nothing behind in the temp folder, however they end."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from deck.processes import end_rank
from deck.testing.dist_harness import run_ranks


def _meet(rank: int, world_size: int, how: str) -> None:
    group = dist.group.WORLD  # held, as a sharded model's environment holds it
    dist.barrier(group)
    if how == "fails" and rank == 1:
        raise RuntimeError("rank 1 gives up")
    if how == "ends":
        end_rank()  # as a user's rank ends (docs/quickstart.md), its model still in scope


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("deck-group-"))


def test_a_group_leaves_no_rendezvous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (every group a rank ended with end_rank while it held the group, or that a rank failed, left its
    # FileStore file in the temp folder: one per demo run, hundreds per test run)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_ranks(_meet, "ends")
    assert _left(tmp_path) == []
    with pytest.raises(ProcessRaisedException, match="rank 1 gives up"):
        run_ranks(_meet, "fails")
    assert _left(tmp_path) == []
