"""What every export shares: its report, the run that fills it while tensors are written, and
the check that the output place is new."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from deck.errors import ConfigError
from deck.failpoints import failpoint
from deck.ops.export.dense import flatten
from deck.ops.export.layout import Piece, StepState
from deck.storage.atomic import fsync_dir

logger = logging.getLogger(__name__)

Progress = Callable[[int], None]


@dataclass
class ExportReport:
    """What an export wrote."""

    step: int
    chain: list[str]  # folders of the checkpoints applied, oldest first
    path: str
    tensors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    max_held_bytes: int = 0  # largest block of table state held at once
    skipped: list[str] = field(default_factory=list)


def nbytes(p: Piece | torch.Tensor) -> int:
    if isinstance(p, torch.Tensor):
        return p.numel() * p.element_size()
    return math.prod(p.size) * p.dtype.itemsize


class ExportRun:
    """One export being written: its :class:`ExportReport`, the step's dense state, and the
    caller's progress, told the bytes of each table tensor as it is written (the dense state,
    small and written in one go, is not counted in progress)."""

    def __init__(self, state: StepState, path: str, progress: Progress | None):
        self.state = state
        self.progress = progress
        self.report = ExportReport(
            step=state.step, chain=[m.folder for m in state.chain], path=path
        )
        self.eager = state.eager_state(self.report.skipped)
        self.dense = flatten(self.eager)

    def holding(self, tensors: dict[str, torch.Tensor]) -> None:
        """Record that ``tensors`` of table state are held at once (``max_held_bytes``)."""
        held = sum(nbytes(t) for t in tensors.values())
        self.report.max_held_bytes = max(self.report.max_held_bytes, held)

    def wrote(self, t: torch.Tensor) -> None:
        """Record that table tensor ``t`` is written: its bytes, and progress."""
        self.report.bytes_written += nbytes(t)
        if self.progress:
            self.progress(nbytes(t))

    def finish(self) -> ExportReport:
        """The report, once every table tensor and the dense state are written."""
        self.report.tensors = len(self.dense) + len({p.fqn for p in self.state.pieces})
        self.report.bytes_written += sum(nbytes(t) for t in self.dense.values())
        self.report.bytes_read = self.state.read_bytes
        return self.report


# Where an export into a directory writes first, inside it: what a killed run left there is
# this folder alone, which the next export removes (a break-it finding: a killed export's
# files refused every rerun), and a finished export's files appear in the directory itself
# (DCP's `.metadata` last), never a directory with some of them
PARTIAL = ".deck-partial"


@contextlib.contextmanager
def writing_out_dir(out_dir: str) -> Iterator[str]:
    """:func:`check_out_dir`, then the export's writing into the folder this yields (inside
    ``out_dir``), whose files go into ``out_dir`` once it is done. If it fails, nothing it
    wrote stays (nor the directory, when the export made it), so a rerun finds it new or empty
    again; what a killed export left, the next one removes."""
    check_out_dir(out_dir)
    made = not os.path.exists(out_dir)
    work = os.path.join(out_dir, PARTIAL)
    if os.path.lexists(work):
        logger.warning("deck: removing %s, what an export killed before it finished left", work)
        if os.path.isdir(work) and not os.path.islink(work):
            shutil.rmtree(work)
        else:  # (not deck's: a file or link by that name is removed, never followed)
            os.unlink(work)
    os.makedirs(work)
    try:
        yield work
        failpoint("export.before_publish")
        # (DCP's .metadata last: a crash among the moves leaves no loadable checkpoint)
        for name in sorted(os.listdir(work), key=lambda n: n == ".metadata"):
            os.rename(os.path.join(work, name), os.path.join(out_dir, name))
        os.rmdir(work)
        fsync_dir(out_dir)
    except BaseException:
        shutil.rmtree(out_dir if made else work, ignore_errors=True)
        raise


def check_out_dir(out_dir: str) -> None:
    """Refuse an export target that is not a new or empty directory (one holding only what a
    killed export left is empty to it)."""
    if not os.path.exists(out_dir):
        return
    held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else None
    if held is None or (held and held != [PARTIAL]):
        what = "a non-empty directory" if held is not None else "a file"
        hint = (
            f" (its {PARTIAL} folder: an export was killed there as it finished; remove the "
            "directory's contents and export again)"
            if held and PARTIAL in held
            else ""
        )
        raise ConfigError(
            f"the export target {out_dir} is {what}, not an empty directory{hint}; choose a new "
            "or empty directory"
        )
