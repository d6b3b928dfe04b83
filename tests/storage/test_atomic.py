"""deck.storage.atomic: the one temp + fsync + rename helper every local write uses."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from deck.storage.atomic import TEMP_PREFIX, atomic_file, atomic_write, fsync_dir


def _entries(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    atomic_write(str(path), b"old")
    atomic_write(str(path), memoryview(b"new bytes"))
    assert path.read_bytes() == b"new bytes"
    atomic_write(str(tmp_path / "page.html"), "<p>\u00e9</p>\n")
    assert (tmp_path / "page.html").read_text(encoding="utf-8") == "<p>\u00e9</p>\n"
    assert _entries(tmp_path) == ["f.bin", "page.html"]


def test_failure_inside_the_block_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_file(str(path)) as f:
        f.write(b"half of the new")
        assert os.path.basename(f.name).startswith(TEMP_PREFIX)
        raise RuntimeError("crash while writing")
    assert path.read_bytes() == b"old"
    assert _entries(tmp_path) == ["f.bin"]


def test_failed_fsync_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("deck.storage.atomic.os.fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        atomic_write(str(path), b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert _entries(tmp_path) == ["f.bin"]


def test_named_temp_file(tmp_path: Path) -> None:
    """A caller that finds torn writes by name after a crash names the temp file itself."""
    path = tmp_path / "record.json"
    with atomic_file(str(path), tmp=str(path) + ".tmp") as f:
        assert f.name == str(path) + ".tmp"
        f.write(b"{}")
    assert path.read_bytes() == b"{}"
    assert _entries(tmp_path) == ["record.json"]


def test_refuses_modes_that_do_not_write_a_new_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"), atomic_file(str(tmp_path / "f"), "ab"):
        pass


def test_fsync_dir(tmp_path: Path) -> None:
    fsync_dir(str(tmp_path))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsync_dir(str(tmp_path / "file"))


def test_a_folder_removed_under_a_put_is_said_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder a put writes into removed between opening it and writing the file (a GC with
    a grace period shorter than a save, in a break-it run): the error says that, not "check
    permissions / free space"."""
    from deck.errors import StorageError
    from deck.storage import LocalStorage

    store = LocalStorage(tmp_path / "ck")
    opened = LocalStorage._open_folder

    def then_removed(self: LocalStorage, names: list[str], key: str, **kw: bool) -> int:
        fd = opened(self, names, key, **kw)
        if names:
            os.rmdir(tmp_path / "ck" / "/".join(names))
        return fd

    monkeypatch.setattr(LocalStorage, "_open_folder", then_removed)
    with pytest.raises(StorageError, match=r"step-1/a.*its folder was removed while it was"):
        store.put("step-1/a", b"x")
