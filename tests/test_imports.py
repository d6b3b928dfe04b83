"""The light CLI commands (``deck ls``, ``show``, ``lineage``, ``gc``) run on a real checkpoint
without importing torch, TorchRec, numpy or pyarrow: deck.cli imports each command's modules only when
that command runs. (tests/test_architecture.py checks the import rules on the source, and that
``import deck`` alone loads none of them.)

Each check runs in a fresh interpreter (this one has imported torch long ago)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deck.storage import LocalStorage
from deck.testing.synth import SynthTrainer

HEAVY = ("torch", "torchrec", "numpy", "pyarrow")

# Runs `deck ARGS` in-process in a fresh interpreter, then reports which heavy modules it loaded.
PROBE = f"""
import json, sys
import deck
from deck.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint folder: a full of step 0 and two deltas (2 ranks, the exact format)."""
    root = tmp_path_factory.mktemp("imports") / "ck"
    tr = SynthTrainer(LocalStorage(root))
    tr.save("full")
    for _ in range(2):
        tr.train()
        tr.save()
    return root


def _run(*args: str) -> dict[str, object]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "args",
    [("ls",), ("ls", "--json"), ("show", "2"), ("lineage",), ("gc", "--dry-run")],
    ids=lambda a: " ".join(a),
)
def test_light_commands_on_a_real_checkpoint_load_no_torch(
    ckpt: Path, args: tuple[str, ...]
) -> None:
    out = _run(args[0], str(ckpt), *args[1:])
    assert out["code"] == 0
    assert out["loaded"] == [], f"deck {' '.join(args)} imported {out['loaded']}"


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by basename (the test folders are no packages): a second
    ``test_x.py`` anywhere under tests/ stops the whole run at collection."""
    from collections import Counter
    from pathlib import Path

    names = Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], names.most_common(3)
