"""User configuration: one :class:`DeckConfig` a user fills.

Pydantic validates every field; an invalid value raises :class:`deck.errors.ConfigError` whose
message names the field and says what is allowed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deck.errors import ConfigError

PAGE_BYTES = 4096
CHECKPOINT_CONSUMER = "checkpoint"


class StagingConfig(BaseModel):
    """How checkpoint bytes are cut and moved. Later tiers (SSD spool, remote upload) extend this."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_bytes: int = Field(
        default=4 * 1024 * 1024,
        description="Target size of one chunk file; a multiple of 4096 (the SSD page).",
    )

    @field_validator("chunk_bytes")
    @classmethod
    def _page_multiple(cls, v: int) -> int:
        if v < PAGE_BYTES or v % PAGE_BYTES:
            raise ValueError(f"must be a positive multiple of {PAGE_BYTES} bytes, got {v}")
        return v


class DeckConfig(BaseModel):
    """Everything deck needs to checkpoint one TorchRec model.

    - ``uri``: where checkpoints go: a local directory (the default use) or any fsspec URI
      (``s3://bucket/prefix``, ``gs://...``, ``memory://...``).
    - ``delta_every_steps``: take a delta checkpoint every this many steps (``step % n == 0``).
    - ``full_every_steps``: take a full checkpoint every this many steps; ``None`` means only the
      first checkpoint is full (later fulls come from the merger).
    - ``consumers``: names of the tracking tenants that read deltas from one tracker store; the
      checkpointer uses ``"checkpoint"`` (always present); others (e.g. ``"publish"``) read
      their own deltas at their own pace.
    - ``storage_options``: passed to fsspec (credentials, endpoint).
    - ``track_eval``: also record ids looked up by forwards in eval mode (off: eval does not
      update rows, so tracking it only costs time).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str = Field(description="Checkpoint location: local path or fsspec URI.")
    delta_every_steps: int = Field(
        default=100, description="Delta checkpoint interval in steps (>= 1)."
    )
    full_every_steps: int | None = Field(
        default=None,
        description="Full checkpoint interval in steps (>= 1), or None for first-only.",
    )
    consumers: tuple[str, ...] = Field(
        default=(CHECKPOINT_CONSUMER,), description="Tracking tenants."
    )
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options.")
    track_eval: bool = Field(default=False, description="Track lookups of eval-mode forwards.")
    staging: StagingConfig = Field(default_factory=StagingConfig)

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

    def __init__(self, **data: Any) -> None:
        """Validate ``data``; raises :class:`ConfigError` with one line per bad field."""
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e) from None


def config_error(e: ValidationError) -> ConfigError:
    """Turn a pydantic error into a ConfigError naming each bad field and what is allowed."""
    lines = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        lines.append(f"DeckConfig.{field}: {err['msg']} (got {err.get('input')!r})")
    return ConfigError("invalid deck configuration:\n  " + "\n  ".join(lines))
