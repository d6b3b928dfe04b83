"""Merger workers under the standard launchers: which worker a process is (torchrun, Kubernetes
Indexed Job, SLURM, flags), and a real ``torchrun --nproc-per-node 2 -m deck.cli merge`` that
splits the work with no overlap and nothing missed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deck import cli
from deck.errors import ConfigError
from deck.format.manifest import PARTS_DIR, Kind
from deck.merge.build import Partition
from deck.merge.launch import resolve_worker
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.storage import LocalStorage
from deck.testing.synth import State, SynthTrainer, restore_state, same, snapshot

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX", "DECK_NUM_WORKERS")
LAUNCHER_VARS += ("SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---- env resolution, one launcher at a time -----------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "env", "expected", "source"),
    [
        ((None, None), {}, (0, 1), "default"),
        ((None, None), {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, (1, 2), "$RANK=1"),
        ((None, 4), {"JOB_COMPLETION_INDEX": "3"}, (3, 4), "$JOB_COMPLETION_INDEX=3"),
        ((None, None), {"JOB_COMPLETION_INDEX": "0", "DECK_NUM_WORKERS": "2"}, (0, 2), "$DECK"),
        ((None, None), {"SLURM_PROCID": "2", "SLURM_NTASKS": "3"}, (2, 3), "$SLURM_PROCID=2"),
        # torchrun started by srun: torchrun's variables describe this process.
        (
            (None, None),
            {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
            (3, 4),
            "torchrun",
        ),
        # Explicit values win over the environment.
        ((0, 2), {"RANK": "1", "WORLD_SIZE": "2"}, (0, 2), "worker_index/num_workers"),
        ((5, 6), {"JOB_COMPLETION_INDEX": "1"}, (5, 6), "worker_index/num_workers"),
        # One explicit value, the other from the launcher.
        ((1, None), {"SLURM_PROCID": "0", "SLURM_NTASKS": "3"}, (1, 3), "worker_index"),
        ((None, 2), {"RANK": "1", "WORLD_SIZE": "2"}, (1, 2), "num_workers"),
    ],
)
def test_worker_slot_from_each_launcher(
    flags: tuple[int | None, int | None],
    env: dict[str, str],
    expected: tuple[int, int],
    source: str,
) -> None:
    slot = resolve_worker(*flags, env=env)
    assert (slot.index, slot.count) == expected
    assert source in slot.source


@pytest.mark.parametrize(
    ("flags", "env", "match"),
    [
        ((None, None), {"RANK": "0"}, r"\$RANK is set but \$WORLD_SIZE is not"),
        ((None, None), {"WORLD_SIZE": "2"}, r"\$WORLD_SIZE is set but \$RANK is not"),
        ((None, None), {"RANK": "2", "WORLD_SIZE": "2"}, r"index 2 of 2 .*\$RANK=2"),
        ((None, None), {"JOB_COMPLETION_INDEX": "1"}, r"JOB_COMPLETION_INDEX=1.*DECK_NUM_WORKERS"),
        (
            (None, 3),
            {"JOB_COMPLETION_INDEX": "1", "DECK_NUM_WORKERS": "4"},
            r"num_workers 3 disagrees with \$DECK_NUM_WORKERS=4",
        ),
        ((None, 3), {"RANK": "0", "WORLD_SIZE": "2"}, r"num_workers 3 .*\$WORLD_SIZE=2"),
        (
            (None, None),
            {"RANK": "0", "WORLD_SIZE": "2", "DECK_NUM_WORKERS": "3"},
            r"\$DECK_NUM_WORKERS=3 disagrees .*\$WORLD_SIZE=2",
        ),
        ((None, None), {"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, r"\$SLURM_PROCID='x'"),
        ((1, None), {}, r"worker_index needs num_workers"),
        ((None, 2), {}, r"num_workers needs worker_index"),
        ((2, 2), {}, r"index 2 of 2"),
    ],
)
def test_inconsistent_or_missing_values_name_the_variables(
    flags: tuple[int | None, int | None], env: dict[str, str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_worker(*flags, env=env)


def test_cli_reports_a_launcher_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    assert cli.main(["merge", str(tmp_path), "--once"]) == 2
    err = capsys.readouterr().err
    # The CLI names its own flag; the library, called directly, its parameter (above).
    assert "DECK_NUM_WORKERS" in err and "--num-workers N" in err


# ---- torchrun splits the work ------------------------------------------------------------------

MERGE_ARGS = ("--stride", "2", "--full-every", "8", "--full-live-fraction", "0", "--wait", "60")


def _written(root: Path, deltas: int) -> dict[str, State]:
    tr = SynthTrainer(LocalStorage(root))
    tr.save("full")
    history = {tr.saved[0].id: tr.saved[0].state}
    for _ in range(deltas):
        tr.train(2, rows=20)
        history[tr.save().id] = snapshot(tr.shards)
    return history


def _merged(root: Path) -> dict[str, tuple[object, ...]]:
    """Every committed merged checkpoint: id -> (kind, step, layer, inputs)."""
    return {
        m.id: (m.kind, m.step, m.layer, m.inputs)
        for m in read_manifests(LocalStorage(root)).merged.values()
    }


@pytest.mark.slow
def test_torchrun_two_workers_split_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, alone = tmp_path / "ck", tmp_path / "alone"
    history = _written(root, 20)
    shutil.copytree(root, alone)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    # torchrun as this interpreter's module (the console script's shebang may name another).
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    p = subprocess.run(
        [*torchrun, "--standalone", "--nproc-per-node", "2", "--tee", "3", "-m", "deck.cli",
         "merge", str(root), "--once", *MERGE_ARGS],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr

    # Each worker says which it was (from torchrun's variables) once, at launch, and how many
    # partitions it built (torchrun's --tee prefixes each process's lines with its rank).
    logged = re.findall(
        r"\[default(\d)\]:.*worker (\d) of 2 \(from torchrun \$RANK=(\d), \$WORLD_SIZE=2\)",
        p.stdout + p.stderr,
    )
    assert sorted((int(r), int(i), int(e)) for r, i, e in logged) == [(0, 0, 0), (1, 1, 1)], (
        p.stdout + p.stderr
    )
    lines = re.findall(r"\[default(\d)\]:deck merge: .*?(\d+) partition\(s\) built", p.stdout)
    assert sorted(int(r) for r, _ in lines) == [0, 1], p.stdout
    built = {int(r): int(n) for r, n in lines}

    # Every partition of every merged checkpoint has its record, was written by exactly one
    # attempt (no worker built another's partition, none built one twice), and each worker
    # built exactly the partitions the hash gives it.
    merged = root / "merged"
    owners = {0: 0, 1: 0}
    for item in merged.iterdir():
        records = sorted((item / PARTS_DIR).glob("*.json"))
        assert records, item
        for rec in records:
            owners[Partition(0, 0, rec.stem).owner(2)] += 1
        attempts: dict[tuple[str, ...], set[str]] = {}
        for f in item.rglob("*"):
            rel = f.relative_to(item).parts
            # <attempt>/<rank dir>/<table dir>/<chunk>: the chunks of one partition build
            if f.is_file() and len(rel) == 4 and rel[0] != PARTS_DIR:
                attempts.setdefault(rel[1:3], set()).add(rel[0])
        assert len(attempts) == len(records), (item.name, sorted(attempts))
        assert all(len(a) == 1 for a in attempts.values()), (item.name, attempts)
    assert built == owners and min(owners.values()) > 0, (built, owners)

    # The same lineage as one worker alone makes, and every step restores exactly.
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["merge", str(alone), "--once", *MERGE_ARGS]) == 0
    assert _merged(root) == _merged(alone)
    # Both kinds of work were split: a merger full and merged deltas.
    assert {kind for kind, *_ in _merged(root).values()} == {Kind.FULL, Kind.MERGED}
    storage = LocalStorage(root)
    manifests = read_manifests(storage)
    # Every step restores exactly; every step from the merger's full on restores through merged
    # checkpoints (older steps keep the trainer's full + deltas: a merger that found itself behind
    # builds only the newest full).
    newest_full = max(step for kind, step, *_ in _merged(root).values() if kind == Kind.FULL)
    through_merged = []
    for step in sorted(manifests):
        chain = chain_for(manifests, step)
        if any(m.is_merged for m in chain):
            through_merged.append(step)
        got, user = restore_state(storage, chain)
        assert not same(got, history[chain[-1].id]) and user == step, step
    assert through_merged == [s for s in sorted(manifests) if s >= newest_full], through_merged
