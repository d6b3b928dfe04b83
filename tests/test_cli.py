"""The deck console script, run as a subprocess on a checkpoint written by a 2-rank job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import run_ranks

import deck
from deck.demo import ModelSpec, build_model, train_step

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32)


def _write(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=5)) as ck:
        for step in range(0, 11):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)


def _deck(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_ls_and_verify(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_write, uri)

    r = _deck("ls", uri, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["step"], x["kind"], x["ranks"]) for x in rows] == [
        (0, "full", 2),
        (5, "delta", 2),
        (10, "delta", 2),
    ]
    assert "delta" in _deck("ls", uri).stdout

    r = _deck("verify", uri, "--all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 with problems" in r.stdout

    # Flip one byte of one chunk of step 5: verify fails and names that file.
    chunk = sorted((tmp_path / "ck" / "step-000000000005").rglob("*.chunk"))[0]
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    r = _deck("verify", uri, "--step", "5")
    assert r.returncode == 1
    assert chunk.name in r.stdout and "checksum" in r.stdout

    assert _deck("ls").returncode == 2  # usage error
    assert _deck("verify", str(tmp_path / "nothing")).returncode == 1
