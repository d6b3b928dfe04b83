"""``deck follow URI --out DIR`` as a service (no ``--once``), started on a DIR that is already
up to date: its first line says which step of which URI it serves and that it waits for new
checkpoints (before, it printed nothing at all and looked hung); a new delta is then applied
and announced as before. One follower writes a folder at a time, and a killed one leaves it
free. The real console script on a real checkpoint folder."""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deck.storage import LocalStorage
from deck.testing.synth import SynthTrainer

pytestmark = pytest.mark.slow


def _deck() -> str:
    return shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"


def test_a_service_started_up_to_date_says_what_it_serves(tmp_path: Path) -> None:
    uri, out = tmp_path / "pub", tmp_path / "serving"
    trainer = SynthTrainer(LocalStorage(uri))
    trainer.save("full")
    trainer.train()
    trainer.save()
    once = _once(uri, out)
    assert once.returncode == 0 and once.stdout.startswith("step 1 "), once.stdout + once.stderr

    service = subprocess.Popen(
        [_deck(), "follow", str(uri), "--out", str(out), "--poll", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(ln) for ln in service.stdout or ()], daemon=True
    )
    reader.start()
    try:
        # (the timeouts only guard against a hang; nothing here is timed)
        first = lines.get(timeout=300)
        assert first.startswith("serving step 1 ("), first
        assert f"of {uri} in {out}; waiting for new checkpoints" in first, first
        trainer.train()
        trainer.save()  # a new delta: applied and announced, the waiting line not repeated
        second = lines.get(timeout=300)
        assert second.startswith("step 2 (") and ": delta, 1 checkpoint(s) read" in second
        # A second follower on the same --out would interleave its files with this one's
        beside = _once(uri, out)
        assert beside.returncode == 2 and "being written by another deck follow" in beside.stderr
        assert str(out) in beside.stderr, beside.stderr
    finally:
        service.terminate()
        service.wait(timeout=60)
    reader.join(timeout=60)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert not any(ln.startswith("serving step") for ln in rest), rest


def test_a_killed_follower_leaves_its_out_free(tmp_path: Path) -> None:
    uri, out = tmp_path / "pub", tmp_path / "serving"
    trainer = SynthTrainer(LocalStorage(uri))
    trainer.save("full")
    service = subprocess.Popen(
        [_deck(), "follow", str(uri), "--out", str(out), "--poll", "3600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert service.stdout is not None
        assert service.stdout.readline().startswith("step 0 (")  # wrote it, holds the lock
    finally:
        service.kill()  # SIGKILL: no clean-up of its own
        service.wait(timeout=60)
    trainer.train()
    trainer.save()
    again = _once(uri, out)
    assert again.returncode == 0 and again.stdout.startswith("step 1 "), again.stderr


def _once(uri: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_deck(), "follow", str(uri), "--out", str(out), "--once"],
        capture_output=True,
        text=True,
        timeout=300,
    )
