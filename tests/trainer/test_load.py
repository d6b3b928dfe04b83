"""``deck.load``: a committed step into a fresh model, read only -- beside a running trainer that
holds the URI's writer lease, and through a store that refuses every write and delete (what a
read-only mount or bucket does) -- bitwise equal to the trainer's live state of that step. Real
2-rank TorchRec DMP models over gloo, real files."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from deck.adapters.torchrec_optim import fused_kernels

import deck
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleModelError,
)
from deck.storage import open_storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.differential import Setup, Table, UserState, build, train_phase
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage
from deck.trainer.load import load_step

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32, sharding="table_wise")


def _refusing(uri: str) -> FaultyStorage:
    def refuse(key: Any, n: int = 0) -> bool:
        return True

    return FaultyStorage(open_storage(uri), fail_put=refuse, fail_delete=refuse)


def _files(root: str) -> list[tuple[str, int, int]]:
    """Every file under ``root`` with its size and mtime, but the lease the trainer renews."""
    out = []
    for d, _, names in os.walk(root):
        for name in names:
            path = os.path.join(d, name)
            if "_lease" not in os.path.relpath(path, root).split(os.sep):
                st = os.stat(path)
                out.append((path, st.st_size, st.st_mtime_ns))
    return sorted(out)


def _load_beside_a_trainer(rank: int, world_size: int, root: str) -> None:
    uri = f"{root}/ck"
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=2), state=user) as ck:
        for step in range(1, 7):
            user.losses.append(train_step(model, opt, SPEC, step))
            user.step = step
            live[step] = capture_state(model, opt, user, full=True)
            ck.step(step)
        assert ck.flush()
        before = _files(uri)
        # The trainer is still open (its lease held): an evaluation job loads beside it.
        for step, store in ((None, None), (4, _refusing(uri)), (2, _refusing(uri))):
            fresh, fresh_opt = build_model(SPEC, seed=7)
            fresh_user = TrainState()
            got = deck.load(fresh, [fresh_opt], store or uri, step=step, state=fresh_user)
            assert got == (step or 6)
            bad = diff_states(live[got], capture_state(fresh, fresh_opt, fresh_user, full=True))
            assert not bad, (step, bad[:5])
            assert store is None or store.puts == 0
        # Nothing there (a typo in an eval job's URI): an error, never the initial weights.
        empty, empty_opt = build_model(SPEC, seed=7)
        with pytest.raises(CheckpointNotFoundError, match="nothing is committed at"):
            deck.load(empty, [empty_opt], _refusing(f"{root}/empty"))
        with pytest.raises(CheckpointNotFoundError, match="5"):  # a step never committed
            deck.load(empty, [empty_opt], uri, step=5)
        for beyond in (10**12, -1):  # a step no folder name holds: refused, named
            with pytest.raises(ConfigError, match=rf"step={beyond}\)"):
                deck.load(empty, [empty_opt], uri, step=beyond)
        # Into the model the trainer tracks: its next delta would miss what the load changed.
        with pytest.raises(ConfigError, match="restore through that checkpointer"):
            deck.load(model, [opt], uri, step=2)
        assert _files(uri) == before  # the loads through the plain store wrote nothing either


def test_load_reads_a_committed_step_without_writing(tmp_path: Path) -> None:
    run_ranks(_load_beside_a_trainer, str(tmp_path), world_size=2)


def _failed_restore(rank: int, world_size: int, root: str) -> None:
    uri = f"{root}/ck"
    config = deck.DeckConfig(uri=uri, delta_every_steps=2, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    live = {}
    with deck.enable(model, [opt], config, state=user) as ck:
        for step in range(1, 5):
            user.losses.append(train_step(model, opt, SPEC, step))
            user.step = step
            ck.step(step)
        assert ck.flush()
        if rank == 0:  # step 4's state file damaged: read after the tables were loaded
            damaged = sorted(Path(uri).glob("step-*4/*/rank-00000/extra.safetensors"))[0]
            data = bytearray(damaged.read_bytes())
            data[len(data) // 2] ^= 0xFF
            damaged.write_bytes(bytes(data))
        dist.barrier()
        with pytest.raises(CorruptCheckpointError):
            ck.restore(4)  # the tables are partly overwritten by now
        # The job catches it and trains on: the next checkpoint is a full, so what is saved is
        # what is live, whatever the failed restore left in the model.
        for step in range(5, 7):
            user.losses.append(train_step(model, opt, SPEC, step))
            user.step = step
            live[step] = capture_state(model, opt, user, full=True)
            ck.step(step)
        assert ck.flush()
        assert [(h.step, h.kind) for h in ck.history][-1] == (6, "full")
    fresh, fresh_opt = build_model(SPEC, seed=7)
    fresh_user = TrainState()
    # deck.load does not fall back: it says what to do
    with pytest.raises(CorruptCheckpointError, match=r"deck.load of step 4 .* --quarantine") as e:
        deck.load(fresh, [fresh_opt], uri, step=4, state=fresh_user)
    # (not a checkpointer's allow_fallback, which deck.load has not: a break-it finding)
    assert "allow_fallback" not in str(e.value), e.value
    assert deck.load(fresh, [fresh_opt], uri, state=fresh_user) == 6
    bad = diff_states(live[6], capture_state(fresh, fresh_opt, fresh_user, full=True))
    assert not bad, bad[:5]


def test_a_failed_restore_makes_the_next_checkpoint_a_full(tmp_path: Path) -> None:
    """Before: the later deltas were relative to the last checkpoint while the model held a
    half-restored state, and their restore differed from the live model."""
    run_ranks(_failed_restore, str(tmp_path), world_size=2)


class _GcDeletesStepMidRead(StorageWrapper):
    """A reader's view of the store: at its first read of a data file of ``step``, GC deletes that
    checkpoint (its record first, then its files), as a bounded policy does to a step it no
    longer retains."""

    def __init__(self, inner: Any, step: int) -> None:
        super().__init__(inner)
        self.folder = f"step-{step:012d}/"
        self.done = False

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        if not self.done and path.startswith(self.folder) and path.endswith(".safetensors"):
            self.done = True
            self.inner.delete(f"{self.folder}manifest.json")
            self.inner.delete_prefix(self.folder)
        return super().get(path, start, end)


def _load_while_gc_deletes(rank: int, world_size: int, root: str) -> None:
    spec = ModelSpec(num_tables=2, rows=64, dim=8, batch=8)
    model, opt = build_model(spec)
    uri = f"{root}/ck"
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=1)) as ck:
        for step in range(4):
            train_step(model, opt, spec, step)
            ck.step(step)
    reader, ropt = build_model(spec, seed=9)
    store = _GcDeletesStepMidRead(open_storage(uri), 3)
    with pytest.raises(CheckpointNotFoundError, match=r"deleted .* while it was being read"):
        load_step(reader, [ropt], store, step=3)


def test_a_step_gc_deletes_while_it_is_read_is_not_found_not_damaged(tmp_path: Path) -> None:
    """A reader loading a step GC deletes meanwhile (no policy retains it) is told so, as
    CheckpointNotFoundError, not CorruptCheckpointError: nothing is damaged."""
    run_ranks(_load_while_gc_deletes, str(tmp_path), world_size=1)


SMALL = ModelSpec(num_tables=2, rows=64, dim=8, batch=8)


def _deck_lines() -> list[str]:
    """The messages deck logs from now on in this (rank's) process, at INFO and above."""
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deck").addHandler(handler)
    return said


def _edited_lr_restore(rank: int, world_size: int, root: str) -> None:
    said = _deck_lines()
    spec = replace(SMALL, sharding="table_wise")  # (a fused kernel: not data_parallel tables)
    model, opt = build_model(spec)
    config = deck.DeckConfig(uri=root, delta_every_steps=1, lease_ttl_s=None)
    with deck.DeltaCheckpointer(model, [opt], config) as ck:
        train_step(model, opt, spec, 0)
        ck.step(0)
        assert ck.flush()
    # Edits the checkpoint's values replace: the dense lr, and the fused kernel's eps and
    # weight decay (fbgemm's optimizer_args: a break-it run found those replaced silently)
    fresh, fresh_opt = build_model(
        replace(spec, fused_params={"eps": 0.1, "weight_decay": 0.5}), seed=3
    )
    for group in fresh_opt.param_groups:
        group["lr"] = group["lr"] * 10
    deck.load(fresh, [fresh_opt], root)
    edits = [m for m in said if "replace what the optimizer was built with" in m]
    assert len(edits) == (1 if rank == 0 else 0), (rank, edits)  # one line per job
    kernel = [m for m in said if "replace what the kernel was built with" in m]
    assert bool(kernel) == (rank == 0), (rank, kernel)
    assert all("eps=1e-08" in m and "eps=0.1" in m and "weight_decay=0.5" in m for m in kernel)
    assert all("update_hyper_parameters()" in m for m in kernel), kernel
    # (Rank 0 says it for every rank: the line says its tables are rank 0's)
    assert all("the tables named are the ones this rank holds" in m for m in kernel), kernel
    assert {
        (k.optimizer_args.eps, k.optimizer_args.weight_decay)
        for k in fused_kernels(fresh.fused_optimizer)
    } == {(1e-8, 0.0)}
    # Dense layers changed: refused for what it is (it was blamed on the dense optimizer, whose
    # state no longer fit)
    other, other_opt = build_model(replace(spec, dense_hidden=16), seed=5)
    with pytest.raises(IncompatibleModelError, match=r"dense state of step 0 at .* does not fit"):
        deck.load(other, [other_opt], root)
    # Another fused optimizer with states of the same names (row-wise -> element-wise Adagrad):
    # refused before anything is written (a break-it run found the tables written before the
    # state that did not fit was met)
    exact, exact_opt = build_model(replace(spec, fused_optimizer="EXACT_ADAGRAD"), seed=7)
    before = capture_state(exact, exact_opt, full=True)
    with pytest.raises(
        IncompatibleModelError,
        match=r"tables \['.*\.weight'\] were saved with another fused "
        r"optimizer than this model's kernels run \(EXACT_ROWWISE_ADAGRAD saved, EXACT_ADAGRAD now\)",
    ):
        deck.load(exact, [exact_opt], root)
    assert not diff_states(before, capture_state(exact, exact_opt, full=True))


@pytest.mark.slow
def test_a_replaced_hyperparameter_is_said_once_per_job_and_changed_dense_layers_are_refused(
    tmp_path: Path,
) -> None:
    run_ranks(_edited_lr_restore, str(tmp_path / "ck"), world_size=2)


def _restore_without_rng(rank: int, world_size: int, root: str) -> None:
    said = _deck_lines()
    model, opt = build_model(SMALL)
    for save_rng in (True, False):
        config = deck.DeckConfig(
            uri=f"{root}/{save_rng}", delta_every_steps=1, lease_ttl_s=None, save_rng=save_rng
        )
        with deck.DeltaCheckpointer(model, [opt], config) as ck:
            train_step(model, opt, SMALL, 0)
            ck.step(0)
            assert ck.flush()
    fresh, fresh_opt = build_model(SMALL, seed=3)
    deck.load(fresh, [fresh_opt], f"{root}/True")
    assert not [m for m in said if "RNG" in m], said
    deck.load(fresh, [fresh_opt], f"{root}/False")
    no_rng = [m for m in said if "holds no RNG states (saved with save_rng=False" in m]
    assert len(no_rng) == (1 if rank == 0 else 0), (rank, said)
    said.clear()
    # A job that saves none restores none, and says nothing of it
    off = deck.DeckConfig(uri=f"{root}/False", lease_ttl_s=None, save_rng=False)
    with deck.DeltaCheckpointer(fresh, [fresh_opt], off) as ck:
        assert ck.restore() == 0
    assert not [m for m in said if "RNG" in m], said


@pytest.mark.slow
def test_a_checkpoint_without_rng_states_says_so_when_restored(tmp_path: Path) -> None:
    """A checkpoint saved with save_rng=False, loaded by a job that restores RNG states: the
    states are left as the process has them (training on does not repeat the saved run's
    random draws), and rank 0 says so; before, nothing was said."""
    run_ranks(_restore_without_rng, str(tmp_path / "ck"), world_size=2)


def _into_fp16(rank: int, world_size: int, uri: str) -> None:
    train_phase(rank, world_size, Setup(), uri)  # one fp32 table, table_wise: on rank 0 only
    setup = Setup(tables=(Table(fp16=True),))
    model, opt, sched = build(setup, seed=2)
    config = deck.DeckConfig(uri=uri, delta_every_steps=setup.every)
    with (
        deck.enable(model, [opt], config, state=UserState(sched)) as ck,
        pytest.raises(IncompatibleModelError, match="t0"),
    ):
        ck.restore()


def test_a_model_one_ranks_part_does_not_fit_is_refused_alike_on_every_rank(
    tmp_path: Path,
) -> None:
    """A break-it finding: restoring fp32 tables into a model whose table (held by rank 0
    alone) is fp16 raised IncompatibleModelError on rank 0 and CheckpointError on rank 1. The
    class is the failing rank's on every rank (code catching IncompatibleModelError)."""
    run_ranks(_into_fp16, str(tmp_path / "ck"), world_size=2)
