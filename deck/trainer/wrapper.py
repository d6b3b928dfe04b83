"""Enable deck through the model wrapper: :class:`DeckDistributedModelParallel`, a TorchRec
``DistributedModelParallel`` that takes a ``DeckConfig`` beside TorchRec's own arguments and
exposes the checkpointer as ``model.deck`` (its TorchRec half, what it overrides of TorchRec's
class and why, is ``adapters/dmp.py``; this module adds the checkpointer).

Why the checkpointer is made in ``__init__`` and the dense optimizers attach later: building
the checkpointer is collective (writability check, writer lease, recovery of spooled parts), and
the wrapper's constructor is a point every rank reaches together anyway (TorchRec plans the
sharding collectively there). Creating it lazily on first access to ``model.deck`` would run
those collectives wherever a rank first touches the attribute (say, a log line on rank 0 only)
and hang. The dense optimizer, though, is built from ``model.named_parameters()``, so it exists
only after the wrapper: ``model.deck.attach(optimizers, state)`` (local, not collective) hands
it over, and the first checkpoint or restore refuses to run until it has (``attach([])`` for a
model without dense optimizer), instead of silently leaving dense optimizer state out.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from deck.adapters.dmp import CheckpointedModelParallel
from deck.config import DeckConfig
from deck.errors import ConfigError
from deck.trainer.checkpointer import DeltaCheckpointer, UserState
from deck.trainer.staging import CheckpointStats

logger = logging.getLogger(__name__)


class ModelCheckpointer(DeltaCheckpointer):
    """The :class:`~deck.DeltaCheckpointer` of a :class:`DeckDistributedModelParallel`
    (``model.deck``): the same methods, plus :meth:`attach` for what is built after the model."""

    def __init__(
        self, model: nn.Module, optimizers: Any, config: DeckConfig, state: UserState | None
    ):
        super().__init__(model, [] if optimizers is None else optimizers, config, state)
        self._attached = optimizers is not None

    def attach(self, optimizers: Any, state: UserState | None = None) -> ModelCheckpointer:
        """Checkpoint ``optimizers`` (the dense ones; the fused embedding optimizers are found
        through the model) and, if given, ``state`` (``state_dict()``/``load_state_dict()`` or a
        ``(get, set)`` pair) from now on. Local, not collective; call it on every rank before the
        first checkpoint or restore. Pass ``[]`` when the model has no dense optimizer."""
        self._use(optimizers, state)
        self._attached = True
        return self

    def _require_attached(self, what: str) -> None:
        if not self._attached:
            raise ConfigError(
                f"model.deck.{what}() at {self.storage.uri}: no dense optimizers given yet; call "
                "model.deck.attach(optimizers, state) after building them (attach([]) when the "
                "model has none), or pass deck_optimizers= to DeckDistributedModelParallel. "
                "Otherwise checkpoints would miss the dense optimizer state."
            )

    def _check_hooks(self) -> None:
        """Something (e.g. a TorchRec tracker built on the model directly) replaced deck's
        callbacks since they were installed: rows looked up since then were not tracked, so
        the next checkpoint and publish are fulls; tracking is chained in again."""
        if not self._hooks_replaced():
            return
        logger.warning(
            "deck: another tracker replaced deck's lookup hooks on %s; deck chains in again and "
            "takes a full (rows looked up in between were not tracked)",
            self.storage.uri,
        )
        self.break_chains()
        self.retrack()

    def save(self, kind: Any = "delta", *, step: int | None = None) -> CheckpointStats | None:
        self._require_attached("save")
        self._check_hooks()
        return super().save(kind, step=step)

    def publish(self, step: int | None = None) -> CheckpointStats | None:
        self._require_attached("publish")
        self._check_hooks()
        return super().publish(step)

    def restore(self, step: int | None = None, *, allow_fallback: bool = False) -> int | None:
        self._require_attached("restore")
        return super().restore(step, allow_fallback=allow_fallback)

    def retrack(self) -> None:
        """Install the tracking hooks again, chained after whatever callbacks the sharded
        modules hold now (TorchRec's setters replace a callback instead of chaining); nothing
        once closed."""
        self._reinstall_tracking()


class DeckDistributedModelParallel(CheckpointedModelParallel[ModelCheckpointer]):
    """TorchRec's :class:`DistributedModelParallel` with deck delta checkpoints turned on by
    ``deck_config``; the checkpointer is ``model.deck`` (``step``, ``restore``, ``save``,
    ``flush``, ``pause``, ``close``, ``attach``).

    Every other argument is TorchRec's, passed through unchanged (``model_tracker_configs``
    included: TorchRec's trackers and deck's chain their hooks). ``deck_optimizers`` and
    ``deck_state`` are optional here because the dense optimizer is usually built from the
    wrapped model's parameters: give them later with ``model.deck.attach(optimizers, state)``.
    Construction is collective (every rank, as for TorchRec's planning); so are ``step``,
    ``save``, ``restore``, ``flush`` and ``close``.

    The wrapper adds no module, parameter or buffer: ``state_dict()``, ``named_parameters()``
    and the ``_dmp_wrapped_module`` prefixes are exactly those of a plain
    ``DistributedModelParallel`` of the same module, so TorchRec and DCP code sees no difference.
    """

    def _make_checkpointer(
        self, optimizers: Any, config: DeckConfig, state: UserState | None
    ) -> ModelCheckpointer:
        return ModelCheckpointer(self, optimizers, config, state)
