"""A torch.distributed.checkpoint ``StorageWriter`` built on DCP's public interface only: it
writes the directory layout that DCP's own ``FileSystemReader`` (and so ``dcp.load``) reads,
with the write items grouped into files by the caller, so that a file is the unit of memory.

The contract (torch/distributed/checkpoint/storage.py), in DCP's call order: ``reset``,
``set_up_storage_writer``, ``prepare_local_plan``, ``prepare_global_plan`` (coordinator),
``write_data``, ``finish`` (coordinator). Data files are written and fsynced in ``write_data``;
``.metadata`` is written last, atomically, by DCP's own ``FileSystemWriter.finish`` (a public
method of a public class): its encoding stays torch's whatever the release, and deck never
pickles anything itself.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Hashable
from types import SimpleNamespace
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from deck.storage.atomic import fsync_dir

# The data files' suffix, as DCP names them (its reader opens whatever name the metadata gives).
SUFFIX = ".distcp"


@dataclasses.dataclass(frozen=True)
class FilePrefix:
    """The ``storage_data`` of one rank's plan: how its data files' names start (``__<rank>_``,
    as DCP's file writer names them)."""

    prefix: str


def stored_at(relative_path: str, offset: int, length: int) -> SimpleNamespace:
    """Where one item's bytes are, in the shape ``FileSystemReader`` reads from the metadata's
    ``storage_data``: file, offset, length, and no stream transforms. A standard-library
    namespace, so ``.metadata`` names no deck class and loads wherever torch does."""
    return SimpleNamespace(
        relative_path=relative_path, offset=offset, length=length, transform_descriptors=None
    )


class DirectoryWriter(StorageWriter):
    """Writes a DCP checkpoint directory at ``path``: the items of each group (``group(item)``,
    in order of first appearance in the plan) go to one data file, resolved one at a time and
    written at once, so the writer holds one item at a time. Every data file is fsynced before
    ``.metadata`` is written (by ``finish``, last, under a temporary name then renamed): a crash
    leaves no loadable checkpoint. Files are created exclusively: nothing is overwritten."""

    def __init__(
        self, path: str, group: Callable[[WriteItem], Hashable], published: str | None = None
    ) -> None:
        super().__init__()
        self.path = path
        self.group = group
        # DCP's own file writer, for what it does publicly: the checkpoint's storage_meta and
        # writing ``.metadata`` in finish.
        self.meta = _MetadataWriter(path, published or path)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.meta.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # No rank: one global ``.metadata``, as a collective save writes it.
        self.meta.set_up_storage_writer(is_coordinator)
        os.makedirs(self.path, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=FilePrefix(f"__{i}_")) for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix if isinstance(plan.storage_data, FilePrefix) else "__0_"
        files: dict[Hashable, list[WriteItem]] = {}
        for item in plan.items:
            files.setdefault(self.group(item), []).append(item)
        results: list[WriteResult] = []
        for n, items in enumerate(files.values()):
            results += self._write_file(f"{prefix}{n}{SUFFIX}", items, planner)
        fsync_dir(self.path)  # the files' names are durable before the metadata names them
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        with open(os.path.join(self.path, name), "xb") as f:
            results = [_write_item(f, name, item, planner.resolve_data(item)) for item in items]
            f.flush()
            os.fsync(f.fileno())
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # FileSystemWriter.finish fills the metadata's storage_data from ``results`` and writes
        # it to a temporary file, fsynced, then renamed to ``.metadata``.
        self.meta.finish(metadata, results)
        fsync_dir(self.path)

    def storage_meta(self) -> StorageMeta | None:
        return self.meta.storage_meta()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)


def _write_item(f: IO[bytes], name: str, item: WriteItem, data: Any) -> WriteResult:
    """Append ``data`` (bytes of a BYTE_IO item, else a tensor, saved with ``torch.save`` as
    DCP's reader loads it) to ``f``; where it went."""
    offset = f.tell()
    if item.type == WriteItemType.BYTE_IO:
        f.write(data.getbuffer())
    else:
        t = data.detach().cpu()
        if t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()  # torch.save writes a view's whole storage: keep only the view
        torch.save(t, f)
    length = f.tell() - offset
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=stored_at(name, offset, length)
    )


class _MetadataWriter(FileSystemWriter):
    """DCP's file writer, whose ``.metadata`` names ``published`` as the checkpoint: where the
    files end up (an export moves them out of the folder it writes them in)."""

    def __init__(self, path: str, published: str) -> None:
        super().__init__(path, overwrite=False)
        self.published = published

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.published, save_id=self.save_id)
