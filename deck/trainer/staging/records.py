"""What the stager keeps of one rank's part: the pending record a restart finishes it from
(:class:`PendingPart`), what this rank saw of it (:class:`CheckpointStats`), and the commit
thread's work item (:class:`_Item`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from deck.errors import DeckError
from deck.format.manifest import Kind, RankManifest

if TYPE_CHECKING:
    from deck.trainer.staging.part import StagedPart

PENDING_SUFFIX = ".pending.json"


class _NeverCommits(DeckError):
    """A part that failed for good (its writes, or another rank's part): drop it, or every
    restart would retry it."""


class PendingPart(BaseModel):
    """Everything needed to finish one rank's part of a checkpoint after a restart."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str
    step: int
    ckpt_id: str
    rank: int
    world_size: int
    kind: Kind
    parent: int | None
    parent_id: str | None
    base: int
    epoch: int
    files: tuple[str, ...] = ()  # relative to the step folder; data files of this part
    part: RankManifest | None = None  # set once the part is written


@dataclass
class CheckpointStats:
    """One checkpoint as this rank saw it. Stall and sizes are filled when ``step``/``save``
    returns (sizes summed over ranks); the background thread fills the rest as it goes."""

    step: int
    kind: str
    id: str
    stall_s: float = 0.0
    # Of the stall, the longest any rank waited for a free chunk buffer: > 0 when a rank's part
    # was larger than the pool (chunks_in_flight x chunk_bytes), which then bounds the stall.
    buffer_wait_s: float = 0.0
    # Where the stall went (each the longest of any rank): the first all-gather (agreeing on id
    # and kind; it also absorbs the ranks' arrival skew), claiming the tracked rows, and copying
    # them into buffers (the snapshot: rows, dense and extra state). The rest of ``stall_s`` is
    # the second all-gather that releases training.
    agree_s: float = 0.0
    claim_s: float = 0.0
    snapshot_s: float = 0.0
    bytes: int = 0
    rows: int = 0
    chunks: int = 0
    durable_local_s: float | None = None  # snapshot start -> this rank's files fsynced
    committed_s: float | None = None  # snapshot start -> part uploaded (rank 0: manifest written)
    state: str = "staged"  # staged | recovering | durable | uploaded | committed | failed
    error: str | None = None
    spool_reserved: int = field(default=0, repr=False)
    started: float = field(default_factory=time.perf_counter, repr=False)


@dataclass
class _Item:
    """One part for the commit thread: staged by this process, or found in the spool."""

    pending: PendingPart  # of a staged part: without files and manifest until its writes are done
    stats: CheckpointStats
    staged: StagedPart | None = None
