"""``deck.load``: a committed step into a fresh model, read only -- beside a running trainer that
holds the URI's writer lease, and through a store that refuses every write and delete (what a
read-only mount or bucket does) -- bitwise equal to the trainer's live state of that step. Real
2-rank TorchRec DMP models over gloo, real files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import deck
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.errors import CheckpointNotFoundError
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _refusing(uri: str) -> FaultyStorage:
    def refuse(key: Any, n: int = 0) -> bool:
        return True

    return FaultyStorage(open_storage(uri), fail_put=refuse, fail_delete=refuse)


def _files(root: str) -> list[tuple[str, int, int]]:
    """Every file under ``root`` with its size and mtime, but the lease the trainer renews."""
    out = []
    for d, _, names in os.walk(root):
        for name in names:
            path = os.path.join(d, name)
            if "_lease" not in os.path.relpath(path, root).split(os.sep):
                st = os.stat(path)
                out.append((path, st.st_size, st.st_mtime_ns))
    return sorted(out)


def _load_beside_a_trainer(rank: int, world_size: int, root: str) -> None:
    uri = f"{root}/ck"
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=2), state=user) as ck:
        for step in range(1, 7):
            user.losses.append(train_step(model, opt, SPEC, step))
            user.step = step
            live[step] = capture_state(model, opt, user, full=True)
            ck.step(step)
        assert ck.flush()
        before = _files(uri)
        # The trainer is still open (its lease held): an evaluation job loads beside it.
        for step, store in ((None, None), (4, _refusing(uri)), (2, _refusing(uri))):
            fresh, fresh_opt = build_model(SPEC, seed=7)
            fresh_user = TrainState()
            got = deck.load(fresh, [fresh_opt], store or uri, step=step, state=fresh_user)
            assert got == (step or 6)
            bad = diff_states(live[got], capture_state(fresh, fresh_opt, fresh_user, full=True))
            assert not bad, (step, bad[:5])
            assert store is None or store.puts == 0
        # Nothing there: None; a step never committed: an error naming it, on every rank.
        empty, empty_opt = build_model(SPEC, seed=7)
        assert deck.load(empty, [empty_opt], _refusing(f"{root}/empty")) is None
        with pytest.raises(CheckpointNotFoundError, match="5"):
            deck.load(empty, [empty_opt], uri, step=5)
        assert _files(uri) == before  # the loads through the plain store wrote nothing either


def test_load_reads_a_committed_step_without_writing(tmp_path: Path) -> None:
    run_ranks(_load_beside_a_trainer, str(tmp_path), world_size=2)
