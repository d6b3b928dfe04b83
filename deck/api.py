"""The top-level convenience functions that take a URI (``deck.list_checkpoints(uri)``,
``deck.lineage_graph(uri)``): each opens the URI (:func:`deck.storage.open_storage`) and calls
the library function, which takes a :class:`~deck.storage.Storage`. URIs are turned into
storage only at the edges: here, the CLI, and the trainer's config."""

from __future__ import annotations

import os
from typing import Any

from deck.read import catalog, lineage
from deck.storage import Storage, open_storage


def _store(where: str | os.PathLike[str] | Storage, options: dict[str, Any] | None) -> Storage:
    return where if isinstance(where, Storage) else open_storage(os.fspath(where), options)


def list_checkpoints(
    uri: str | os.PathLike[str] | Storage, storage_options: dict[str, Any] | None = None
) -> list[catalog.CheckpointInfo]:
    """Committed checkpoints at ``uri`` (or an open Storage), oldest step first (an empty list
    for an empty URI)."""
    return catalog.list_checkpoints(_store(uri, storage_options))


def lineage_graph(
    uri: str | os.PathLike[str] | Storage, storage_options: dict[str, Any] | None = None
) -> lineage.LineageGraph:
    """The lineage graph of every committed checkpoint at ``uri`` (or an open Storage),
    trainer's and merger's; an empty or missing URI gives an empty graph."""
    return lineage.lineage_graph(_store(uri, storage_options))
