"""User configuration: one :class:`DeckConfig` a user fills.

Pydantic validates every field; an invalid value raises :class:`deck.errors.ConfigError` whose
message names the field and says what is allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deck.errors import ConfigError

PAGE_BYTES = 4096
CHECKPOINT_CONSUMER = "checkpoint"
PUBLISH_CONSUMER = "publish"


Tiers = Literal["auto", "local", "cpu-remote", "cpu-ssd-remote"]


class Settings(BaseModel):
    """Base of every deck configuration model (DeckConfig, StagingConfig, MergeConfig,
    RetentionPolicy, RetryPolicy, ...): frozen, unknown fields refused, and an invalid value
    raises :class:`ConfigError` with one line per bad field (``Model.field: why (got value)``).
    Fields carry ``description`` and ``json_schema_extra`` (``constraints``, ``cli``), from which
    :mod:`deck.docgen` writes docs/configuration.md."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e) from None


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
        json_schema_extra={"constraints": "a positive multiple of 4096"},
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
        description="Cap on the CPU chunk buffers of one rank's snapshot (the pool never holds "
        "more, nor fewer than chunks_in_flight). A part larger than it waits for buffers "
        "while the first tier writes; CheckpointStats.pool_capped and a log line say so.",
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
        default=64 * 2**30, ge=0, description="Spool capacity (bytes staged but not uploaded)."
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
        "with its pending record, so a checkpoint save() returned survives a process crash.",
    )

    @field_validator("chunk_bytes")
    @classmethod
    def _page_multiple(cls, v: int) -> int:
        if v < PAGE_BYTES or v % PAGE_BYTES:
            raise ValueError(f"must be a positive multiple of {PAGE_BYTES} bytes, got {v}")
        return v

    @model_validator(mode="after")
    def _bundle_fits(self) -> StagingConfig:
        b = self.bundle_bytes
        if b and (b < self.chunk_bytes or b % PAGE_BYTES):
            raise ValueError(
                f"bundle_bytes must be 0 (off) or a multiple of {PAGE_BYTES} of at least "
                f"chunk_bytes={self.chunk_bytes}, got {b}"
            )
        return self


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
        "DeckConfig.uri); must differ from DeckConfig.uri.",
        json_schema_extra={"constraints": "non-empty, not DeckConfig.uri"},
    )
    every_steps: int = Field(
        default=10,
        ge=1,
        description="ckpt.step(step) publishes when step % n == 0 (a delta of the rows touched "
        "since the last publish; the first publish, or the one after a failure, is a full).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to fsspec for the publish URI: credentials, endpoint.",
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
        json_schema_extra={"constraints": "required when uri is kafka://"},
    )
    kafka: dict[str, Any] = Field(
        default_factory=dict,
        description="With a kafka:// uri: extra librdkafka producer settings (security, "
        "compression, timeouts); deck sets bootstrap.servers, acks=all and idempotence.",
    )
    max_message_bytes: int = Field(
        default=1_000_000,
        ge=4096,
        description="With a kafka:// uri: the largest message value deck produces; a table "
        "file is split into segments of at most this size. Keep it below the broker's "
        "message.max.bytes (and the topic's max.message.bytes) minus ~1 KiB of headers.",
    )

    @field_validator("uri")
    @classmethod
    def _uri_nonempty(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("must be a non-empty local path or fsspec URI")
        return v.strip()

    @model_validator(mode="after")
    def _kafka_state(self) -> PublishConfig:
        if self.uri.startswith("kafka://") and not self.state_uri:
            raise ValueError(
                "a kafka:// publish uri needs state_uri: where the dense and user state and "
                "the commit records of each publish go (a shared path or object store URI)"
            )
        return self


class DeckConfig(Settings):
    """Everything deck needs to checkpoint one TorchRec model.

    - ``uri``: where checkpoints go: a local directory (the default use) or an fsspec URI whose
      put is atomic (``s3://bucket/prefix``, ``gs://...``, ``az://...``, ``memory://...``;
      other protocols are refused: see :class:`deck.storage.FsspecStorage`).
    - ``delta_every_steps``: take a delta checkpoint every this many steps (``step % n == 0``).
    - ``full_every_steps``: take a full checkpoint every this many steps; ``None`` means only the
      first checkpoint is full (later fulls come from the merger).
    - ``consumers``: names of the tracking tenants that read deltas from one tracker store; the
      checkpointer uses ``"checkpoint"`` (always present); others (e.g. ``"publish"``) read
      their own deltas at their own pace.
    - ``storage_options``: passed to fsspec (credentials, endpoint).
    - ``track_eval``: also record ids looked up by forwards in eval mode (off: eval does not
      update rows, so tracking it only costs time).
    - ``save_rng``: save and restore every rank's torch RNG states (on by default).
    - ``lease_ttl_s``: the writer lease that keeps a second trainer off the URI (None: no lease).
    - ``publish``: an optional publisher tenant (:class:`PublishConfig`).
    """

    uri: str = Field(
        description="Where checkpoints go: a local directory or an object store URI whose put is "
        "atomic (s3://bucket/prefix, gs://..., az://..., memory:// for one-process jobs); other "
        "protocols (sftp, ftp, smb, hdfs, http, ...) are refused: mount them and give the path.",
        json_schema_extra={"constraints": "non-empty"},
    )
    delta_every_steps: int = Field(
        default=100,
        description="ckpt.step(step) takes a checkpoint when step % n == 0 (a delta, or a full "
        "when one is due).",
        json_schema_extra={"constraints": ">= 1"},
    )
    full_every_steps: int | None = Field(
        default=None,
        description="Also take a full when step % n == 0. None: only the first checkpoint of a "
        "process is full (later fulls come from the merger).",
        json_schema_extra={"constraints": ">= 1 or None; a multiple of delta_every_steps"},
    )
    consumers: tuple[str, ...] = Field(
        default=(CHECKPOINT_CONSUMER,),
        description="Tracking tenants that read their own deltas from one tracker store at their "
        "own pace (e.g. a publisher); checkpoint is always added.",
        json_schema_extra={"constraints": "unique names of [A-Za-z0-9_-], at most 8"},
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to fsspec: credentials, client_kwargs={'endpoint_url': ...}.",
    )
    track_eval: bool = Field(
        default=False,
        description="Also track lookups of eval-mode forwards (eval does not update rows, so "
        "this only costs time).",
    )
    save_rng: bool = Field(
        default=True,
        description="Save every rank's torch random number generator states (CPU, and CUDA where "
        "present) with each checkpoint and restore them, so dropout and other torch randomness "
        "resume exactly. Generators of your own and the data loader's position are your state.",
    )
    lease_ttl_s: float | None = Field(
        default=60.0,
        gt=0,
        description="Writer lease lifetime, renewed every third of it: a second trainer on the URI "
        "waits up to this long for it, then is refused; a crashed holder on the same host is taken "
        "over at once. None disables the lease.",
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

    @field_validator("uri")
    @classmethod
    def _uri_nonempty(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError(
                "must be a non-empty local path or fsspec URI such as s3://bucket/prefix"
            )
        return v.strip()

    @field_validator("delta_every_steps")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be an integer >= 1, got {v}")
        return v

    @field_validator("full_every_steps")
    @classmethod
    def _positive_or_none(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be an integer >= 1 or None (first checkpoint only), got {v}")
        return v

    @field_validator("consumers")
    @classmethod
    def _consumers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError(f"names must be unique, got {list(v)}")
        if len(v) > 8 or (len(v) == 8 and CHECKPOINT_CONSUMER not in v):
            raise ValueError(f"at most 8 consumers (one bit each in the tracker), got {len(v)}")
        for name in v:
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"names must be non-empty [A-Za-z0-9_-], got {name!r}")
        if CHECKPOINT_CONSUMER not in v:
            v = (CHECKPOINT_CONSUMER, *v)
        return v

    @model_validator(mode="after")
    def _full_multiple(self) -> DeckConfig:
        if self.full_every_steps is not None and self.full_every_steps % self.delta_every_steps:
            raise ValueError(
                f"full_every_steps ({self.full_every_steps}) must be a multiple of "
                f"delta_every_steps ({self.delta_every_steps}) so fulls land on checkpoint steps"
            )
        return self

    @model_validator(mode="after")
    def _publish_uri(self) -> DeckConfig:
        if self.publish is not None and self.publish.uri.rstrip("/") == self.uri.rstrip("/"):
            raise ValueError(
                f"publish.uri ({self.publish.uri}) must differ from uri: the two chains "
                "have their own steps, parents and epochs"
            )
        return self

    @property
    def tracking_consumers(self) -> tuple[str, ...]:
        """The tracker's tenants: ``consumers``, plus ``"publish"`` when publishing."""
        if self.publish is None or PUBLISH_CONSUMER in self.consumers:
            return self.consumers
        return (*self.consumers, PUBLISH_CONSUMER)


def config_error(e: ValidationError) -> ConfigError:
    """Turn a pydantic error into a ConfigError naming each bad field (``Model.field``, the model
    being the one validated: ``DeckConfig``, ``RetentionPolicy``, ...) and what is allowed."""
    lines = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        lines.append(f"{e.title}.{field}: {err['msg']} (got {err.get('input')!r})")
    return ConfigError("invalid deck configuration:\n  " + "\n  ".join(lines))
