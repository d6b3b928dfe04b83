"""What the stager keeps of one rank's part: the pending record a restart finishes it from
(:class:`PendingPart`), what this rank saw of it (:class:`CheckpointStats`), and the commit
thread's work item (:class:`_Item`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deck.errors import DeckError
from deck.format.manifest import (
    CkptId,
    Kind,
    NonNeg,
    RankManifest,
    check_rel_path,
    rank_dir,
)

if TYPE_CHECKING:
    from deck.trainer.staging.part import StagedPart

PENDING_SUFFIX = ".pending.json"


class _NeverCommits(DeckError):
    """A part that failed for good (its writes, or another rank's part): drop it, or every
    restart would retry it."""


class PendingPart(BaseModel):
    """Everything needed to finish one rank's part of a checkpoint after a restart.

    Validated like a manifest when read back (a restart acts on it: it may delete the files it
    names): every file is a safe relative path inside this part's own folder
    ``<ckpt_id>/rank-<rank>/``, and the rank manifest, when set, is this part's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str
    step: NonNeg
    ckpt_id: CkptId
    rank: NonNeg
    world_size: int = Field(ge=1)
    kind: Kind
    parent: NonNeg | None
    parent_id: CkptId | None
    base: NonNeg
    epoch: NonNeg
    files: tuple[str, ...] = ()  # relative to the step folder; data files of this part
    part: RankManifest | None = None  # set once the part is written

    @model_validator(mode="after")
    def _own_files(self) -> PendingPart:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        folder = f"{self.ckpt_id}/{rank_dir(self.rank)}/"
        named = list(self.files)
        if self.part is not None:
            p = self.part
            if (p.step, p.ckpt_id, p.rank, p.world_size) != (
                self.step,
                self.ckpt_id,
                self.rank,
                self.world_size,
            ):
                raise ValueError("its rank manifest is of another step, checkpoint or rank")
            named += [c.path for s in p.shards for c in s.chunks]
            named += [f.path for f in (p.dense, p.extra) if f is not None]
        for f in named:
            check_rel_path(f)
            if not f.startswith(folder):
                raise ValueError(f"file {f!r} is not in the part's folder {folder}")
        return self


@dataclass
class CheckpointStats:
    """One checkpoint as this rank saw it. Stall and sizes are filled when ``step``/``save``
    returns (sizes summed over ranks); the background thread fills the rest as it goes."""

    step: int
    kind: str
    id: str
    stall_s: float = 0.0  # the longest any rank spent in the checkpoint call
    # What the checkpoint added to the job's critical path: from the last rank's arrival (wall
    # clocks) to the end of the vote that released training. A rank that arrived earlier waited
    # for it, as it would have at the next training step's collective anyway.
    job_stall_s: float = 0.0
    # Of the stall, the longest any rank waited for a free chunk buffer: > 0 when a rank's part
    # was larger than the pool (chunks_in_flight x chunk_bytes), which then bounds the stall.
    buffer_wait_s: float = 0.0
    pool_bytes: int = 0  # the largest chunk buffer pool of any rank for this part
    pool_capped: bool = False  # a rank's part needed more than staging.snapshot_memory_bytes
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
