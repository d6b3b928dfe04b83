"""deck: delta checkpoints for TorchRec recommendation models.

Quick use::

    ckpt = deck.enable(model, [dense_optimizer], deck.DeckConfig(uri="/ckpt", delta_every_steps=100))
    start = ckpt.restore() or 0
    for step in range(start + 1, steps + 1):
        train_one_step(...)
        ckpt.step(step)
"""

__version__ = "0.1.0"

from deck import errors, lineage
from deck.catalog import CheckpointInfo, list_checkpoints
from deck.checkpointer import DeltaCheckpointer, enable
from deck.config import DeckConfig, PublishConfig, StagingConfig
from deck.errors import CheckpointError
from deck.lineage import LineageGraph, lineage_graph
from deck.staging import CheckpointStats

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStats",
    "DeckConfig",
    "DeckDistributedModelParallel",
    "DeltaCheckpointer",
    "LineageGraph",
    "PublishConfig",
    "StagingConfig",
    "__version__",
    "enable",
    "errors",
    "lineage",
    "lineage_graph",
    "list_checkpoints",
]


def __getattr__(name: str) -> object:
    # Lazy: the TorchRec wrapper imports torchrec, which the CLI and merger workers do not need.
    if name == "DeckDistributedModelParallel":
        from deck.adapters.dmp import DeckDistributedModelParallel

        return DeckDistributedModelParallel
    raise AttributeError(f"module 'deck' has no attribute {name!r}")
