"""The pending record: a rank's part of a checkpoint staged in the spool and not yet committed.

Written by the trainer's stager beside the part's spooled files (``<step>/<id>/rank-N.pending.json``,
fsynced), read back by a restarted process, which finishes the part from it or discards it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deck.format.manifest import (
    CkptId,
    Kind,
    NonNeg,
    RankManifest,
    check_rel_path,
    rank_dir,
    rank_manifest_name,
)

PENDING_SUFFIX = ".pending.json"


def pending_name(rank: int) -> str:
    """The file name of rank ``rank``'s pending record, in the attempt folder ``<step>/<id>/``
    beside where its rank manifest goes."""
    return rank_manifest_name(rank).replace(".json", PENDING_SUFFIX)


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
