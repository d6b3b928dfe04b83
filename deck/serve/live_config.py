"""The settings of a live apply (:class:`deck.serve.live.LiveModel`); torch-free, so the
configuration reference is generated without it."""

from __future__ import annotations

from pydantic import Field

from deck.config import Settings


class LiveConfig(Settings):
    """How a serving process applies a publish URI's steps to its live model."""

    keep_versions: int = Field(
        default=4,
        ge=0,
        description="How many applied versions keep the rows they replaced, so rollback(step) "
        "to any of them restores in place without reading storage; further back reloads from "
        "the newest full at or before the step. Memory: the replaced rows of that many "
        "versions, in the served form (int8 rows are 4 + dim bytes).",
    )
    rows_per_s: float | None = Field(
        default=100_000,
        ge=1,
        description="Cap on rows written per second (all served copies of a row count once), "
        "so that an apply takes little of the CPU the requests need: a delta of 20,000 rows is "
        "written over 0.2 s. The rows requests looked up most are written first; requests keep "
        "reading the previous version of their rows meanwhile, and one waiting for its rows "
        "has them written at once. A version that changes the served model's dense part (a "
        "DLRM's MLPs: every step of a trained one) is seen whole or not at all, so a request "
        "whose rows are written waits for its switch and the rest of it is written at once: "
        "with requests running, such versions are not paced, only the time between them. "
        "None: no cap (each version written back to back).",
        json_schema_extra={"constraints": ">= 1, or None"},
    )
    slice_rows: int = Field(
        default=4096,
        ge=1,
        description="Rows written per slice. No request starts while a slice is copied (a "
        "slice of 4096 dim-64 rows is well under a millisecond of copying), and the applier "
        "waits only for the requests in flight that read rows of it.",
    )
    poll_s: float = Field(
        default=0.5,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="How often the background applier (LiveModel.start) looks for new steps: "
        "a step is found on average poll_s / 2 after its commit, then read and written. A poll "
        "that finds nothing new reads only what changed at the URI since the last one (on a "
        "store with a commit log, one listing of the log).",
    )
    allow_quantized: bool = Field(
        default=False,
        description="Apply steps a publisher wrote with PublishConfig.quantize (dequantised "
        "first, so the served rows are not the exact trained ones).",
    )
