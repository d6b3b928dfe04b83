"""The DCP writer of `deck export` (deck.ops.export.dcp_writer.DirectoryWriter), through DCP's own
``dcp.save`` / ``dcp.load`` and ``FileSystemReader``: one data file per group, data stored
bitwise, ``.metadata`` last and readable where deck is not installed."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from deck.ops.export.dcp_writer import DirectoryWriter


def _state() -> dict[str, torch.Tensor]:
    big = torch.arange(100_000, dtype=torch.float32)
    return {
        "a": torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
        "b": big[10:20],  # a view of a large storage: only the view is stored
        "c": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
    }


def _save(state: dict[str, torch.Tensor], writer: DirectoryWriter) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state, storage_writer=writer, no_dist=True)


def test_dcp_load_reads_what_the_writer_wrote(tmp_path: Path) -> None:
    state = _state()
    groups = {"a": 0, "b": 1, "c": 1}
    _save(state, DirectoryWriter(str(tmp_path), group=lambda item: groups[item.index.fqn]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
    ]
    assert (tmp_path / "__0_1.distcp").stat().st_size < 100_000  # not the view's whole storage
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    for k, v in state.items():
        assert torch.equal(out[k], v) and out[k].dtype == v.dtype, k


def test_metadata_loads_without_deck(tmp_path: Path) -> None:
    """``.metadata`` names no deck class: DCP's reader loads it in a process where deck cannot
    be imported."""
    _save(_state(), DirectoryWriter(str(tmp_path), group=lambda item: item.index.fqn))
    code = (
        "import sys; sys.modules['deck'] = None\n"
        "from torch.distributed.checkpoint import FileSystemReader\n"
        f"md = FileSystemReader({str(tmp_path)!r}).read_metadata()\n"
        "print(sorted((i.fqn, s.relative_path) for i, s in md.storage_data.items()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(
        [("a", "__0_0.distcp"), ("b", "__0_1.distcp"), ("c", "__0_2.distcp")]
    )


def test_a_failed_write_leaves_no_metadata(tmp_path: Path) -> None:
    """The metadata is written last: a write that fails part-way (after two of its three files)
    leaves no loadable checkpoint; and the writer never overwrites a file."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem

    class FailsOnC(DefaultSavePlanner):
        def resolve_data(self, write_item: WriteItem) -> object:
            if write_item.index.fqn == "c":
                raise OSError("disk gone while writing c")
            return super().resolve_data(write_item)

    writer = DirectoryWriter(str(tmp_path), group=lambda item: item.index.fqn)
    with pytest.raises(dcp.CheckpointException) as failed, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(_state(), storage_writer=writer, planner=FailsOnC(), no_dist=True)
    assert [str(e[0]) for e in failed.value.failures.values()] == ["disk gone while writing c"]
    assert (tmp_path / "__0_1.distcp").stat().st_size > 0  # a and b were written
    assert not (tmp_path / ".metadata").exists()

    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(dcp.CheckpointException) as exists:
        _save(_state(), DirectoryWriter(str(tmp_path), group=lambda item: item.index.fqn))
    assert [type(e[0]) for e in exists.value.failures.values()] == [FileExistsError]
    assert (tmp_path / "__0_0.distcp").read_bytes() == b"x"
    assert not (tmp_path / ".metadata").exists()
