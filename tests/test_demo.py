"""The main job as a user runs it (``python -m deck.demo``, what ``make demo`` runs), small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_shows_progress_verifies_and_says_where_its_checkpoint_is(tmp_path: Path) -> None:
    out = tmp_path / "demo ckpt"  # a space: the printed commands must quote it
    small = ["--tables", "2", "--rows", "2000", "--dim", "8", "--batch", "64"]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "deck.demo",
            *small,
            "--steps",
            "10",
            "--delta-every",
            "5",
            "--no-dcp",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    # Progress while it trains: one line per committed checkpoint, as it commits.
    assert [ln.split(":")[0].split()[-1] for ln in lines if "committed (" in ln] == [
        "0/10",
        "5/10",
        "10/10",
    ], run.stdout
    assert "verified: restored state is bitwise equal" in run.stdout
    # Where the checkpoint is, and the commands to look at it and to remove it, runnable.
    assert f"the checkpoints are in {out} (" in run.stdout
    assert f"/deck ls '{out}'" in run.stdout and f"rm -rf '{out}'" in run.stdout
    # TorchRec's and fbgemm's known warnings are kept out of the demo's output; deck has none.
    assert "warn" not in run.stderr.lower(), run.stderr


def test_demo_refuses_what_it_would_get_wrong(tmp_path: Path) -> None:
    """A folder holding someone's files is refused (the demo ends by printing `rm -rf` of it);
    a count below 1 is a usage error, not a traceback; a run whose last step is not a
    checkpoint step still verifies (the demo saves the last step)."""

    def demo(*args: str) -> subprocess.CompletedProcess[str]:
        small = ["--tables", "2", "--rows", "2000", "--dim", "8", "--batch", "64", "--no-dcp"]
        return subprocess.run(
            [sys.executable, "-m", "deck.demo", *small, *args],
            capture_output=True,
            text=True,
            timeout=600,
        )

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    r = demo("--out", str(busy))
    assert r.returncode == 2 and "not an empty folder" in r.stderr, r.stderr
    assert (busy / "notes.txt").read_text() == "mine"
    r = demo("--delta-every", "0")
    assert r.returncode == 2 and "must be >= 1" in r.stderr and "Traceback" not in r.stderr
    r = demo("--steps", "7", "--delta-every", "5", "--out", str(tmp_path / "odd"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restore of step 7 " in r.stdout and "verified:" in r.stdout, r.stdout
