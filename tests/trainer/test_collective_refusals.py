"""What ``enable`` refuses on one rank is refused on every rank, before any rank enters a
collective the refusing rank would never join (the writer lease's broadcast, DDP's bucket
rebuild, the epoch, the stager's recovery): the refusing rank raises its own error, the others an
error of the same class naming that rank, and nothing stays installed, so a later enable of a
good setup works on the same process group."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import deck
from deck.errors import ConfigError, UnsupportedError
from deck.testing.differential import Setup, build
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow


def _one_rank_refuses(rank: int, world_size: int, root: str) -> None:
    from torchrec.optim.keyed import OptimizerWrapper

    class Stateful(OptimizerWrapper):  # a wrapper deck does not know: refused
        pass

    model, opt, _ = build(Setup(world_size=world_size), seed=1)
    config = deck.DeckConfig(uri=f"{root}/run", delta_every_steps=1)
    odd = world_size - 1
    cases: list[tuple[Any, Any, type[BaseException], str]] = [
        # (optimizers, state) on the odd rank; what the odd rank raises
        (Stateful(opt), None, UnsupportedError, "OptimizerWrapper deck does not know"),
        (opt, object(), ConfigError, "state must be an object with state_dict()"),
    ]
    for bad_opt, bad_state, odd_error, odd_match in cases:
        mine = (bad_opt, bad_state) if rank == odd else (opt, None)
        with pytest.raises(Exception) as caught:
            deck.enable(model, [mine[0]], config, state=mine[1])
        if rank == odd:
            assert isinstance(caught.value, odd_error), caught.value
            assert odd_match in str(caught.value)
        else:
            assert type(caught.value) is odd_error, caught.value  # the same class
            assert f"deck.enable failed on rank {odd}" in str(caught.value), caught.value
    # What every rank must share: a configuration (or optimizers, or state) that differs on one
    # rank is refused on every rank, naming what differs (a rank checkpointing at other steps or
    # into another URI used to hang the job at its first checkpoint or at close()).
    mode = "process" if config.staging.mode == "threads" else "threads"
    threads = config.staging.model_copy(update={"mode": mode})
    other = {
        "DeckConfig.delta_every_steps": (config.model_copy(update={"delta_every_steps": 3}), [opt]),
        "DeckConfig.uri": (config.model_copy(update={"uri": f"{root}/elsewhere"}), [opt]),
        "dense optimizers": (config, []),
        # (a nested field by its own name: a break-it finding read "DeckConfig.staging")
        "DeckConfig.staging.mode": (config.model_copy(update={"staging": threads}), [opt]),
    }
    for field, (odd_config, odd_opts) in other.items():
        mine = (odd_config, odd_opts) if rank == odd else (config, [opt])
        with pytest.raises(ConfigError, match=rf"ranks \[0, {odd}\] disagree on {field}"):
            deck.enable(model, mine[1], mine[0])
    # The same relative URI in another working directory (or a local folder on hosts that
    # share no disk): each rank would write where the others never look, and close() waited an
    # hour for the missing parts (a break-it finding). Refused on every rank.
    here = os.getcwd()
    os.makedirs(f"{root}/{'odd' if rank == odd else 'cwd'}", exist_ok=True)
    os.chdir(f"{root}/{'odd' if rank == odd else 'cwd'}")
    try:
        with pytest.raises(ConfigError) as caught:
            deck.enable(model, [opt], config.model_copy(update={"uri": "run-relative"}))
    finally:
        os.chdir(here)
    said = str(caught.value)
    assert f"rank {odd} does not see" in said if rank == odd else f"failed on rank {odd}" in said
    # Not a DeckConfig (a break-it finding: an AttributeError on every rank)
    with pytest.raises(ConfigError, match=r"config must be a deck\.DeckConfig, not dict"):
        deck.enable(model, [opt], config.model_dump())  # type: ignore[arg-type]
    # A host's own spool folder may differ.
    spool = config.model_copy(
        update={"staging": config.staging.model_copy(update={"spool_dir": f"{root}/spool{rank}"})}
    )
    deck.enable(model, [opt], spool).close()
    # One host's spool folder cannot be made (a read-only or mistyped path; a break-it finding:
    # a bare OSError from enable, the other ranks left waiting): refused on every rank
    if rank == odd:
        Path(f"{root}/a-file").write_text("x")
    remote = config.model_copy(
        update={
            "staging": config.staging.model_copy(
                update={
                    "tiers": "cpu-ssd-remote",
                    "spool_dir": f"{root}/a-file/spool" if rank == odd else f"{root}/s{rank}",
                }
            )
        }
    )
    with pytest.raises(ConfigError) as caught:
        deck.enable(model, [opt], remote)
    said = str(caught.value)
    assert "staging.spool_dir" in said if rank == odd else f"failed on rank {odd}" in said, said
    # The group is in step and nothing was left installed: a good setup enables and checkpoints.
    dist.barrier()
    with deck.enable(model, [opt], config) as ck:
        assert ck.step(0) is not None
        assert ck.flush()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_refusal_on_one_rank_is_raised_on_every_rank(tmp_path: Path, world_size: int) -> None:
    run_ranks(_one_rank_refuses, str(tmp_path), world_size=world_size)


def _forgotten_dense_optimizer(rank: int, world_size: int, root: str) -> None:
    from deck.demo import ModelSpec, build_model, train_step

    spec = ModelSpec(num_tables=2, rows=100, dim=8, batch=16)
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deck").addHandler(handler)
    model, opt = build_model(spec)
    with deck.enable(model, [], deck.DeckConfig(uri=root, delta_every_steps=1)) as ck:
        for step in range(3):
            train_step(model, opt, spec, step)
            ck.step(step)
    warned = [m for m in said if "in none of the optimizers given" in m]
    assert len(warned) == 1 and "dense_arch" in warned[0], said


def test_a_dense_optimizer_left_out_of_enable_is_said(tmp_path: Path) -> None:
    """A break-it finding: a dense optimizer not given to enable restored without a word, its
    state fresh. Parameters that get gradients but are in no optimizer given are said, once
    (not refused: a parameter may be frozen by leaving it out)."""
    run_ranks(_forgotten_dense_optimizer, str(tmp_path / "ck"), world_size=1)
