"""Running the user-facing examples of docs/examples as a user does: under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str, *args: str, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node ranks docs/examples/<script> args...``, with this
    checkout importable; the caller checks the return code (its output is captured)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(ROOT / "docs" / "examples" / script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
