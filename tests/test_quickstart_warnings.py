"""The quick start's list of warnings a user may see is what its script prints: every warning
line `python train.py` (the quick start's own file, a world of one) writes to stderr is one
the list names, and the list's silencing snippet leaves none of them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "docs" / "quickstart.md"

pytestmark = pytest.mark.slow


def _section() -> str:
    text = QUICKSTART.read_text()
    start = text.index("**Warnings you will see, and can ignore.**")
    return text[start : text.index("## 2.", start)]


def _file_block(name: str) -> str:
    found = re.search(rf"```python file={re.escape(name)}\n(.*?)```", QUICKSTART.read_text(), re.S)
    assert found, name
    return found.group(1)


def _warnings(stderr: str) -> list[str]:
    """Warning lines (logging's, warnings', torch's W-prefixed ones) other than deck's own."""
    return [
        ln
        for ln in stderr.splitlines()
        if re.search(r"WARNING|Warning:|\]:W\d{4}|^W\d{4}", ln) and "deck" not in ln
    ]


def _run(script: Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(
        [sys.executable, str(script), "10"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stderr


def test_the_listed_warnings_are_the_printed_ones(tmp_path: Path) -> None:
    section = _section()
    # What the list quotes: the start of each backticked warning text (before any "...").
    quoted = [
        " ".join(q.split("...")[0].split())
        for q in re.findall(r"`([^`]*)`", section.split("```")[0])
        if len(q) >= 20
    ]
    (tmp_path / "train.py").write_text(_file_block("train.py"))
    printed = _warnings(_run(tmp_path / "train.py", tmp_path))
    assert printed, "the script printed no warning: the list may be out of date"
    for line in printed:
        assert any(q[:40] in line for q in quoted), f"not in the quick start's list: {line}"

    # The silencing snippet the section gives, at the top of the same script.
    snippet = re.search(r"```python\n(import logging\n.*?)```", section, re.S)
    assert snippet, "the section's silencing snippet"
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    (quiet / "train.py").write_text(snippet.group(1) + _file_block("train.py"))
    left = _warnings(_run(quiet / "train.py", quiet))
    # Only the root logger's line of a world without torchrun stays (the section says so).
    assert all("LOCAL_WORLD_SIZE" in ln for ln in left), left
