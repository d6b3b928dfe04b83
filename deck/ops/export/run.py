"""What every export shares: its report, the run that fills it while tensors are written, and
the check that the output place is new."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from deck.errors import ConfigError
from deck.ops.export.dense import flatten
from deck.ops.export.layout import Piece, StepState

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


@contextlib.contextmanager
def writing_out_dir(out_dir: str) -> Iterator[None]:
    """:func:`check_out_dir`, then the export's writing: if it fails, what it wrote there goes
    (the directory too when the export made it), so a rerun finds it new or empty again."""
    check_out_dir(out_dir)
    made = not os.path.exists(out_dir)
    try:
        yield
    except BaseException:
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        elif os.path.isdir(out_dir):  # it was empty: everything in it is this export's
            for entry in os.scandir(out_dir):
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
        raise


def check_out_dir(out_dir: str) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        what = "a non-empty directory" if os.path.isdir(out_dir) else "a file"
        raise ConfigError(
            f"the export target {out_dir} is {what}, not an empty directory; choose a new or "
            "empty directory"
        )
