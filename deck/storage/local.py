"""Storage on a local (or locally mounted) directory.

Commit protocol of :meth:`LocalStorage.put`: write a ``.tmp-*`` file in the destination directory,
fsync it, ``os.replace`` it over the destination, fsync the directory (the helpers of
:mod:`deck.storage.atomic`, which every other local write of deck uses too). A crash at any point
leaves either the old object or the new one, plus at worst a ``.tmp-*`` file that
:meth:`LocalStorage.list` never reports and :meth:`LocalStorage.delete_prefix` removes.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import logging
import mmap
import os

from deck.errors import ConfigError, NotFoundError, StorageError
from deck.storage.atomic import TEMP_PREFIX, fsync_dir, replace_durably, temp_path
from deck.storage.base import Storage, check_folder, check_prefix

logger = logging.getLogger(__name__)

__all__ = ["TEMP_PREFIX", "LocalStorage", "validate_key", "write_new_file"]

_WRITE_HINT = "check permissions / free space"
_READ_HINT = "check permissions"
# MAP_POPULATE (Linux) faults the whole file in with one call and large reads, instead of one
# page fault per 4 KiB page while the rows are copied out.
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)


def validate_key(path: str) -> str:
    """Return ``path`` if it is a valid storage key, else raise :class:`ConfigError`.

    A key is a relative '/'-separated path without empty, ``.`` or ``..`` components, so that it
    can never escape the store's root (on disk or in a bucket).
    """
    if not isinstance(path, str) or not path:
        raise ConfigError(f"storage key must be a non-empty string, got {path!r}")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path:
        raise ConfigError(
            f"invalid storage key {path!r}: use a relative '/'-separated path without "
            "empty, '.' or '..' components"
        )
    return path


def _makedirs(path: str) -> list[str]:
    """Create ``path`` and missing parents; return the created directories, outermost first."""
    missing: list[str] = []
    cur = path
    while not os.path.isdir(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    created: list[str] = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
            created.append(d)
        except FileExistsError:
            if not os.path.isdir(d):  # a regular file is in the way
                raise
    return created


def _write_all(fd: int, view: memoryview) -> None:
    # os.write may write less than asked (signals, >2 GiB requests): loop until all is written.
    while view:
        n = os.write(fd, view)
        view = view[n:]


PAGE = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_no_direct: set[int] = set()  # st_dev of filesystems that refused O_DIRECT


def write_new_file(
    path: str, view: memoryview, *, exclusive: bool = False, fsync: bool = False
) -> None:
    """Create ``path`` (truncating it, or failing if it exists with ``exclusive``) holding exactly
    ``view``'s bytes; with ``fsync`` they are on disk when this returns.

    Page-aligned buffers of whole pages (chunks, bundles) bypass the page cache with O_DIRECT:
    filling fresh page-cache pages is most of a large write's cost on the project's VMs (~0.3-0.6
    GB/s buffered vs ~1.5 GB/s direct), and checkpoint bytes then do not evict the training job's
    cache. Filesystems that refuse O_DIRECT (tmpfs on older kernels, some network mounts;
    remembered per device) and other buffers are written through the page cache.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    if _O_DIRECT and _page_aligned(view):
        device = os.stat(os.path.dirname(path) or ".").st_dev
        if device not in _no_direct:
            if _write(path, view, flags | _O_DIRECT, fsync):
                return
            _no_direct.add(device)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # what the refused attempt created
    _write(path, view, flags, fsync)


def _write(path: str, view: memoryview, flags: int, fsync: bool) -> bool:
    """One attempt of :func:`write_new_file`; False if O_DIRECT was refused (EINVAL)."""
    try:
        # 0o666 & ~umask, like a plain open(): mkstemp's 0o600 would hide checkpoints from other
        # users of a shared directory.
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if flags & _O_DIRECT and e.errno == errno.EINVAL:
            return False
        raise
    try:
        _write_all(fd, view)
        if fsync:
            os.fsync(fd)
        return True
    except OSError as e:
        if flags & _O_DIRECT and e.errno == errno.EINVAL:  # the open was taken, not the write
            return False
        raise
    finally:
        os.close(fd)


def _page_aligned(view: memoryview) -> bool:
    if not view.nbytes or view.nbytes % PAGE or view.readonly or not view.c_contiguous:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE == 0


class LocalStorage(Storage):
    """A :class:`Storage` rooted at a local directory (created on the first ``put``).

    Keys map to files ``root/<key>``. ``put`` is atomic and durable (see the module docstring);
    ``get`` of a whole file is a single read into one ``bytes`` object.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = os.path.abspath(os.path.expanduser(os.fspath(root)))

    @property
    def uri(self) -> str:
        """The absolute root directory."""
        return self._root

    @property
    def root(self) -> str:
        """The absolute root directory."""
        return self._root

    def __repr__(self) -> str:
        return f"LocalStorage({self._root!r})"

    def _file(self, path: str) -> str:
        """Filesystem path of the object at key ``path`` (validated: never the root itself)."""
        return os.path.join(self._root, *validate_key(path).split("/"))

    def local_path(self, path: str = "") -> str:
        """Filesystem path of the object at key ``path``, or the root for "" (never None)."""
        return self._root if path == "" else self._file(path)

    def modified(self, path: str) -> float | None:
        """The file's modification time (``st_mtime``); None when it cannot be stat'ed."""
        try:
            return os.stat(self._file(path)).st_mtime
        except OSError:
            return None

    def _error(self, action: str, path: str, exc: OSError, hint: str) -> StorageError:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename else ""
        return StorageError(f"could not {action} {self.describe(path)}: {reason}{where}; {hint}")

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically and durably replace the file at ``path`` with ``data``.

        On any failure the temp file is removed and the previous object (if any) is untouched.
        """
        full = self._file(path)
        directory = os.path.dirname(full)
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        try:
            created = _makedirs(directory)
        except OSError as exc:
            raise self._error("write", path, exc, _WRITE_HINT) from exc
        tmp = temp_path(full)
        try:
            write_new_file(tmp, view, exclusive=True, fsync=True)
            replace_durably(tmp, full)
            # New directories also need their own entries in their parents synced.
            for d in created:
                fsync_dir(os.path.dirname(d))
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise self._error("write", path, exc, _WRITE_HINT) from exc
            raise

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the file (shorter if the file ends first)."""
        full = self._file(path)
        if start < 0 or (end is not None and end < start):
            raise ConfigError(f"invalid byte range [{start}, {end}) for {self.describe(path)}")
        try:
            with open(full, "rb", buffering=0) as f:
                if start == 0 and end is None:
                    # FileIO.readall sizes one buffer from fstat: a single read, no copies.
                    return f.readall()
                if start:
                    f.seek(start)
                if end is None:
                    return f.readall()
                remaining = end - start
                chunks: list[bytes] = []
                while remaining > 0:
                    chunk = f.read(remaining)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    remaining -= len(chunk)
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{self.describe(path)} does not exist") from exc
        except OSError as exc:
            raise self._error("read", path, exc, _READ_HINT) from exc

    def map_file(self, path: str) -> memoryview:
        """The whole file at ``path`` memory-mapped, as a flat byte view (zero-copy read).

        The mapping is read-only and private, populated up front (``MAP_POPULATE``: one call,
        large reads); nothing is copied into Python objects. It and the one descriptor it holds
        are released when the view and every tensor made from it are freed, so callers keep
        one chunk mapped at a time. deck never rewrites a file in place (``put`` replaces it with
        a new inode), so a mapped checkpoint file cannot shrink under the reader.
        Raises :class:`NotFoundError` / :class:`StorageError` naming the URI like :meth:`get`.
        """
        full = self._file(path)
        try:
            nbytes = os.stat(full).st_size
        except FileNotFoundError as exc:
            raise NotFoundError(f"{self.describe(path)} does not exist") from exc
        except OSError as exc:
            raise self._error("read", path, exc, _READ_HINT) from exc
        if nbytes == 0:
            return memoryview(b"")
        try:
            with open(full, "rb", buffering=0) as f:
                mapped = mmap.mmap(f.fileno(), nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{self.describe(path)} does not exist") from exc
        except (OSError, ValueError) as exc:
            raise self._error("map", path, OSError(str(exc)), _READ_HINT) from exc
        return memoryview(mapped)

    def prefetch(self, path: str) -> None:
        """Ask the kernel to start reading the file at ``path`` into the page cache in the
        background (``POSIX_FADV_WILLNEED``), so that a later :meth:`map_file` finds it there.
        Only a hint: a missing file or a platform without ``posix_fadvise`` is ignored (the
        read that follows reports any error)."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self._file(path), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        """Size in bytes of the file at ``path``."""
        full = self._file(path)
        try:
            return os.stat(full).st_size
        except FileNotFoundError as exc:
            raise NotFoundError(f"{self.describe(path)} does not exist") from exc
        except OSError as exc:
            raise self._error("stat", path, exc, _READ_HINT) from exc

    def exists(self, path: str) -> bool:
        """Whether a regular file exists at ``path``."""
        return os.path.isfile(self._file(path))

    def delete(self, path: str) -> None:
        """Remove the file at ``path``; a missing file is not an error."""
        full = self._file(path)
        try:
            os.unlink(full)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error("delete", path, exc, _WRITE_HINT) from exc

    def _walk(self, prefix: str, include_temps: bool) -> list[str]:
        check_prefix(prefix)
        # Only walk the deepest directory the prefix names, not the whole root.
        base_key = prefix.rpartition("/")[0]
        base = os.path.join(self._root, *base_key.split("/")) if base_key else self._root
        keys: list[str] = []

        def onerror(exc: OSError) -> None:
            if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                raise self._error("list", prefix, exc, _READ_HINT) from exc

        for dirpath, _dirnames, filenames in os.walk(base, onerror=onerror):
            rel = os.path.relpath(dirpath, self._root)
            rel_key = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                if not include_temps and name.startswith(TEMP_PREFIX):
                    continue
                key = rel_key + name
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort()
        return keys

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys of all files under the root whose key starts with ``prefix``.

        In-flight or abandoned ``.tmp-*`` files are never reported.
        """
        return self._walk(prefix, include_temps=False)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        """One level of :meth:`Storage.list_dir` (a ``scandir``); ``.tmp-*`` files are left out."""
        check_folder(prefix)
        base = os.path.join(self._root, *prefix.rstrip("/").split("/")) if prefix else self._root
        try:
            with os.scandir(base) as it:
                names = [
                    e.name + "/" if e.is_dir(follow_symlinks=False) else e.name
                    for e in it
                    if not e.name.startswith(TEMP_PREFIX)
                ]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._error("list", prefix, exc, _READ_HINT) from exc
        return sorted(names)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every file under ``prefix`` (abandoned temps too) and prune empty directories."""
        for key in self._walk(prefix, include_temps=True):
            self.delete(key)
        base_key = prefix.rpartition("/")[0]
        base = os.path.join(self._root, *base_key.split("/")) if base_key else self._root
        for dirpath, _dirnames, _filenames in os.walk(base, topdown=False):
            rel = os.path.relpath(dirpath, self._root)
            if rel != "." and (rel.replace(os.sep, "/") + "/").startswith(prefix):
                # A concurrent writer may have just created a file here: ENOTEMPTY is fine.
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
