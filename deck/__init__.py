"""deck: delta checkpoints for TorchRec recommendation models.

Quick use::

    ckpt = deck.enable(model, [dense_optimizer], deck.DeckConfig(uri="/ckpt", delta_every_steps=100))
    start = ckpt.restore() or 0
    for step in range(start + 1, steps + 1):
        train_one_step(...)
        ckpt.step(step)

``deck.load(model, optimizers, uri)`` loads a committed step read-only (evaluation, inference,
beside a running trainer).

``import deck`` does not import torch or TorchRec: the training-process names (``enable``,
``DeltaCheckpointer``, ``CheckpointStats``, ``CheckpointEvent``, ``DeckDistributedModelParallel``, ``DoctorSetup``,
``run_doctor``) load on first use, so ``deck ls`` and the merger workers start without them.

TorchRec is not a dependency of the distribution (README, Install): without its stack, the
names that need it (``enable``, ``DeckDistributedModelParallel``, ``load`` with no adapter, the
doctor) raise ``MissingDependencyError`` naming the pip commands.

Errors: every failure a user can act on is a :class:`deck.DeckError`; its subclasses
(``ConfigError``, ``StorageError``, ``NotFoundError``, ``CorruptCheckpointError``,
``CheckpointNotFoundError``, ``MissingDependencyError``, ...: :mod:`deck.errors`; the stream's
``CorruptStreamError``, ``StreamGapError``, ``MessageTooLargeError``; ``QuantizedStateError``)
are importable from ``deck`` too.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from deck import errors
from deck.api import lineage_graph, list_checkpoints, load
from deck.config import DeckConfig, PublishConfig, StagingConfig
from deck.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ClockSkewError,
    ConfigError,
    CorruptCheckpointError,
    DeckError,
    DoctorError,
    IncompatibleModelError,
    LeaseHeldError,
    MergeError,
    MissingDependencyError,
    NotFoundError,
    SpoolError,
    StorageError,
    UnsafePathError,
    UnsupportedError,
)
from deck.read import lineage
from deck.read.catalog import CheckpointInfo
from deck.read.lineage import LineageGraph
from deck.stack import is_stack_module, missing_stack_error, require_torchrec
from deck.version import __version__

if TYPE_CHECKING:  # the names _LAZY loads, for type checkers
    from deck.doctor import DoctorSetup, run_doctor
    from deck.format.quantize import QuantizedStateError
    from deck.format.stream import CorruptStreamError, MessageTooLargeError, StreamGapError
    from deck.trainer.checkpointer import DeltaCheckpointer, enable
    from deck.trainer.events import CheckpointEvent
    from deck.trainer.staging import CheckpointStats
    from deck.trainer.wrapper import DeckDistributedModelParallel

__all__ = [
    "CheckpointError",
    "CheckpointEvent",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointStats",
    "ClockSkewError",
    "ConfigError",
    "CorruptCheckpointError",
    "CorruptStreamError",
    "DeckConfig",
    "DeckDistributedModelParallel",
    "DeckError",
    "DeltaCheckpointer",
    "DoctorError",
    "DoctorSetup",
    "IncompatibleModelError",
    "LeaseHeldError",
    "LineageGraph",
    "MergeError",
    "MessageTooLargeError",
    "MissingDependencyError",
    "NotFoundError",
    "PublishConfig",
    "QuantizedStateError",
    "SpoolError",
    "StagingConfig",
    "StorageError",
    "StreamGapError",
    "UnsafePathError",
    "UnsupportedError",
    "__version__",
    "enable",
    "errors",
    "lineage",
    "lineage_graph",
    "list_checkpoints",
    "load",
    "run_doctor",
]

# name -> module that defines it; these import torch (and the wrapper TorchRec).
_LAZY = {
    "DeltaCheckpointer": "deck.trainer.checkpointer",
    "enable": "deck.trainer.checkpointer",
    "CheckpointStats": "deck.trainer.staging",
    "CheckpointEvent": "deck.trainer.events",
    "DeckDistributedModelParallel": "deck.trainer.wrapper",
    "DoctorSetup": "deck.doctor",  # deck doctor: the check of a user's own setup
    "run_doctor": "deck.doctor",
    # error classes defined with the formats they guard (DeckError subclasses all)
    "CorruptStreamError": "deck.format.stream",
    "MessageTooLargeError": "deck.format.stream",
    "StreamGapError": "deck.format.stream",
    "QuantizedStateError": "deck.format.quantize",
}


# The names that always run TorchRec (deck.enable has no adapter argument): without its stack,
# which the distribution does not declare (deck.stack), they say what to install.
_NEEDS_TORCHREC = {"enable", "DeckDistributedModelParallel", "DoctorSetup", "run_doctor"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deck' has no attribute {name!r}")
    if name in _NEEDS_TORCHREC:
        require_torchrec(f"deck.{name}")
    try:
        loaded = import_module(module)
    except ModuleNotFoundError as e:
        if is_stack_module(e):
            raise missing_stack_error(str(e.name), f"deck.{name}") from e
        raise
    return getattr(loaded, name)
