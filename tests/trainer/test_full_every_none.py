"""``full_every_steps=None`` as DeckConfig documents it: no scheduled fulls; a full only when
there is nothing to build a delta on (the first checkpoint of a process that restored none);
after ``restore()`` the next checkpoint is a delta of the restored step, also in a new process.
"""

from __future__ import annotations

from pathlib import Path

import deck
from deck.config import DeckConfig
from deck.demo import ModelSpec, build_model, train_step
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=2, rows=200, dim=8, batch=16)


def _train(rank: int, world_size: int, uri: str, steps: list[int], restore: bool) -> None:
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], DeckConfig(uri=uri, delta_every_steps=2)) as ck:
        if restore:
            assert ck.restore() is not None
        for step in steps:
            train_step(model, opt, SPEC, step)
            ck.step(step)


def test_fulls_without_a_schedule(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_train, uri, [0, 1, 2, 3, 4], False)  # full 0, deltas 2 and 4
    run_ranks(_train, uri, [5, 6, 7, 8], True)  # restored 4: deltas 6 and 8, no full
    run_ranks(_train, uri, [9, 10, 11, 12], False)  # restored nothing: full 10, delta 12
    got = {c.step: (c.kind, c.parent) for c in deck.list_checkpoints(uri)}
    assert got == {
        0: ("full", None),
        2: ("delta", 0),
        4: ("delta", 2),
        6: ("delta", 4),
        8: ("delta", 6),
        10: ("full", None),
        12: ("delta", 10),
    }, got
