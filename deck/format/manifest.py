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

The merger writes its checkpoints (merged deltas, merger fulls) under ``merged/<name>/`` with the
same files and the same ``manifest.json`` commit record (see :func:`merged_dir`); each record's
:attr:`CheckpointManifest.folder` says where its files are.

Only ``manifest.json`` makes a checkpoint exist. It is written after every rank's part manifest
is durable, and it lists them with their checksums, so a reader that sees it can trust the rest.
Manifests are strict pydantic models: unknown fields, versions, negative sizes, or file names that
escape the checkpoint folder are rejected with :class:`deck.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import bisect
import json
import operator
import os
import re
from collections.abc import Iterable
from enum import Enum
from typing import Annotated, Any, Literal, TypeVar

import xxhash
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from deck.errors import ConfigError, CorruptCheckpointError
from deck.format.jsonio import MAX_RECORD_DEPTH, load_json

FORMAT_VERSION = 1
PAGE_ALIGN = 4096
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-([0-9]{12})")  # whole names only (fullmatch): ASCII digits
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.\-/]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_BAD_PARTS = frozenset(("", ".", ".."))  # path components a record may not hold

NonNeg = Annotated[int, Field(ge=0, le=2**62)]
# A wall-clock time written by a host: finite, not before 1970 and not past the year 5000 (a
# break-it finding: a re-signed NaN or 1e308 was a traceback in `deck show`, and `ls --json`
# printed NaN, which is not JSON)
UnixTime = Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]
CkptId = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
MERGED_ROOT = "merged"
QUARANTINE_ROOT = "quarantine"
# A merger item's partition records, inside its folder under merged/.
PARTS_DIR = "parts"
# A merger folder's name under merged/ (merged_dir): groups full step, layer, first step, step, id
MERGED_NAME_PATTERN = r"(?:F-([0-9]{12})|L([0-9]{2})-([0-9]{12})-([0-9]{12}))-([0-9a-f]{16})"
_MERGED_DIR = re.compile(MERGED_NAME_PATTERN)
# Quantised encodings of a chunk segment (deck.format.quantize); None everywhere means exact.
Encoding = Literal["fp16", "bf16", "int8"]
_ENCODED_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8"}
_FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _omit_none(out: dict[str, Any], *names: str) -> dict[str, Any]:
    # Optional fields added after format v1 shipped are left out at None, so records without
    # them dump byte-for-byte as before and older readers (extra="forbid") still read them.
    for name in names:
        if name in out and out[name] is None:
            del out[name]
    return out


class Kind(str, Enum):
    """What a checkpoint holds: every row (full), rows touched since its parent (delta), or the
    newest version of every row touched in a run of consecutive deltas (merged, by the merger)."""

    FULL = "full"
    DELTA = "delta"
    MERGED = "merged"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_rel_path(v: str) -> str:
    """``v`` if it is a safe file name for a record to hold (a relative '/'-path of letters,
    digits, ``_.-`` without empty, ``.`` or ``..`` components), else ValueError: a record from
    an untrusted place must not make deck read, write or delete outside the folder it names."""
    if not _SAFE_PATH.match(v) or v.startswith("/") or not _BAD_PARTS.isdisjoint(v.split("/")):
        raise ValueError(f"unsafe file name {v!r}: must be a relative path without '..'")
    return v


class Segment(_Strict):
    """One array inside a chunk file: raw little-endian bytes at [offset, offset + nbytes).

    ``encoding`` (optional; None = the exact values) says the segment holds a quantised
    encoding of a state whose real dtype is ``source_dtype``: ``fp16`` / ``bf16`` values, or
    ``int8`` values with a per-row fp32 scale in segment ``<name>.scale`` (see deck.format.quantize)."""

    name: str
    dtype: str
    shape: tuple[NonNeg, ...]
    offset: NonNeg
    nbytes: NonNeg
    encoding: Encoding | None = None
    source_dtype: str | None = None

    @model_validator(mode="after")
    def _encoded(self) -> Segment:
        if self.encoding is None:
            if self.source_dtype is not None:
                raise ValueError("segment: source_dtype without an encoding")
            return self
        if self.dtype != _ENCODED_DTYPE[self.encoding]:
            raise ValueError(
                f"segment {self.name}: encoding {self.encoding} is stored as "
                f"{_ENCODED_DTYPE[self.encoding]}, not {self.dtype}"
            )
        if self.source_dtype not in _FLOAT_DTYPES or len(self.shape) != 2:
            raise ValueError(
                f"segment {self.name}: an encoded segment needs a float source_dtype and rows x cols"
            )
        return self

    @model_serializer(mode="wrap")
    def _omit_exact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _omit_none(handler(self), "encoding", "source_dtype")


_BASE64_DIGITS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _is_base64(s: str) -> bool:
    """Whether ``s`` matches ``[A-Za-z0-9+/]*={0,2}``: at C speed (a regex check took
    ~50 us per chunk's filter, holding the GIL, on the thread writing a delta's records)."""
    rest = s.encode().translate(None, _BASE64_DIGITS)  # what is not a digit
    return rest in (b"", b"=", b"==") and s.endswith(rest.decode())


class RowIndex(_Strict):
    """Which global row ids a chunk can hold, for point queries (``deck history``) that skip the
    chunks that cannot: every id is in ``[min_id, max_id]``; ``bloom`` (base64 of ``bits`` bits,
    ``k`` hashes, see :mod:`deck.format.rowindex`) has no false negatives. ``bloom`` is None when the
    ids are exactly the range (a full's chunks): the range then says it all."""

    min_id: NonNeg
    max_id: NonNeg
    bits: int = Field(default=0, ge=0, le=2**32)
    k: int = Field(default=0, ge=0, le=16)
    bloom: str | None = None  # base64 (checked by _consistent)

    @model_validator(mode="after")
    def _consistent(self) -> RowIndex:
        if self.min_id > self.max_id:
            raise ValueError("row index: min_id > max_id")
        if self.bloom is None:
            if self.bits or self.k:
                raise ValueError("row index: bits / k without a bloom filter")
        elif not _is_base64(self.bloom):
            raise ValueError("row index: bloom filter is not base64")
        elif (
            self.bits < 8
            or self.bits % 8
            or self.k < 1
            or len(self.bloom) != 4 * ((self.bits // 8 + 2) // 3)
        ):
            raise ValueError("row index: bloom filter length does not match bits, or no k")
        return self

    @field_serializer("bloom")
    def _lift_bloom(self, bloom: str | None, info: SerializationInfo) -> str | None:
        lifted = info.context.get(_LIFTED) if isinstance(info.context, dict) else None
        return bloom if bloom is None or lifted is None else lifted.lift(bloom)


class ChunkRecord(_Strict):
    """One chunk file: ``rows`` global row ids (segment ``ids``) and the same rows of each state.

    ``index`` (optional: older checkpoints have none) bounds the ids it holds; readers that find
    none must assume any id of the shard."""

    path: str
    rows: NonNeg
    nbytes: NonNeg
    checksum: str
    segments: tuple[Segment, ...]
    index: RowIndex | None = None
    # Set when the chunk lives inside a bundle file (``path``) at this page-aligned byte offset,
    # the chunk being bytes [offset, offset + nbytes) of it; None: ``path`` is the chunk's own file.
    offset: NonNeg | None = None

    _path = field_validator("path")(check_rel_path)

    @model_validator(mode="after")
    def _scales(self) -> ChunkRecord:
        if self.offset is not None and self.offset % PAGE_ALIGN:
            raise ValueError(
                f"chunk: bundle offset {self.offset} is not a multiple of {PAGE_ALIGN}"
            )
        by_name = {s.name: s for s in self.segments}
        if len(by_name) != len(self.segments):
            raise ValueError("chunk: two segments with the same name")
        for s in self.segments:
            if s.encoding != "int8":
                continue
            sc = by_name.get(f"{s.name}.scale")
            if sc is None or sc.dtype != "float32" or sc.shape != s.shape[:1] or sc.encoding:
                raise ValueError(
                    f"chunk: int8 segment {s.name} needs a float32 segment {s.name}.scale "
                    "with one value per row"
                )
        return self

    @property
    def bundled(self) -> bool:
        """Whether the chunk is a byte range of a bundle file rather than a file of its own."""
        return self.offset is not None

    @property
    def encoding(self) -> Encoding | None:
        """The quantised encoding of this chunk's segments, None when every segment is exact."""
        return next((s.encoding for s in self.segments if s.encoding is not None), None)

    @model_serializer(mode="wrap")
    def _omit_no_index(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Chunks without an index (or not bundled) dump exactly as before those fields existed.
        return _omit_none(handler(self), "index", "offset")


def check_table_name(v: str) -> str:
    """``v`` if it can be a table's state_dict key (dot-separated module and parameter names:
    no empty part, no control character, at most 1024 characters), else ValueError. A record
    naming anything else (``../../x``) is damage, not a table some model lacks."""
    if not 0 < len(v) <= 1024 or "" in v.split(".") or _CONTROL.search(v):
        raise ValueError(f"invalid table name {v[:80]!r}: not a state_dict key")
    return v


class ShardRecord(_Strict):
    """The saved rows of one table shard (all rows of columns [col_offset, col_offset + cols)).

    Validated on read: the shard lies inside its table, its chunks hold at most ``rows`` rows,
    and a ``full`` record's chunks hold exactly its ``rows`` (every row, once)."""

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

    _table = field_validator("table")(check_table_name)

    @model_validator(mode="after")
    def _inside_table(self) -> ShardRecord:
        if (
            self.row_offset + self.rows > self.num_rows
            or self.col_offset + self.cols > self.num_cols
        ):
            raise ValueError(
                f"shard of {self.table}: rows {self.row_offset}+{self.rows}, columns "
                f"{self.col_offset}+{self.cols} lie outside the {self.num_rows} x {self.num_cols} table"
            )
        for c in self.chunks:
            for seg in c.segments:
                # (a break-it finding: a re-signed [rows, 4] weight of an 8-column shard passed
                # verify, and `deck history` printed its 4 values as the row; other states may
                # have any row shape: one that does not fit the model is refused there)
                if seg.name == "weight" and tuple(seg.shape) != (c.rows, self.cols):
                    raise ValueError(
                        f"shard of {self.table}: segment weight of {c.path} has shape "
                        f"{list(seg.shape)}, not {c.rows} rows of the shard's {self.cols} columns"
                    )
        held = sum(c.rows for c in self.chunks)
        if held > self.rows or (self.full and held != self.rows):
            raise ValueError(
                f"shard of {self.table}: its chunks hold {held} rows, the shard has {self.rows}"
                + (" and is saved in full" if self.full else "")
            )
        return self


class FileRecord(_Strict):
    """A whole file with its checksum (dense and extra state)."""

    path: str
    nbytes: NonNeg
    checksum: str

    _path = field_validator("path")(check_rel_path)


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
    # Set when some chunk of this part holds quantised state (deck.format.quantize): the encoding.
    encoding: Encoding | None = None

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)

    @model_validator(mode="after")
    def _says_encoding(self) -> RankManifest:
        found = {c.encoding for s in self.shards for c in s.chunks if c.encoding is not None}
        if found != ({self.encoding} if self.encoding is not None else set()):
            raise ValueError(
                f"rank manifest says encoding {self.encoding}, its chunks hold {sorted(found)}"
            )
        return self

    @model_serializer(mode="wrap")
    def _omit_exact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _omit_none(handler(self), "encoding")

    def file_sizes(self, folder: str, into: dict[str, tuple[int, bool]]) -> None:
        """Add the data files this part names, under ``folder``, to ``into`` as key -> (bytes,
        exact): a chunk file's size, or for a bundle of chunks the least size that holds its
        last chunk (exact False)."""
        for rec in self.shards:
            for c in rec.chunks:
                key = f"{folder}/{c.path}"
                if c.offset is None:
                    into[key] = (c.nbytes, True)
                else:
                    into[key] = (max(into.get(key, (0, False))[0], c.offset + c.nbytes), False)
        for f in (self.dense, self.extra):
            if f is not None:
                into[f"{folder}/{f.path}"] = (f.nbytes, True)


class RankRef(_Strict):
    rank: NonNeg
    path: str
    nbytes: NonNeg
    checksum: str
    data_bytes: NonNeg

    _path = field_validator("path")(check_rel_path)


class CheckpointManifest(_Strict):
    """The commit record of one checkpoint, and its place in the lineage.

    ``parent`` is the step this delta is relative to (rows touched after ``parent``'s snapshot);
    ``base`` is the full checkpoint the chain starts from. A full has ``parent is None`` and
    ``base == step``.

    Records written by the merger (``state_id`` set; see docs/format.md, "Merged checkpoints")
    live under ``merged/`` and reproduce the state of the trainer checkpoint ``(step, state_id)``:

    - a merged delta (``kind == "merged"``, ``layer >= 1``) holds the newest version of every row
      of the ``inputs`` (consecutive deltas or merged deltas of layer ``layer - 1``, oldest first)
      and applies on top of state ``(parent, parent_id)``; it covers trainer steps
      ``first_step .. step``;
    - a merger full (``kind == "full"``) holds every row, built from ``inputs`` (a full, then the
      chain up to ``step``).

    The merger's fields default to "trainer checkpoint" and are left out of the JSON at their
    defaults, so trainer records are byte-for-byte what earlier versions wrote.
    """

    format_version: int
    id: CkptId
    step: NonNeg
    kind: Kind
    parent: NonNeg | None
    parent_id: str | None
    base: NonNeg
    epoch: NonNeg
    world_size: int = Field(ge=1)
    ranks: tuple[RankRef, ...]
    created_unix: UnixTime
    deck_version: str
    first_step: NonNeg | None = None
    layer: int = Field(default=0, ge=0, le=64)
    inputs: tuple[CkptId, ...] = ()
    state_id: CkptId | None = None
    # Set when the checkpoint holds quantised weights (some rank manifest says this encoding):
    # restoring it needs an explicit opt-in (deck.read.restore.apply_chain(allow_quantized=True)).
    encoding: Encoding | None = None

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)

    @model_validator(mode="after")
    def _lineage(self) -> CheckpointManifest:
        # In this order, so a record breaking several rules is named by the same one as ever.
        self._check_parent()
        if self.state_id is None:
            self._check_trainer_record()
        elif self.kind is Kind.DELTA:
            raise ValueError("a checkpoint with state_id is merged or a merger full, not a delta")
        elif self.kind is Kind.MERGED:
            self._check_merged_delta()
        else:
            self._check_merger_full()
        self._check_ranks()
        return self

    def _check_parent(self) -> None:
        """Every kind: a full has no parent and is its own base; a delta or merged delta
        applies on a parent (id and step) older than itself."""
        if self.kind is Kind.FULL:
            if self.parent is not None or self.base != self.step:
                raise ValueError("a full checkpoint has no parent and is its own base")
        elif self.parent is None or self.parent_id is None or self.parent >= self.step:
            raise ValueError("a delta needs a parent (id and step) older than itself")

    def _check_trainer_record(self) -> None:
        """No state_id: the trainer's full or delta, none of the merger's fields set."""
        if self.kind is Kind.MERGED or self.layer or self.first_step is not None or self.inputs:
            raise ValueError(
                "merged checkpoints need state_id; trainer checkpoints have no layer, "
                "first_step or inputs"
            )

    def _check_merged_delta(self) -> None:
        """The merger's merged delta: a layer above the trainer's deltas, built from two or more
        inputs, covering the trainer steps ``first_step .. step`` after its parent."""
        if (
            self.layer < 1
            or len(self.inputs) < 2
            or self.first_step is None
            or self.parent is None
            or not self.parent < self.first_step <= self.step
        ):
            raise ValueError(
                "a merged delta needs layer >= 1, two or more inputs and parent < first_step <= step"
            )

    def _check_merger_full(self) -> None:
        """The merger's full: built from its inputs; no layer, no first step (a falsy
        ``first_step``, 0, passes as it always has)."""
        if not self.inputs or self.layer or self.first_step:
            raise ValueError("a merger full lists its inputs and has no layer or first_step")

    def _check_ranks(self) -> None:
        """Every kind: one rank reference per rank of ``world_size``."""
        if len({r.rank for r in self.ranks}) != self.world_size or any(
            r.rank >= self.world_size for r in self.ranks
        ):
            raise ValueError("ranks must list each rank of world_size exactly once")

    @model_serializer(mode="wrap")
    def _omit_merger_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Trainer records stay exactly what format v1 readers without merging expect (they
        # forbid unknown keys): the merger's fields are written only when set.
        out: dict[str, Any] = handler(self)
        for name, defaults in _MERGER_DEFAULTS.items():
            if name in out and any(out[name] == d for d in defaults):
                del out[name]
        return out

    @property
    def data_bytes(self) -> int:
        """Bytes of all files of this checkpoint (chunks, dense, extra, rank manifests)."""
        return sum(r.data_bytes + r.nbytes for r in self.ranks)

    @property
    def is_merged(self) -> bool:
        """Written by the merger (a merged delta or a merger full), not by the trainer."""
        return self.state_id is not None

    @property
    def state(self) -> tuple[int, str]:
        """The training state this checkpoint reproduces: (step, id of the trainer checkpoint)."""
        return (self.step, self.state_id if self.state_id is not None else self.id)

    @property
    def start(self) -> tuple[int, str] | None:
        """The state a delta / merged delta applies on; None for a full."""
        if self.parent is None or self.parent_id is None:
            return None
        return (self.parent, self.parent_id)

    @property
    def covers(self) -> tuple[int, int]:
        """First and last trainer step whose rows this checkpoint holds (a full: its own step)."""
        if self.kind is Kind.FULL:
            return (self.step, self.step)
        return (self.first_step if self.first_step is not None else self.step, self.step)

    @property
    def folder(self) -> str:
        """The folder (relative to the root URI) holding ``manifest.json`` and every path this
        record and its rank manifests name."""
        if self.state_id is None:
            return step_dir(self.step)
        if self.kind is Kind.FULL:
            return merged_dir(self.id, self.step)
        assert self.first_step is not None  # checked by the validator
        return merged_dir(self.id, self.step, layer=self.layer, first_step=self.first_step)


# Values at which the merger's fields are left out of the JSON (tuples dump as lists in JSON mode).
_MERGER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "first_step": (None,),
    "layer": (0,),
    "inputs": ((), []),
    "state_id": (None,),
    "encoding": (None,),  # not a merger field: exact checkpoints dump as before it existed
}


class MergePartRecord(_Strict):
    """One finished partition (one rank's shard) of a merger checkpoint that is being built:
    ``merged/<name>/parts/<partition>.json``. Written after the partition's chunks are durable;
    the checkpoint is committed once every partition has one (docs/format.md)."""

    format_version: int
    item_id: CkptId
    rank: NonNeg
    shard: ShardRecord

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)


class QuarantineRecord(_Strict):
    """``quarantine/<id>.json``: checkpoint ``id`` (in ``folder``) failed verification; chains
    avoid it. Written by the merger, ``deck verify --quarantine`` or a restore with fallback."""

    format_version: int
    id: CkptId
    folder: str
    reason: str
    created_unix: UnixTime

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)

    _folder = field_validator("folder")(check_rel_path)


def _check_version(v: int) -> int:
    if v != FORMAT_VERSION:
        raise ValueError(
            f"format_version {v} is not supported by this deck (reads {FORMAT_VERSION}); "
            "upgrade deck to read it"
        )
    return v


# Step folders are named by 12 digits (docs/format.md): the largest step a checkpoint can have
MAX_STEP = 10**12 - 1


def step_dir(step: int) -> str:
    """Folder of the checkpoint of ``step``."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in 0..{MAX_STEP}, got {step}")
    return f"step-{step:012d}"


def as_step(step: object, call: str) -> int:
    """``step`` as an int (numpy and 0-d tensor integers too), or a :class:`ConfigError` for
    anything else -- a float, a bool, a negative number -- naming the call: what every API
    that takes a step from its caller checks first."""
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"{call}(step={step!r}): a step is the training step's number, an int >= 0, not "
            f"{type(step).__name__}"
        ) from None
    if value < 0:
        raise ConfigError(f"{call}(step={value}): steps are numbered from 0")
    if value > MAX_STEP:
        # (a break-it finding: step() took it, and the checkpoint failed in the background)
        raise ConfigError(
            f"{call}(step={value}): a step is at most {MAX_STEP:,} (a step folder's name "
            "holds 12 digits); give the training step's number, not a clock's time (Unix "
            "milliseconds or nanoseconds are larger)"
        )
    return value


def steps_text(steps: Iterable[int], near: int | None = None) -> str:
    """``steps`` for an error message: all of them when few (``[0, 5, 10]``), else the first
    and last three and those around ``near`` (the step asked for), with the count: a message
    about a history of 100,000 checkpoints stays one short line."""
    s = sorted(steps)
    if len(s) <= 12:
        return str(s)
    keep = {0, 1, 2, len(s) - 3, len(s) - 2, len(s) - 1}
    if near is not None:
        i = bisect.bisect_left(s, near)
        keep.update(range(max(0, i - 3), min(len(s), i + 3)))
    parts: list[str] = []
    for i in sorted(keep):
        if parts and i - 1 not in keep:
            parts.append("...")
        parts.append(str(s[i]))
    return f"[{', '.join(parts)}] ({len(s)} steps)"


def step_dirs_from(step: int) -> str:
    """A name every step folder of ``step`` or above sorts after, and no lower one does: the
    ``after`` of a :meth:`deck.storage.Storage.list_dir` of the root that lists those folders
    (names are zero-padded, so their order is the steps')."""
    return step_dir(step - 1) if step > 0 else "step-"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<n>`` folder name, or None for anything else."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def merged_dir(
    ckpt_id: str, step: int, *, layer: int | None = None, first_step: int | None = None
) -> str:
    """Folder of a merger-written checkpoint: ``merged/F-<step>-<id>`` for a merger full,
    ``merged/L<layer>-<first_step>-<step>-<id>`` for a merged delta (steps with 12 digits).

    The id is part of the name, so items of different timelines never share a folder, and the
    merger's ids are a hash of their inputs, so a rerun writes the same folder.
    """
    if layer is None:
        return f"{MERGED_ROOT}/F-{step:012d}-{ckpt_id}"
    if first_step is None:
        raise ValueError("a merged delta's folder needs first_step")
    return f"{MERGED_ROOT}/L{layer:02d}-{first_step:012d}-{step:012d}-{ckpt_id}"


def parse_merged_dir(name: str) -> tuple[str, int] | None:
    """(id, step) of a ``merged/`` child folder name, or None for anything else."""
    m = _MERGED_DIR.fullmatch(name)
    if not m:
        return None
    step = m.group(1) if m.group(1) is not None else m.group(4)
    return m.group(5), int(step)


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def rank_failure_name(rank: int) -> str:
    """Beside the rank manifests of an attempt: this rank's part failed after training was
    released (its first-tier writes), so rank 0 stops waiting for it. UTF-8 text of the error;
    never read as checkpoint data."""
    return f"rank-{rank:05d}.failed"


def table_dir(table: str) -> str:
    """A file-system-safe folder name for a table key (state_dict key of its weight), one per
    key: a key with other characters has them replaced by ``_`` and the xxh3-64 of the key
    appended (``user/id`` and ``user_id`` are two tables TorchRec accepts; one folder would
    have had each overwrite the other's chunks). Readers take paths from the records, never
    from this."""
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", table)
    if safe == table:
        return safe
    return f"{safe}-{xxhash.xxh3_64_hexdigest(table.encode())}"


M = TypeVar("M", bound=BaseModel)


# Every manifest carries the xxh3-64 of its own canonical JSON under this key, so that any
# damage to a manifest (not only to the files it lists) is detected.
SELF_CHECKSUM = "self_checksum"


def _canonical(d: dict[str, Any]) -> bytes:
    # Compact separators keep json's C encoder (any indent falls back to the pure-Python one:
    # 5x slower, a sixth of a merger pass on manifests with many chunks).
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


# Serialisation context key of :class:`_Lifted` (see :func:`dump_model`).
_LIFTED = "deck.lifted"


class _Lifted:
    """Parts of a record taken out while it is encoded, and put back after.

    A delta's rank manifest is ~1/4 MB, nearly all of it base64 filters, and ``json.dumps``
    scans every character of a string for escapes (~50 us per chunk's filter, on whichever
    background thread writes the record, holding the GIL). A filter is base64 (checked when the
    record is built), which JSON writes as it is; a field whose value was encoded before (a
    pending record's rank manifest, :func:`dump_model`) is its canonical JSON again. So each is
    encoded as a short placeholder string and its bytes are spliced in place of it: the result
    is the same bytes as encoding everything in place."""

    def __init__(self) -> None:
        self.nonce = os.urandom(8).hex()  # no other string of a record holds it (checked)
        self.fragments: list[bytes] = []

    def lift(self, s: str) -> str:
        """The placeholder of string ``s`` (JSON-safe as it is: no escapes)."""
        return self.fragment(b'"' + s.encode() + b'"')

    def fragment(self, encoded: bytes) -> str:
        """The placeholder of a value whose canonical JSON is ``encoded``."""
        self.fragments.append(encoded)
        return f"{self.nonce}{len(self.fragments) - 1:08d}"

    def splice(self, body: bytes) -> bytes | None:
        """``body`` with the fragments back in place of their placeholders; None when the
        nonce turned up anywhere else in it."""
        if not self.fragments:
            return body
        pieces = body.split(b'"' + self.nonce.encode())
        if len(pieces) != len(self.fragments) + 1:
            return None
        out = [pieces[0]]
        for piece in pieces[1:]:
            out += (self.fragments[int(piece[:8])], piece[9:])
        return b"".join(out)


def _canonical_v1(d: dict[str, Any]) -> bytes:
    """The canonical form of manifests written by earlier deck builds (indent 1), still accepted."""
    return json.dumps(d, sort_keys=True, indent=1).encode()


def encode_body(model: BaseModel, encoded: dict[str, bytes] | None = None) -> bytes:
    """The record's canonical JSON (sorted keys, compact), without its checksum: what
    :func:`dump_model` checksums. ``encoded``: fields of ``model`` whose values' canonical JSON
    is already known (:func:`encode_body` of them), put in as they are instead of encoded
    again."""
    lifted = _Lifted()
    encoded = encoded or {}
    d = model.model_dump(mode="json", context={_LIFTED: lifted}, exclude=set(encoded) or None)
    for name, value in encoded.items():
        d[name] = lifted.fragment(value)
    body = lifted.splice(_canonical(d))
    if body is None:  # a placeholder was not unique: encode the record in place
        body = _canonical(model.model_dump(mode="json"))
    return body


def with_checksum(body: bytes) -> bytes:
    """A record's file from its canonical JSON (:func:`encode_body`): the same bytes with its
    own checksum (``self_checksum``, the xxh3-64 of ``body``) as the last key. Put in instead
    of encoding the record a second time (a delta's rank manifest is ~1/4 MB of row-index
    filters): readers take the keys in any order and check it against the canonical form
    without it."""
    tail = f'"{SELF_CHECKSUM}":"{xxhash.xxh3_64_hexdigest(body)}"}}'.encode()
    return body[:-1] + (b"" if body == b"{}" else b",") + tail


def dump_model(model: BaseModel, encoded: dict[str, bytes] | None = None) -> bytes:
    """Serialise a manifest as JSON (UTF-8) with its own checksum embedded (``self_checksum``,
    the last key: the xxh3-64 of the record's canonical JSON without it, sorted keys).
    ``encoded``: as :func:`encode_body`."""
    return with_checksum(encode_body(model, encoded))


def _written_body(data: bytes) -> bytes | None:
    """The body :func:`dump_model` checksummed, when ``data`` ends the way it writes the
    checksum (``,"self_checksum":"<16 hex>"}``); else None."""
    raw = data if isinstance(data, bytes) else bytes(data)  # no copy of a ~1/4 MB record
    cut = len(raw) - _TAIL_LEN
    if cut < 1 or not raw.endswith(b'"}') or raw[cut : cut + len(_TAIL_KEY)] != _TAIL_KEY:
        return None
    if raw[cut - 1 : cut] == b",":
        return raw[: cut - 1] + b"}"
    return raw[:cut] + b"}" if raw[:cut] == b"{" else None


_TAIL_KEY = f'"{SELF_CHECKSUM}":"'.encode()
_TAIL_LEN = len(_TAIL_KEY) + 16 + 2  # the key, the hex digest, '"}'


def load_model(cls: type[M], data: bytes, where: str) -> M:
    """Parse, check and validate a manifest; any problem raises CorruptCheckpointError naming
    ``where``. The embedded checksum is verified when present: any changed byte of the content
    is detected (a manifest written without one, by hand, is only validated)."""
    fast = _load_written(cls, data)
    if fast is not None:
        return fast
    d = load_json(data, where, f"{cls.__name__} record")
    if isinstance(d, dict) and SELF_CHECKSUM in d:
        want = d.pop(SELF_CHECKSUM)
        # As dump_model wrote it, the file is the canonical body with the checksum put in
        # before its closing brace: checked on those bytes, without encoding the record again.
        body = _written_body(data)
        if body is None or want != xxhash.xxh3_64_hexdigest(body):
            body = _canonical(d)
            if want != xxhash.xxh3_64_hexdigest(body) and want != xxhash.xxh3_64_hexdigest(
                _canonical_v1(d)
            ):
                raise CorruptCheckpointError(
                    f"{where}: {cls.__name__} fails its own checksum; the file is damaged"
                )
        data = body
    try:
        return cls.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise CorruptCheckpointError(
            f"{where}: invalid {cls.__name__} ({e.error_count()} problem(s); first at '{loc}': "
            f"{first['msg']}); the file is damaged or was not written by deck"
        ) from None


def _load_written(cls: type[M], data: bytes) -> M | None:
    """The record ``data`` as :func:`load_model` gives it, when it is exactly what
    :func:`dump_model` writes and valid; None for anything else, which :func:`load_model` then
    decodes, checks and reports the slow way (the same messages as ever).

    Every reader of a long history parses each commit record (100,000 of them for ``deck ls
    --all``), and the slow way decodes each twice: ``json.loads`` for the embedded checksum and
    the nesting bound, then pydantic. Here the checksum is read from the record's last bytes
    (where :func:`dump_model` puts it) and checked against the body, the nesting bound is the
    count of opening brackets (a record with at most :data:`MAX_RECORD_DEPTH` of them nests no
    deeper), and pydantic decodes the body once: the same call on the same bytes as the slow
    way's last step. pydantic's decoder is the stricter one (it refuses invalid UTF-8, control
    characters in strings and lone surrogates, which ``json.loads`` takes), so a record taken
    here is one the slow way takes too (tests/format/test_load_fast.py)."""
    raw = data if isinstance(data, bytes) else bytes(data)
    body = _written_body(raw)
    if body is None or raw[-18:-2] != xxhash.xxh3_64_hexdigest(body).encode():
        return None
    if body.count(b"[") + body.count(b"{") > MAX_RECORD_DEPTH:
        return None
    try:
        return cls.model_validate_json(body)
    except ValidationError:
        return None
