"""Storage over the fsspec filesystems whose single-object put is atomic (s3://, gs://, az://,
memory://).

Object stores have no rename, so ``put`` is one ``pipe_file`` call: a single PUT (or a multipart
upload that becomes visible only when completed) is all-or-nothing. Filesystems that write a file
in place (sftp, ftp, smb, hdfs, webdav, http, caching wrappers, ...) would let a reader see a
prefix of a file being written, so they are refused at open (:mod:`deck.schemes`). Every
call is retried on transient failures per a :class:`deck.storage.retry.RetryPolicy`.

An interrupted put leaves no temp object, so :meth:`~deck.storage.base.Storage.prune_temps` is
the base class's no-op here: a single PUT creates nothing until it completes, and a multipart
upload (s3fs, from 100 MiB) is invisible until completed -- s3fs aborts it when a part fails; the
parts of one whose process died stay out of every listing until the bucket's
``AbortIncompleteMultipartUpload`` lifecycle rule (the operator's, bucket-wide) removes them.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec
import fsspec.core

import deck.schemes as schemes
from deck.errors import ConfigError, DeckError, NotFoundError, StorageError
from deck.storage.base import (
    Storage,
    check_folder,
    check_prefix,
    is_valid_key,
    names_after,
    validate_key,
)
from deck.storage.retry import RetryPolicy, call_with_retry, is_transient, status_of

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FsspecStorage(Storage):
    """A :class:`Storage` rooted at an fsspec URI.

    Args:
        uri: root URI, e.g. ``s3://bucket/run-1`` or ``memory://scratch``.
        storage_options: passed to the fsspec filesystem (for s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ..., "region_name": ...}``, ``config_kwargs``).
        retry: retry policy for transient failures (default :class:`RetryPolicy`()).
        max_workers: threads :meth:`iter_get` and :meth:`delete_prefix` use to overlap requests.

    Only schemes whose put is atomic (:mod:`deck.schemes`) are accepted, so that no reader ever sees a prefix of an
    object: any other protocol (sftp, ftp, smb, hdfs, webdav, http, chained ``a::b://`` URIs)
    raises :class:`ConfigError` naming the URI and protocol. Local paths are refused too
    (fsspec's local ``pipe_file`` is not atomic): use :class:`deck.storage.local.LocalStorage`
    (``open_storage`` picks it for you), which commits by temp file + rename.
    """

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        max_workers: int = 8,
    ) -> None:
        if max_workers < 1:
            raise ConfigError(f"max_workers must be >= 1, got {max_workers}")
        _check_protocol(uri)
        try:
            fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        except ImportError as exc:
            raise ConfigError(
                f"URI {uri} needs an fsspec backend that is not installed ({exc}); "
                "for s3:// install s3fs (pip install s3fs, deck's s3 extra)"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"cannot open storage URI {uri}: {exc}") from exc
        self._fs: fsspec.AbstractFileSystem = fs
        self._root: str = root.rstrip("/")
        self._uri = uri.rstrip("/")
        self._scheme = schemes.lookup(uri)
        self._retry = retry if retry is not None else RetryPolicy()
        self._max_workers = max_workers
        self._find_prefix = _find_takes_prefix(fs)

    @property
    def uri(self) -> str:
        """The root URI as given, without a trailing '/'."""
        return self._uri

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The underlying fsspec filesystem."""
        return self._fs

    def __repr__(self) -> str:
        return f"FsspecStorage({self._uri!r})"

    def _full(self, path: str) -> str:
        key = validate_key(path)
        return f"{self._root}/{key}" if self._root else key

    def _call(self, action: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; map its failure to a typed error naming the full URI."""
        where = self.describe(path)
        try:
            return call_with_retry(fn, self._retry, f"{action} {where}")
        except DeckError:
            raise
        except FileNotFoundError as exc:
            if action in ("read", "stat"):
                raise NotFoundError(f"{where} does not exist") from exc
            raise StorageError(
                f"could not {action} {where}: not found ({exc}); does the bucket exist?"
            ) from exc
        except Exception as exc:
            limit = self._retry.attempts or self._retry.deadline_s
            unit = " attempts" if self._retry.attempts else " s"
            gave_up = f" (gave up after {limit}{unit})" if is_transient(exc) else ""
            raise StorageError(
                f"could not {action} {where}: {type(exc).__name__}: {exc}{gave_up}; check the "
                "URI, credentials, endpoint and network"
            ) from exc

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at ``path`` with a single ``pipe_file`` (one atomic PUT)."""
        full = self._full(path)
        # botocore only accepts bytes / bytearray / file objects as a PUT body: a memoryview (e.g.
        # of a tensor) costs one copy here, which is cheap next to the network transfer.
        payload = data if isinstance(data, (bytes, bytearray)) else memoryview(data).tobytes()
        self._call("write", path, lambda: self._fs.pipe_file(full, payload))

    def put_if_absent(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        """Create the object only if none is there: fsspec's ``pipe_file(mode="create")``, which
        S3 sends as one PUT with ``If-None-Match: *`` (the store refuses it with 412 when the key
        exists); other filesystems check, then write. A retried request whose first attempt
        landed reports False: callers that must know read the object back."""
        full = self._full(path)
        payload = data if isinstance(data, (bytes, bytearray)) else memoryview(data).tobytes()

        def create() -> bool:
            try:
                self._fs.pipe_file(full, payload, mode="create")
            except FileExistsError:
                return False
            except Exception as e:
                if status_of(e) == 412:  # PreconditionFailed: the key exists
                    return False
                raise
            return True

        return self._call("write", path, create)

    @property
    def atomic_create(self) -> bool:
        """True on S3 (``If-None-Match: *``; AWS S3 and SeaweedFS honour it), False elsewhere."""
        return self._scheme.atomic_create

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object (shorter if the object ends first)."""
        full = self._full(path)
        if start < 0 or (end is not None and end < start):
            raise ConfigError(f"invalid byte range [{start}, {end}) for {self.describe(path)}")
        if end is not None and end == start:
            # An empty HTTP range is invalid and S3 then returns the whole object: still check
            # that the object exists, but ask for no bytes.
            self.size(path)
            return b""
        if start == 0 and end is None:
            return self._call("read", path, lambda: bytes(self._fs.cat_file(full)))
        try:
            return self._call(
                "read", path, lambda: bytes(self._fs.cat_file(full, start=start, end=end))
            )
        except StorageError as e:
            # S3 answers a range that starts at or past the end (any range of an empty object)
            # with 416: that is "the object ends first", an empty result, not an error.
            if isinstance(e, NotFoundError) or self.size(path) > start:
                raise
            return b""

    def _info(self, path: str) -> dict[str, Any]:
        full = self._full(path)

        def info() -> dict[str, Any]:
            # Listings are cached by some backends (s3fs): another writer's changes would be
            # invisible, so always ask the store.
            self._fs.invalidate_cache(full)
            return dict(self._fs.info(full))

        return self._call("stat", path, info)

    def size(self, path: str) -> int:
        """Size in bytes of the object at ``path``."""
        info = self._info(path)
        if info.get("type") != "file":
            raise NotFoundError(f"{self.describe(path)} is a directory, not an object")
        return int(info["size"])

    def modified(self, path: str) -> float | None:
        """The object's modification (or creation) time as the store reports it (``mtime``,
        ``LastModified``, ...); None when it reports none or the object cannot be examined."""
        try:
            info = self._info(path)
        except StorageError:
            return None
        return _info_time(info)

    def list_modified(self, prefix: str = "") -> list[tuple[str, float | None]]:
        """:meth:`list` with the times the same listing reports (one LIST, no request per
        object), so GC can age every file of a long job's URI."""
        check_prefix(prefix)
        base = "/".join(p for p in (self._root, prefix.rpartition("/")[0]) if p)
        strip = f"{self._root}/" if self._root else ""

        def find() -> dict[str, Any]:
            self._fs.invalidate_cache(base)
            try:
                return dict(self._fs.find(base or "/", withdirs=False, detail=True))
            except FileNotFoundError:
                return {}

        out = []
        for found, info in self._call("list", prefix, find).items():
            if strip and not found.startswith(strip):
                continue
            rel = found[len(strip) :] if strip else found.lstrip("/")
            if rel.startswith(prefix) and is_valid_key(rel):
                out.append((rel, _info_time(info)))
        out.sort()
        return out

    def exists(self, path: str) -> bool:
        """Whether an object (not just a directory-like prefix) exists at ``path``: a read of
        its first byte, one request either way. (A stat answers a missing key with a second
        request on S3: s3fs lists the key as a folder to tell a folder from nothing.)"""
        full = self._full(path)

        def first_byte() -> bool:
            try:
                self._fs.cat_file(full, start=0, end=1)
            except FileNotFoundError:  # no object (a folder-like prefix is none either)
                return False
            return True

        try:
            return self._call("read", path, first_byte)
        except StorageError as e:
            if isinstance(e, NotFoundError) or status_of(e) != 416:
                raise
        # 416: S3 refuses any range of an empty object; it exists, a stat says what it is
        try:
            return self._info(path).get("type") == "file"
        except NotFoundError:
            return False

    def delete(self, path: str) -> None:
        """Delete the object at ``path``; a missing object is not an error."""
        full = self._full(path)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(full)

        self._call("delete", path, rm)

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys of all objects whose key starts with ``prefix``."""
        check_prefix(prefix)
        strip = f"{self._root}/" if self._root else ""
        if self._find_prefix and prefix:
            # The store filters by the key prefix, from the folder above its last part: one
            # request, also when nothing matches (s3fs answers an empty listing of a folder
            # with two more: a stat of the folder's name and a listing to tell a folder).
            head, sep, _ = prefix.rstrip("/").rpartition("/")
            base = "/".join(p for p in (self._root, head) if p)
            kwargs = {"prefix": prefix[len(head) + len(sep) :]}
        else:
            base = "/".join(p for p in (self._root, prefix.rpartition("/")[0]) if p)
            kwargs = {}

        def find() -> list[str]:
            self._fs.invalidate_cache(base)
            try:
                return list(self._fs.find(base or "/", withdirs=False, **kwargs))
            except FileNotFoundError:
                return []

        keys: list[str] = []
        for found in self._call("list", prefix, find):
            if strip:
                # Some servers (SeaweedFS) report the root itself as an object once it is empty.
                if not found.startswith(strip):
                    continue
                rel = found[len(strip) :]
            else:
                rel = found.lstrip("/")  # memory:// reports '/key' for an empty root
            # A key no call would accept (``..``, empty components: object names are free
            # text) is not listed: it could only be read or deleted outside the root.
            if rel.startswith(prefix) and is_valid_key(rel):
                keys.append(rel)
        keys.sort()
        return keys

    def list_dir_after(self, prefix: str, after: str) -> builtins.list[str]:
        """:meth:`Storage.list_dir_after`: S3 lists from ``StartAfter``, so only the names
        above it cost requests; other filesystems list the folder and drop the rest."""
        check_folder(prefix)
        if not _lists_from_key(self._fs):
            return names_after(self.list_dir(prefix), after)
        base = "/".join(p for p in (self._root, prefix.rstrip("/")) if p)
        listed = self._call("list", prefix, lambda: self._s3_names_after(base, after))
        return names_after(sorted(set(listed)), after)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        """One level of :meth:`Storage.list_dir` (``fs.ls``: one delimited LIST on S3, per
        1,000 names)."""
        check_folder(prefix)
        base = "/".join(p for p in (self._root, prefix.rstrip("/")) if p)

        def ls() -> builtins.list[dict[str, Any]]:
            self._fs.invalidate_cache(base)
            try:
                return list(self._fs.ls(base or "/", detail=True))
            except FileNotFoundError:
                return []

        names = set()
        for entry in self._call("list", prefix, ls):
            full = str(entry["name"]).rstrip("/")
            name = full.rpartition("/")[2]
            if not name or full.lstrip("/") == base.lstrip("/"):
                continue  # the folder itself (some servers report it)
            names.add(name + "/" if entry.get("type") == "directory" else name)
        return sorted(names)

    def _s3_names_after(self, base: str, after: str) -> builtins.list[str]:
        """The names in folder ``base`` (bucket/key) after ``after``: delimited
        ``ListObjectsV2`` pages from ``StartAfter``, each page through s3fs's own retried
        call (``call_s3``). (s3fs's ``ls`` has no start; its listing is the same request.)"""
        fs: Any = self._fs
        bucket, key, _ = fs.split_path(base)
        folder = f"{key.strip('/')}/" if key.strip("/") else ""
        kwargs: dict[str, Any] = {
            "Bucket": bucket,
            "Prefix": folder,
            "Delimiter": "/",
            "StartAfter": folder + after,
            **fs.req_kw,
        }
        names: builtins.list[str] = []
        while True:
            out = fs.call_s3("list_objects_v2", **kwargs)
            names.extend(p["Prefix"][len(folder) :] for p in out.get("CommonPrefixes", []))
            names.extend(c["Key"][len(folder) :] for c in out.get("Contents", []))
            if not out.get("IsTruncated"):
                break
            kwargs["ContinuationToken"] = out["NextContinuationToken"]
        # A key ending in "/" (a folder marker) or with an empty name is no name of the folder
        return [n for n in names if n and n.count("/") <= (1 if n.endswith("/") else 0)]

    def _map_ordered(
        self, fn: Callable[[str], T], paths: builtins.list[str]
    ) -> Iterator[tuple[str, T]]:
        """``(p, fn(p))`` in input order, at most ``2 * max_workers`` calls in flight."""
        if not paths:
            return
        workers = min(self._max_workers, len(paths))
        window = 2 * workers
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deck-storage") as pool:
            pending: deque[tuple[str, Future[T]]] = deque()
            it: Iterator[str] = iter(paths)
            try:
                for p in it:
                    pending.append((p, pool.submit(fn, p)))
                    if len(pending) >= window:
                        break
                while pending:
                    p, fut = pending.popleft()
                    result = fut.result()
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.append((nxt, pool.submit(fn, nxt)))
                    yield p, result
            finally:
                # The consumer stopped early or a fetch failed: do not start the rest.
                for _, fut in pending:
                    fut.cancel()

    def iter_get(self, paths: builtins.list[str]) -> Iterator[tuple[str, bytes]]:
        """Fetch whole objects in parallel (bounded), yielding them in the order of ``paths``."""
        return self._map_ordered(self.get, paths)

    def get_many(
        self, paths: builtins.list[str], limit: int | None = None
    ) -> Iterator[tuple[str, bytes | None]]:
        """:meth:`Storage.get_many` with requests in parallel (bounded), in order."""
        return self._map_ordered(lambda p: self.get_or_none(p, limit), paths)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``, several requests in flight."""
        for _ in self._map_ordered(self.delete, self.list(prefix)):
            pass


def _lists_from_key(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is s3fs with the requests :meth:`FsspecStorage._s3_names_after` makes
    (a versioned bucket lists versions instead: the plain listing, filtered, serves it)."""
    return (
        type(fs).__module__.startswith("s3fs")
        and callable(getattr(fs, "call_s3", None))
        and not getattr(fs, "version_aware", False)
    )


def _find_takes_prefix(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs.find`` filters by a key prefix on the server (``prefix=``: s3fs, gcsfs,
    adlfs); elsewhere the keyword would reach ``ls`` unread."""
    try:  # an async filesystem's find wraps its coroutine: its signature is the coroutine's
        return "prefix" in inspect.signature(fs.find).parameters
    except (TypeError, ValueError):
        return False


def _check_protocol(uri: str) -> None:
    """Refuse ``uri`` unless its scheme's put is atomic (checked before any backend loads, so
    the refusal does not depend on what is installed)."""
    if schemes.is_local(uri):
        raise ConfigError(
            f"{uri} is a local path: use LocalStorage / open_storage, whose put is an atomic "
            "rename (fsspec's local pipe_file is not)"
        )
    try:
        schemes.lookup(uri)
    except ValueError as e:
        raise ConfigError(
            f"storage URI {uri}: {e}. deck writes only where a put makes an object visible "
            "whole or not at all, so that no reader ever sees a prefix of a file; mount the "
            "store where its rename is atomic (e.g. NFS) and pass the local path: deck then "
            "writes a temp file and renames it"
        ) from e


def _info_time(info: dict[str, Any]) -> float | None:
    """The modification (or creation) time an fsspec ``info`` dict reports, if any."""
    for name in ("mtime", "LastModified", "last_modified", "created", "updated"):
        v = info.get(name)
        if v is None:
            continue
        if hasattr(v, "timestamp"):  # a datetime
            return float(v.timestamp())
        with contextlib.suppress(TypeError, ValueError):
            return float(v)
    return None
