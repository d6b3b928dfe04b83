"""Tracking through TorchRec's hook points on a real 2-rank DMP."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import deck
from deck.config import CHECKPOINT_CONSUMER
from deck.demo import ModelSpec, build_model, looked_up_rows, make_batch, train_step
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=3, rows=500, dim=8, batch=32, sharding="table_wise")


def _touched(ckpt: deck.DeltaCheckpointer, consumer: str) -> dict[str, set[int]]:
    token = ckpt.tracker.begin_read(consumer)
    out = {}
    for s in ckpt.adapter.table_shards():
        rows = ckpt.tracker.touched(token, s.track_base, s.track_base + s.rows) + s.row_offset
        out[s.table.split(".")[-2]] = set(rows.tolist())
    ckpt.tracker.commit(token)
    return out


def _chain_pause_eval(rank: int, world_size: int, uri: str) -> None:
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec

    model, opt = build_model(SPEC)
    # TorchRec's own tracker first: deck must chain with it, not replace it.
    trec = ModelDeltaTrackerTrec(model, auto_compact=True)
    config = deck.DeckConfig(uri=uri, delta_every_steps=1000, consumers=("checkpoint", "publish"))
    ckpt = deck.enable(model, [opt], config)
    mine = {s.table.split(".")[-2] for s in ckpt.adapter.table_shards()}

    # Two tenants with different intervals each get exactly the rows since their own last read.
    for step in range(1, 4):
        train_step(model, opt, SPEC, step)
        trec.step()
    assert _touched(ckpt, "publish") == looked_up_rows(SPEC, mine, range(1, 4), world_size)
    for step in range(4, 7):
        train_step(model, opt, SPEC, step)
        trec.step()
    assert _touched(ckpt, "publish") == looked_up_rows(SPEC, mine, range(4, 7), world_size)
    assert _touched(ckpt, CHECKPOINT_CONSUMER) == looked_up_rows(
        SPEC, mine, range(1, 7), world_size
    )

    # TorchRec's tracker kept recording through the chained hooks.
    trec_ids = trec.get_unique_ids()
    assert trec_ids and all(v.numel() > 0 for v in trec_ids.values()), trec_ids.keys()

    # Paused and eval-mode forwards record nothing.
    dense, kjt, _ = make_batch(SPEC, 99, rank)
    with ckpt.pause(), torch.no_grad():
        model(dense, kjt)
    model.eval()
    with torch.no_grad():
        model(dense, kjt)
    model.train()
    assert all(not v for v in _touched(ckpt, CHECKPOINT_CONSUMER).values())

    # close() removes deck's hooks and leaves TorchRec's in place.
    ckpt.close()
    train_step(model, opt, SPEC, 7)
    assert all(not v for v in _touched(ckpt, CHECKPOINT_CONSUMER).values())
    # (A second get_unique_ids() hits TorchRec's empty-bucket bug, so check its hooks instead.)
    for module in trec.tracked_modules.values():
        assert module.post_lookup_tracker_fn == trec.record_lookup
        assert module.post_odist_tracker_fn == trec.trigger_compaction

    # Callbacks chained after deck's (they call deck's) cannot be unhooked by close(): deck's
    # then only pass the call on, so tracking still stops at close(), the later callbacks (and
    # TorchRec's before deck's) keep working, and deck's no longer hold the checkpointer.
    ck2 = deck.enable(model, [opt], deck.DeckConfig(uri=f"{uri}-2", delta_every_steps=1000))
    calls: list[str] = []
    for module in trec.tracked_modules.values():
        deck_lookup, deck_odist = module.post_lookup_tracker_fn, module.post_odist_tracker_fn

        def later(features, embs, mod, raw_ids, _deck=deck_lookup):  # type: ignore[no-untyped-def]
            calls.append("lookup")
            _deck(features, embs, mod, raw_ids)

        def later_odist(_deck=deck_odist):  # type: ignore[no-untyped-def]
            calls.append("odist")
            _deck()

        module.post_lookup_tracker_fn = later
        module.post_odist_tracker_fn = later_odist
    train_step(model, opt, SPEC, 8)
    assert {"lookup", "odist"} <= set(calls)
    assert any(_touched(ck2, CHECKPOINT_CONSUMER).values())
    tracker = weakref.ref(ck2.tracker)
    ck2.close()
    calls.clear()
    train_step(model, opt, SPEC, 9)
    assert {"lookup", "odist"} <= set(calls)
    assert all(not v for v in _touched(ck2, CHECKPOINT_CONSUMER).values())
    del ck2
    gc.collect()
    assert tracker() is None, "a callback chained behind deck's keeps its tracker alive"
    dist.barrier()


def test_tenants_chaining_pause_eval(tmp_path: Path) -> None:
    run_ranks(_chain_pause_eval, str(tmp_path))


def _warnings_of_deck(rank: int, world_size: int, uri: str) -> None:
    import warnings

    model, opt = build_model(SPEC)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=2)) as ckpt:
            for step in range(1, 5):
                train_step(model, opt, SPEC, step)
                ckpt.step(step)
            ckpt.restore()
    # TorchRec's own warnings may come (planner, DDP); none may point at deck's source.
    root = str(Path(deck.__file__).resolve().parents[1])
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.filename.startswith(root)]
    assert not ours, ours
    dist.barrier()


def test_deck_raises_no_warning_of_its_own(tmp_path: Path) -> None:
    run_ranks(_warnings_of_deck, str(tmp_path / "ckpt"))
