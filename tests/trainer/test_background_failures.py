"""Parts that fail in the background after training moved on: a failed spool fsync fails its part
for good (never retried over data the kernel may have dropped), and a failure recorded while the
ranks vote on the next checkpoint is kept for the vote after it; a full local destination fails
parts at once and removes their files. Real TorchRec DMP models over
gloo, real files; faults from deck.failpoints and FaultyStorage."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import deck
from deck import failpoints
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.format.manifest import step_dir
from deck.read.catalog import read_manifests
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")
VOTING = "checkpointer.agree.voting"


def _config(root: str, **staging: Any) -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=f"{root}/ck",
        delta_every_steps=1,
        lease_ttl_s=None,
        staging=deck.StagingConfig(
            chunk_bytes=4096,
            tiers="cpu-ssd-remote",
            spool_dir=f"{root}/spool",
            retry_initial_s=0.01,
            retry_max_s=0.05,
            **staging,
        ),
    )


def _train(model: Any, opt: Any, user: TrainState, step: int) -> dict[str, Any]:
    """Step ``step`` (none for step 0); the live state after it."""
    if step:
        user.losses.append(train_step(model, opt, SPEC, step))
        user.step = step
    return capture_state(model, opt, user)


def _restores_bitwise(config: deck.DeckConfig, live: dict[int, Any], steps: list[int]) -> None:
    for step in steps:
        model, opt = build_model(SPEC, seed=100 + step)
        user = TrainState()
        with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
            assert ck.restore(step) == step
        bad = diff_states(live[step], capture_state(model, opt, user))
        assert not bad, f"step {step}: {bad[:5]}"


# ---- a failed fsync ------------------------------------------------------------------------------


def _fsync_fails(rank: int, world_size: int, root: str) -> None:
    config = _config(root)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        for step in range(4):
            live[step] = _train(model, opt, user, step)
            if step == 1:
                # Nothing of step 0 is still being fsynced: the point's first hit is the early
                # fsync of step 1's first spooled file. It fails once; a retry would succeed.
                ck.flush()
                failpoints.configure("stager.spool.fsync:1:enospc")
            assert ck.step(step) is not None  # released at the snapshot: nothing raised here
            if step == 1:
                # It returns (nothing waits for the failed part) and says step 1 did not commit.
                assert not ck.flush(timeout=600)
                failpoints.configure(None)
        ck.flush()
        history = {h.step: (h.kind, h.state) for h in ck.history}
        error = next(h.error or "" for h in ck.history if h.step == 1)

    assert history == {
        0: ("full", "committed"),
        1: ("delta", "failed"),  # its fsync failed: the part failed, its fsync was not retried
        2: ("full", "committed"),  # the chain is broken there: a full follows
        3: ("delta", "committed"),
    }, history
    assert "fsync" in error and "step 1" in error and "No space left" in error, error
    assert sorted(read_manifests(LocalStorage(config.uri))) == [0, 2, 3]
    spooled = [os.path.join(d, f) for d, _, fs in os.walk(f"{root}/spool") for f in fs]
    assert not spooled, spooled  # dropped, not left for a restart to finish
    # Nor their folders (a break-it finding: ~5 empty folders per checkpoint stayed, for every
    # restart's recovery to list): the spool is its root folder alone
    folders = [os.path.relpath(d, f"{root}/spool") for d, _, _ in os.walk(f"{root}/spool")]
    assert len(folders) == 2 and "/" not in folders[1], folders
    _restores_bitwise(config, live, [2, 3])


def test_failed_spool_fsync_fails_the_part_and_the_next_is_a_full(tmp_path: Path) -> None:
    """The ``stager.spool.fsync`` failpoint makes the first fsync of step 1's spooled files
    return ENOSPC, as a writeback error would: Linux reports such an error to one fsync only, so
    the part must fail rather than fsync again. Step 1 is never committed, nothing of it stays in
    the spool, step 2 is a full, and the steps after restore bitwise."""
    run_ranks(_fsync_fails, str(tmp_path), world_size=1)


def _rank0_learns_late(rank: int, world_size: int, root: str) -> None:
    config = _config(root)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        live[0] = _train(model, opt, user, 0)
        ck.step(0)
        assert ck.flush(timeout=600)
        if rank == 1:
            # Rank 1's part of step 1 fails in the background, and its failure record cannot be
            # put: rank 0 learns of it at the next checkpoint's collective only
            failpoints.configure("stager.spool.fsync:1:enospc,stager.failure_record.put:1:enospc")
        live[1] = _train(model, opt, user, 1)
        assert ck.step(1) is not None
        if rank == 1:
            deadline = time.monotonic() + 600
            while {h.step: h.state for h in ck.history}.get(1) != "failed":
                assert time.monotonic() < deadline, ck.history
                time.sleep(0.01)
            failpoints.configure(None)
        live[2] = _train(model, opt, user, 2)
        assert ck.step(2) is not None  # a full: rank 1's part of its parent failed
        # Rank 0 gives step 1 up now (told at step 2's vote), after the full was decided
        assert not ck.flush(timeout=600)
        live[3] = _train(model, opt, user, 3)
        assert ck.step(3) is not None
        assert ck.flush(timeout=600)
        history = {h.step: (h.kind, h.state) for h in ck.history}
    assert history == {
        0: ("full", "committed" if rank == 0 else "uploaded"),
        1: ("delta", "failed"),
        2: ("full", "committed" if rank == 0 else "uploaded"),
        # Step 1 is not of the chain step 3 extends: no second full (there was one)
        3: ("delta", "committed" if rank == 0 else "uploaded"),
    }, history
    assert sorted(read_manifests(LocalStorage(config.uri))) == [0, 2, 3]
    _restores_bitwise(config, live, [2, 3])


def test_a_part_given_up_after_a_full_was_taken_makes_no_second_full(tmp_path: Path) -> None:
    """Found by a user trying to break it (a staging process killed): rank 0 gave up an old step
    only after the full that followed it was taken, and the next checkpoint was a full again
    ("the last one failed in the background"), though the chain it extended was whole; up to
    three fulls followed one failure. A failed part makes the next checkpoint a full only when
    it is of that checkpoint's chain."""
    run_ranks(_rank0_learns_late, str(tmp_path))


# ---- a full local destination --------------------------------------------------------------------


def _files_of(root: str, step: int) -> list[str]:
    top = os.path.join(root, step_dir(step))
    return sorted(os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs)


def _disk_fills(rank: int, world_size: int, root: str, where: str) -> None:
    # The local tier (the default for a local URI): the stager writes into the URI itself.
    config = deck.DeckConfig(uri=f"{root}/ck", delta_every_steps=1, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        for step in range(5):
            live[step] = _train(model, opt, user, step)
            if step == 1:
                ck.flush()
                # The disk is full from here on: every write of a part manifest (through the
                # store), or every chunk file the spool writer writes, fails with ENOSPC.
                failpoints.configure(f"{where}:1+:enospc")
            assert ck.step(step) is not None
            if step in (1, 2):
                # The part failed at once: no retry for upload_timeout_s (an hour) while the
                # later checkpoints pile up on the same full disk.
                assert not ck.flush(timeout=600)
            if step == 2:
                failpoints.configure(None)  # space was freed
        assert ck.flush()
        history = {h.step: (h.kind, h.state) for h in ck.history}
        errors = {h.step: h.error or "" for h in ck.history if h.error}

    assert history == {
        0: ("full", "committed"),
        1: ("delta", "failed"),
        2: ("full", "failed"),  # the chain is broken at step 1: a full follows
        3: ("full", "committed"),
        4: ("delta", "committed"),
    }, history
    assert "No space left" in errors[1], errors
    if where == "storage.local.write":  # the part manifest: the committer says what to do
        assert "a disk is full" in errors[1] and "deck gc" in errors[1], errors
    elif where == "stager.spool.fsync":  # the URI's disk, not a spool (there is none)
        assert f"in the destination {root}/ck failed" in errors[1], errors
        assert "the spool" not in errors[1] and "spool_dir" not in errors[1], errors
        assert "move the URI to a larger disk" in errors[1], errors
    else:  # the spool writer, whose spool is the destination: it says so
        assert f"to the destination {root}/ck" in errors[1] and "move the URI" in errors[1]
        assert "spool_dir" not in errors[1], errors
    for step in (1, 2):  # the failed parts' files are gone: the next full needs their room
        assert _files_of(f"{root}/ck", step) == [], (step, _files_of(f"{root}/ck", step))
    assert sorted(read_manifests(LocalStorage(config.uri))) == [0, 3, 4]
    _restores_bitwise(config, live, [0, 3, 4])


@pytest.mark.parametrize(
    "where", ["storage.local.write", "stager.spool.write", "stager.spool.fsync"]
)
def test_a_full_local_destination_fails_parts_at_once_and_removes_their_files(
    tmp_path: Path, where: str
) -> None:
    """A local destination whose disk fills up (ENOSPC from deck.failpoints: on every part
    manifest the store writes, every chunk file the spool writer writes there, or every fsync of
    them): each part fails at once instead of being retried for ``upload_timeout_s``, its files
    are removed, the error says what to do (about the URI's disk: the local tier has no spool of
    its own), and once space is freed the next checkpoint is a full that commits and restores
    bitwise."""
    run_ranks(_disk_fills, str(tmp_path), where, world_size=1)


# ---- a failure recorded during the vote ----------------------------------------------------------


def _wait_for(what: str, done: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _failure_during_vote(rank: int, world_size: int, root: str) -> None:
    gate = threading.Event()
    marker = Path(root, "rank1-part-failed")

    def fail(key: str, n: int) -> bool:
        # Rank 1's uploads of step 1 wait at the gate, then fail for good, and so does its
        # failure record: rank 0 learns of it at a collective only (it must not at step 2's)
        if rank == 1 and key.startswith(f"{step_dir(1)}/"):
            gate.wait()
            return True
        return False

    def fail_during_the_vote() -> None:
        # Rank 1's training thread has taken its failure flag for step 2's vote and waits in the
        # all-gather for rank 0: only now does its part of step 1 fail.
        _wait_for("rank 1's vote", lambda: failpoints.hits()[VOTING] >= 1)
        gate.set()
        ck.stager.flush()  # the part has failed and the failure is recorded
        marker.touch()

    config = _config(root, upload_timeout_s=0.2)
    store = FaultyStorage(LocalStorage(config.uri), fail_put=fail)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    helper = threading.Thread(target=fail_during_the_vote)
    with deck.DeltaCheckpointer(model, [opt], config, state=user, storage=store) as ck:
        for step in range(5):
            live[step] = _train(model, opt, user, step)
            if step == 2 and rank == 1:
                failpoints.configure(f"{VOTING}:{10**9}")  # counts the hits, never fires
                helper.start()
            assert ck.step(step) is not None
            if step == 2 and rank == 1:
                helper.join()
                failpoints.configure(None)
            if step == 0:
                ck.flush()
        ck.flush()
        kinds = {h.step: (h.kind, h.state) for h in ck.history}
    assert marker.exists()

    done = "committed" if rank == 0 else "uploaded"
    assert kinds == {
        0: ("full", done),
        1: ("delta", "failed"),
        # No rank knew at its vote: a delta of step 1, which rank 0 cannot commit (its parent
        # failed); rank 1's part of it went up
        2: ("delta", "failed" if rank == 0 else "uploaded"),
        3: ("full", done),  # rank 1's failure came during step 2's vote and was kept for this
        # (rank 0 gave steps 1 and 2 up after step 3's vote: not of step 4's chain, no full)
        4: ("delta", done),
    }, kinds
    assert [c.step for c in deck.list_checkpoints(config.uri)] == [0, 3, 4]
    _restores_bitwise(config, live, [3, 4])


def test_a_failure_recorded_during_the_vote_is_kept_for_the_next(tmp_path: Path) -> None:
    """A part that fails between a rank taking its failure flag and the all-gather of the vote
    (rank 1 waits in it for rank 0) is not cleared with that vote: the next checkpoint, whose
    chain holds it, is a full on every rank. The ``checkpointer.agree.voting`` failpoint, armed never to fire, tells a
    helper thread when rank 1 is there; the part's uploads wait for it at a gate."""
    run_ranks(_failure_during_vote, str(tmp_path))
