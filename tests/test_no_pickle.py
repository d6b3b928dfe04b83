"""No pickle on any load path: deck's own code never imports a pickle-family module nor calls a
loader that unpickles, and a real 2-rank restore of a full + delta chain unpickles
nothing (checked with the interpreter's ``pickle.find_class`` audit event)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import deck
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.testing.dist_harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _problems(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        out += [f"{path}:{node.lineno}: imports {n}" for n in names if n in PICKLERS]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            call = ast.unparse(node.func)
            if call in ("torch.load", "np.load", "numpy.load") and not any(
                k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords
            ):
                out.append(f"{path}:{node.lineno}: calls {call}")
    return out


def test_library_code_has_no_unpickling() -> None:
    files = [p for d in ("deck", "kernels", "adapters") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    bad = [msg for f in files for msg in _problems(f)]
    assert not bad, bad


def test_the_scan_finds_pickle(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import pickle\nfrom dill import loads\nimport torch\ntorch.load('x')\n")
    assert len(_problems(src)) == 3


SPEC = ModelSpec(num_tables=2, rows=300, dim=8, batch=32)


def _restore_without_pickle(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=2, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        for step in range(7):
            if step:
                train_step(model, opt, SPEC, step)
                user.step = step
            ck.step(step)
        live = capture_state(model, opt, user)
    model2, opt2 = build_model(SPEC, seed=3)  # building a DMP pickles its plan: not ours
    user2 = TrainState()
    events: list[str] = []
    armed = [True]
    sys.addaudithook(
        lambda event, args: (
            events.append(f"{args}") if armed[0] and event == "pickle.find_class" else None
        )
    )
    with deck.DeltaCheckpointer(model2, [opt2], config, state=user2) as ck2:
        assert ck2.restore(allow_fallback=True) == 6
    armed[0] = False
    assert not events, f"rank {rank}: restore unpickled {events[:5]}"
    assert not diff_states(live, capture_state(model2, opt2, user2))


@pytest.mark.slow
def test_restore_unpickles_nothing(tmp_path: Path) -> None:
    run_ranks(_restore_without_pickle, str(tmp_path))
