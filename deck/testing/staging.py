"""Test support: driving a stager by hand, as the checkpointer does."""

from __future__ import annotations

from typing import Any

from deck.format.manifest import Kind
from deck.format.pending import PendingPart


def full_part_info(
    uri: str, step: int, ckpt_id: str, rank: int = 0, world_size: int = 1, **more: Any
) -> PendingPart:
    """The pending record of rank ``rank``'s part of a full checkpoint of ``step`` (epoch 0);
    ``more``: other fields (``part``, ...)."""
    return PendingPart(
        uri=uri,
        step=step,
        ckpt_id=ckpt_id,
        rank=rank,
        world_size=world_size,
        kind=Kind.FULL,
        parent=None,
        parent_id=None,
        base=step,
        epoch=0,
        **more,
    )
