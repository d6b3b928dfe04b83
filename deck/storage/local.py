"""Storage on a local (or locally mounted) directory.

Commit protocol of :meth:`LocalStorage.put`: write a ``.tmp-*`` file in the destination directory,
fsync it, ``os.replace`` it over the destination, fsync the directory (the helpers of
:mod:`deck.storage.atomic`, which every other local write of deck uses too). A crash at any point
leaves either the old object or the new one, plus at worst a ``.tmp-*`` file that
:meth:`LocalStorage.list` never reports and :meth:`LocalStorage.delete_prefix` and
:meth:`LocalStorage.prune_temps` remove.

Containment (the rule every backend keeps: a key never leads outside the root): a key is
resolved one folder at a time from the root on directory descriptors, each opened with
``O_NOFOLLOW`` (``openat``-style), so a symbolic link below the root is never followed, by a
read, a write, a listing or a delete, whoever planted it and whenever. Reads open files with
``O_NOFOLLOW | O_NONBLOCK`` and accept regular files only, so a FIFO or a device never blocks
or feeds a reader. Such an entry is an :class:`deck.errors.UnsafePathError` naming it; listings
neither report nor enter it; deletes remove a link itself, never what it points to. The root
itself may be a link: that is the user's choice of place.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from deck.errors import ConfigError, NotFoundError, StorageError, UnsafePathError
from deck.failpoints import failpoint
from deck.storage.atomic import TEMP_PREFIX, fsync_dir, temp_path
from deck.storage.base import Storage, check_folder, check_prefix, validate_key

logger = logging.getLogger(__name__)

__all__ = ["TEMP_PREFIX", "LocalStorage", "validate_key", "write_new_file"]

_WRITE_HINT = "check permissions / free space"
_READ_HINT = "check permissions"
# MAP_POPULATE (Linux) faults the whole file in with one call and large reads, instead of one
# page fault per 4 KiB page while the rows are copied out.
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_FLAGS = _ROOT_FLAGS | os.O_NOFOLLOW
# O_NONBLOCK: opening a FIFO must not wait for its other end (it is refused right after).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LINK_HINT = (
    "deck never follows a symbolic link below the root of a store (it could make deck read, "
    "write or delete files elsewhere): replace the link with the folder or file itself, or "
    "remove it"
)


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
    path: str,
    view: memoryview,
    *,
    exclusive: bool = False,
    fsync: bool = False,
    dir_fd: int | None = None,
) -> None:
    """Create ``path`` (truncating it, or failing if it exists with ``exclusive``) holding exactly
    ``view``'s bytes; with ``fsync`` they are on disk when this returns. ``path`` is relative to
    the folder ``dir_fd`` when given. A symbolic link or FIFO at ``path`` is refused (OSError),
    never written through.

    Page-aligned buffers of whole pages (chunks, bundles) bypass the page cache with O_DIRECT:
    filling fresh page-cache pages is most of a large write's cost on the project's VMs (~0.3-0.6
    GB/s buffered vs ~1.5 GB/s direct), and checkpoint bytes then do not evict the training job's
    cache. Filesystems that refuse O_DIRECT (tmpfs on older kernels, some network mounts;
    remembered per device) and other buffers are written through the page cache.
    """
    # O_NOFOLLOW: a link planted at the file's name is refused (ELOOP), never written through;
    # O_NONBLOCK: a FIFO planted there is refused (ENXIO) instead of blocking the writer.
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    flags |= os.O_EXCL if exclusive else os.O_TRUNC
    if _O_DIRECT and _page_aligned(view):
        folder = os.fstat(dir_fd) if dir_fd is not None else os.stat(os.path.dirname(path) or ".")
        if folder.st_dev not in _no_direct:
            if _write(path, view, flags | _O_DIRECT, fsync, dir_fd):
                return
            _no_direct.add(folder.st_dev)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path, dir_fd=dir_fd)  # what the refused attempt created
    _write(path, view, flags, fsync, dir_fd)


def _write(path: str, view: memoryview, flags: int, fsync: bool, dir_fd: int | None) -> bool:
    """One attempt of :func:`write_new_file`; False if O_DIRECT was refused (EINVAL)."""
    try:
        # 0o666 & ~umask, like a plain open(): mkstemp's 0o600 would hide checkpoints from other
        # users of a shared directory.
        fd = os.open(path, flags, 0o666, dir_fd=dir_fd)
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


_T = TypeVar("_T")


class _FolderGone(Exception):
    """A folder a write made or opened was removed before the write's file was in it."""

    def __init__(self, exc: FileNotFoundError) -> None:
        super().__init__(str(exc))
        self.exc = exc


class LocalStorage(Storage):
    """A :class:`Storage` rooted at a local directory (created on the first ``put``).

    Keys map to files ``root/<key>``. ``put`` is atomic and durable (see the module docstring);
    ``get`` of a whole file is a single read into one ``bytes`` object. No call follows a
    symbolic link below the root or reads anything but a regular file (module docstring).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        self._said_links: set[str] = set()  # links a listing left out, said once each

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
        """Filesystem path of the object at key ``path``, or the root for "" (never None).

        Whoever opens it directly must keep this store's containment rule: create folders with
        :meth:`make_folder`, write with :func:`write_new_file` (which refuses a link at the file)."""
        return self._root if path == "" else self._file(path)

    def _error(self, action: str, path: str, exc: OSError, hint: str) -> StorageError:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename else ""
        if hint == _WRITE_HINT and isinstance(exc, FileNotFoundError):
            # (a break-it finding: a folder GC pruned under a writer was said as permissions)
            hint = (
                "its folder was removed while it was written (a `deck gc` with a grace period "
                "shorter than a save takes?)"
            )
        return StorageError(f"could not {action} {self.describe(path)}: {reason}{where}; {hint}")

    # ---- containment: walking keys without following links -------------------------------------

    def _open_folder(
        self, names: list[str], key: str, *, create: bool = False, durable: bool = False
    ) -> int:
        """A descriptor of the folder ``root/names[0]/...`` (the caller closes it), opened one
        component at a time with ``O_NOFOLLOW``: a link on the way is an
        :class:`UnsafePathError` naming ``key``. ``create`` makes missing folders (``durable``:
        each new entry fsynced in its parent); otherwise a missing one raises
        FileNotFoundError (NotADirectoryError: a file is in the way)."""
        fd = self._open_root(create, durable)
        try:
            for i, name in enumerate(names):
                child = self._open_child(fd, name, "/".join(names[: i + 1]), key, create, durable)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_root(self, create: bool, durable: bool) -> int:
        try:
            return os.open(self._root, _ROOT_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        # The root and the folders above it are the user's choice of place: made like mkdir -p.
        for d in _makedirs(self._root):
            if durable:
                fsync_dir(os.path.dirname(d))
        return os.open(self._root, _ROOT_FLAGS)

    def _open_child(
        self, fd: int, name: str, rel: str, key: str, create: bool, durable: bool
    ) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as exc:
            raise self._refused(fd, name, rel, key, exc) from exc
        try:
            os.mkdir(name, 0o777, dir_fd=fd)
            if durable:
                os.fsync(fd)  # the new folder's entry in its parent
        except FileExistsError:
            pass  # made meanwhile by a concurrent writer
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise self._refused(fd, name, rel, key, exc) from exc

    def _refused(self, fd: int, name: str, rel: str, key: str, exc: OSError) -> OSError:
        """Why ``name`` (key ``rel``) in folder ``fd`` could not be opened: a link or a special
        file there is an :class:`UnsafePathError`; anything else is ``exc`` itself."""
        try:
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except OSError:
            return exc
        if stat.S_ISLNK(mode):
            return self._link_error(rel, key)
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return exc
        return self._not_a_file(rel, mode)

    def _link_error(self, rel: str, key: str) -> UnsafePathError:
        where = self.describe(key) + ("" if rel == key else f": {self.describe(rel)}")
        return UnsafePathError(f"{where} is a symbolic link; {_LINK_HINT}")

    def _not_a_file(self, path: str, mode: int) -> StorageError:
        if stat.S_ISDIR(mode):
            return NotFoundError(f"{self.describe(path)} is a folder, not a file")
        if stat.S_ISLNK(mode):
            return self._link_error(path, path)
        return UnsafePathError(
            f"{self.describe(path)} is {_kind(mode)}, not a regular file: deck reads only regular "
            "files (a FIFO or a device could block a reader or never end); remove it, or put the "
            "file back from a copy"
        )

    def _open_read(self, path: str, action: str = "read") -> tuple[int, os.stat_result]:
        """A read descriptor of the regular file at key ``path`` and its ``fstat`` (the caller
        closes it); never through a link, never a FIFO, device or folder."""
        names = validate_key(path).split("/")
        try:
            dfd = self._open_folder(names[:-1], path)
            try:
                try:
                    fd = os.open(names[-1], _READ_FLAGS, dir_fd=dfd)
                except OSError as exc:
                    raise self._refused(dfd, names[-1], path, path, exc) from exc
            finally:
                os.close(dfd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise self._not_a_file(path, st.st_mode)
            except BaseException:
                os.close(fd)
                raise
        except StorageError:
            raise
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFoundError(f"{self.describe(path)} does not exist") from exc
        except OSError as exc:
            raise self._error(action, path, exc, _READ_HINT) from exc
        return fd, st

    def _lstat(self, path: str) -> os.stat_result:
        """``lstat`` of the entry at key ``path``, reached without following links."""
        names = validate_key(path).split("/")
        try:
            dfd = self._open_folder(names[:-1], path)
            try:
                return os.stat(names[-1], dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)
        except StorageError:
            raise
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFoundError(f"{self.describe(path)} does not exist") from exc
        except OSError as exc:
            raise self._error("stat", path, exc, _READ_HINT) from exc

    def _tree(self, base: str, prefix: str) -> Iterator[tuple[str, int, list[os.DirEntry[str]]]]:
        """Folder ``base`` and those below it whose keys can start with ``prefix``, top-down, as
        (key prefix of the folder, its descriptor, its entries). Iterative (any depth), each
        folder opened from the root without following links: a link is never entered, an
        absent folder yields nothing."""
        stack = [base]
        while stack:
            folder = stack.pop()
            rel = f"{folder}/" if folder else ""
            try:
                fd = self._open_folder(folder.split("/") if folder else [], folder or ".")
            except (FileNotFoundError, NotADirectoryError, UnsafePathError):
                continue  # gone, or not a folder of this store
            except OSError as exc:  # (named: the caller's prefix may be the root)
                raise self._error("list", rel, exc, _READ_HINT) from exc
            try:
                try:
                    with os.scandir(fd) as it:
                        entries = list(it)
                except OSError as exc:
                    raise self._error("list", rel, exc, _READ_HINT) from exc
                yield rel, fd, entries
                stack += [
                    rel + e.name
                    for e in entries
                    if e.is_dir(follow_symlinks=False) and f"{rel}{e.name}/".startswith(prefix)
                ]
            finally:
                os.close(fd)

    def make_folder(self, key: str) -> str:
        """Create the folder ``key`` and its missing parents below the root, never through a
        link (:class:`UnsafePathError` naming it), and return its filesystem path. Writers of
        files of their own there (the stager's spool) then create them with
        :func:`write_new_file`, which refuses a link at the file itself."""
        names = validate_key(key).split("/")

        def make() -> None:
            try:
                os.close(self._open_folder(names, key, create=True))
            except StorageError:
                raise
            except (
                FileNotFoundError
            ) as exc:  # a parent removed between its creation and its child's
                raise _FolderGone(exc) from exc
            except OSError as exc:
                raise self._error("create", key, exc, _WRITE_HINT) from exc

        self._while_folders_go(key, "create", make)
        return self._file(key)

    def _while_folders_go(self, key: str, action: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, called again (3 tries in all) while it raises :class:`_FolderGone`: a
        cleaner of empty folders (remove_empty_folder, GC's pruning) removed a folder it had
        just made or opened, which is made again (a break-it finding: a trainer's commit-log
        entry failed so under `deck gc` of an emptied _log/)."""
        for attempt in range(3):
            try:
                return fn()
            except _FolderGone as gone:
                if attempt == 2:
                    raise self._error(action, key, gone.exc, _WRITE_HINT) from gone.exc
        raise AssertionError("unreachable")

    def remove_empty_folder(self, key: str) -> bool:
        """Remove the folder ``key`` if it is empty (never through a link: a link there is not
        a folder, and one on the way is not followed); whether it went."""
        names = validate_key(key).split("/")
        try:
            fd = self._open_folder(names[:-1], key)
        except (OSError, StorageError):
            return False
        try:
            os.rmdir(names[-1], dir_fd=fd)
            return True
        except OSError:  # not empty, not a folder, gone
            return False
        finally:
            os.close(fd)

    # ---- the Storage interface ------------------------------------------------------------------

    def modified(self, path: str) -> float | None:
        """The file's modification time (``st_mtime``); None when it cannot be stat'ed or is not
        a regular file."""
        try:
            st = self._lstat(path)
        except OSError:
            return None
        return st.st_mtime if stat.S_ISREG(st.st_mode) else None

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically and durably replace the file at ``path`` with ``data``.

        On any failure the temp file is removed and the previous object (if any) is untouched.
        A link on the way is an :class:`UnsafePathError`; a link at ``path`` itself is replaced
        (the rename never writes through it).
        """
        self._commit(path, data, exclusive=False)

    def put_if_absent(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        """Create the file at ``path`` only if nothing is there (not even a link): the fsynced
        temp file is hard-linked to the name, which the file system does atomically or refuses
        with EEXIST. Exactly one of several simultaneous callers gets True."""
        return self._commit(path, data, exclusive=True)

    @property
    def atomic_create(self) -> bool:
        """True: :meth:`put_if_absent` is an exclusive link."""
        return True

    def _commit(self, path: str, data: bytes | bytearray | memoryview, *, exclusive: bool) -> bool:
        """Write a fsynced temp file, then rename it over ``path`` or (``exclusive``) link it to
        ``path`` if nothing is there; fsync the folder. False: ``exclusive`` and taken."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        return self._while_folders_go(
            path, "write", lambda: self._commit_once(path, view, exclusive=exclusive)
        )

    def _commit_once(self, path: str, view: memoryview, *, exclusive: bool) -> bool:
        names = validate_key(path).split("/")
        try:
            dfd = self._open_folder(names[:-1], path, create=True, durable=True)
        except StorageError:
            raise
        except OSError as exc:
            raise self._error("write", path, exc, _WRITE_HINT) from exc
        tmp = temp_path(names[-1])
        created = True
        try:
            failpoint("storage.local.write", path)  # test hook: a full disk (enospc)
            try:
                write_new_file(tmp, view, exclusive=True, fsync=True, dir_fd=dfd)
            except FileNotFoundError as exc:
                raise _FolderGone(exc) from exc
            if exclusive:
                try:
                    os.link(tmp, names[-1], src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    created = False
                os.unlink(tmp, dir_fd=dfd)
            else:
                os.replace(tmp, names[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            return created
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            if isinstance(exc, OSError):
                raise self._error("write", path, exc, _WRITE_HINT) from exc
            raise
        finally:
            os.close(dfd)

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the file (shorter if the file ends first); only a regular
        file is read, and never more than ``end - start`` bytes of it."""
        validate_key(path)
        if start < 0 or (end is not None and end < start):
            raise ConfigError(f"invalid byte range [{start}, {end}) for {self.describe(path)}")
        fd, st = self._open_read(path)
        try:
            with open(fd, "rb", buffering=0) as f:
                if start == 0 and end is None:
                    # FileIO.readall sizes one buffer from fstat: a single read, no copies.
                    return f.readall()
                if start:
                    f.seek(start)
                if end is None:
                    return f.readall()
                # FileIO.read allocates what it is asked for before reading, and a record may
                # claim any size: never ask for more than the file holds.
                remaining = min(end, max(st.st_size, start)) - start
                chunks: list[bytes] = []
                while remaining > 0:
                    chunk = f.read(remaining)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    remaining -= len(chunk)
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
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
        fd, st = self._open_read(path, "map")
        try:
            if st.st_size == 0:
                return memoryview(b"")
            mapped = mmap.mmap(fd, st.st_size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise self._error("map", path, OSError(str(exc)), _READ_HINT) from exc
        finally:
            os.close(fd)  # the mapping holds its own
        return memoryview(mapped)

    def prefetch(self, path: str) -> None:
        """Ask the kernel to start reading the file at ``path`` into the page cache in the
        background (``POSIX_FADV_WILLNEED``), so that a later :meth:`map_file` finds it there.
        Only a hint: a missing file or a platform without ``posix_fadvise`` is ignored (the
        read that follows reports any error)."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            fd, _st = self._open_read(path)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        """Size in bytes of the regular file at ``path`` (a link or special file there is an
        :class:`UnsafePathError`, a folder a :class:`NotFoundError`)."""
        st = self._lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise self._not_a_file(path, st.st_mode)
        return st.st_size

    def exists(self, path: str) -> bool:
        """Whether a regular file exists at ``path`` (reached without following links)."""
        try:
            return stat.S_ISREG(self._lstat(path).st_mode)
        except OSError:
            return False

    def delete(self, path: str) -> None:
        """Remove the file at ``path``; a missing file is not an error. A link there is removed
        itself (never what it points to); a link on the way is an :class:`UnsafePathError`."""
        names = validate_key(path).split("/")
        try:
            dfd = self._open_folder(names[:-1], path)
            try:
                os.unlink(names[-1], dir_fd=dfd)
            finally:
                os.close(dfd)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except StorageError:
            raise
        except OSError as exc:
            raise self._error("delete", path, exc, _WRITE_HINT) from exc

    def delete_if(self, path: str, data: bytes) -> bool:
        """:meth:`Storage.delete_if`, atomic: the file is renamed aside (a write landing after
        that is untouched), compared, then removed, or linked back unless a newer file is
        there by then."""
        names = validate_key(path).split("/")
        try:
            dfd = self._open_folder(names[:-1], path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except StorageError:
            raise
        except OSError as exc:
            raise self._error("delete", path, exc, _WRITE_HINT) from exc
        aside = os.path.basename(temp_path(names[-1]))
        try:
            try:
                os.rename(names[-1], aside, src_dir_fd=dfd, dst_dir_fd=dfd)
            except FileNotFoundError:
                return True
            same = False
            with contextlib.suppress(OSError):  # (a link, a folder: not ``data``)
                fd = os.open(aside, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
                try:
                    same = stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(data) + 1) == data
                finally:
                    os.close(fd)
            if same:
                os.unlink(aside, dir_fd=dfd)
            else:
                try:
                    os.link(aside, names[-1], src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                    os.unlink(aside, dir_fd=dfd)
                except FileExistsError:  # a newer write is there: it wins
                    os.unlink(aside, dir_fd=dfd)
                except OSError:  # not a file (a folder): back under its name
                    os.rename(aside, names[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            return same
        except OSError as exc:
            raise self._error("delete", path, exc, _WRITE_HINT) from exc
        finally:
            os.close(dfd)

    @property
    def atomic_delete_if(self) -> bool:
        """True: :meth:`delete_if` renames the file aside first."""
        return True

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys of all regular files under the root whose key starts with ``prefix``.

        In-flight or abandoned ``.tmp-*`` files are never reported; links, FIFOs and devices are
        neither reported nor entered."""
        check_prefix(prefix)
        keys: list[str] = []
        try:
            for rel, _fd, entries in self._tree(prefix.rpartition("/")[0], prefix):
                keys += [
                    rel + e.name
                    for e in entries
                    if e.is_file(follow_symlinks=False)
                    and not e.name.startswith(TEMP_PREFIX)
                    and (rel + e.name).startswith(prefix)
                ]
        except StorageError:
            raise  # (a folder below, named by _tree)
        except OSError as exc:
            raise self._error("list", prefix, exc, _READ_HINT) from exc
        keys.sort()
        return keys

    def list_modified(self, prefix: str = "") -> builtins.list[tuple[str, float | None]]:
        """:meth:`list` with each file's ``st_mtime``, stat'ed in the same walk."""
        check_prefix(prefix)
        out: list[tuple[str, float | None]] = []
        try:
            for rel, _fd, entries in self._tree(prefix.rpartition("/")[0], prefix):
                for e in entries:
                    key = rel + e.name
                    if (
                        not e.is_file(follow_symlinks=False)
                        or e.name.startswith(TEMP_PREFIX)
                        or not key.startswith(prefix)
                    ):
                        continue
                    try:
                        mtime: float | None = e.stat(follow_symlinks=False).st_mtime
                    except FileNotFoundError:
                        continue  # deleted since the walk read the folder: not listed
                    except OSError:
                        mtime = None  # unknown, never old
                    out.append((key, mtime))
        except StorageError:
            raise  # (a folder below, named by _tree)
        except OSError as exc:
            raise self._error("list", prefix, exc, _READ_HINT) from exc
        out.sort()
        return out

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        """One level of :meth:`Storage.list_dir` (a ``scandir``); ``.tmp-*`` files, links and
        special files are left out, a folder reached through a link is empty."""
        return self._scan(prefix, None)

    def list_dir_after(self, prefix: str, after: str) -> builtins.list[str]:
        """:meth:`list_dir`, the names at or below ``after`` passed over before any other look
        at them (the directory is still read whole: no order on disk to start from)."""
        return self._scan(prefix, after)

    def _scan(self, prefix: str, after: str | None) -> builtins.list[str]:
        check_folder(prefix)
        names = prefix.rstrip("/").split("/") if prefix else []
        try:
            fd = self._open_folder(names, prefix or ".")
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return []
        except OSError as exc:
            raise self._error("list", prefix, exc, _READ_HINT) from exc
        try:
            with os.scandir(fd) as it:
                entries = it if after is None else (e for e in it if e.name > after)
                out, links = [], []
                for e in entries:
                    if e.name.startswith(TEMP_PREFIX):
                        continue
                    if e.is_dir(follow_symlinks=False):
                        out.append(e.name + "/")
                    elif e.is_file(follow_symlinks=False):
                        out.append(e.name)
                    elif e.is_symlink():
                        links.append(prefix + e.name)
        except OSError as exc:
            raise self._error("list", prefix, exc, _READ_HINT) from exc
        finally:
            os.close(fd)
        self._say_links(links)
        return sorted(out)

    def _say_links(self, links: builtins.list[str]) -> None:
        """Links a listing left out, said once each (a break-it finding: a step folder replaced
        by a link was left out of `deck ls`, verify and GC without a word)."""
        for key in links:
            if key not in self._said_links:
                self._said_links.add(key)
                logger.warning(
                    "%s is a symbolic link: deck never follows links below its root, so it is "
                    "left out (as if it were not there); replace it with the folder or file",
                    self.describe(key),
                )

    def delete_prefix(self, prefix: str) -> None:
        """Delete every file under ``prefix`` (abandoned temps, links and special files too:
        a link is removed itself, never followed) and prune the emptied folders. A folder
        ``prefix`` that is a link is removed as the link; what it points to is untouched."""
        check_prefix(prefix)
        base = prefix.rpartition("/")[0]
        try:
            if base and prefix == f"{base}/" and self._unlink_link(base):
                return
            folders: list[str] = []
            for rel, fd, entries in self._tree(base, prefix):
                if rel and rel.startswith(prefix):
                    folders.append(rel[:-1])
                for e in entries:
                    if not e.is_dir(follow_symlinks=False) and (rel + e.name).startswith(prefix):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.name, dir_fd=fd)
            for folder in reversed(folders):  # children before their parents
                parent, _, name = folder.rpartition("/")
                with contextlib.suppress(OSError):
                    # A concurrent writer may have just created a file here: ENOTEMPTY is fine.
                    pfd = self._open_folder(parent.split("/") if parent else [], folder)
                    try:
                        os.rmdir(name, dir_fd=pfd)
                    finally:
                        os.close(pfd)
        except StorageError:
            raise
        except OSError as exc:
            raise self._error("delete", prefix, exc, _WRITE_HINT) from exc

    def prune_temps(
        self,
        prefix: str = "",
        older_than_s: float = 0.0,
        *,
        now: float | None = None,
        folders_older_than_s: float | None = None,
    ) -> builtins.list[str]:
        """:meth:`Storage.prune_temps`: ``.tmp-*`` files of crashed puts, then the folders left
        empty, deepest first; ages are ``st_mtime``, a folder's as found before this call
        removed anything in it (removing an entry touches its folder: an old, empty tree goes in
        one call, not one level per grace period).

        Walked like every other call, one folder at a time from the root with ``O_NOFOLLOW``: a
        link below the root is never entered, and a temp-named link is removed itself. A
        ``prefix`` reached through a link is logged and left alone: nothing outside the root is
        touched."""
        check_folder(prefix)
        when = time.time() if now is None else now

        def old(mtime: float, age: float = older_than_s) -> bool:
            return age <= 0 or when - mtime >= age

        folder_age = older_than_s if folders_older_than_s is None else folders_older_than_s

        base = prefix.rstrip("/")
        try:
            os.close(self._open_folder(base.split("/") if base else [], prefix or "."))
        except UnsafePathError:
            logger.warning("%s leads through a symbolic link; not pruned", self.describe(prefix))
            return []
        except OSError:
            return []  # absent (or unreadable): nothing to prune
        removed: list[str] = []
        folders: list[tuple[str, float]] = []  # each with its mtime before anything was removed
        try:
            for rel, fd, entries in self._tree(base, prefix):
                if rel:
                    folders.append((rel[:-1], os.fstat(fd).st_mtime))
                for e in entries:
                    if e.name.startswith(TEMP_PREFIX) and not e.is_dir(follow_symlinks=False):
                        with contextlib.suppress(OSError):
                            if old(os.stat(e.name, dir_fd=fd, follow_symlinks=False).st_mtime):
                                os.unlink(e.name, dir_fd=fd)
                                removed.append(rel + e.name)
        except OSError as exc:  # best effort: the rest is left for the next call
            logger.warning("could not prune %s: %s", self.describe(prefix), exc)
        for folder, mtime in reversed(folders):  # children before their parents
            if not old(mtime, folder_age):
                continue
            parent, _, name = folder.rpartition("/")
            with contextlib.suppress(OSError):
                pfd = self._open_folder(parent.split("/") if parent else [], folder)
                try:
                    # Only succeeds when empty: an entry a writer made since the walk keeps it
                    os.rmdir(name, dir_fd=pfd)
                finally:
                    os.close(pfd)
        return sorted(removed)

    def _unlink_link(self, key: str) -> bool:
        """If the entry at ``key`` is a link (or nothing can be there), remove the link and say
        True: nothing below it belongs to this store."""
        names = key.split("/")
        try:
            dfd = self._open_folder(names[:-1], key)
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return True
        try:
            if not stat.S_ISLNK(os.stat(names[-1], dir_fd=dfd, follow_symlinks=False).st_mode):
                return False
            os.unlink(names[-1], dir_fd=dfd)
            return True
        except FileNotFoundError:
            return True
        finally:
            os.close(dfd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "a special file"
