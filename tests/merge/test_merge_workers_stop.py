"""``deck merge --follow --workers K`` stops its worker processes with itself: on SIGTERM (what
kill, systemd and Kubernetes send) it stops them and exits 0, and killed with -9 its workers
end too (a break-it finding: SIGTERM left K workers and the resource tracker merging for ever,
children of init, holding the caller's pipes open)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deck.storage import open_storage
from deck.testing.procfs import exited
from deck.testing.synth import SynthTrainer

EXE = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def _catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & SIGTERM_BIT)


def _until(done: object, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_merge_workers_end_with_their_command(tmp_path: Path, how: str) -> None:
    uri = str(tmp_path / "ck")
    tr = SynthTrainer(open_storage(uri))
    tr.save("full")
    for _ in range(6):
        tr.train()
        tr.save("delta")
    proc = subprocess.Popen(
        [EXE, "merge", uri, "--follow", "--workers", "2", "--poll", "0.05", "--stride", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Both workers are following (their SIGTERM handler is installed)
        def following() -> bool:
            assert proc.poll() is None, proc.communicate()
            workers = [c for c in _children(proc.pid) if _catches_sigterm(c)]
            return len(workers) >= 2

        _until(following, "the workers did not start following")
        descendants = _children(proc.pid)
        os.kill(proc.pid, getattr(signal, how))
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "SIGTERM":
        assert proc.returncode == 0, stdout + stderr
        assert "deck merge:" in stdout and "Traceback" not in stderr, stdout + stderr
    _until(lambda: all(exited(p) for p in descendants), f"left running: {descendants}")
