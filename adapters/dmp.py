"""The TorchRec half of the model wrapper: a ``DistributedModelParallel`` that takes a
``DeckConfig`` beside TorchRec's own arguments (as TorchRec 1.8 turns its trackers on with
``model_tracker_configs``) and carries a checkpointer as ``model.deck``. The wrapper users get,
:class:`deck.DeckDistributedModelParallel` (``deck/trainer/wrapper.py``), builds on it and says
which checkpointer; nothing here imports the trainer.

What it knows of TorchRec: the constructor plans the sharding collectively, so the config is
checked before it and the checkpointer (collective too) made right after it, a point every rank
reaches together; ``init_torchrec_delta_tracker`` installs TorchRec's tracker with setters that
replace the sharded modules' lookup callbacks, so the checkpointer is told to chain its hooks in
again; ``copy`` deep-copies the model, so the copy must not take the checkpointer along.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel

from deck.config import DeckConfig
from deck.errors import ConfigError


class Retracking(Protocol):
    def retrack(self) -> None:
        """Install the tracking hooks again, behind whatever callbacks the model holds now."""


C = TypeVar("C", bound=Retracking)


class CheckpointedModelParallel(DistributedModelParallel, Generic[C]):
    """TorchRec's :class:`DistributedModelParallel` with a checkpointer made by
    :meth:`_make_checkpointer` once TorchRec's constructor is done. ``deck_config`` is required,
    ``deck_optimizers`` and ``deck_state`` are handed to the checkpointer; every other argument
    is TorchRec's, passed through unchanged. Adds no module, parameter or buffer."""

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        deck_config: DeckConfig,
        deck_optimizers: Any = None,
        deck_state: Any = None,
        **kwargs: Any,
    ):
        if not isinstance(deck_config, DeckConfig):  # before TorchRec's (collective) sharding
            raise ConfigError(
                f"deck_config must be a deck.DeckConfig, got {type(deck_config).__name__}"
            )
        super().__init__(module, *args, **kwargs)
        # A plain attribute (not a module): invisible to state_dict / named_parameters.
        self._deck: C | None = self._make_checkpointer(deck_optimizers, deck_config, deck_state)

    def _make_checkpointer(self, optimizers: Any, config: DeckConfig, state: Any) -> C:
        """The checkpointer of this model (collective: every rank builds it here)."""
        raise NotImplementedError

    @property
    def deck(self) -> C:
        """This model's checkpointer."""
        if self._deck is None:
            # Not AttributeError: nn.Module.__getattr__ would replace the message.
            raise ConfigError(
                "this model has no deck checkpointer: it is a copy made by "
                "DistributedModelParallel.copy(); checkpoint through the original model"
            )
        return self._deck

    def init_torchrec_delta_tracker(self, delta_tracker_config: Any) -> Any:
        """TorchRec's own delta tracker (its setters would replace deck's hooks): deck's
        tracking is chained after it again, so both see every lookup."""
        tracker = super().init_torchrec_delta_tracker(delta_tracker_config)
        if self._deck is not None:
            self._deck.retrack()
        return tracker

    def copy(self, device: torch.device) -> DistributedModelParallel:
        """TorchRec's copy to another device (e.g. for inference). The copy has no checkpointer:
        threads, files and the writer lease stay with this model."""
        deck, self._deck = self._deck, None
        try:
            return super().copy(device)
        finally:
            self._deck = deck
