"""What a merger worker is configured with, and DECK's sizing rules for it.

:class:`MergeConfig` (stride, chunk size, this worker's share) and :class:`FullPolicy` (when a
new full is built) are validated pydantic models like :class:`deck.DeckConfig`: an invalid value
raises :class:`deck.errors.ConfigError` naming the field. :func:`stride_for_velocity` (DECK
eq. 1) and :func:`full_every_for_bound` (eq. 2) pick their values from a model of merged sizes
(:func:`merged_size`).
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from deck.config import PAGE_BYTES, Settings

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


class FullPolicy(Settings):
    """When the merger builds a new full (any rule that is set triggers it).

    - ``every``: after this many deltas since the last full (DECK's fixed N; see
      :func:`full_every_for_bound` for N from eq. 2).
    - ``max_live_fraction``: when the chain a restore reads on top of the full (merged deltas and
      deltas) is larger than this fraction of the full (DECK's dynamic rule: bounds recovery at
      about ``1 + fraction`` full loads).
    - ``cost_ratio`` (IncrCP-style alternative): when ``live * cost_ratio >= 2 * full + live``,
      i.e. when the bytes every recovery must read on top of the full, weighted by how much more a
      recovery byte costs than a background byte, outweigh building a full (read full + live,
      write full).

    Decisions are evaluated once the planned chain to a step is committed, in step order, so
    every worker takes the same decision.
    """

    every: int | None = Field(
        default=None,
        description="New full after this many deltas since the last full (DECK's fixed N; "
        "`full_every_for_bound` solves eq. 2 for it). None: no fixed interval.",
        json_schema_extra={"constraints": ">= 1 or None", "cli": "deck merge --full-every N"},
    )
    max_live_fraction: float | None = Field(
        default=0.1,
        description="New full when the chain a restore reads on top of the full is larger than "
        "this fraction of the full (recovery reads about 1 + F fulls). None: off.",
        json_schema_extra={
            "constraints": "> 0 or None",
            "cli": "deck merge --full-live-fraction F (0: off)",
        },
    )
    cost_ratio: float | None = Field(
        default=None,
        description="IncrCP-style rule: new full when live x R >= 2 x full + live (R: how much "
        "more a byte read at recovery costs than a byte of background merging). None: off.",
        json_schema_extra={"constraints": "> 1 or None", "cli": "deck merge --full-cost-ratio R"},
    )

    @field_validator("every")
    @classmethod
    def _every(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be >= 1 or None")
        return v

    @field_validator("max_live_fraction")
    @classmethod
    def _fraction(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError("must be > 0 or None")
        return v

    @field_validator("cost_ratio")
    @classmethod
    def _ratio(cls, v: float | None) -> float | None:
        if v is not None and not v > 1:
            raise ValueError("must be > 1 or None")
        return v

    @property
    def needs_sizes(self) -> bool:
        return self.max_live_fraction is not None or self.cost_ratio is not None

    def want_full(self, position: int, live_bytes: int | None, full_bytes: int) -> bool:
        """Whether the state ``position`` deltas after a full gets a new full; ``live_bytes``
        is None when the sizes are not known yet (only asked then if no size rule is set)."""
        if self.every is not None and position >= self.every:
            return True
        if live_bytes is None:
            return False
        if self.max_live_fraction is not None and live_bytes > self.max_live_fraction * full_bytes:
            return True
        return self.cost_ratio is not None and live_bytes * self.cost_ratio >= (
            2 * full_bytes + live_bytes
        )


class MergeConfig(Settings):
    """What a merger worker builds and which share of the work is its own."""

    stride: int = Field(
        default=4,
        description="Items per merge, s: every s items of layer L become one merged delta of "
        "layer L + 1 (DECK eq. 1, `stride_for_velocity`, picks s).",
        json_schema_extra={"constraints": ">= 2", "cli": "deck merge --stride S"},
    )
    full: FullPolicy = Field(
        default_factory=FullPolicy,
        description="When the merger builds a new full (any rule that is set).",
    )
    chunk_bytes: int = Field(
        default=DEFAULT_CHUNK_BYTES,
        description="Chunk file size of merged checkpoints.",
        json_schema_extra={
            "constraints": f"a positive multiple of {PAGE_BYTES}",
            "cli": "deck merge --chunk-bytes B",
        },
    )
    worker_index: int = Field(
        default=0,
        description="This worker's share of the partitions: those with "
        "xxh3(partition) % num_workers == worker_index.",
        json_schema_extra={
            "constraints": "0 <= worker_index < num_workers",
            "cli": "deck merge --worker-index i",
        },
    )
    num_workers: int = Field(
        default=1,
        description="How many workers split the work (give every worker the same value).",
        json_schema_extra={
            "constraints": ">= 1",
            "cli": "deck merge --num-workers n (or --workers K on one host)",
        },
    )

    @field_validator("stride")
    @classmethod
    def _stride(cls, v: int) -> int:
        if v < 2:
            raise ValueError("must be >= 2")
        return v

    @field_validator("chunk_bytes")
    @classmethod
    def _chunk_bytes(cls, v: int) -> int:
        if v < PAGE_BYTES or v % PAGE_BYTES:
            raise ValueError(f"must be a positive multiple of {PAGE_BYTES}")
        return v

    @model_validator(mode="after")
    def _worker_share(self) -> MergeConfig:
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ValueError(
                f"worker index {self.worker_index} of {self.num_workers} workers: need "
                "0 <= worker_index < num_workers"
            )
        return self


def merged_size(dup_ratio: float, stride: int, layer: int) -> float:
    """DECK's model of a layer-``layer`` merged delta's size relative to one delta:
    ``(2 - d) ** (layer * log2 s)`` for duplication ratio ``d`` of two consecutive deltas."""
    return (2 - dup_ratio) ** (layer * math.log2(stride))


def full_every_for_bound(stride: int, dup_ratio: float, bound: float, limit: int = 10_000) -> int:
    """DECK eq. 2: the largest N such that the live merged volume after N deltas,
    ``sum_i (floor(N / s^i) - floor(N / s^(i+1)) * s) * (2 - d)^(i log s)``, stays below
    ``bound`` (in units of one delta). At least 1."""
    best = 1
    for n in range(1, limit + 1):
        vol, i = 0.0, 1
        while stride**i <= n:
            vol += (n // stride**i - (n // stride ** (i + 1)) * stride) * merged_size(
                dup_ratio, stride, i
            )
            i += 1
        vol += n % stride  # the unmerged deltas of layer 0
        if vol >= bound:
            break
        best = n
    return best


def stride_for_velocity(dup_ratio: float, velocity: float, max_stride: int = 64) -> int | None:
    """DECK eq. 1: the smallest stride ``s`` with ``sum_i (2 - d)^(i log s) / s^i < v`` (the
    merger keeps up with the trainer at relative merge velocity ``v``), or None if none does."""
    for s in range(2, max_stride + 1):
        r = (2 - dup_ratio) ** math.log2(s) / s
        if r < 1 and r / (1 - r) < velocity:
            return s
    return None
