"""Crash consistency under SIGKILL at named failpoints, and a full spool disk.

The kill test drives tests/trainer/crash_job.py (see its docstring): a real 2-rank DMP trainer with the
cpu-ssd-remote tiers (spool dir + local URI), merger workers and GC are killed with SIGKILL at
deck.failpoints points and restarted; every restart must restore the newest committed step
bitwise, finish or drop what the spool holds, and lose nothing committed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import crash_job
import pytest
import torch.distributed as dist

import deck
from deck import failpoints
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.errors import CheckpointError, SpoolError
from deck.read.catalog import read_manifests
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow
JOB = str(Path(__file__).with_name("crash_job.py"))


def test_failpoint_spec_parsing_and_enospc_action() -> None:
    assert failpoints.parse("a:3, b:2+:enospc,c") == {
        "a": (3, False, "kill"),
        "b": (2, True, "enospc"),
        "c": (1, False, "kill"),
    }
    for bad in ("a:0", "a:x", "a:1:explode", ":1", "a:1:kill:9"):
        with pytest.raises(ValueError):
            failpoints.parse(bad)
    try:
        failpoints.configure("p:2+:enospc")
        failpoints.failpoint("p")  # 1st hit: nothing
        for _ in range(2):  # 2nd and every later hit
            with pytest.raises(OSError) as e:
                failpoints.failpoint("p", "/x")
            assert e.value.errno == errno.ENOSPC and e.value.filename == "/x"
        failpoints.failpoint("other")
    finally:
        failpoints.configure(None)
    assert failpoints.armed() == []


# The plan of the process-mode run: "staging" in CI (each point a staging process passes, once;
# ~25 s), DECK_CRASH_PLAN=all for every point of the threads run
PROCESS_PLAN = os.environ.get("DECK_CRASH_PLAN", "staging")


@pytest.mark.parametrize(
    "mode,plan", [("threads", "all"), ("process", PROCESS_PLAN)], ids=["threads", "process"]
)
def test_sigkill_at_every_failpoint_then_restart(tmp_path: Path, mode: str, plan: str) -> None:
    """At least 50 distinct (point, nth) kills across trainer ranks, merger workers and GC; all
    survived. The counts go to docs/reliability.md.

    ``process``: the trainers stage through a staging process per rank
    (``StagingConfig(mode="process")``) and are killed at each point that process passes (20
    points, plan "staging"): the kill is hit in the staging process (its marker says so),
    which kills its training process first, so the rank dies at that moment as with threads;
    the same restarts, recoveries and bitwise restores are checked."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(failpoints.ENV, None)
    env.pop("DECK_STAGING_MODE", None)
    proc = subprocess.run(
        [sys.executable, JOB, str(tmp_path), mode, plan],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results_file = tmp_path / "results.json"
    assert results_file.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(results_file.read_text())
    assert res["ok"], res.get("error", "")[-6000:]
    kills = set(res["kills"])
    print(
        f"\ncrash points ({mode}, plan {plan}): {len(kills)} distinct kills survived "
        f"({sum(k.startswith('trainer') for k in kills)} trainer, of them "
        f"{len(res['staging_kills'])} hit in a staging process, "
        f"{sum(k.startswith('merger') for k in kills)} merger, "
        f"{sum(k.startswith('gc') for k in kills)} gc); not reached: {res['not_reached']}; "
        f"{res['restarts_checked']} restarts checked, {res['recovered_parts']} spooled parts "
        f"recovered; {res['seconds']:.0f} s"
    )
    assert res["mode"] == mode
    assert len(kills) == len(res["kills"])  # each point armed once
    # Every armed point fires: each is reached on every run, whatever the timing (the recovery
    # points follow kills that always leave a part in the spool; see crash_job.TRAINER_POINTS).
    assert not res["not_reached"], res["not_reached"]
    assert res["recovered_parts"] > 0
    assert res["restarts_checked"] >= crash_job.restarts_always_checked(plan)
    staged = {k.split(":")[1] for k in res["staging_kills"]}
    if mode == "threads":
        assert not staged
    else:  # every point the staging process passes was killed there, and only those
        assert staged == crash_job.STAGING_POINTS, sorted(staged ^ crash_job.STAGING_POINTS)
    if plan == "all":
        assert len(kills) >= 50, sorted(kills)


# ---- disk full on the spool ----------------------------------------------------------------------

SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _try_tmpfs(path: Path, size: str) -> bool:
    """Mount a small tmpfs (needs root); False where that is not allowed."""
    path.mkdir()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            timeout=10,
        )
        return r.returncode == 0
    return False


def _fill(path: str) -> None:
    """Fill the filesystem of ``path`` until it reports ENOSPC."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # unbuffered: no flush on close
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def _spool_config(root: str, spool: str, release: str) -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=f"{root}/ck",
        delta_every_steps=1,
        lease_ttl_s=None,
        staging=deck.StagingConfig(
            chunk_bytes=4096,
            tiers="cpu-ssd-remote",
            spool_dir=spool,
            retry_initial_s=0.05,
            release=release,
            commit_timeout_s=3600,  # a flush that waited for a failed part would not return
        ),
    )


def _committed_verify_and_restore(
    rank: int, config: deck.DeckConfig, spool: str, live: dict, parents: dict[int, int | None]
) -> None:
    """Exactly the steps of ``parents`` are committed (with those parents), verify, restore
    bitwise; the failed attempts' spool files are gone."""
    storage = LocalStorage(config.uri)
    manifests = read_manifests(storage)
    assert {s: m.parent for s, m in manifests.items()} == parents
    assert all(not verify_checkpoint(storage, m).problems for m in manifests.values())
    leftovers = [os.path.join(d, f) for d, _, fs in os.walk(spool) for f in fs]
    assert not leftovers, leftovers
    for step in sorted(parents)[1:]:
        model2, opt2 = build_model(SPEC, seed=7 + step)
        user2 = TrainState()
        with deck.DeltaCheckpointer(model2, [opt2], config, state=user2) as ck2:
            assert ck2.restore(step) == step
        bad = diff_states(live[step], capture_state(model2, opt2, user2))
        assert not bad, f"rank {rank} step {step}: {bad[:5]}"


def _spool_full(rank: int, world_size: int, root: str, spool: str, real: bool) -> None:
    """release="first_tier": the failed writes fail ``ck.step`` on every rank."""
    config = _spool_config(root, spool, "first_tier")
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    errors: dict[int, CheckpointError] = {}
    ballast = os.path.join(spool, "ballast")
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        for step in range(5):
            if step:
                user.losses.append(train_step(model, opt, SPEC, step))
                user.step = step
            live[step] = capture_state(model, opt, user)
            if step == 1:  # the spool's disk is full for this checkpoint
                ck.flush()
                if real and rank == 0:
                    _fill(ballast)
                dist.barrier()
                if not real and rank == 1:
                    failpoints.configure("stager.spool.write:1:enospc")
            if step == 3 and rank == 0:  # ... and for the pending record of this one
                failpoints.configure("stager.pending.write:1:enospc")
            try:
                ck.step(step)
            except CheckpointError as e:
                errors[step] = e
            failpoints.configure(None)
            if step == 1:
                dist.barrier()
                if real and rank == 0:
                    os.remove(ballast)
                dist.barrier()
        ck.flush()
        history = {h.step: (h.kind, h.state) for h in ck.history}

    assert sorted(errors) == [1, 3], errors
    mine = {1} if real or rank == 1 else set()
    if rank == 0:
        mine.add(3)
    for step in mine:  # the rank whose write failed says where and what
        e = errors[step]
        assert isinstance(e.__cause__, SpoolError), repr(e.__cause__)
        text = str(e)
        assert f"step {step}" in text and "No space left on device" in text, text
        assert os.path.realpath(spool) in os.path.realpath(text.split("spool ")[1].split(":")[0])
    for step in {1, 3} - mine:
        assert "not committed" in str(errors[step]) and f"step {step}" in str(errors[step])
    # Training went on; the skipped steps' rows went into the next deltas.
    done = "committed" if rank == 0 else "uploaded"
    assert history == {0: ("full", done), 2: ("delta", done), 4: ("delta", done)}, history
    _committed_verify_and_restore(rank, config, spool, live, {0: None, 2: 0, 4: 2})


def _spool_full_after_release(
    rank: int, world_size: int, root: str, spool: str, real: bool
) -> None:
    """release="in_memory": training was given back before the writes failed. ``ck.step``
    returns; the failed step is never committed, rank 0 learns it at once (the failed rank's
    failure record) or at the next collective (when even that record cannot be written) instead
    of waiting ``commit_timeout_s``, and the next checkpoint is a full. The full disk is
    always the failpoint's (``real`` is False)."""
    assert not real
    config = _spool_config(root, spool, "in_memory")
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        for step in range(5):
            if step:
                user.losses.append(train_step(model, opt, SPEC, step))
                user.step = step
            live[step] = capture_state(model, opt, user)
            if step in (1, 3):
                # Nothing of the steps before is still being written when the point is armed:
                # its first hit is this step's.
                ck.flush()
            if step == 1 and rank == 1:  # its spool's disk is full for this checkpoint
                failpoints.configure("stager.spool.write:1:enospc")
            if step == 3 and rank == 1:  # its pending record, and the failure record too
                failpoints.configure(
                    "stager.pending.write:1:enospc,stager.failure_record.put:1:enospc"
                )
            assert ck.step(step) is not None  # training goes on: nothing raised here
            if step in (1, 3):
                # Returns (rank 0 did not wait for the failed part), saying it did not commit.
                assert not ck.flush(timeout=600)
            failpoints.configure(None)
        ck.flush()
        history = {h.step: (h.kind, h.state) for h in ck.history}
        failures = {h.step: h.error or "" for h in ck.history if h.state == "failed"}

    done = "committed" if rank == 0 else "uploaded"
    assert history == {
        0: ("full", done),
        1: ("delta", "failed"),
        2: ("full", done),  # the failed part broke the chain: a full follows
        3: ("delta", "failed"),
        4: ("full", done),
    }, history
    # Step 1: rank 1's failure record told rank 0 what failed.
    assert "No space left on device" in failures[1] and "step 1" in failures[1], failures
    if rank == 0:  # step 3: no record could be written; the flush's collective told rank 0
        assert "rank 1's part failed" in failures[3], failures
    # Fulls after each failure: nothing builds on the failed steps.
    _committed_verify_and_restore(rank, config, spool, live, {0: None, 2: None, 4: None})


@pytest.mark.parametrize("release", ["first_tier", "in_memory"])
def test_spool_disk_full(tmp_path: Path, release: str) -> None:
    """ENOSPC on the spool: the checkpoint fails with a SpoolError naming the spool dir and step,
    nothing committed is touched, training goes on. With release="first_tier" ``ck.step`` raises
    and the next delta carries the rows; with "in_memory" (the default) the step fails in the
    background, rank 0 stops waiting for it, and the next checkpoint is a full.

    How the full disk is produced: where this process may mount (root), the spool is a real
    1 MiB tmpfs that the test fills with a ballast file, so the kernel returns ENOSPC to the
    real spool write of step 1 on both ranks. Elsewhere (CI without root) the
    ``stager.spool.write:1:enospc`` failpoint raises OSError(ENOSPC) at that same write, between
    its open() and write(), on rank 1. Step 3's ENOSPC (rank 0's pending record) always comes
    from the ``stager.pending.write`` failpoint."""
    spool = tmp_path / "spool"
    # Released early, a real full disk is not deterministic: a rank's failed part is cleaned up
    # in the background, which may free room for the other rank's write still running. The
    # failpoint fails exactly rank 1's write.
    real = release == "first_tier" and _try_tmpfs(spool, "1m")
    try:
        fn = _spool_full if release == "first_tier" else _spool_full_after_release
        run_ranks(fn, str(tmp_path), str(spool), real)
    finally:
        if real:
            subprocess.run(["umount", str(spool)], check=False)
    print(f"\nspool disk full produced by {'a real full tmpfs' if real else 'the failpoint'}")
