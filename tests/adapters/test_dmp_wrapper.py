"""deck turned on through the model wrapper: ``DeckDistributedModelParallel(..., deck_config=...)``
on a real 2-rank gloo DMP, beside TorchRec's own trackers."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest

import deck
from deck.demo import (
    ModelSpec,
    TrainState,
    build_model,
    capture_state,
    diff_states,
    looked_up_rows,
    train_step,
)
from deck.errors import ConfigError
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=3, rows=500, dim=8, batch=32, sharding="table_wise")
AUDIT = "audit"  # a second deck tracking tenant, read once at the end to compare with TorchRec's


def _wrapped(uri: str, seed: int | None = None, **kw: object) -> tuple[Any, Any]:
    from torchrec.distributed.model_tracker.types import ModelTrackerConfigs, RawIdTrackerConfig

    config = deck.DeckConfig(uri=uri, delta_every_steps=2, consumers=("checkpoint", AUDIT))
    dmp = functools.partial(
        deck.DeckDistributedModelParallel,
        deck_config=config,
        # TorchRec's own tracker configuration, passed through the wrapper untouched.
        model_tracker_configs=ModelTrackerConfigs(raw_id_tracker_config=RawIdTrackerConfig()),
        **kw,
    )
    return build_model(SPEC, seed=seed, dmp=dmp)


def _table(name: str) -> str:
    found = re.findall(r"(?:^|\.)(t\d+)(?:\.|$)", name)
    assert found, name
    return found[-1]


def _worker(rank: int, world_size: int, uri: str) -> None:
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig

    # The wrapper adds nothing TorchRec or DCP would see: same keys, parameters, prefixes.
    plain, _ = build_model(SPEC)
    model, opt = _wrapped(uri)
    assert isinstance(model.deck, deck.DeltaCheckpointer)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert any(n.startswith("_dmp_wrapped_module.") for n, _ in model.named_modules())
    del plain

    # Without the dense optimizer, checkpoints would miss its state: refused until attached.
    with pytest.raises(ConfigError, match=r"model\.deck\.attach"):
        model.deck.restore()
    user = TrainState()
    assert model.deck.attach([opt], state=user) is model.deck
    assert model.deck.restore() is None  # an empty URI

    # TorchRec's delta tracker, created after deck's hooks (its setter replaces callbacks).
    trec = model.init_torchrec_delta_tracker(DeltaTrackerConfig())
    losses: dict[int, float] = {}
    for step in range(1, 9):
        losses[step] = train_step(model, opt, SPEC, step)
        user.step, user.losses = step, [*user.losses, losses[step]]
        model.deck.step(step)  # full at 2, deltas at 4, 6, 8
    expected = capture_state(model, opt, user)
    kinds = [s.kind for s in model.deck.history]
    assert kinds == ["full", "delta", "delta", "delta"], kinds

    # Both trackers saw every lookup: TorchRec's ids equal deck's rows of the same steps
    # (table_wise: shard-local ids are global row ids), and both equal the batches' ids.
    token = model.deck.tracker.begin_read(AUDIT)
    deck_rows = {}
    for s in model.deck.adapter.table_shards():
        rows = model.deck.tracker.touched(token, s.track_base, s.track_base + s.rows)
        deck_rows[_table(s.table)] = set((rows + s.row_offset).tolist())
    model.deck.tracker.commit(token)
    trec_rows = {_table(k): set(v.tolist()) for k, v in trec.get_unique_ids().items()}
    assert deck_rows and trec_rows == deck_rows, (sorted(trec_rows), sorted(deck_rows))
    assert deck_rows == looked_up_rows(SPEC, set(deck_rows), range(1, 9), world_size)
    # DMP.forward stepped both of TorchRec's trackers (model_tracker_configs' and the delta one).
    assert {k: t.curr_batch_idx for k, t in model.model_trackers.items()} == {
        "RAW_ID_TRACKER": 8,
        "DELTA_TRACKER": 8,
    }

    # Train on without checkpoints: the reference losses.
    for step in range(9, 13):
        losses[step] = train_step(model, opt, SPEC, step)
    model.deck.close()

    # A fresh wrapper (other initial weights) restores step 8 bitwise: weights, fused
    # optimizer states, dense parameters, dense optimizer and user state.
    model2, opt2 = _wrapped(uri, seed=SPEC.seed + 99)
    user2 = TrainState()
    model2.deck.attach([opt2], state=user2)
    assert diff_states(expected, capture_state(model2, opt2, user2))  # really different before
    assert model2.deck.restore() == 8
    bad = diff_states(expected, capture_state(model2, opt2, user2))
    assert not bad, f"rank {rank}: {bad[:5]}"
    for step in range(9, 13):
        if step == 11:
            # A TorchRec tracker built on the model directly replaces deck's hooks: the next
            # checkpoint notices, takes a full (step 11's rows were not tracked) and re-chains.
            ModelDeltaTrackerTrec(model2)
        assert train_step(model2, opt2, SPEC, step) == losses[step], step
        user2.step = step
        model2.deck.step(step)
    assert [s.kind for s in model2.deck.history] == ["delta", "full"]
    for step in (13, 14):
        train_step(model2, opt2, SPEC, step)
        user2.step = step
    model2.deck.step(14)  # a delta again: deck tracked 13 and 14 behind TorchRec's tracker
    assert [s.kind for s in model2.deck.history] == ["delta", "full", "delta"]
    expected = capture_state(model2, opt2, user2)
    model2.deck.close()

    # The user state may also come with the wrapper (it exists before the model).
    user3 = TrainState()
    model3, opt3 = _wrapped(uri, seed=SPEC.seed + 7, deck_state=user3)
    model3.deck.attach([opt3])
    assert model3.deck.restore() == 14
    bad = diff_states(expected, capture_state(model3, opt3, user3))
    assert not bad, f"rank {rank} step 14: {bad[:5]}"
    model3.deck.close()


def test_wrapper_trains_restores_bitwise_beside_torchrec_trackers(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_worker, uri)
    infos = deck.list_checkpoints(uri)
    assert [(i.step, i.kind) for i in infos] == [
        (2, "full"),
        (4, "delta"),
        (6, "delta"),
        (8, "delta"),
        (10, "delta"),
        (12, "full"),
        (14, "delta"),
    ]
    assert infos[-3].parent == 8  # the restored process's first delta builds on step 8
