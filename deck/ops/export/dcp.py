"""``deck export --format dcp``: the step as a torch.distributed.checkpoint directory, written by
``dcp.save`` with a planner that reads each table shard only when the writer asks for it and
:class:`~deck.ops.export.dcp_writer.DirectoryWriter`, one file per table shard."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from deck.ops.export.layout import Piece, StepState
from deck.ops.export.run import ExportReport, ExportRun, Progress, writing_out_dir

_PieceKey = tuple[str, tuple[int, ...]]  # (fqn, offsets): what a DCP write item names


def export_dcp(state: StepState, out_dir: str, progress: Progress | None = None) -> ExportReport:
    """Write ``state`` as a DCP checkpoint in ``out_dir`` (which must be empty or absent).

    Guarantee: ``dcp.load({"model": model.state_dict(), "optim": CombinedOptimizer([
    model.fused_optimizer, dense_opt]).state_dict()}, checkpoint_id=out_dir)`` into a model
    built with the same tables and plan fills it with exactly (bitwise) what
    ``DeltaCheckpointer.restore(step)`` loads (tables and fused optimizer states, dense
    parameters and buffers, dense optimizer state). ``.metadata`` is written last; a crash
    leaves no loadable checkpoint.
    """
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    # Imported here: DCP's modules load only when a DCP export is written.
    from deck.ops.export.dcp_writer import DirectoryWriter

    run = ExportRun(state, out_dir, progress)
    by_key = {(p.fqn, p.offsets): p for p in state.pieces}
    # One file per table shard (in plan order) and one for the dense state: the planner reads a
    # shard when its first piece is asked for and drops it at the next, the writer holds one item.
    with writing_out_dir(out_dir) as work, warnings.catch_warnings():
        writer = DirectoryWriter(work, group=lambda item: _file_of(by_key, item), published=out_dir)
        # DCP warns that no process group is initialised: one process writing is the point.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp_save(
                run.eager, storage_writer=writer, planner=_dcp_planner(run, by_key), no_dist=True
            )
        except CheckpointException as e:
            # DCP wraps what failed (a damaged chunk, a full disk) with every frame's traceback
            # in its message: raise the cause itself, which names the file.
            causes = [cause for cause, _ in e.failures.values()]
            if not causes:
                raise
            raise causes[0] from None
    return run.finish()


def _piece_of(by_key: dict[_PieceKey, Piece], item: Any) -> Piece | None:
    """The table piece DCP write item ``item`` stands for; None for an item of the dense state."""
    off = item.index.offset
    return by_key.get((item.index.fqn, tuple(int(x) for x in off) if off is not None else ()))


def _file_of(by_key: dict[_PieceKey, Piece], item: Any) -> object:
    """The data file of write item ``item``: its table shard's, or the dense state's."""
    piece = _piece_of(by_key, item)
    return "dense" if piece is None else piece.shard


def _shard_write_items(pieces: list[Piece]) -> list[Any]:
    """One DCP SHARD write item per table piece."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return [
        WriteItem(
            index=MetadataIndex(p.fqn, p.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(
                    offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)
                ),
                properties=TensorProperties(dtype=p.dtype),
                size=torch.Size(p.size),
            ),
        )
        for p in pieces
    ]


class _HeldShard:
    """The one table shard a DCP export holds. The writer asks for the pieces of one shard
    together (one file per shard), so a piece of another shard drops this one and reads that."""

    def __init__(self, run: ExportRun):
        self.run = run
        self.current: tuple[int, dict[str, torch.Tensor]] | None = None

    def tensor(self, piece: Piece) -> torch.Tensor:
        """The data of ``piece``, counted as written."""
        if self.current is None or self.current[0] != piece.shard:
            self.current = None  # drop the previous shard before reading the next
            self.current = (piece.shard, self.run.state.read_shard(piece.shard))
            self.run.holding(self.current[1])
        t = self.current[1][piece.state]
        self.run.wrote(t)
        return t


def _dcp_planner(run: ExportRun, by_key: dict[_PieceKey, Piece]) -> Any:
    """The default planner for the dense state, plus one SHARD item per table piece whose data
    is read from the checkpoint only when the writer asks for it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem

    pieces = run.state.pieces
    held = _HeldShard(run)

    class Planner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = _shard_write_items(pieces)
            mappings = {**(plan.planner_data or {}), **{p.fqn: p.path for p in pieces}}
            self.plan = dataclasses.replace(
                plan, items=[*plan.items, *items], planner_data=mappings
            )
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> Any:
            piece = _piece_of(by_key, write_item)
            if piece is None:
                return super().resolve_data(write_item)
            return held.tensor(piece)

    return Planner()
