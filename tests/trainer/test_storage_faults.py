"""Storage faults on a real 2-rank DMP run: transient upload errors (with slow writes) are
retried, a part that never uploads makes the next checkpoint a full, a full spool skips a
checkpoint without losing its rows. Every committed step restores bitwise."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import deck
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=3, rows=1500, dim=8, batch=64)


def _staging(root: str, **kw: object) -> deck.StagingConfig:
    return deck.StagingConfig(
        chunk_bytes=8192,
        tiers="cpu-ssd-remote",
        spool_dir=f"{root}/spool",
        retry_initial_s=0.01,
        retry_max_s=0.05,
        **kw,  # type: ignore[arg-type]
    )


def _faults(rank: int, world_size: int, root: str, mode: str) -> None:
    uri = f"{root}/ck"
    once: set[str] = set()
    gate = threading.Event()
    staging = _staging(root)
    if mode == "transient":
        # Every chunk of rank 1 fails its first upload.
        def fail(key: str, n: int) -> bool:
            if rank == 1 and key.endswith(".chunk") and key not in once:
                once.add(key)
                return True
            return False

    elif mode == "permanent":
        # Rank 1 can never upload its part of step 10.
        def fail(key: str, n: int) -> bool:
            return rank == 1 and key.startswith("step-000000000010/")

        # Rank 1 gives its part up after 0.5 s of failures; rank 0 waits commit_timeout_s for
        # it. That wait is also how long rank 0 waits for rank 1's good parts of steps 0 and
        # 5 (flushed one by one below): generous against a busy machine.
        staging = _staging(root, upload_timeout_s=0.5, commit_timeout_s=15.0)
    else:  # "spool-full": uploads wait at a gate; the spool holds one checkpoint

        def fail(key: str, n: int) -> bool:
            if key.endswith(".chunk"):
                gate.wait()
            return False

        staging = _staging(root, spool_max_bytes=1, spool_full="skip")
    # Transient mode also has slow writes (every put waits 10 ms): uploads lag behind training.
    slow = 0.01 if mode == "transient" else 0.0
    store = FaultyStorage(LocalStorage(uri), fail_put=fail, slow_put_s=slow)
    config = deck.DeckConfig(uri=uri, delta_every_steps=5, staging=staging, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    captured = {}
    results = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user, storage=store) as ck:
        for step in range(0, 21):
            if step:
                train_step(model, opt, SPEC, step)
                user.step = step
            stats = ck.step(step)
            results[step] = stats
            if stats is not None:
                captured[step] = capture_state(model, opt, user)
            if mode == "spool-full" and step == 5:
                gate.set()  # the store comes back: uploads drain the spool
                ck.flush()
            if step == 10 or (mode == "spool-full" and step > 5 and stats is not None):
                # The spool holds one checkpoint: the next one is only staged (not skipped) if
                # this one has been uploaded by then, which must not depend on timing.
                ck.flush()
            elif mode == "permanent" and stats is not None:
                ck.flush()  # rank 0 waits for rank 1's part on an otherwise idle job
        ck.flush()
        states = {h.step: (h.kind, h.state) for h in ck.history}

    done = "committed" if rank == 0 else "uploaded"
    if mode == "transient":
        assert store.failed_puts > 0 if rank == 1 else store.failed_puts == 0
        assert all(s == done for _, s in states.values()), states
        expect = [0, 5, 10, 15, 20]
    elif mode == "permanent":
        assert states[10][1] == "failed", states
        assert states[15] == ("full", done), states  # every rank took a full after the failure
        expect = [0, 5, 15, 20]
    else:
        assert results[5] is None and 5 not in states  # skipped on every rank
        assert states[10] == ("delta", done), states  # and its rows went into step 10
        expect = [0, 10, 15, 20]
    assert [c.step for c in deck.list_checkpoints(uri)] == expect

    for step in expect:
        model2, opt2 = build_model(SPEC, seed=50 + step)
        user2 = TrainState()
        with deck.DeltaCheckpointer(model2, [opt2], config, state=user2) as ck2:
            assert ck2.restore(step) == step
        bad = diff_states(captured[step], capture_state(model2, opt2, user2))
        assert not bad, f"{mode} rank {rank} step {step}: {bad[:5]}"


@pytest.mark.parametrize("mode", ["transient", "permanent", "spool-full"])
def test_storage_faults(tmp_path: Path, mode: str) -> None:
    run_ranks(_faults, str(tmp_path), mode)
