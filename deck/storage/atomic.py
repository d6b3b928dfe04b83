"""Atomic, durable replacement of a local file: the one place deck does temp + fsync + rename.

:func:`atomic_file` (and :func:`atomic_write` for bytes or text at hand) write a temp file in
the destination's directory, fsync it, ``os.replace`` it over the destination and fsync the
directory. A crash at any point leaves either the old file or the new one, plus at worst the temp
file; an exception removes the temp file and leaves the destination untouched.
:class:`deck.storage.local.LocalStorage` commits its ``put`` with :func:`replace_durably` too.

Temp files are named ``.tmp-<name>.<random>`` by default: the prefix :meth:`LocalStorage.list`
never reports and garbage collection removes once stale.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any

__all__ = [
    "TEMP_PREFIX",
    "atomic_file",
    "atomic_write",
    "fsync_dir",
    "replace_durably",
    "temp_path",
]

TEMP_PREFIX = ".tmp-"


def fsync_dir(path: str) -> None:
    """fsync the directory ``path``, which makes the entries created or renamed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str) -> str:
    """A fresh temp file name next to ``path`` (same directory, so a rename is atomic)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex}")


def replace_durably(tmp: str, path: str) -> None:
    """``os.replace(tmp, path)``, then fsync of ``path``'s directory: the rename is durable when
    this returns. ``tmp`` must be fsynced already and lie in the same directory."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_file(
    path: str, mode: str = "wb", *, tmp: str | None = None, encoding: str | None = None
) -> Iterator[IO[Any]]:
    """Open a temp file for writing whose content replaces ``path`` when the block ends.

    On a normal exit the file is flushed, fsynced and renamed over ``path``, and the directory is
    fsynced; on an exception the temp file is removed and ``path`` is untouched. ``mode`` is
    ``"wb"`` or ``"w"`` (then ``encoding``, default UTF-8). ``tmp`` names the temp file (default
    :func:`temp_path`); a caller that recovers from crashes by the temp file's name passes its
    own, in the same directory. The temp file's name is the file object's ``name``.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file writes a new file: mode 'wb' or 'w', got {mode!r}")
    tmp = temp_path(path) if tmp is None else tmp
    try:
        with open(tmp, mode, encoding=encoding or ("utf-8" if mode == "w" else None)) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def atomic_write(path: str, data: bytes | bytearray | memoryview | str) -> None:
    """Atomically and durably replace ``path`` with ``data`` (text is written as UTF-8)."""
    with atomic_file(path, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)
