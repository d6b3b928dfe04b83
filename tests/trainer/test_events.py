"""Watching checkpoints: one event per checkpoint and rank to ``on_checkpoint``, one INFO line
per commit, ``wait_for(step)``; and the TensorBoard example of docs/examples, run as a user runs
it (torchrun, 2 ranks)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

import deck
from deck import failpoints
from deck.demo import ModelSpec, build_model, train_step
from deck.testing.dist_harness import run_ranks
from deck.testing.examples import run_example
from deck.units import human_bytes

pytestmark = pytest.mark.slow

SPEC = ModelSpec(num_tables=2, rows=1000, dim=8, batch=32)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _events(rank: int, world_size: int, uri: str) -> None:
    lines = _Lines()
    logging.getLogger("deck").addHandler(lines)
    logging.getLogger("deck").setLevel(logging.DEBUG)
    model, opt = build_model(SPEC)
    events: list[deck.CheckpointEvent] = []
    config = deck.DeckConfig(uri=uri, delta_every_steps=3)
    with deck.enable(model, [opt], config, on_checkpoint=events.append) as ckpt:
        for step in range(1, 10):
            train_step(model, opt, SPEC, step)
            ckpt.step(step)
            if step == 6:
                # Rank 0's event says committed: any process finds the step, before any flush.
                done = ckpt.wait_for(6, timeout=120)
                if rank == 0:
                    assert done.state == "committed" and done.committed_s is not None, done
                    assert 6 in [c.step for c in deck.list_checkpoints(uri)]
                else:
                    assert done.state == "uploaded", done
        assert ckpt.flush()
        history = {s.step: s for s in ckpt.history}
        with pytest.raises(
            deck.CheckpointNotFoundError, match=r"no checkpoint of step 4 .*steps 3, 6, 9"
        ):
            ckpt.wait_for(4)

        # A callback that raises is logged; checkpointing goes on.
        ckpt.on_checkpoint = _raises
        train_step(model, opt, SPEC, 10)
        ckpt.save("delta", step=10)
        assert ckpt.flush()
        assert ckpt.wait_for(10).ok
        assert any("on_checkpoint callback raised" in r.getMessage() for r in lines.records)

        # A callback that blocks holds up neither training nor the next commit: events wait
        # on their own thread, and flush() returns once they are delivered.
        gate, seen = threading.Event(), []

        def blocked(e: deck.CheckpointEvent) -> None:
            gate.wait()
            seen.append(e.step)

        ckpt.on_checkpoint = blocked
        for step in (12, 13):
            train_step(model, opt, SPEC, step)
            ckpt.save("delta", step=step)
        assert ckpt.wait_for(13, timeout=120).ok  # the commit went on past the blocked callback
        assert seen == []
        gate.set()
        assert ckpt.flush() and seen == [12, 13]
        with pytest.raises(deck.ConfigError, match="on_checkpoint must be a callable"):
            ckpt.on_checkpoint = 42  # type: ignore[assignment]
        with pytest.raises(deck.ConfigError, match="timeout"):
            ckpt.wait_for(13, timeout=-1)

        # A checkpoint that fails in the background: a failed event, and wait_for raises.
        ckpt.on_checkpoint = events.append
        if rank == 0:
            failpoints.configure("stager.commit.before:1:enospc")
        train_step(model, opt, SPEC, 14)
        ckpt.save("delta", step=14)
        assert not ckpt.flush()
        failpoints.configure(None)
        if rank == 0:
            with pytest.raises(deck.CheckpointError, match=r"step 14 .* failed"):
                ckpt.wait_for(14)

    assert [(e.step, e.kind) for e in events] == [
        (3, "full"),
        (6, "delta"),
        (9, "delta"),
        (14, "delta"),
    ], events
    for e in events[:3]:
        s = history[e.step]
        assert (e.rank, e.chain, e.uri, e.id) == (rank, "checkpoint", uri, s.id)
        assert (e.rows, e.bytes, e.stall_s) == (s.rows, s.bytes, s.stall_s) and e.rows > 0
        assert e.state == ("committed" if rank == 0 else "uploaded"), e
        assert set(e.scalars()) >= {"deck/checkpoint/stall_s", "deck/checkpoint/committed_s"}
    assert events[3].state == ("failed" if rank == 0 else "uploaded"), events[3]
    # One INFO line per commit, on rank 0 only; no other INFO line per checkpoint.
    info = [r.getMessage() for r in lines.records if r.levelno == logging.INFO]
    per_step = [m for m in info if " step " in m and "checkpoint" in m]
    if rank == 0:
        assert [m.split(" step ")[1].split()[0] for m in per_step] == [
            "3",
            "6",
            "9",
            "10",
            "12",
            "13",
        ], info
        assert "committed at" in per_step[0] and "rows" in per_step[0], per_step
        # Its size as deck ls prints it (deck.units.human_bytes), not always in MiB
        assert f" rows, {human_bytes(events[0].bytes)}, stall " in per_step[0], per_step
    else:
        assert per_step == [], per_step
    dist.barrier()


def _raises(event: deck.CheckpointEvent) -> None:
    raise RuntimeError(f"user bug at step {event.step}")


def test_events_callback_log_lines_and_wait_for(tmp_path: Path) -> None:
    run_ranks(_events, str(tmp_path / "ckpt"))


def test_tensorboard_example(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    run = run_example("tensorboard_checkpoints.py", str(tmp_path / "ckpt"), str(tb))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    stall = acc.Scalars("deck/checkpoint/stall_s")
    assert [p.step for p in stall] == [5, 10, 15, 20, 25, 30]
    assert all(0 < p.value < 60 for p in stall)
    assert [p.step for p in acc.Scalars("deck/checkpoint/rows")] == [5, 10, 15, 20, 25, 30]
