"""The top-level convenience functions that take a URI (``deck.list_checkpoints(uri)``,
``deck.lineage_graph(uri)``, ``deck.load(model, optimizers, uri)``): each opens the URI (:func:`deck.storage.open_storage`) and calls
the library function, which takes a :class:`~deck.storage.Storage`. URIs are turned into
storage only at the edges: here, the CLI, and the trainer's config."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from deck.errors import CheckpointNotFoundError
from deck.read import catalog, lineage
from deck.stack import require_torchrec
from deck.storage import Storage, open_storage

if TYPE_CHECKING:
    import torch

    from deck.model import ModelAdapter
    from deck.trainer.checkpointer import UserState


def _store(where: str | os.PathLike[str] | Storage, options: dict[str, Any] | None) -> Storage:
    return where if isinstance(where, Storage) else open_storage(os.fspath(where), options)


def _existing(where: str | os.PathLike[str] | Storage, options: dict[str, Any] | None) -> Storage:
    """The store at ``where``, which must exist (as ``deck ls`` requires): a typo raises
    :class:`CheckpointNotFoundError` naming the URI instead of reading as an empty run."""
    storage = _store(where, options)
    why = catalog.missing_uri(storage, storage.uri if isinstance(where, Storage) else str(where))
    if why is not None:
        raise CheckpointNotFoundError(why)
    return storage


def list_checkpoints(
    uri: str | os.PathLike[str] | Storage, storage_options: dict[str, Any] | None = None
) -> list[catalog.CheckpointInfo]:
    """Committed checkpoints at ``uri`` (or an open Storage), oldest step first: an empty list
    for a URI that exists but holds none. A URI that does not exist (a local path that is not
    a directory, a remote prefix with no object) raises :class:`CheckpointNotFoundError`
    naming it, as ``deck ls`` exits 2 for it."""
    return catalog.list_checkpoints(_existing(uri, storage_options))


def lineage_graph(
    uri: str | os.PathLike[str] | Storage, storage_options: dict[str, Any] | None = None
) -> lineage.LineageGraph:
    """The lineage graph of every committed checkpoint at ``uri`` (or an open Storage),
    trainer's and merger's: an empty graph for a URI that exists but holds none; a URI that
    does not exist raises :class:`CheckpointNotFoundError` naming it (``deck lineage``: exit
    2)."""
    return lineage.lineage_graph(_existing(uri, storage_options))


def load(
    model: torch.nn.Module,
    optimizers: Any,
    uri: str | os.PathLike[str] | Storage,
    *,
    step: int | None = None,
    state: UserState | None = None,
    storage_options: dict[str, Any] | None = None,
    restore_rng: bool = True,
    adapter: ModelAdapter | None = None,
) -> int:
    """Load committed ``step`` of ``uri`` (the latest when None) into ``model``, ``optimizers``
    and ``state`` bitwise, reading only: no write probe, no writer lease, no tracking, so it
    works on a read-only URI and beside a running trainer. Returns the step loaded
    (CheckpointNotFoundError for a URI that holds none). Collective (every rank, any world size or plan). See
    :func:`deck.trainer.load.load_step`; imports torch and TorchRec when called."""
    from deck.trainer.load import load_step

    if adapter is None:  # TorchRec's adapter, whose stack is not a declared dependency
        require_torchrec("deck.load")
    return load_step(
        model,
        optimizers,
        _store(uri, storage_options),
        step=step,
        state=state,
        restore_rng=restore_rng,
        adapter=adapter,
    )
