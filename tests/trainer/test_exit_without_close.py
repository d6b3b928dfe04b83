"""A process that ends without ``close()`` -- falling off the end of its script, on an exception,
with its checkpointer's last reference dropped, or through ``deck.processes.end_rank()`` --
finishes the checkpoints it staged instead of losing them (deck.at_exit): two real
gloo ranks, each its own Python process (tests/trainer/exit_job.py), a local destination; then
a restore of the last step equals the live state at the exit, bitwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import deck
from deck.processes import meeting_file

pytestmark = pytest.mark.slow
JOB = str(Path(__file__).with_name("exit_job.py"))
MODES = {"fall_off": 0, "raise": 1, "dropped": 0, "end_rank": 0}  # mode -> each rank's exit code


def _ranks(*args: str) -> list[subprocess.CompletedProcess[str]]:
    """Run the job's two ranks at once; their results by rank."""
    with meeting_file() as where:
        procs = [
            subprocess.Popen(
                [sys.executable, JOB, args[0], *args[1:2], str(rank), "2", where, *args[2:]]
                if args[0] == "restore"
                else [sys.executable, JOB, *args[:3], str(rank), "2", where],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        out = []
        for p in procs:
            text, _ = p.communicate(timeout=600)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, text))
        return out


def test_staged_checkpoints_are_finished_when_the_process_exits_without_close(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    for mode, code in MODES.items():
        for rank, done in enumerate(_ranks("train", mode, root)):
            assert done.returncode == code, f"{mode} rank {rank}:\n{done.stdout[-3000:]}"
            assert f"TRAINED {mode} rank {rank}" in done.stdout
            # The warning names the URI (and what it waited for, if anything was still staged).
            assert f"exiting without close() on {root}/{mode}/ck" in done.stdout, done.stdout
        steps = {(i.step, i.kind) for i in deck.list_checkpoints(f"{root}/{mode}/ck")}
        assert steps == {(2, "full"), (4, "delta"), (6, "delta"), (8, "delta")}, mode
    for rank, done in enumerate(_ranks("restore", root, *MODES)):
        assert done.returncode == 0, done.stdout[-3000:]
        for mode in MODES:
            assert f"RESTORED {mode} 8 -" in done.stdout, f"rank {rank}:\n{done.stdout[-3000:]}"
