"""The managed-collision adapter's remapper state (adapters/torchrec_mc.py) on TorchRec's own
``MCHManagedCollisionModule``, in one process: what ``module_state`` saves, through the state
file's encoding, puts a fresh (or differently trained) remapper back into the same state, bitwise
(its buffers, counters, id history, pending evictions), and both then remap and evict alike for
the steps after; a remapper of another layout or eviction policy, another world size, state
missing on either side and a damaged state are refused naming what. The sharded collections,
their rows and the restore of whole jobs: tests/trainer/test_managed_collision.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from deck.adapters.torchrec_mc import ManagedCollision, module_state, prepare_restore

from deck.demo import diff_states
from deck.errors import CorruptCheckpointError, IncompatibleModelError, UnsupportedError
from deck.format import treecodec
from deck.testing.managed_collision import remapper_state

SLOTS, ID_SPACE = 8, 60


def _mch(policy: str = "distance_lfu", offset: int = 0, interval: int = 2) -> Any:
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        MCHManagedCollisionModule,
    )

    policies = {
        "lfu": LFU_EvictionPolicy,
        "lru": LRU_EvictionPolicy,
        "distance_lfu": DistanceLFU_EvictionPolicy,
    }
    return MCHManagedCollisionModule(
        zch_size=SLOTS,
        device=torch.device("cpu"),
        eviction_policy=policies[policy](),
        eviction_interval=interval,
        input_hash_size=ID_SPACE,
        output_global_offset=offset,
    )


def _step(mch: Any, step: int, seed: int = 0) -> torch.Tensor:
    """One training forward of ``mch`` on the batch of ``step``: its remapped ids."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    rng = np.random.default_rng([seed, step])
    values = torch.from_numpy(((rng.zipf(1.4, size=12) * 7) % ID_SPACE).astype(np.int64))
    out = mch({"t": JaggedTensor(values=values, lengths=torch.tensor([5, 7]))})
    return out["t"].values()


def _saved(mch: Any, world_size: int = 1) -> dict[str, Any]:
    """What a checkpoint's extra file gives back of ``mch``'s state (encoded and decoded)."""
    state = module_state([ManagedCollision("mc", None, "mc.inner", {"t": mch})], world_size)
    out: dict[str, Any] = treecodec.decode(treecodec.encode(state, "modules"), "test")
    return out


def _put(mch: Any, saved: dict[str, Any], saved_ranks: int = 1) -> None:
    prepare_restore(
        [ManagedCollision("mc", None, "mc.inner", {"t": mch})], saved, saved_ranks, 1, "here"
    )()


def _iteration_tensor(mch: Any) -> torch.Tensor:
    """The persistent iteration buffer (a restore brings it back with the dense state)."""
    return dict(mch.named_buffers())["_current_iter_tensor"]


@pytest.mark.parametrize("policy", ["lfu", "lru", "distance_lfu"])
@pytest.mark.parametrize("at", [0, 3, 4])  # untrained; mid-interval; right after an eviction
def test_a_saved_remapper_comes_back_exactly(policy: str, at: int) -> None:
    live = _mch(policy)
    for step in range(1, at + 1):
        _step(live, step)
    saved = _saved(live)
    fresh = _mch(policy)
    for step in range(1, 6):  # other history, other counters: all of it must go
        _step(fresh, step, seed=1)
    _put(fresh, saved)
    _iteration_tensor(fresh).copy_(_iteration_tensor(live))
    bad = diff_states(remapper_state(live), remapper_state(fresh))
    assert not bad, bad
    for step in range(at + 1, at + 6):  # evictions at every second iteration
        assert torch.equal(_step(live, step), _step(fresh, step)), step
        a, b = live.evict(), fresh.evict()  # what the collection would reset
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
        assert not diff_states(remapper_state(live), remapper_state(fresh)), step


def test_what_does_not_fit_is_refused_naming_it() -> None:
    live = _mch()
    for step in range(1, 4):
        _step(live, step)
    saved = _saved(live)
    with pytest.raises(IncompatibleModelError, match=r"saved by 2 ranks and this job has 1"):
        _put(_mch(), _saved(live, world_size=2), saved_ranks=2)
    with pytest.raises(
        IncompatibleModelError, match=r"over rows \[0, 8\), here it is over rows \[8, 16\)"
    ):
        _put(_mch(offset=8), saved)
    with pytest.raises(
        IncompatibleModelError,
        match=r"eviction policy keeping \['counts', 'last_access_iter'\].*\['counts'\]",
    ):
        _put(_mch("lfu"), saved)
    with pytest.raises(IncompatibleModelError, match=r"holds no managed-collision state.*\['mc'\]"):
        _put(_mch(), {})
    with pytest.raises(
        IncompatibleModelError, match=r"managed-collision state of \['mc'\], this model has.*\[\]"
    ):
        prepare_restore([], saved, 1, 1, "here")
    damaged = _saved(live)
    damaged["managed_collision"]["collections"]["mc"]["t"]["sorted_raw_ids"] = torch.zeros(
        3, dtype=torch.int64
    )
    with pytest.raises(
        CorruptCheckpointError, match=r"here: its managed-collision state.*not 8 long"
    ):
        _put(_mch(), damaged)
    damaged = _saved(live)
    del damaged["managed_collision"]["collections"]["mc"]["t"]["history"]
    with pytest.raises(CorruptCheckpointError, match=r"KeyError: 'history'"):
        _put(_mch(), damaged)


def test_a_hash_zch_remapper_is_refused() -> None:
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    hashed = HashZchManagedCollisionModule(
        zch_size=SLOTS, device=torch.device("cpu"), total_num_buckets=1
    )
    with pytest.raises(
        UnsupportedError, match=r"HashZchManagedCollisionModule cannot train on CPU"
    ):
        ManagedCollision("mc", None, "mc.inner", {"t": hashed})
