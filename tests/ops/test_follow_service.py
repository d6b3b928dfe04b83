"""``deck follow URI --out DIR`` as a service (no ``--once``), started on a DIR that is already
up to date: its first line says which step of which URI it serves and that it waits for new
checkpoints (before, it printed nothing at all and looked hung); a new delta is then applied
and announced as before. The real console script on a real checkpoint folder."""

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
    once = subprocess.run(
        [_deck(), "follow", str(uri), "--out", str(out), "--once"],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    finally:
        service.terminate()
        service.wait(timeout=60)
    reader.join(timeout=60)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert not any(ln.startswith("serving step") for ln in rest), rest
