"""User configuration: one :class:`DeckConfig` a user fills.

Pydantic validates every field, strictly (an int field takes an int, not ``True`` nor ``2.0``),
when the model is built: by the constructor, ``model_validate``, ``model_validate_json``,
``model_validate_strings`` and ``model_copy(update=...)`` alike. An invalid value raises
:class:`deck.errors.ConfigError` (a ``ValueError``, as pydantic's ``ValidationError`` is) whose
message is one line naming the field as the user set it (``DeckConfig.staging.chunk_bytes``),
what is allowed and the value given, and whose ``errors()`` lists pydantic's error records.
Assigning to a field of a built model (they are frozen) raises it too.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from typing_extensions import Self

import deck.schemes as schemes
from deck.errors import ConfigError

PAGE_BYTES = 4096
MAX_CHUNK_BYTES = 2**30
CHECKPOINT_CONSUMER = "checkpoint"
PUBLISH_CONSUMER = "publish"


def check_storage_uri(value: str, *, publish: bool = False) -> str:
    """Return ``value`` stripped if it is a URI deck writes to: a local path or a scheme of
    :mod:`deck.schemes` whose put is atomic (with ``publish``, also a publish sink such as
    ``kafka://``); else raise ``ValueError`` saying which schemes are supported (pydantic turns
    it into a ConfigError naming the field)."""
    value = value.strip()
    if not value:
        raise ValueError("must be a non-empty local path or URI such as s3://bucket/prefix")
    if "\x00" in value:
        raise ValueError("holds a NUL character, which no path or URI can")
    schemes.lookup(value, "publish" if publish else "storage")
    return value


def _multiple_of(v: int | None, info: ValidationInfo, base: str, steps: str) -> int | None:
    """``v`` (a full interval) unless it is not a multiple of the field ``base``, validated
    before it (absent when it was invalid itself)."""
    every = info.data.get(base)
    if v is not None and every is not None and v % every:
        raise ValueError(f"must be a multiple of {base} ({every}) so fulls land on {steps}")
    return v


def _fspath(value: Any) -> Any:
    """A ``pathlib.Path`` (any ``os.PathLike``) as its string; anything else unchanged."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


Tiers = Literal["auto", "local", "cpu-remote", "cpu-ssd-remote"]


class Settings(BaseModel):
    """Base of every deck configuration model (DeckConfig, StagingConfig, MergeConfig,
    RetentionPolicy, RetryPolicy, ...): frozen, unknown fields refused, strict types (no
    ``True`` for an int, no ``"5"`` for a number), and an invalid value raises
    :class:`ConfigError` of one line (``Model.field: why (got value)``, several bad fields
    joined by ``;``) from the constructor, every ``model_validate*`` classmethod and
    ``model_copy(update=...)``; assigning to a field raises it too.
    Fields carry ``description`` and ``json_schema_extra`` (``constraints``, ``cli``), from which
    :mod:`deck.docgen` writes docs/configuration.md."""

    # (NaN and infinities are refused as what they are: a bound's message would say a NaN
    # was too large; None is the way to say "no limit")
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e, type(self)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        # Frozen: pydantic would raise its ValidationError ("Instance is frozen").
        raise ConfigError(
            f"{type(self).__name__} is frozen: make a changed copy with "
            f"model_copy(update={{{name!r}: ...}}) (validated like a new one)"
        )

    def __delattr__(self, name: str) -> None:
        raise ConfigError(f"{type(self).__name__} is frozen: its fields cannot be deleted")

    # pydantic's own entry points raise its ValidationError; deck's raise ConfigError, so a
    # caller catches one exception type however the model was built.
    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate ``obj`` (a dict or model); raises :class:`ConfigError`."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise config_error(e, cls) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """Validate a JSON document; raises :class:`ConfigError`."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise config_error(e, cls) from None

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate a dict of strings (as from environment variables); raises
        :class:`ConfigError`. Strict like the others: a number given as a string is refused
        (parse it first, or pass a JSON document to :meth:`model_validate_json`)."""
        try:
            return super().model_validate_strings(obj, **kwargs)
        except ValidationError as e:
            raise config_error(e, cls) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with the fields in ``update`` replaced, validated like a new model (pydantic's
        own ``model_copy`` would not validate them); raises :class:`ConfigError`."""
        if not update:
            return super().model_copy(deep=deep)
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self).model_validate({**fields, **update})


STAGING_MODE_ENV = "DECK_STAGING_MODE"


def _default_staging_mode() -> Literal["threads", "process"]:
    """``StagingConfig.mode`` when not given: ``DECK_STAGING_MODE`` if set and not empty (a
    whole test suite or fleet switched at once; an empty value, as templated environments
    leave it, is unset), else threads."""
    value = os.environ.get(STAGING_MODE_ENV) or "threads"
    if value not in ("threads", "process"):
        raise ConfigError(f"{STAGING_MODE_ENV}={value!r}: use threads or process")
    return value  # type: ignore[return-value]


class StagingConfig(Settings):
    """How checkpoint bytes travel: CPU chunk buffers -> local SSD spool -> destination URI.

    Tiers:
    - ``local``: the destination is a local directory; chunks are written straight into it, fsynced
      and committed in the background.
    - ``cpu-ssd-remote``: chunks go through the CPU chunk buffers to the spool directory
      (training resumes once every chunk is in the spool), then are uploaded and committed in the
      background. Training never waits on the remote tier unless the spool holds
      ``spool_max_bytes``; then ``spool_full`` decides: ``block`` (wait for uploads) or ``skip``
      (skip this checkpoint; its rows stay pending for the next one).
    - ``cpu-remote``: no spool; chunks are uploaded from the CPU buffers, so training waits for all
      but the last pool's worth of chunks to be uploaded.
    - ``auto`` (default): ``local`` for local paths, ``cpu-ssd-remote`` otherwise.

    CPU memory of the snapshot is a pool of chunk buffers sized from what the job saves: it
    grows to hold a whole delta part (so training never waits for a buffer on a steady
    workload), from ``chunks_in_flight`` buffers up to ``snapshot_memory_bytes`` whatever the
    model size, plus ``upload_concurrency`` chunk reads in the upload tier.
    """

    chunk_bytes: int = Field(
        default=4 * 1024 * 1024,
        description="Size of one chunk file; every chunk of a shard but the last is exactly this "
        "long (SSD-page aligned).",
        json_schema_extra={"constraints": "a positive multiple of 4096, at most 1 GiB"},
    )
    chunks_in_flight: int = Field(
        default=4,
        ge=1,
        le=256,
        description="The fewest reusable CPU chunk buffers. The pool grows from there to hold "
        "a whole delta part (sized from the parts the job saves), up to snapshot_memory_bytes.",
    )
    snapshot_memory_bytes: int = Field(
        default=2**30,
        ge=0,
        description="Cap on the CPU chunk buffers of one rank's snapshot: the pool never holds "
        "more. It holds at least chunks_in_flight buffers (of chunk_bytes, or bundle_bytes "
        "when bundling), so a cap below those is refused. A part larger than it waits for "
        "buffers while the first tier writes; CheckpointStats.pool_capped and a log line say "
        "so.",
        json_schema_extra={"constraints": ">= chunks_in_flight x chunk_bytes (or bundle_bytes)"},
        validate_default=True,  # (a chunk_bytes that the default cap cannot hold is refused)
    )
    bundle_bytes: int = Field(
        default=0,
        ge=0,
        description="Bundle small chunks: chunks of one rank's part are appended (page-aligned) "
        "into bundle files of up to this many bytes, so a restore issues few large reads and "
        "the store holds fewer objects. 0 (default): one file per chunk. A pool buffer then "
        "holds one bundle.",
        json_schema_extra={"constraints": "0, or a multiple of 4096 at least chunk_bytes"},
    )
    tiers: Tiers = Field(
        default="auto",
        description="How bytes travel: local (straight into a local destination), cpu-ssd-remote "
        "(CPU buffers -> spool -> upload), cpu-remote (CPU buffers -> upload, no spool); auto: "
        "local for paths, cpu-ssd-remote otherwise.",
    )
    spool_dir: str | None = Field(
        default=None,
        description="Local SSD directory for the spool (default: $TMPDIR/deck-spool). Put it on a "
        "persistent local disk: a restarted process finishes uploads it finds there.",
    )
    spool_max_bytes: int = Field(
        default=64 * 2**30,
        ge=0,
        description="Spool capacity (bytes staged but not uploaded). A part that would take the "
        "spool past it waits (spool_full) only while other parts are in it: an empty spool takes "
        "the next part whatever its size, so the cap bounds the backlog an outage builds, not a "
        "single checkpoint (0: one part in flight at a time). Not used by tiers='local', which "
        "writes into the destination itself.",
    )
    spool_full: Literal["block", "skip"] = Field(
        default="block",
        description="When the spool holds spool_max_bytes: block (the checkpoint waits for "
        "uploads) or skip (skip the checkpoint; its rows stay pending for the next one).",
    )
    upload_concurrency: int = Field(
        default=4, ge=1, le=64, description="Parallel uploads per rank."
    )
    retry_initial_s: float = Field(
        default=0.5, gt=0, description="First backoff of a failed upload, doubled per retry."
    )
    retry_max_s: float = Field(
        default=30.0, gt=0, description="Longest backoff between upload retries."
    )
    upload_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="Give up a checkpoint whose upload keeps failing this long; the next "
        "checkpoint is then a full.",
    )
    background_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Nice increment of the stager's background threads (fsync, upload, commit, "
        "and the spool writer with release=in_memory; Linux): uploads and checksums yield the "
        "CPU to training, whose steps would otherwise slow down while a large checkpoint "
        "uploads. 0: the training process's priority.",
    )
    commit_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="Rank 0 waits this long for every rank's part before giving up (a rank "
        "whose part failed says so at once; this bounds a rank that went silent).",
    )
    release: Literal["in_memory", "first_tier"] = Field(
        default="in_memory",
        description="When a checkpoint gives training back. in_memory: once every rank's rows "
        "are in the CPU chunk buffers (the stall is the gather, plus waiting for buffers when a "
        "rank's part exceeds snapshot_memory_bytes); a steady delta's first-tier writes start "
        "once the ranks agreed (nothing competes with the stalled job) and go on in the "
        "background, and a write that fails there makes the step uncommitted and the next "
        "checkpoint a full. first_tier: once every rank's part is written to the first tier "
        "with its pending record, so a checkpoint save() returned survives a process crash "
        "(restarted on the same world size, with the same spool); not with tiers='cpu-remote', "
        "which has no spool for that record.",
    )
    max_unwritten: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Most checkpoints of a rank whose parts are still only in memory (not yet "
        "written to the first tier) at once, with release=in_memory: a checkpoint beyond it "
        "first waits for the oldest to be written (CheckpointStats.backlog_wait_s, a warning "
        "once). So a job checkpointing faster than its first tier writes slows down instead of "
        "building a backlog that a crash would lose: a crash loses at most this many "
        "checkpoints. Those in the first tier are finished by a restart.",
    )
    copy_on_write: Literal["off", "deltas", "all"] = Field(
        default="deltas",
        description="With release=in_memory, a checkpoint's rows are copied after the stall: "
        "the stall claims the rows and captures the dense state; a background thread copies "
        "the rows into the chunk buffers, and a step's lookup first copies any of its rows "
        "still pending, so the saved bytes are the rows at the checkpoint's step. deltas "
        "(default): deltas only; all: fulls too (a full's stall then no longer grows with the "
        "model, but its copy lasts as long as its writes, bounded by snapshot_memory_bytes, and "
        "every lookup until then checks and saves its rows: on a 2-core VM the steps after a "
        "2 GiB full ran 30-90% slower for seconds); off: copy in the stall. Copied in the "
        "stall anyway (logged) with release=first_tier or bundle_bytes; tables "
        "off the CPU and quantised states are copied in the stall. Your own writes to "
        "embedding rows outside a step's lookup (a max-norm clamp, re-initialised rows) are "
        "not tracked: name them with mark_rows(table, ids) before writing them (it copies "
        "what the checkpoint just taken still needs of those rows first; called after, the "
        "write may reach that checkpoint unless it was copied: flush() or wait_for(step)), "
        "or take a full checkpoint after them (save('full')), else a delta restores the rows "
        "they changed that no lookup touched since as they were before. "
        "(model.load_state_dict of sharded tables is handled: it waits for the copy of their "
        "rows and its rows go into the next delta.)",
    )

    mode: Literal["threads", "process"] = Field(
        default_factory=lambda: _default_staging_mode(),
        description="Where the background staging runs (default: threads, or the environment "
        "variable DECK_STAGING_MODE). threads: background threads of the "
        "training process. process: a staging process per rank (started at enable, spawned, not "
        "forked), fed through shared-memory chunk buffers, so the training thread never waits "
        "for the GIL while chunks are checksummed, written, uploaded and committed; the "
        "training process keeps the stall, the copy-on-write copy and the lookup guard; it is in "
        "a process group of its own (a terminal's Ctrl-C reaches the training process, whose "
        "close drains it). Falls back to threads (a WARNING on rank 0) without memfd shared "
        "memory (non-Linux), for a storage object passed to enable() instead of a URI, a "
        "memory:// store, storage_options that are not JSON, GPU tables (pinned buffers) and "
        "a publish sink that cannot be opened again by a process (a kafka:// publisher's sink "
        "runs in the staging process). A staging process that dies fails the parts it held "
        "(release='first_tier' too: the training process goes on, and the next checkpoint is a "
        "full).",
    )

    @field_validator("spool_dir", mode="before")
    @classmethod
    def _spool_path(cls, v: Any) -> Any:
        return _fspath(v)

    @field_validator("chunk_bytes")
    @classmethod
    def _page_multiple(cls, v: int) -> int:
        if v < PAGE_BYTES or v % PAGE_BYTES:
            raise ValueError(f"must be a positive multiple of {PAGE_BYTES} bytes")
        if v > MAX_CHUNK_BYTES:
            raise ValueError(
                f"must be at most {MAX_CHUNK_BYTES} bytes (1 GiB): each chunk buffer is "
                "allocated whole"
            )
        return v

    @field_validator("spool_dir")
    @classmethod
    def _spool_absolute(cls, v: str | None) -> str | None:
        # Resolved now: a restart (or a rank) in another working directory finds the same spool
        if v is not None and not v.strip():
            raise ValueError("must name a folder (None: $TMPDIR/deck-spool)")
        return None if v is None else os.path.abspath(v)

    @field_validator("retry_max_s")
    @classmethod
    def _retry_order(cls, v: float, info: ValidationInfo) -> float:
        first = info.data.get("retry_initial_s")  # absent when it was invalid itself
        if first is not None and first > v:
            raise ValueError(
                f"must be at least retry_initial_s ({first:g}): the first backoff doubles up "
                "to the longest"
            )
        return v

    @field_validator("release")
    @classmethod
    def _release_needs_a_record(cls, v: str, info: ValidationInfo) -> str:
        # (a break-it finding: the pending record that lets a restart finish a part lives in
        # the spool, and cpu-remote has none, so a checkpoint step() returned was lost)
        if v == "first_tier" and info.data.get("tiers") == "cpu-remote":
            raise ValueError(
                "first_tier keeps a checkpoint across a crash by the pending record written "
                "beside its files in the spool or local destination, and tiers='cpu-remote' "
                "has neither: use tiers='cpu-ssd-remote' (or 'auto') with first_tier, or "
                "release='in_memory'"
            )
        return v

    @field_validator("bundle_bytes")
    @classmethod
    def _bundle_fits(cls, v: int, info: ValidationInfo) -> int:
        chunk = info.data.get("chunk_bytes")  # absent when chunk_bytes itself was invalid
        if v and (v % PAGE_BYTES or (chunk is not None and v < chunk)):
            raise ValueError(
                f"must be 0 (off) or a multiple of {PAGE_BYTES} of at least chunk_bytes ({chunk})"
            )
        _within_cap(v, "bundle_bytes", info)
        return v

    @field_validator("snapshot_memory_bytes")
    @classmethod
    def _cap_holds_the_fewest(cls, v: int, info: ValidationInfo) -> int:
        # (a break-it finding: a cap below them was accepted and silently exceeded, 1 GiB of
        # buffers per rank under a cap of 4 KiB)
        n, chunk = info.data.get("chunks_in_flight"), info.data.get("chunk_bytes")
        if n is not None and chunk is not None and v < n * chunk:
            raise ValueError(
                f"must be at least chunks_in_flight x chunk_bytes ({n} x {chunk} = {n * chunk}): "
                "the pool never holds fewer buffers; lower chunks_in_flight or chunk_bytes, or "
                "raise the cap"
            )
        return v


# (a break-it finding: refused only at enable, as a DeckError that said nothing of what to use)
LOCAL_TIER_NEEDS = (
    "writes straight into a local directory: use tiers='auto' or 'cpu-ssd-remote' (a spool, "
    "then uploads) or 'cpu-remote' for"
)


def _within_cap(buffer: int, name: str, info: ValidationInfo) -> None:
    """Refuse a buffer size whose ``chunks_in_flight`` buffers exceed ``snapshot_memory_bytes``
    (validated before it, with the field ``name``)."""
    n, cap = info.data.get("chunks_in_flight"), info.data.get("snapshot_memory_bytes")
    if buffer and n is not None and cap is not None and n * buffer > cap:
        raise ValueError(
            f"chunks_in_flight x {name} ({n} x {buffer} = {n * buffer}) exceeds "
            f"snapshot_memory_bytes ({cap}): the pool holds at least that many buffers; lower "
            f"chunks_in_flight or {name}, or raise snapshot_memory_bytes"
        )


class PublishConfig(Settings):
    """A publisher tenant: a second delta chain, at its own (usually shorter) interval, to its own
    URI, for a loading service (``deck follow``) or a serving job to read.

    The publisher reads its own deltas from the tracker (consumer ``"publish"``) and writes an
    ordinary deck checkpoint chain (first publish a full, then deltas), staged in the background
    through its own stager. Its failures never touch the checkpoint chain: they are logged and the
    next publish is a full.
    """

    uri: str = Field(
        description="Where published deltas go: a local directory or an object store URI (as "
        "DeckConfig.uri), or kafka://host:port/topic; must differ from DeckConfig.uri.",
        json_schema_extra={"constraints": "non-empty, a supported scheme, not DeckConfig.uri"},
    )
    every_steps: int = Field(
        default=10,
        ge=1,
        description="ckpt.step(step) publishes when step % n == 0 (a delta of the rows touched "
        "since the last publish; the first publish, or the one after a failure, is a full).",
    )
    full_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Publish a full every this many steps (a multiple of every_steps), so that "
        "a loader that lost a step (Kafka retention, a poison message) moves on at the next "
        "one. None: a full only when needed (the first publish of a process, the first after a "
        "restore(), the one after a failure).",
        json_schema_extra={"constraints": "or None; a multiple of every_steps"},
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to fsspec for the publish URI: credentials, endpoint.",
    )
    take_over: bool = Field(
        default=False,
        description="Publish to a URI where another job (another checkpoint URI) published: "
        "followers and live models there move to this job's model at its first publish. "
        "False: such a URI is refused at enable (its _job.json names the other job's "
        "checkpoints); this job's own restarts are never refused.",
    )
    quantize: Literal["none", "fp16", "bf16", "int8"] = Field(
        default="none",
        description="Row-wise encoding of the weights in published checkpoints (Check-N-Run): "
        "fp16 / bf16 halve them, int8 (per-row fp32 scale, error <= row absmax / 254) cuts them "
        "to about a quarter; optimizer states stay exact. The manifests say so, and readers "
        "refuse such chains unless asked (deck follow --allow-quantized). Checkpoints (the "
        "recovery chain) are always exact.",
    )

    state_uri: str | None = Field(
        default=None,
        description="With a kafka:// uri: the fsspec URI (or local directory) where the dense "
        "and user state, the rank manifests and the commit records of each publish go; the "
        "table rows travel through the topic. Required for kafka://, unused otherwise.",
        validate_default=True,  # so that its absence with a kafka:// uri is refused here
        json_schema_extra={"constraints": "required when uri is kafka://"},
    )
    kafka: dict[str, Any] = Field(
        default_factory=dict,
        description="With a kafka:// uri: extra librdkafka producer settings (security, "
        "compression, timeouts); deck sets bootstrap.servers (from the uri), acks=all, "
        "idempotence and message.max.bytes (from max_message_bytes), and refuses them here.",
    )
    max_message_bytes: int = Field(
        default=1_000_000,
        ge=4096,
        description="With a kafka:// uri: the largest message value deck produces; a table "
        "file is split into segments of at most this size. The broker's message.max.bytes (and "
        "the topic's max.message.bytes) must exceed it by 4 KiB, the allowance for headers and "
        "record overhead (deck sets the producer's message.max.bytes to this sum).",
    )

    @field_validator("uri", "state_uri", mode="before")
    @classmethod
    def _paths(cls, v: Any) -> Any:
        return _fspath(v)

    @field_validator("uri")
    @classmethod
    def _uri_supported(cls, v: str) -> str:
        return check_storage_uri(v, publish=True)

    @field_validator("full_every_steps")
    @classmethod
    def _full_multiple(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _multiple_of(v, info, "every_steps", "publish steps")

    @field_validator("kafka")
    @classmethod
    def _kafka_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        from deck.format.stream import PRODUCER_SETS, options_deck_sets

        problem = options_deck_sets(v, PRODUCER_SETS)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("state_uri")
    @classmethod
    def _kafka_state(cls, v: str | None, info: ValidationInfo) -> str | None:
        uri = info.data.get("uri")  # absent when uri itself was invalid
        if v is not None:
            v = check_storage_uri(v)
        if uri is not None and schemes.lookup(uri, "publish").role == "publish" and not v:
            raise ValueError(
                f"a {schemes.scheme_name(uri)}:// publish uri needs state_uri: where the dense and user state and "
                "the commit records of each publish go (a shared path or object store URI)"
            )
        return v


class DeckConfig(Settings):
    """Everything deck needs to checkpoint one TorchRec model.

    - ``uri``: where checkpoints go: a local directory (the default use) or an fsspec URI whose
      put is atomic (``s3://bucket/prefix``, ``gs://...``, ``az://...``, ``memory://...``;
      other protocols are refused: see :class:`deck.storage.FsspecStorage`).
    - ``delta_every_steps``: take a delta checkpoint every this many steps (``step % n == 0``).
    - ``full_every_steps``: also take a full checkpoint every this many steps; ``None``: a full
      only when there is no committed checkpoint to build a delta on (the first checkpoint of a
      process that restored none, the one after a failed checkpoint or a broken chain); after
      ``restore()`` the next checkpoint is a delta of the restored step (a full when the
      restore changed any rank's shards). Later fulls come from the merger.
    - ``consumers``: names of the tracking tenants that read deltas from one tracker store; the
      checkpointer uses ``"checkpoint"`` (always present); others (e.g. ``"publish"``) read
      their own deltas at their own pace.
    - ``storage_options``: passed to fsspec (credentials, endpoint).
    - ``track_eval``: also record ids looked up by eval-mode forwards under ``no_grad`` (off:
      nothing updates their rows; an eval-mode forward a backward may follow is always tracked).
    - ``save_rng``: save and restore every rank's torch RNG states (on by default).
    - ``lease_ttl_s``: the writer lease that keeps a second trainer off the URI and the publish
      URI (None: no lease).
    - ``publish``: an optional publisher tenant (:class:`PublishConfig`).
    """

    uri: str = Field(
        description="Where checkpoints go: a local directory (a str or pathlib.Path, file:// or "
        "local://), or an object store URI whose put is atomic (s3://bucket/prefix, s3a://, "
        "gs://, gcs://, az://, abfs://, abfss://, memory:// for one-process jobs); other "
        "schemes (sftp, ftp, smb, hdfs, http, ...) are refused at construction: mount them and "
        "give the path.",
        json_schema_extra={"constraints": "non-empty; a path or a supported scheme"},
    )
    delta_every_steps: int = Field(
        default=100,
        ge=1,
        description="ckpt.step(step) takes a checkpoint when step % n == 0 (a delta, or a full "
        "when one is due).",
    )
    full_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Also take a full when step % n == 0. None: no scheduled fulls; the "
        "trainer takes a full only when it has no committed checkpoint to build a delta on: "
        "its first checkpoint when the process restored none (after restore() the next one is "
        "a delta of the restored step, or a full when the restore changed any rank's shards "
        "or was a rollback: a restore of any step but the latest), "
        "and the one after a checkpoint that failed or whose chain broke (damage, GC). Later "
        "fulls come from the merger (deck merge).",
        json_schema_extra={"constraints": "or None; a multiple of delta_every_steps"},
    )
    consumers: tuple[str, ...] = Field(
        default=(CHECKPOINT_CONSUMER,),
        description="Tracking tenants that read their own deltas from one tracker store at their "
        "own pace (e.g. a publisher); checkpoint is always added.",
        json_schema_extra={
            "constraints": "unique names of [A-Za-z0-9_-], at most 8 with checkpoint (7 of yours; 6 with publish)"
        },
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to fsspec: credentials, client_kwargs={'endpoint_url': ...}.",
    )
    track_eval: bool = Field(
        default=False,
        description="Also track lookups of eval-mode forwards whose output needs no gradient "
        "(nothing updates their rows, so this only costs time). An eval-mode or paused forward "
        "whose output requires grad is always tracked: its backward updates the rows.",
    )
    save_rng: bool = Field(
        default=True,
        description="Save every rank's torch random number generator states (CPU, and CUDA where "
        "present) with each checkpoint and restore them, so dropout and other torch randomness "
        "resume exactly. Generators of your own and the data loader's position are your state.",
    )
    lease_ttl_s: float | None = Field(
        default=60.0,
        # Below a second a renewal cannot keep up with its own lifetime (every checkpoint would
        # be refused); above 1e9 s (31 years) the lease record cannot hold it
        ge=1.0,
        le=1e9,
        description="Writer lease lifetime, renewed every third of it: a second trainer on the URI "
        "waits up to this long for it, then is refused; a crashed holder on the same host is taken "
        "over at once. Renewals failing for longer (a store outage) refuse checkpoints until the "
        "store answers and deck takes the lease again. The publish URI (publish.uri, or its "
        "state_uri for a Kafka topic) has a lease of its own, taken the same way. None disables "
        "both.",
    )
    staging: StagingConfig = Field(
        default_factory=StagingConfig,
        description="How checkpoint bytes travel: buffers, spool, uploads (StagingConfig).",
    )
    publish: PublishConfig | None = Field(
        default=None,
        description="A publisher tenant streaming its own delta chain to its own URI at its own "
        "interval (PublishConfig); None: no publishing.",
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _uri_path(cls, v: Any) -> Any:
        return _fspath(v)

    @field_validator("uri")
    @classmethod
    def _uri_supported(cls, v: str) -> str:
        return check_storage_uri(v)

    @field_validator("full_every_steps")
    @classmethod
    def _full_multiple(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _multiple_of(v, info, "delta_every_steps", "checkpoint steps")

    @field_validator("staging")
    @classmethod
    def _local_tier(cls, v: StagingConfig, info: ValidationInfo) -> StagingConfig:
        uri = info.data.get("uri")  # absent when uri itself was invalid
        if v.tiers == "local" and uri is not None and not schemes.is_local(uri):
            raise ValueError(f"tiers='local' {LOCAL_TIER_NEEDS} {uri}")
        return v

    @field_validator("consumers", mode="before")
    @classmethod
    def _consumers_sequence(cls, v: Any) -> Any:
        # strict mode takes only a tuple; a list of names is as clear and as common
        return tuple(v) if isinstance(v, list) else v

    @field_validator("consumers")
    @classmethod
    def _consumers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError("names must be unique")
        if len(v) > 8 or (len(v) == 8 and CHECKPOINT_CONSUMER not in v):
            raise ValueError(
                "at most 8 consumers, checkpoint included (one bit each in the tracker): 7 of "
                "your own"
            )
        for name in v:
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"names must be non-empty [A-Za-z0-9_-], not {name!r}")
        if CHECKPOINT_CONSUMER not in v:
            v = (CHECKPOINT_CONSUMER, *v)
        return v

    @field_validator("publish")
    @classmethod
    def _publish_uri(cls, v: PublishConfig | None, info: ValidationInfo) -> PublishConfig | None:
        uri = info.data.get("uri")
        consumers = info.data.get("consumers", ())
        if v is not None and len(consumers) == 8 and PUBLISH_CONSUMER not in consumers:
            # (publishing tracks its rows as one more tenant of the tracker's 8 bits)
            raise ValueError(
                "publishing takes a tracker consumer of its own (publish) and consumers already "
                "names 8: at most 6 of your own with publish"
            )
        if v is None or uri is None:
            return v
        # Compared as places, not strings: /r, file:///r and /tmp/../r are one folder
        for field, other in (("uri", v.uri), ("state_uri", v.state_uri)):
            if other is not None and schemes.location(other) == schemes.location(uri):
                raise ValueError(
                    f"publish.{field} ({other}) is the same place as uri ({uri}): the publish "
                    "chain has its own steps, parents and epochs; give it a place of its own"
                )
        return v

    @property
    def tracking_consumers(self) -> tuple[str, ...]:
        """The tracker's tenants: ``consumers``, plus ``"publish"`` when publishing."""
        if self.publish is None or PUBLISH_CONSUMER in self.consumers:
            return self.consumers
        return (*self.consumers, PUBLISH_CONSUMER)


def _records(e: ValidationError) -> list[Any]:
    """pydantic's error records of ``e``, flat: a nested deck model validated by its own
    constructor raised a ConfigError that pydantic wrapped as one value error at the nested
    field; its records come back here with their location under that field."""
    out: list[Any] = []
    for err in e.errors(include_url=False):
        inner = err.get("ctx", {}).get("error")
        if err["type"] == "value_error" and isinstance(inner, ConfigError) and inner.errors():
            out.extend({**rec, "loc": (*err["loc"], *rec["loc"])} for rec in inner.errors())
        else:
            out.append(err)
    return out


def config_error(
    e: ValidationError,
    model: type[BaseModel] | None = None,
    names: Mapping[str, str] | None = None,
) -> ConfigError:
    """Turn a pydantic error into a ConfigError of one line naming each bad field as the user
    sets it (``Model.field``, the model being the one validated: ``DeckConfig``,
    ``RetentionPolicy``, ...; nested fields as ``DeckConfig.staging.chunk_bytes``; ``names``:
    other names for fields, e.g. the command line's flags), what is allowed and the value
    given; a rule across fields is named by the model (or nested model) it belongs to. The
    pydantic records stay available as ``ConfigError.errors()``."""
    return describe_errors(_records(e), e.title, model, names)


def describe_errors(
    records: list[Any],
    title: str,
    model: type[BaseModel] | None = None,
    names: Mapping[str, str] | None = None,
) -> ConfigError:
    """The one-line ConfigError of pydantic error ``records`` of model ``title`` (``model``:
    its class, which names the fields an unknown one may have meant); ``names`` maps a field
    (its last name, e.g. ``chunk_bytes``) to what the user wrote instead (``--chunk-bytes``)."""
    said = []
    for err in records:
        path = tuple(str(p) for p in err["loc"])
        if names and path and path[-1] in names:
            where = names[path[-1]]
        else:
            where = ".".join((title, *path))
        given = err.get("input")
        why = _why(err, model, path)
        if err["type"] in ("missing", "extra_forbidden") or isinstance(given, (Mapping, BaseModel)):
            # the input is the whole (nested) model: a field missing, or a rule across fields;
            # an unknown field's value says nothing about what is wrong
            said.append(f"{where}: {why}")
        else:
            said.append(f"{where}: {why} (got {_short(given)})")
    if len(said) == 1:
        return ConfigError(said[0], errors=records)
    return ConfigError(f"{len(said)} invalid values: " + "; ".join(said), errors=records)


# pydantic's error types that say a bound: the message deck gives, from the error's context.
_BOUNDS = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
}
_KINDS = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "True or False",
    "dict_type": "a dict",
    "tuple_type": "a tuple or list",
    "list_type": "a list",
}


def _why(err: Mapping[str, Any], model: type[BaseModel] | None, path: tuple[str, ...]) -> str:
    """What is allowed, in deck's words, for one pydantic error record."""
    kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    if kind in _BOUNDS and all(k in ctx for k in ("gt", "ge", "lt", "le") if k in _BOUNDS[kind]):
        return _BOUNDS[kind].format(**ctx)
    if kind in _KINDS:
        what = _KINDS[kind]
        if kind == "bool_type":
            return f"must be {what}"
        if isinstance(given, bool):
            return f"must be {what}, not a bool"
        if isinstance(given, str) and kind != "string_type":
            return f"must be {what}, not a string"
        return f"must be {what}"
    if kind in ("model_type", "model_attributes_type") and "class_name" in ctx:
        return f"must be a {ctx['class_name']} or a dict of its fields"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        owner = _model_at(model, path[:-1])
        if owner is None:
            return "is not a field here"
        fields = sorted(owner.model_fields)
        close = difflib.get_close_matches(path[-1], fields, n=1)
        if close:
            return f"is not a field of {owner.__name__}; did you mean {close[0]}?"
        return f"is not a field of {owner.__name__} (its fields: {', '.join(fields)})"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return msg.replace("Input should be", "must be", 1)


def _model_at(model: type[BaseModel] | None, path: tuple[str, ...]) -> type[BaseModel] | None:
    """The model class of the (nested) field at ``path`` of ``model``, None if unknown."""
    for name in path:
        if model is None or name not in model.model_fields:
            return None
        ann = model.model_fields[name].annotation
        found = [
            t
            for t in (ann, *typing.get_args(ann))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        model = found[0] if found else None
    return model


def _short(value: Any) -> str:
    """``repr(value)``, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 120 else text[:100] + f"... ({len(text)} characters)"
