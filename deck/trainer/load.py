"""Loading a committed step without a checkpointer (``deck.load``): for evaluation, inference or
a copy of the model, from a store this process may not write (a read-only mount, a bucket it may
only read) or while a trainer holds its writer lease."""

from __future__ import annotations

from typing import Any

import torch

from deck.at_exit import still_open
from deck.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from deck.format.manifest import as_step
from deck.model import ModelAdapter
from deck.storage import Storage
from deck.trainer.checkpointer import (
    DeltaCheckpointer,
    UserState,
    default_adapter,
    user_state_pair,
)
from deck.trainer.coordination import Coordinator
from deck.trainer.loader import StateLoader


def load_step(
    model: torch.nn.Module,
    optimizers: Any,
    storage: Storage,
    *,
    step: int | None = None,
    state: UserState | None = None,
    restore_rng: bool = True,
    adapter: ModelAdapter | None = None,
) -> int:
    """Load committed ``step`` of ``storage`` (the latest restorable one when None) into
    ``model``, ``optimizers`` and ``state``, bitwise, as ``DeltaCheckpointer.restore`` does;
    returns the step loaded. Collective: call it on every rank (any world size or sharding
    plan); they load the same step or all raise.

    It only reads: no write probe, no writer lease, no tracking hooks, no threads, so it works
    on a read-only URI and beside a running trainer. It never falls back to an older step: a
    damaged or missing file raises :class:`~deck.errors.CorruptCheckpointError` naming it (the
    model is then partly loaded). :class:`~deck.errors.CheckpointNotFoundError` when
    ``storage`` holds nothing (an eval job must not go on with the weights it started with);
    :class:`~deck.errors.ConfigError` for a model an open checkpointer tracks (restore through
    it instead). Training on from what it loaded is not tracked: to train on with
    checkpoints, restore through ``deck.enable(...).restore()``. ``adapter`` replaces
    TorchRec's adapter.
    """
    if step is not None:
        step = as_step(step, "deck.load")
    coord = Coordinator()
    refused: Exception | None = None
    loader: StateLoader | None = None
    try:
        if any(isinstance(c, DeltaCheckpointer) and c.watches(model) for c in still_open()):
            raise ConfigError(
                f"deck.load into a model an open checkpointer tracks (loading {storage.uri}): "
                "its next delta would miss what the load changed; restore through that "
                "checkpointer (ckpt.restore(step)), or close() it first"
            )
        found = adapter or default_adapter(model)
        pair = user_state_pair(state)
        loader = StateLoader(
            storage,
            coord,
            found,
            found.optimizers(optimizers),
            None if pair is None else pair[1],
            restore_rng=restore_rng,
            fallback_hint="",
        )
    except Exception as e:
        refused = e
    # A rank that refused must not leave the others waiting in the loader's collectives.
    coord.agree_on_failure(refused, "deck.load")
    assert loader is not None
    try:
        done = loader.restore(step, allow_fallback=False)
    except CorruptCheckpointError as e:
        # Every rank raises this (the ranks agree on the outcome).
        which = "the latest step" if step is None else f"step {step}"
        raise CorruptCheckpointError(
            f"deck.load of {which} of {storage.uri}: {e}. deck.load never falls back to "
            f"another step: `deck verify {storage.uri} --all --quarantine` marks the damaged "
            "checkpoints (the latest step then avoids them), or pass an older step="
        ) from e
    if done is None:
        raise CheckpointNotFoundError(
            f"deck.load: nothing is committed at {storage.uri} (a wrong or empty URI?)"
        )
    return done.step
