"""On-disk format v1: layout of a checkpoint and its manifests (spec: docs/format.md).

A checkpoint of step S under the root URI is the folder ``step-<S:012d>/``::

    step-000000000040/
      <id>/rank-00000/<table>/c<col>-r<row>-<n:06d>.chunk  row chunks (ids + every row state)
      <id>/rank-00000/dense.safetensors                     rank 0 only: replicated dense state
      <id>/rank-00000/extra.safetensors                     optimizers, user state, shard scalars
      <id>/rank-00000.json                                  rank part manifest (last write of that rank)
      manifest.json                                         commit record (last write, by rank 0)

``<id>`` is the checkpoint's random id: a step saved again (after rolling back) writes new files
and atomically replaces ``manifest.json``; files are never rewritten in place.

Only ``manifest.json`` makes a checkpoint exist. It is written after every rank's part manifest
is durable, and it lists them with their checksums, so a reader that sees it can trust the rest.
Manifests are strict pydantic models: unknown fields, versions, negative sizes, or file names that
escape the checkpoint folder are rejected with :class:`deck.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deck.errors import CorruptCheckpointError

FORMAT_VERSION = 1
PAGE_ALIGN = 4096
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.\-/]+$")

NonNeg = Annotated[int, Field(ge=0, le=2**62)]


class Kind(str, Enum):
    """What a checkpoint holds: every row (full) or rows touched since its parent (delta)."""

    FULL = "full"
    DELTA = "delta"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_rel_path(v: str) -> str:
    # A manifest from an untrusted place must not make us read outside the checkpoint folder.
    if not v or v.startswith("/") or ".." in v.split("/") or not _SAFE_PATH.match(v):
        raise ValueError(f"unsafe file name {v!r}: must be a relative path without '..'")
    return v


class Segment(_Strict):
    """One array inside a chunk file: raw little-endian bytes at [offset, offset + nbytes)."""

    name: str
    dtype: str
    shape: tuple[NonNeg, ...]
    offset: NonNeg
    nbytes: NonNeg


class ChunkRecord(_Strict):
    """One chunk file: ``rows`` global row ids (segment ``ids``) and the same rows of each state."""

    path: str
    rows: NonNeg
    nbytes: NonNeg
    checksum: str
    segments: tuple[Segment, ...]

    _path = field_validator("path")(_check_rel_path)


class ShardRecord(_Strict):
    """The saved rows of one table shard (all rows of columns [col_offset, col_offset + cols))."""

    table: str
    num_rows: NonNeg
    num_cols: NonNeg
    row_offset: NonNeg
    rows: NonNeg
    col_offset: NonNeg
    cols: NonNeg
    full: bool
    states: tuple[str, ...]
    chunks: tuple[ChunkRecord, ...]


class FileRecord(_Strict):
    """A whole file with its checksum (dense and extra state)."""

    path: str
    nbytes: NonNeg
    checksum: str

    _path = field_validator("path")(_check_rel_path)


class RankManifest(_Strict):
    """What one rank wrote for one checkpoint; written after all its files are durable."""

    format_version: int
    step: NonNeg
    ckpt_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    rank: NonNeg
    world_size: int = Field(ge=1)
    shards: tuple[ShardRecord, ...]
    dense: FileRecord | None
    extra: FileRecord

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)


class RankRef(_Strict):
    rank: NonNeg
    path: str
    nbytes: NonNeg
    checksum: str
    data_bytes: NonNeg

    _path = field_validator("path")(_check_rel_path)


class CheckpointManifest(_Strict):
    """The commit record of one checkpoint, and its place in the lineage.

    ``parent`` is the step this delta is relative to (rows touched after ``parent``'s snapshot);
    ``base`` is the full checkpoint the chain starts from. A full has ``parent is None`` and
    ``base == step``.
    """

    format_version: int
    id: str = Field(pattern=r"^[0-9a-f]{16}$")
    step: NonNeg
    kind: Kind
    parent: NonNeg | None
    parent_id: str | None
    base: NonNeg
    epoch: NonNeg
    world_size: int = Field(ge=1)
    ranks: tuple[RankRef, ...]
    created_unix: float
    deck_version: str

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)

    @model_validator(mode="after")
    def _lineage(self) -> CheckpointManifest:
        if self.kind is Kind.FULL and (self.parent is not None or self.base != self.step):
            raise ValueError("a full checkpoint has no parent and is its own base")
        if self.kind is Kind.DELTA and (
            self.parent is None or self.parent_id is None or self.parent >= self.step
        ):
            raise ValueError("a delta needs a parent (id and step) older than itself")
        if len({r.rank for r in self.ranks}) != self.world_size or any(
            r.rank >= self.world_size for r in self.ranks
        ):
            raise ValueError("ranks must list each rank of world_size exactly once")
        return self

    @property
    def data_bytes(self) -> int:
        """Bytes of all files of this checkpoint (chunks, dense, extra, rank manifests)."""
        return sum(r.data_bytes + r.nbytes for r in self.ranks)


def _check_version(v: int) -> int:
    if v != FORMAT_VERSION:
        raise ValueError(
            f"format_version {v} is not supported by this deck (reads {FORMAT_VERSION}); "
            "upgrade deck to read it"
        )
    return v


def step_dir(step: int) -> str:
    """Folder of the checkpoint of ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<n>`` folder name, or None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def table_dir(table: str) -> str:
    """A file-system-safe folder name for a table key (state_dict key of its weight)."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", table)


M = TypeVar("M", bound=BaseModel)


def dump_model(model: BaseModel) -> bytes:
    """Serialise a manifest as JSON (UTF-8, sorted keys for stable checksums)."""
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, indent=1).encode()


def load_model(cls: type[M], data: bytes, where: str) -> M:
    """Parse and validate a manifest; any problem raises CorruptCheckpointError naming ``where``."""
    try:
        return cls.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise CorruptCheckpointError(
            f"{where}: invalid {cls.__name__} ({e.error_count()} problem(s); first at '{loc}': "
            f"{first['msg']}); the file is damaged or was not written by deck"
        ) from None
