"""The staging process (``StagingConfig(mode="process")``): its checkpoints restore bitwise in
every tier, a staging process that dies fails the next checkpoint on every rank (naming its
step), a new one starts and the checkpoint after is a full; a training process killed with -9
leaves no staging process behind. Real TorchRec DMP models over gloo, real files; the death
comes from a failpoint in the staging process, never from timing."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import crash_job
import pytest
import torch.distributed as dist

import deck
from deck import failpoints
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.errors import CheckpointError, ConfigError, DeckError
from deck.format.manifest import rank_failure_name, rank_manifest_name, step_dir
from deck.read.catalog import read_manifests
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.procfs import exited, process_state
from deck.testing.staging import full_part_info
from deck.trainer.staging import CheckpointStats, remote
from deck.trainer.staging.remote import CLOSE_S, ProcessStager, Reopen

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _config(root: str, tiers: str = "local", **staging: Any) -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=f"{root}/ck",
        delta_every_steps=1,
        lease_ttl_s=None,
        staging=deck.StagingConfig(
            mode="process",
            chunk_bytes=4096,
            tiers=tiers,  # type: ignore[arg-type]
            spool_dir=f"{root}/spool",
            **staging,
        ),
    )


def _train(model: Any, opt: Any, user: TrainState, step: int) -> dict[str, Any]:
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


# ---- every tier, every release ------------------------------------------------------------------


def _tiers(rank: int, world_size: int, root: str, tiers: str, release: str, cow: str) -> None:
    config = _config(root, tiers, release=release, copy_on_write=cow)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        assert ck.stager.pid is not None  # type: ignore[union-attr]
        for step in range(5):
            live[step] = _train(model, opt, user, step)
            assert ck.step(step) is not None
        assert ck.flush(timeout=120)
        want = "committed" if rank == 0 else "uploaded"
        assert [(h.kind, h.state) for h in ck.history] == [("full", want)] + [("delta", want)] * 4
    dist.barrier()
    _restores_bitwise(config, live, list(range(5)))


@pytest.mark.parametrize(
    "tiers,release,cow",
    [
        ("local", "in_memory", "deltas"),
        ("local", "first_tier", "off"),
        ("cpu-ssd-remote", "in_memory", "all"),
        ("cpu-remote", "in_memory", "off"),
    ],
)
def test_parts_staged_by_a_process_restore_bitwise(
    tmp_path: Path, tiers: str, release: str, cow: str
) -> None:
    run_ranks(_tiers, str(tmp_path), tiers, release, cow)


# ---- a staging process that dies -----------------------------------------------------------------


def _dies(rank: int, world_size: int, root: str) -> None:
    config = _config(root, "cpu-ssd-remote")
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        for step in range(2):
            live[step] = _train(model, opt, user, step)
            ck.step(step)
        assert ck.flush(timeout=120)
        first = ck.stager.pid  # type: ignore[union-attr]
        if rank == 1:
            # Rank 1's staging process dies alone, writing step 2's first file
            failpoints.configure("stager.spool.before_write:1:kill-self")
        live[2] = _train(model, opt, user, 2)
        assert ck.step(2) is not None  # staged: the death comes after, in the background
        if rank == 1:
            deadline = time.monotonic() + 120
            while ck.stager.dead is None:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the staging process did not die"
                time.sleep(0.01)
            failpoints.configure(None)
        dist.barrier()
        live[3] = _train(model, opt, user, 3)
        with pytest.raises(CheckpointError) as e:
            ck.step(3)
        assert "step 3" in str(e.value) and "rank(s) [1]" in str(e.value), e.value
        if rank == 1:
            assert "staging process" in str(e.value) and "died" in str(e.value), e.value
            assert ck.stager.pid != first  # type: ignore[union-attr]
            with pytest.raises(ProcessLookupError):
                os.kill(first, 0)  # reaped
        live[4] = _train(model, opt, user, 4)
        stats = ck.step(4)
        assert stats is not None and stats.kind == "full"
        assert not ck.flush(timeout=120)  # step 2 failed since the last flush
        states = {h.step: h.state for h in ck.history}
        assert states[2] == "failed" and states[4] in ("committed", "uploaded"), states
    dist.barrier()
    committed = sorted(read_manifests(LocalStorage(f"{root}/ck")))
    assert committed == [0, 1, 4], committed
    _restores_bitwise(config, live, [1, 4])


def test_a_dead_staging_process_fails_the_next_checkpoint_on_every_rank(tmp_path: Path) -> None:
    run_ranks(_dies, str(tmp_path))


def _rank0_stops_waiting(rank: int, world_size: int, root: str) -> None:
    # (Without the record rank 0 gives up after 90 s: the test fails at 45 s, not hangs)
    config = _config(root, "cpu-ssd-remote", commit_timeout_s=90)
    model, opt = build_model(SPEC)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        ck.step(0)
        assert ck.flush(timeout=120)
        if rank == 1:
            failpoints.configure("stager.spool.before_write:1:kill-self")
        _train(model, opt, user, 1)
        assert ck.step(1) is not None
        # No collective of deck's from here until rank 0 gave step 1 up
        deadline = time.monotonic() + 45
        states: dict[int, str] = {}
        done = ("failed", "committed" if rank == 0 else "uploaded")  # where the part ends
        while states.get(1) not in done:
            assert time.monotonic() < deadline, f"rank {rank}: step 1 still {states.get(1)}"
            time.sleep(0.05)
            states = {h.step: h.state for h in ck.history}
        failpoints.configure(None)
        assert states[1] == "failed", states
        errors = {h.step: h.error or "" for h in ck.history}
        if rank == 0:  # the failure record rank 1's training process wrote says why
            assert "rank 1" in errors[1] and "staging process" in errors[1], errors
        dist.barrier()
        with pytest.raises(CheckpointError):
            ck.step(2)
        stats = ck.step(3)
        assert stats is not None and stats.kind == "full"
        assert not ck.flush(timeout=120)
    dist.barrier()
    assert sorted(read_manifests(LocalStorage(f"{root}/ck"))) == [0, 3]


def test_rank_0_stops_waiting_for_a_part_whose_staging_process_died(tmp_path: Path) -> None:
    """Found by the kill-self test below: a staging process of rank 1 that died with a part in
    its hands left rank 0's commit of that step waiting until the next collective or
    ``commit_timeout_s``, where a part failing with staging threads writes a
    failure record that stops rank 0 at once. Rank 1's training process now writes that record
    for each part the dead process held (best effort, as the staging threads do): rank 0 gives
    the step up at once, naming rank 1's dead staging process, with no collective between.
    Both ways it can go are covered: the process dying after the part was handed on (the
    death handler writes the record) and while its files were still being sent, before the
    hand-over (a cold pool sends them during the stall; the hand-over that finds it dead
    writes it: the first version of the fix missed this one, seen on a loaded machine; both
    made to happen in the test after this one)."""
    run_ranks(_rank0_stops_waiting, str(tmp_path))


@pytest.mark.parametrize("handed_on", [True, False], ids=["after_hand_over", "before_hand_over"])
def test_a_dead_staging_process_of_rank_1_leaves_a_failure_record(
    tmp_path: Path, handed_on: bool
) -> None:
    """The fix pinned above, both ways the death can meet a part, each made to happen (not
    left to timing): rank 1's staging process killed after its part was handed on (the death
    handler writes the record) and before (the hand-over finds it dead and writes it; the first
    version of the fix missed this one: on a loaded machine the process died writing files sent
    during the stall, before the hand-over). A part whose rank manifest is up gets none."""
    uri = str(tmp_path / "ck")
    stager = ProcessStager(
        LocalStorage(uri), deck.StagingConfig(mode="process", tiers="local"), 1, Reopen(uri, {})
    )
    try:
        for step, manifest_up in ((1, False), (2, True)):
            info = full_part_info(uri, step, f"{step:016x}", rank=1, world_size=2)
            folder = tmp_path / "ck" / step_dir(step) / info.ckpt_id
            if manifest_up:  # (as if the part had gone up just before the death)
                folder.mkdir(parents=True)
                (folder / rank_manifest_name(1)).write_bytes(b"{}")
            staged = stager.begin(info, reserved=0)
            stats = CheckpointStats(step=step, kind="full", id=info.ckpt_id)
            if handed_on:
                stager.enqueue(staged, stats)
            pid = stager.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while stager.dead is None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if not handed_on:
                stager.enqueue(staged, stats)
            assert stats.progress.wait(60), stats  # (the death handler ends it)
            record = folder / rank_failure_name(1)  # (written before the part is failed)
            if manifest_up and handed_on:  # its work done: reported done (its news died with it)
                assert stats.state == "uploaded" and stats.error is None, stats
            else:  # (not handed on: none of it can have gone up but in this test's fake)
                assert stats.state == "failed" and "died" in (stats.error or ""), stats
            if manifest_up:
                assert not record.exists()
            else:
                text = record.read_text()
                assert text.startswith("rank 1: ") and "staging process" in text, text
            with pytest.raises(DeckError, match=f"step {step + 10}"):  # a new one starts
                stager.begin(full_part_info(uri, step + 10, "f" * 16, 1, 2), reserved=0)
    finally:
        stager.close()


def test_a_death_found_by_a_send_fails_one_checkpoint_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a user trying to break it: a staging process killed just before a checkpoint
    failed it with "is gone ([Errno 32] Broken pipe)" when the send found it dead before its
    receiver did, and then the next checkpoint failed too (only a death the receiver had
    recorded started a new process); and parts failed by the death said "not committed: None"
    when the next checkpoint's new process cleared the reason meanwhile. Whichever sees the
    death first, one checkpoint fails naming why it died, a new process starts, the next one
    goes on; every part in the dead one's hands says why."""
    uri = str(tmp_path / "ck")
    stager = ProcessStager(
        LocalStorage(uri), deck.StagingConfig(mode="process", tiers="local"), 1, Reopen(uri, {})
    )
    try:
        parts = []
        for step in (1, 2, 3):
            info = full_part_info(uri, step, f"{step:016x}", rank=1, world_size=2)
            stats = CheckpointStats(step=step, kind="full", id=info.ckpt_id)
            stager.enqueue(stager.begin(info, reserved=0), stats)
            parts.append(stats)
        pid = stager.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not exited(pid):  # its socket closed; the receiver may not have seen it yet
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(DeckError, match=r"step 10 on rank 1: .*died \(signal 9"):
            stager.begin(full_part_info(uri, 10, "a" * 16, 1, 2), reserved=0)
        assert stager.pid not in (None, pid)
        stager.begin(full_part_info(uri, 11, "b" * 16, 1, 2), reserved=0)  # goes on
        for stats in parts:
            assert stats.progress.wait(60), stats
            assert stats.state == "failed" and "died (signal 9" in (stats.error or ""), stats
        # The steps it took with it are named where its death is said (a break-it finding)
        said = [r.getMessage() for r in caplog.records if "died (signal 9" in r.getMessage()]
        assert len(said) == 1 and "step(s) 1, 2, 3 in its hands are not committed" in said[0]
    finally:
        stager.close()


@pytest.mark.parametrize("seen", [True, False], ids=["death-seen", "death-unseen"])
def test_buffers_sent_to_a_dead_staging_process_go_back_to_the_pool(
    tmp_path: Path, seen: bool
) -> None:
    """A break-it finding: with a small pool, a rank whose staging process was killed hung in
    close() for ever: a copy-on-write copy's chunk buffers sent after the death was handled
    were never given back, and the copy waited for one. A send that finds the process dead
    raises and puts its buffers back, whether the receiver saw the death first or not."""
    uri = str(tmp_path / "ck")
    stager = ProcessStager(
        LocalStorage(uri), deck.StagingConfig(mode="process", tiers="local"), 1, Reopen(uri, {})
    )
    try:
        stager.begin(full_part_info(uri, 1, "a" * 16, rank=1, world_size=2), reserved=0)
        pid = stager.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _until("the staging process exited", lambda: exited(pid))
        if seen:
            _until("the receiver saw the death", lambda: stager.dead is not None)
        before = stager.pool.in_use
        bufs = [stager.pool.acquire(), stager.pool.acquire()]
        body = {"part": 1, "rel": "x.chunk", "nbytes": 0, "specs": []}
        with pytest.raises(DeckError, match="staging process"):
            stager.send_parts([(remote.Kind.FILE, body, [], b) for b in bufs])
        assert stager.pool.in_use == before
    finally:
        stager.close()


def _until(what: str, done: Any) -> None:
    """Wait for ``done()``, which a stopped process makes certain (the bound only guards a
    regression from hanging the suite)."""
    deadline = time.monotonic() + 120
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_stopped_staging_process_neither_holds_a_timed_flush_nor_a_silent_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a staging process that stopped reading its socket (SIGSTOP, as a
    hung one) held ``flush(timeout)`` in the send, past its limit, and ``close()`` without a
    word. The timed request is sent aside and given up at its limit; close() says it waits."""
    uri = str(tmp_path / "ck")
    stager = ProcessStager(
        LocalStorage(uri), deck.StagingConfig(mode="process", tiers="local"), 1, Reopen(uri, {})
    )
    stager.failpoint_hits()  # it runs and answers
    pid = stager.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        # A message the stopped process cannot take: the socket fills and its sender holds
        # the channel, as checkpoints sent to a hung staging process do
        pad = threading.Thread(
            target=stager.tell, args=("failpoint_hits",), kwargs={"pad": "x" * (64 << 20)}
        )
        pad.start()
        chan = stager._chan
        assert chan is not None
        _until("the pad holds the channel", chan._lock.locked)
        got: list[bool] = []
        flushing = threading.Thread(target=lambda: got.append(stager.flush(0.5)), daemon=True)
        flushing.start()
        _until("flush(0.5) returns", lambda: not flushing.is_alive())
        assert got == [False]
        monkeypatch.setattr(remote, "CLOSE_SAY_S", 0.05)
        caplog.set_level(logging.WARNING, logger="deck")
        closing = threading.Thread(target=stager.close)
        closing.start()
        _until(
            "close() says it waits",
            lambda: any("close() has waited" in r.getMessage() for r in caplog.records),
        )
        assert closing.is_alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    pad.join(120)
    closing.join(120)
    assert not pad.is_alive() and not closing.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_staging_process_lowers_its_background_threads_once(tmp_path: Path) -> None:
    """Priorities as with staging threads: the spool writer, fsync, parts and records threads
    at ``background_nice``, the rest of the staging process at the training process's. It was
    niced whole as well, so its writer ran at 19 and a full's stall waited for its buffers (2.45
    s against 1.64 s in bench_stall)."""
    uri = str(tmp_path / "ck")
    cfg = deck.StagingConfig(mode="process", tiers="local", background_nice=5)
    stager = ProcessStager(LocalStorage(uri), cfg, 0, Reopen(uri, {}))
    try:
        stager.flush(timeout=60)  # (an answer: it is up, its Stager made)
        pid = stager.pid
        assert pid is not None
        mine = os.getpriority(os.PRIO_PROCESS, 0)

        def nice(tid: str) -> int:
            stat = process_state(pid, int(tid))
            if stat is None:  # (a thread that ended since the listing)
                return mine
            return int(stat.split()[16])  # (field 19: nice)

        assert nice(str(pid)) == mine  # its main thread: the training process's priority
        tasks = os.listdir(f"/proc/{pid}/task")
        assert all(nice(t) in (mine, min(19, mine + 5)) for t in tasks), [nice(t) for t in tasks]
    finally:
        stager.close()


# ---- killed alone at each of its failpoints ------------------------------------------------------

# Every failpoint named in deck's code (as tests/test_docs.py counts them)
ALL_POINTS = sorted(
    {
        m
        for f in Path(deck.__file__).parent.rglob("*.py")
        for m in re.findall(r"failpoint\(\s*\"([^\"]+)\"", f.read_text())
    }
)
UNREACHED = 10**9  # an nth no run reaches: armed only to count hits
EVERY_POINT = os.environ.get("DECK_STAGING_KILLS") == "all"


def _probe(ck: Any, model: Any, opt: Any, user: TrainState, live: dict, steps: range) -> set[str]:
    """Checkpoint ``steps`` with every point armed and never fired; the points this rank's
    staging process reached (asked from it), checked against the training process's."""
    failpoints.configure(",".join(f"{p}:{UNREACHED}" for p in ALL_POINTS))
    for step in steps:
        live[step] = _train(model, opt, user, step)
        assert ck.step(step) is not None
    assert ck.flush(timeout=120)
    staged = {p for p, n in ck.stager.failpoint_hits().items() if n}
    here = {p for p, n in failpoints.hits().items() if n}
    failpoints.configure(None)
    assert not staged & here, sorted(staged & here)  # each point is one process's
    return staged


def _killed_alone(
    rank: int, world_size: int, root: str, declared: list[str], every_point: bool
) -> None:
    config = _config(root, "cpu-ssd-remote", commit_timeout_s=120)
    model, opt = build_model(SPEC)
    user = TrainState()
    live: dict[int, Any] = {}
    every: list[Any] = [None] * world_size
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        # 1. Which points the staging processes pass (a full and two deltas): exactly those
        #    crash_job declares (STAGING_POINTS, STAGING_HOOKS), but the recovery point (a
        #    restart's)
        dist.all_gather_object(every, sorted(_probe(ck, model, opt, user, live, range(3))))
        reached = [set(x) for x in every]
        want = set(declared) - {"stager.recover.before_check"}
        assert set.union(*reached) == want, sorted(set.union(*reached) ^ want)
        # 2. Kill each rank's staging process alone at those points. The points only rank 0
        #    passes (the commit's) alone: rank 0 commits only once rank 1's part is up. The
        #    others two at once, one per rank (rank 1's never wait for rank 0).
        rounds: list[tuple[str | None, str | None]] = [
            (x, None) for x in sorted(reached[0] - reached[1])
        ]
        shared = sorted(reached[1])
        ones, zeros = shared[::2], [x for x in shared[1::2] if x in reached[0]]
        ones += [x for x in shared[1::2] if x not in reached[0]]
        pairs = [
            (zeros[i] if i < len(zeros) else None, ones[i] if i < len(ones) else None)
            for i in range(max(len(zeros), len(ones)))
        ]
        rounds += pairs if every_point else pairs[:1]
        step = 3
        outcome: dict[str | None, tuple[int, str]] = {}
        for pair in rounds:
            point = pair[rank]
            first = ck.stager.pid
            dist.all_gather_object(every, point)
            victims = [r for r, x in enumerate(every) if x is not None]
            if point is not None:  # (in the staging process alone: the training process
                # passes storage.local.write too once its staging process died)
                ck.stager.arm_failpoints(f"{point}:1:kill-self")
            live[step] = _train(model, opt, user, step)
            assert ck.step(step) is not None  # staged: the death comes after, in the background
            if point is not None:
                deadline = time.monotonic() + 120
                while ck.stager.dead is None:
                    assert time.monotonic() < deadline, f"{point} was not reached"
                    time.sleep(0.01)
            dist.barrier()
            # The next checkpoint raises on every rank, naming its step and the dead ranks
            live[step + 1] = _train(model, opt, user, step + 1)
            with pytest.raises(CheckpointError) as e:
                ck.step(step + 1)
            text = str(e.value)
            assert f"step {step + 1}" in text and f"rank(s) {victims}" in text, text
            if point is not None:
                assert "staging process" in text and "died" in text, text
                assert ck.stager.pid != first
                with pytest.raises(ProcessLookupError):
                    os.kill(first, 0)  # reaped
            # ... a new staging process takes the one after: a full
            live[step + 2] = _train(model, opt, user, step + 2)
            stats = ck.step(step + 2)
            assert stats is not None and stats.kind == "full", (point, stats)
            flushed = ck.flush(timeout=120)
            assert ck.stager.pool.in_use == 0  # every buffer lent to the dead process came back
            states = {h.step: h.state for h in ck.history}
            # The step in flight failed unless its part had gone up (rank 0: committed) before
            # the death, and flush() (a collective) says whether every rank's parts did
            done = ("committed", "uploaded")
            mine = all(states[s] in done for s in (step, step + 1, step + 2) if s in states)
            dist.all_gather_object(every, mine)
            assert flushed == all(every), (point, flushed, states, every)
            if point is not None:
                outcome[point] = (step, states[step])
            assert step + 1 not in states or states[step + 1] == "failed", states
            assert states[step + 2] in ("committed", "uploaded"), (point, states)
            step += 3
        # close() drains the (replaced) staging process within its bound and stops it
        last = ck.stager.pid
        t0 = time.monotonic()
        ck.close()
        assert time.monotonic() - t0 < CLOSE_S, time.monotonic() - t0
        assert last is not None and exited(last)
    dist.all_gather_object(every, outcome)
    if rank == 0:
        print(f"\nkilled alone at (rank: point -> the step in flight): {every}")
    # Nothing the training process did not hand over is committed (the refused steps); what
    # is committed restores bitwise: the steps in flight at a death (committed only where the
    # death came after the commit record) and each full after one
    committed = sorted(read_manifests(LocalStorage(f"{root}/ck")))
    # What a rank reports of the step in flight at its staging process's death is what
    # happened: rank 0's "committed" exactly where the step is committed, a "failed" part never
    # committed (found by a break-it run: a part that had gone up was reported failed)
    for r, seen in enumerate(every):
        for point, (at, state) in seen.items():
            if r == 0:
                assert (state == "committed") == (at in committed), (point, at, state)
            if state == "failed":
                assert at not in committed, (r, point, at)
    refused = set(range(4, step, 3))
    assert not refused & set(committed), committed
    fulls = set(range(5, step, 3))
    assert fulls <= set(committed), committed
    assert {0, 1, 2} <= set(committed), committed
    threads = config.model_copy(
        update={"staging": config.staging.model_copy(update={"mode": "threads"})}
    )
    # (each full after a death is the same code: the last one stands for them)
    _restores_bitwise(threads, live, [s for s in committed if s > 2 and s not in fulls])
    _restores_bitwise(threads, live, [max(fulls)])


def test_a_staging_process_killed_alone_at_each_of_its_points(tmp_path: Path) -> None:
    """Each rank's staging process is killed alone (``kill-self``) at each failpoint it passes,
    the two ranks' at two points at once (rank 0 alone passes the commit's): the checkpoint in
    flight fails, the next raises a CheckpointError naming its step and the dead ranks on every
    rank, a new staging process stages the one after as a full, the dead one's buffers come
    back to the pool, nothing refused is committed, and every committed step restores bitwise.
    CI kills at the commit's points and one pair of the others (5 of 20 points: each death
    costs a staging process's start, ~1.5 s on CI's 2 cores); ``DECK_STAGING_KILLS=all`` at
    every point (the crash test kills the rank at each of them in every CI run).
    The points are those the staging processes report reaching in a probe run
    (``ProcessStager.failpoint_hits``), checked against the crash test's lists
    (``crash_job.STAGING_POINTS``, ``STAGING_HOOKS``), so a point moving between the processes
    fails here."""
    declared = crash_job.STAGING_POINTS | crash_job.STAGING_HOOKS
    run_ranks(_killed_alone, str(tmp_path), sorted(declared), EVERY_POINT)


# ---- kill -9 of the training process -------------------------------------------------------------

# A 1-rank job with a staging process that took step 0 (the jobs below go on from there)
_STAGED_JOB = """
import os, sys, time
from deck.processes import init_process_group, rendezvous
import deck
from deck.demo import ModelSpec, build_model
init_process_group(0, 1, rendezvous())
model, opt = build_model(ModelSpec(num_tables=2, rows=400, dim=8, batch=32))
cfg = deck.DeckConfig(uri=sys.argv[1], lease_ttl_s=None,
                      staging=deck.StagingConfig(mode="process"))
ck = deck.enable(model, [opt], cfg)
ck.step(0)
"""
ORPHAN_JOB = (
    _STAGED_JOB
    + """
print("STAGER", ck.stager.pid, flush=True)
time.sleep(3600)
"""
)


def _staging_pid(job: subprocess.Popen[str]) -> int:
    """The staging process's pid, from the job's ``STAGER <pid>`` line."""
    assert job.stdout is not None
    line = ""
    for line in job.stdout:
        if line.startswith("STAGER"):
            break
    assert line.startswith("STAGER"), line
    return int(line.split()[1])


def test_a_training_process_killed_leaves_no_staging_process(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_JOB, str(tmp_path / "ck")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        child = _staging_pid(proc)
        assert not exited(child)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while not exited(child):
            assert time.monotonic() < deadline, f"staging process {child} outlived its trainer"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


INTERRUPTED_JOB = (
    _STAGED_JOB
    + """
try:  # (entered before the line the test waits for: the signal may come at once)
    print("STAGER", ck.stager.pid, flush=True)
    time.sleep(3600)
except KeyboardInterrupt:
    ck.close()
    print("COMMITTED", [c.step for c in deck.list_checkpoints(sys.argv[1])], flush=True)
"""
)


def test_a_ctrl_c_at_the_terminal_reaches_the_training_process_alone(tmp_path: Path) -> None:
    """A break-it finding: a terminal's Ctrl-C (SIGINT to the job's process group) killed the
    staging process too (a KeyboardInterrupt traceback in it), and the checkpoints it held were
    lost though the training process closed its checkpointer. The staging process is in a
    group of its own: the training process alone gets the signal, and its close commits."""
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_JOB, str(tmp_path / "ck")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # (the job's group, as a terminal's; pytest's is not in it)
    )
    try:
        child = _staging_pid(proc)
        assert os.getpgid(child) != os.getpgid(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stdout.read() if proc.stdout else ""
        assert proc.wait(120) == 0, rest
        assert "COMMITTED [0]" in rest and "Traceback" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_where_a_staging_process_cannot_open_the_destination_the_threads_do_it(
    tmp_path: Path,
) -> None:
    """The reasons logged at enable: a store passed as an object, a store only this process
    sees, and a publish sink registered without a way to open it again; a Kafka publisher's
    sink opens again (its reopener), so it runs in the staging process."""
    from deck import schemes
    from deck.config import PublishConfig, StagingConfig
    from deck.storage import open_storage
    from deck.trainer.staging import Reopen, process_unsupported

    cfg = StagingConfig(mode="process")
    store = open_storage(str(tmp_path / "store"))
    assert process_unsupported(cfg, store, Reopen(str(tmp_path / "store"), {}), False) is None
    assert "passed as an object" in str(process_unsupported(cfg, store, None, False))
    assert "only the training process sees" in str(
        process_unsupported(cfg, store, Reopen("memory://x", {}), False)
    )
    kafka = PublishConfig(uri="kafka://127.0.0.1:1/t", state_uri=str(tmp_path / "state"))
    reopen = Reopen(str(tmp_path / "state"), {}, kafka, 2, 5.0)
    assert process_unsupported(cfg, store, reopen, False) is None
    assert Reopen.from_json(reopen.to_json()) == reopen
    schemes.register(schemes.Scheme("onlyhere", lambda *a: None, role="publish"))
    try:
        mine = PublishConfig(uri="onlyhere://x/t", state_uri=str(tmp_path / "state"))
        why = process_unsupported(cfg, store, Reopen(str(tmp_path / "state"), {}, mine), False)
        assert why == "the publish sink of onlyhere://x/t runs in the training process"
        with pytest.raises(ConfigError, match="cannot be opened by a staging process"):
            schemes.lookup("onlyhere://x/t", "publish").reopen(mine, store, 1, 1.0)
    finally:
        schemes.unregister("onlyhere")


def test_storage_options_a_process_cannot_be_sent_keep_the_threads(tmp_path: Path) -> None:
    """A break-it finding: storage_options holding an object (a credentials session) made
    `enable` with staging.mode="process" fail with a bare TypeError and left a staging process
    behind. It is one of the reasons the threads stage instead (said at enable)."""
    from deck.storage import open_storage
    from deck.trainer.staging.remote import Reopen, process_unsupported

    uri = str(tmp_path / "ck")
    staging = deck.StagingConfig(mode="process")
    assert process_unsupported(staging, open_storage(uri), Reopen(uri, {}), False) is None
    why = process_unsupported(staging, open_storage(uri), Reopen(uri, {"s": object()}), False)
    assert why is not None and "storage_options cannot be sent to a process as JSON" in why
