"""A job that checkpoints faster than its first tier writes waits instead of building a backlog
(a break-it finding: with a delta every step the parts still only in memory grew to ~200
checkpoints, and a kill lost all of them while ``release="in_memory"`` promised the one being
written). At most ``staging.max_unwritten`` checkpoints of a rank are only in memory: the next
one first waits for the oldest to be written, says so once, and what is saved restores bitwise.

The first tier is held deterministically: the local tier's writer thread is kept busy until the
training thread has waited once without result (the spy on ``PartProgress.wait_in_first_tier``
opens it at its second call), so the checkpoints before are certainly unwritten when the cap is
reached, and the wait that cannot end says so.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import deck
from deck import failpoints
from deck.demo import ModelSpec, build_model, capture_state, diff_states, train_step
from deck.testing.dist_harness import run_ranks
from deck.trainer import chain
from deck.trainer.staging.records import PartProgress

SPEC = ModelSpec(num_tables=2, rows=300, dim=8, batch=16, sharding="table_wise")
CAP = 2
STEPS = 6


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(
        uri=root,
        delta_every_steps=1,
        staging=deck.StagingConfig(mode="threads", max_unwritten=CAP),
    )
    gate = threading.Event()
    at: dict[str, Any] = {"step": None, "waits": []}
    original = PartProgress.wait_in_first_tier

    def spy(self: PartProgress, timeout: float | None = None) -> bool:
        at["waits"].append(at["step"])
        if len(at["waits"]) == 2:  # the first wait ran out (and said so): now it may write
            gate.set()
        return original(self, timeout)

    PartProgress.wait_in_first_tier = spy  # type: ignore[method-assign]
    chain.BACKLOG_SAY_S = 0.01  # a wait that cannot end (the writer is held) says so at once
    said = _Said()
    logging.getLogger("deck").addHandler(said)
    model, opt = build_model(SPEC)
    stats = []
    with deck.enable(model, [opt], config) as ck:
        ck._ckpt.stager._writer.submit(gate.wait)  # the first tier's writer, held
        for step in range(STEPS):
            train_step(model, opt, SPEC, step)
            at["step"] = step
            stats.append(ck.step(step))
            if step < CAP:
                assert not gate.is_set() and at["waits"] == [], (step, at["waits"])
        gate.set()  # (opened by the first wait; else the assertions below fail, not hang)
        assert ck.flush()
        final = capture_state(model, opt)
    # The first wait was the checkpoint after CAP unwritten ones; no checkpoint before it waited
    assert at["waits"][:1] == [CAP], at["waits"]
    assert [s.backlog_wait_s > 0 for s in stats[: CAP + 1]] == [False] * CAP + [True]
    assert all(s.state == "committed" for s in stats) or rank != 0, [s.state for s in stats]
    backlog = [m for m in said.lines if "staging.max_unwritten" in m]
    assert len(backlog) == 1, said.lines  # said once, whatever the waits after
    assert f"step {CAP} at {root} waited" in backlog[0], backlog[0]
    # A wait that lasts is said while it lasts (a break-it finding: a stopped staging process
    # held training here without a word)
    waiting = [m for m in said.lines if "has waited" in m]
    assert waiting and f"step {CAP} at {root} has waited" in waiting[0], said.lines
    assert "stopped or hung staging process" in waiting[0], waiting[0]

    fresh, fresh_opt = build_model(SPEC, seed=7)
    with deck.enable(fresh, [fresh_opt], config) as ck:
        assert ck.restore() == STEPS - 1
        assert not diff_states(final, capture_state(fresh, fresh_opt))


def test_a_checkpoint_waits_for_the_unwritten_ones_before_it(tmp_path: Path) -> None:
    run_ranks(_rank, str(tmp_path / "ckpt"), world_size=1)


def _rank_failed(rank: int, world_size: int, root: str) -> None:
    config = deck.DeckConfig(
        uri=root,
        delta_every_steps=1,
        staging=deck.StagingConfig(mode="threads", max_unwritten=1),
    )
    gate = threading.Event()
    original = PartProgress.wait_in_first_tier

    def spy(self: PartProgress, timeout: float | None = None) -> bool:
        gate.set()  # the next checkpoint waits for the first: now its write may fail
        return original(self, timeout)

    PartProgress.wait_in_first_tier = spy  # type: ignore[method-assign]
    said = _Said()
    logging.getLogger("deck").addHandler(said)
    model, opt = build_model(SPEC)
    failpoints.configure("stager.spool.before_write:1:enospc")
    try:
        with deck.enable(model, [opt], config) as ck:
            ck._ckpt.stager._writer.submit(gate.wait)  # the first tier's writer, held
            train_step(model, opt, SPEC, 0)
            first = ck.step(0)
            train_step(model, opt, SPEC, 1)
            ck.step(1)
            assert first is not None and first.state == "failed", first
            ck.flush()
    finally:
        failpoints.configure(None)
    # The wait ended on a failed part: its error is said with it, not blamed on the rate
    assert not [m for m in said.lines if "staging.max_unwritten" in m], said.lines


def test_a_wait_that_ends_on_a_failed_part_does_not_blame_the_checkpoint_rate(
    tmp_path: Path,
) -> None:
    run_ranks(_rank_failed, str(tmp_path / "ckpt"), world_size=1)


def _rank_outage(rank: int, world_size: int, root: str) -> None:
    """The remote store is down (every upload held) for more checkpoints than the upload slots
    and the backlog cap together: each part still reaches the first tier (the spool) at once,
    training never waits for the store, and everything commits once it is back."""
    from deck.trainer.staging.committer import PARTS_IN_FLIGHT, Committer

    config = deck.DeckConfig(
        uri=f"{root}/ckpt",
        delta_every_steps=1,
        staging=deck.StagingConfig(
            mode="threads", tiers="cpu-ssd-remote", spool_dir=f"{root}/spool", max_unwritten=CAP
        ),
    )
    down = threading.Event()
    down.set()
    back = threading.Event()
    upload = Committer._upload

    def outage(self: Committer, p: Any) -> None:
        if down.is_set():
            back.wait()
        upload(self, p)

    stuck: list[int | None] = []
    original = PartProgress.wait_in_first_tier

    def spy(self: PartProgress, timeout: float | None = None) -> bool:
        done = original(self, timeout)
        if not done:  # the backlog's wait ran out: the old behaviour (not a hang: open it)
            stuck.append(at[0])
            back.set()
        return done

    Committer._upload = outage  # type: ignore[method-assign]
    PartProgress.wait_in_first_tier = spy  # type: ignore[method-assign]
    chain.BACKLOG_SAY_S = 60.0  # (a spool write of these parts takes milliseconds)
    at: list[int | None] = [None]
    steps = PARTS_IN_FLIGHT + 2 * CAP + 2
    model, opt = build_model(SPEC)
    stats = []
    with deck.enable(model, [opt], config) as ck:
        for step in range(steps):
            train_step(model, opt, SPEC, step)
            at[0] = step
            stats.append(ck.step(step))
        for s in stats:  # every part in the spool, none uploaded: the store is still down
            assert s is not None and s.progress.wait_in_first_tier(60), (s, stuck)
        assert not stuck, stuck
        assert not back.is_set() and all(s.state == "durable" for s in stats), stats
        down.clear()
        back.set()  # the store is back
        assert ck.flush()
        final = capture_state(model, opt)
    assert all(s.state == "committed" for s in stats) or rank != 0, [s.state for s in stats]
    fresh, fresh_opt = build_model(SPEC, seed=7)
    with deck.enable(fresh, [fresh_opt], config) as ck:
        assert ck.restore() == steps - 1
        assert not diff_states(final, capture_state(fresh, fresh_opt))


def test_an_outage_of_the_store_keeps_parts_going_to_the_spool(tmp_path: Path) -> None:
    """A break-it finding: with the store down, the parts whose uploads held every upload slot
    kept the next ones from being fsynced, so after max_unwritten more checkpoints training
    waited for the whole outage (told to checkpoint less often)."""
    run_ranks(_rank_outage, str(tmp_path), world_size=2)
