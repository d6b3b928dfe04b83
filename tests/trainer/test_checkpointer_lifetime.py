"""A checkpointer gives back everything it took -- tracking hooks, stager threads, the writer
lease -- when its construction fails at any step, and when ``close()`` fails: a real DMP model on
one gloo rank, real files, real faults (an unusable optimizer, an unwritable publish store, a
failpoint in spool recovery, a collective that raises)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import deck
from deck import failpoints
from deck.demo import ModelSpec, build_model, train_step
from deck.errors import DeckError, StorageError
from deck.processes import init_process_group, rendezvous
from deck.storage import LocalStorage, open_storage
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage
from deck.trainer.lease import Lease

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _earlier_lookup_hook(features: Any, embs: Any, mod: Any, raw_ids: Any) -> None:
    """Stands for a tracker installed before deck (e.g. TorchRec's own)."""


def _earlier_odist_hook() -> None:
    """Stands for a tracker installed before deck (e.g. TorchRec's own)."""


def _hooks(model: Any) -> list[tuple[Any, Any]]:
    return [
        (m.post_lookup_tracker_fn, m.post_odist_tracker_fn)
        for m in model.modules()
        if hasattr(m, "register_post_lookup_tracker_fn")
    ]


def _deck_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("deck-"))


def _assert_nothing_left(model: Any, uri: str, hooks_before: list[tuple[Any, Any]]) -> None:
    """No hook of deck's on the model, no thread of deck's, no lease at the URI; a new
    checkpointer on the URI starts at once (a held lease would make it wait 60 s, then refuse)."""
    assert _hooks(model) == hooks_before
    assert _deck_threads() == []
    held = Lease(open_storage(uri), ttl_s=1).read()
    assert held is None or held.expires_unix == 0  # released
    with deck.DeltaCheckpointer(model, [], deck.DeckConfig(uri=uri, lease_ttl_s=60)):
        assert _hooks(model) != hooks_before and "deck-lease" in _deck_threads()
    assert _hooks(model) == hooks_before and _deck_threads() == []


def _construction_fails(rank: int, world_size: int, root: str, where: str) -> None:
    model, opt = build_model(SPEC)
    for m in model.modules():
        if hasattr(m, "register_post_lookup_tracker_fn"):
            m.register_post_lookup_tracker_fn(_earlier_lookup_hook)
            m.register_post_odist_tracker_fn(_earlier_odist_hook)
    hooks_before = _hooks(model)
    assert hooks_before and all(
        h == (_earlier_lookup_hook, _earlier_odist_hook) for h in hooks_before
    )
    assert _deck_threads() == []
    uri = f"{root}/ck"
    staging = deck.StagingConfig(tiers="cpu-ssd-remote", spool_dir=f"{root}/spool")
    publish = deck.PublishConfig(uri=f"{root}/pub", every_steps=1)
    config = deck.DeckConfig(uri=uri, lease_ttl_s=60, staging=staging, publish=publish)
    kw: dict[str, Any] = {}
    optimizers: Any = [opt]
    if where == "optimizer":  # after the lease is taken
        optimizers = [object()]
        expected: type[BaseException] = DeckError
    elif where == "publisher":  # after the lease, the hooks and the checkpoint chain's stager
        kw["publish_storage"] = FaultyStorage(
            LocalStorage(f"{root}/pub"), fail_put=lambda key, n: True
        )
        expected = StorageError
    else:  # spool recovery: after everything, both stagers included
        failpoints.configure("stager.recover.scan:1:enospc")
        expected = OSError
    try:
        with pytest.raises(expected):
            deck.DeltaCheckpointer(model, optimizers, config, **kw)
    finally:
        failpoints.configure(None)
    _assert_nothing_left(model, uri, hooks_before)


@pytest.mark.parametrize("where", ["optimizer", "publisher", "recover"])
def test_failed_construction_leaves_nothing_installed_held_or_running(
    tmp_path: Path, where: str
) -> None:
    run_ranks(_construction_fails, str(tmp_path), where, world_size=1)


def _close_fails(rank: int, world_size: int, root: str) -> None:
    model, opt = build_model(SPEC)
    hooks_before = _hooks(model)
    uri = f"{root}/ck"
    config = deck.DeckConfig(
        uri=uri,
        delta_every_steps=1,
        lease_ttl_s=60,
        staging=deck.StagingConfig(tiers="cpu-ssd-remote", spool_dir=f"{root}/spool"),
        publish=deck.PublishConfig(uri=f"{root}/pub", every_steps=1),
    )
    ck = deck.DeltaCheckpointer(model, [opt], config)
    assert _hooks(model) != hooks_before and "deck-lease" in _deck_threads()
    ck.step(0)
    train_step(model, opt, SPEC, 1)
    ck.step(1)
    # The process group goes away (as when a peer dies): close()'s collective flush raises.
    dist.destroy_process_group()
    try:
        with pytest.raises(Exception) as info:
            ck.close()
    finally:
        init_process_group(rank, world_size, rendezvous(root))  # a new group, for what follows
    assert not isinstance(info.value, DeckError), info.value  # the collective's own error
    ck.close()  # idempotent: nothing left to give back, nothing raised
    _assert_nothing_left(model, uri, hooks_before)
    # What was staged before the failed close was still finished by it (its own background work).
    assert [c.step for c in deck.list_checkpoints(uri)] == [0, 1]


def test_close_gives_everything_back_when_its_flush_raises(tmp_path: Path) -> None:
    run_ranks(_close_fails, str(tmp_path), world_size=1)


def _steps_go_forward(rank: int, world_size: int, root: str) -> None:
    from deck.errors import ConfigError

    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=f"{root}/ck",
        delta_every_steps=2,
        publish=deck.PublishConfig(uri=f"{root}/pub", every_steps=2),
    )
    with deck.enable(model, [opt], config) as ck:
        for step in range(5):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)
        # An older step than the one already checkpointed is refused at the call, naming the
        # way back (it used to fail in the background while flush() still returned True).
        with pytest.raises(ConfigError, match=r"step 2 .*already checkpointed step 4.*restore"):
            ck.step(2)
        with pytest.raises(ConfigError, match="steps only go forward"):
            ck.save("full", step=3)
        # One not due too (a break-it finding: step(3) was taken, and the save() after it then
        # said to restore(3), which was never committed)
        with pytest.raises(
            ConfigError, match=r"step 3 .*restore\(\) a committed step at or before 3"
        ):
            ck.step(3)
        # The same step again (a final save() after step() took one) too: it was accepted and
        # failed in the background as a delta of itself, taking the next delta with it.
        with pytest.raises(ConfigError, match=r"step 4 itself is saved"):
            ck.step(4)
        with pytest.raises(ConfigError, match=r"step 4 itself is saved"):
            ck.save("full", step=4)
        assert ck.flush()
        assert [(h.step, h.state) for h in ck.history] == [
            (0, "committed"),
            (2, "committed"),
            (4, "committed"),
        ]
        # A rollback is a restore; from there the chain goes forward again.
        assert ck.restore(2) == 2
        with pytest.raises(ConfigError, match="already restored step 2"):
            ck.save("delta", step=1)
        # The restored step itself: not "restore(2) first", which was just done (a break-it
        # finding), but where the loop resumes
        with pytest.raises(ConfigError, match=r"step 2 is the step restore\(\) loaded.*is 3"):
            ck.save("delta", step=2)
        # The publish stream too (found by a helper: a publish of step 1 here was taken, a full
        # holding step 2's rows labelled step 1, and the stream's step 2 chain broke); the
        # restored step itself starts its new epoch.
        with pytest.raises(ConfigError, match=r"publish of step 1 .*already restored step 2"):
            ck.publish(1)
        assert ck.publish(2) is not None
        train_step(model, opt, SPEC, 3)
        assert ck.save("delta", step=3) is not None
        assert ck.flush()
    assert {c.step for c in deck.list_checkpoints(f"{root}/ck")} == {0, 2, 3, 4}
    # After close (a break-it finding: a staging process said it "died (exit code 0)", staging
    # threads "cannot schedule new futures after shutdown")
    for call in (lambda: ck.step(6), lambda: ck.save("full", step=6), lambda: ck.publish(6)):
        with pytest.raises(ConfigError, match=r"after close\(\): .* is closed"):
            call()


def test_a_step_older_than_the_last_checkpoint_is_refused_at_the_call(tmp_path: Path) -> None:
    run_ranks(_steps_go_forward, str(tmp_path), world_size=1)


def _short_job(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=100)) as ck:
        for step in range(1, 4):
            train_step(model, opt, SPEC, step)
            assert ck.step(step) is None


def test_a_job_closed_before_its_first_checkpoint_says_so(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """(a break-it finding: a job shorter than delta_every_steps ended with nothing saved and
    nothing said)"""
    uri = str(tmp_path / "ck")
    run_ranks(_short_job, uri, world_size=1)
    said = capfd.readouterr().err
    assert f"closing {uri} without a checkpoint: step() was called up to step 3" in said, said
    assert "delta_every_steps (100); call save() before close()" in said, said
