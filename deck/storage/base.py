"""The one storage interface every part of deck talks to.

Paths are relative, '/'-separated keys under the store's root URI. Implementations:
:class:`deck.storage.local.LocalStorage` (a local directory, atomic rename commit) and
:class:`deck.storage.fsspec_store.FsspecStorage` (any fsspec URI: s3://, gs://, memory://).
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Iterator

from deck.errors import ConfigError, CorruptCheckpointError, NotFoundError

# The largest record (manifest, part or pending record, lease, quarantine record) deck reads
# whole: real ones are a few MiB at most (a part manifest lists every chunk of a rank), so a
# larger file is damaged or planted and is refused before more than this is read.
MAX_RECORD_BYTES = 64 * 2**20


class Storage(abc.ABC):
    """A flat key -> bytes store rooted at one URI.

    Guarantees every implementation gives (checked by :class:`deck.testing.storage.StorageTests`,
    which each backend's tests subclass):
    - ``put`` is all-or-nothing: a reader sees either no object or the complete bytes, never a
      prefix. A successful return means the bytes are durable at the destination (fsynced locally,
      acknowledged by the object store remotely).
    - ``get`` of a missing key raises :class:`deck.errors.NotFoundError` naming the full URI.
    - ``list`` returns the keys (relative paths) under a prefix, sorted, without temp files.
    - Errors are :class:`deck.errors.StorageError` (an ``OSError``) naming the full URI; an invalid
      key or byte range is a :class:`deck.errors.ConfigError`.

    Capabilities: :meth:`local_path`, :meth:`modified`, :meth:`map_file`, :meth:`prefetch` and
    :meth:`prune_temps` have defaults that any store can answer (None for "not available here",
    a copying read, a no-op); a backend overrides them where it can do better. Callers ask for a
    capability instead of checking the backend's class, so that wrappers
    (:class:`deck.storage.wrapper.StorageWrapper`) keep them.
    """

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """The root URI, as given by the user (normalised)."""

    def describe(self, path: str) -> str:
        """Full URI of ``path``: for error messages."""
        return f"{self.uri.rstrip('/')}/{path}"

    @abc.abstractmethod
    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at ``path``, replacing any previous object.

        Atomic: a concurrent or later reader sees the old object (or none) or all of ``data``,
        never a prefix, also after a crash. Durable: once this returns the bytes survive a crash
        of this machine (fsynced locally, acknowledged by an object store). On failure the
        previous object, if any, is untouched."""

    @abc.abstractmethod
    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (to the end when ``end`` is None; shorter when the
        object ends first). A missing object raises :class:`NotFoundError`, an invalid range
        (``start < 0`` or ``end < start``) :class:`ConfigError`."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of the object at ``path``; :class:`NotFoundError` when there is none."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether an object exists at ``path`` (a directory-like prefix is not an object)."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete ``path`` if it exists (no error when it does not). Idempotent; once this
        returns, :meth:`exists` and :meth:`list` no longer report it."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Sorted keys of all objects whose key starts with ``prefix`` (a plain string prefix:
        ``"a/b"`` matches ``a/b/c`` and ``a/bc``). Temp files of unfinished writes are never
        listed; a prefix that would leave the root raises :class:`ConfigError`."""

    def put_if_absent(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        """Create ``path`` holding ``data`` only if no object is there: True when this call
        created it, False when an object was already there (left untouched). Otherwise as
        :meth:`put` (atomic, durable).

        Where :attr:`atomic_create` is True, of several callers creating one key at once exactly
        one gets True whatever the store's latency (the file system's exclusive link, an object
        store's ``If-None-Match: *``). This default checks, then writes: two simultaneous
        callers may both get True and the later write wins, so a caller that must be alone
        reads the object back."""
        if self.exists(path):
            return False
        self.put(path, data)
        return True

    @property
    def atomic_create(self) -> bool:
        """Whether :meth:`put_if_absent` is atomic on this store (see there). Default False."""
        return False

    def delete_if(self, path: str, data: bytes) -> bool:
        """Delete ``path`` only while it holds exactly ``data``: True when it was deleted (or
        was already gone), False when another object is there (left in place).

        Where :attr:`atomic_delete_if` is True no write that lands meanwhile is deleted (a local
        disk: the file is taken aside with a rename, compared, and put back when it is not
        ``data``; the key is absent for that moment). This default reads, compares, then
        deletes: a write landing between the read and the delete is deleted."""
        try:
            now = self.get(path)
        except NotFoundError:
            return True
        if now != data:
            return False
        self.delete(path)
        return True

    @property
    def atomic_delete_if(self) -> bool:
        """Whether :meth:`delete_if` never deletes a write that lands during it. Default False."""
        return False

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        """Sorted names of what lies directly in the folder ``prefix`` ("" or ending in "/"):
        objects as named, sub-folders with a trailing "/". An absent folder is empty.

        This default derives it from :meth:`list` (everything below); backends override it to
        read one level only, so that finding manifests costs the same however many chunk
        files the store holds."""
        check_folder(prefix)
        names = set()
        for key in self.list(prefix):
            head, sep, _ = key[len(prefix) :].partition("/")
            names.add(head + sep)
        return sorted(names)

    def list_dir_after(self, prefix: str, after: str) -> builtins.list[str]:
        """The names of :meth:`list_dir` that sort after ``after`` (compared without the
        trailing "/"). This default lists the whole folder; a backend whose listing is in key
        order overrides it to read only those names (S3: ``StartAfter``), so that a bounded
        listing of a folder of step folders costs the steps above the bound, not the
        history."""
        return names_after(self.list_dir(prefix), after)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (not atomic: a failure part-way leaves the rest;
        repeating the call finishes the job). Local stores also remove temp files there."""
        for key in self.list(prefix):
            self.delete(key)

    def iter_get(self, paths: builtins.list[str]) -> Iterator[tuple[str, bytes]]:
        """Fetch several whole objects, yielded in the order of ``paths``; implementations may
        overlap the requests. A missing object raises :class:`NotFoundError` when reached."""
        for p in paths:
            yield p, self.get(p)

    def get_many(
        self, paths: builtins.list[str], limit: int | None = None
    ) -> Iterator[tuple[str, bytes | None]]:
        """Like :meth:`iter_get` (whole objects, in the order of ``paths``), with None for an
        object that does not exist instead of :class:`NotFoundError`. With ``limit``, an object
        larger than ``limit`` bytes raises :class:`CorruptCheckpointError` (see
        :func:`get_bounded`)."""
        for p in paths:
            yield p, self.get_or_none(p, limit)

    def get_or_none(self, path: str, limit: int | None = None) -> bytes | None:
        """The whole object at ``path``, or None if there is none; ``limit`` as in
        :meth:`get_many`."""
        try:
            return self.get(path) if limit is None else get_bounded(self, path, limit)
        except NotFoundError:
            return None

    # -- capabilities: every store answers them; None means "not available on this store" ------

    def local_path(self, path: str = "") -> str | None:
        """The local filesystem path of key ``path`` ("" for the root folder), or None when the
        store is not a local filesystem (then only the methods above reach its objects).

        A path is returned whether or not the object exists. Whoever writes there directly
        takes over :meth:`put`'s promises (temp file, fsync, rename: see
        :mod:`deck.storage.atomic`). The default is None."""
        return None

    @property
    def lists_table_files(self) -> bool:
        """Whether the table files a writer puts here (chunks, bundles) are then listed here.
        False for a sink that routes them elsewhere (a publisher's Kafka topic): a writer's
        check before its commit record then looks only at the rest."""
        return True

    @property
    def overlap_reads(self) -> bool:
        """Whether independent reads are worth overlapping (each request pays a round trip):
        readers of many small objects then keep several in flight. Default: when the store is
        not a local filesystem (:meth:`local_path` is None)."""
        return self.local_path() is None

    def modified(self, path: str) -> float | None:
        """When the object at ``path`` was last written (seconds since the epoch), or None when
        the store does not tell or the object cannot be examined (missing, unreachable): callers
        treat None as "unknown", never as old. The default is None."""
        return None

    def list_modified(self, prefix: str = "") -> builtins.list[tuple[str, float | None]]:
        """:meth:`list` with each object's :meth:`modified` time: ``(key, time or None)``,
        sorted by key. The times are the store's own clock (a file system's mtimes, an object
        store's ``LastModified``), so ages taken from them against a time the same store gave
        (:func:`deck.ops.retention.clock.read_store_clock`) never mix two hosts' clocks. This
        default asks :meth:`modified` per key; backends override it to read the times with the
        listing."""
        return [(k, self.modified(k)) for k in self.list(prefix)]

    def map_file(self, path: str) -> memoryview:
        """The whole object at ``path`` as a flat, read-only byte view.

        Local stores memory-map the file (no copy; the mapping lives as long as the view and the
        tensors made from it); the default reads it with :meth:`get` (one copy). Errors as
        :meth:`get`."""
        return memoryview(self.get(path))

    def prefetch(self, path: str) -> None:
        """A hint that ``path`` is read soon: local stores start reading it into the page cache
        in the background. Never fails (a missing object is reported by the read that
        follows); the default does nothing."""
        return None

    def prune_temps(
        self,
        prefix: str = "",
        older_than_s: float = 0.0,
        *,
        now: float | None = None,
        folders_older_than_s: float | None = None,
    ) -> builtins.list[str]:
        """Remove what interrupted puts left in the folder ``prefix`` ("" or ending in "/") and
        below, and return the removed temp files' paths (relative, like keys), sorted.

        Caller: garbage collection (:func:`deck.ops.retention.collect_garbage`), after its
        deletions. What goes: temp files a crashed :meth:`put` left (never reported by
        :meth:`list`) and folders left empty (the root itself stays), each only once unchanged
        for ``older_than_s`` seconds before ``now`` (default: the current time), since a writer
        may still be using it; ``older_than_s <= 0`` removes them whatever their age.
        ``folders_older_than_s``, when given, is the folders' age instead (0: every empty
        folder, for a prefix whose files the caller just deleted as abandoned). An object
        :meth:`list` reports is never touched. Best effort: what cannot be examined or removed
        stays for a later call. The default removes nothing and returns []: a store whose put
        leaves nothing behind when interrupted has nothing to prune."""
        check_folder(prefix)
        return []


def validate_key(path: str) -> str:
    """Return ``path`` if it is a valid storage key, else raise :class:`ConfigError`.

    A key is a relative '/'-separated path without empty, ``.`` or ``..`` components, NUL or
    backslash, so that it can never escape the store's root (on disk or in a bucket). Every
    backend checks every key it is given here: the one rule for all of them."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"storage key must be a non-empty string, got {path!r}")
    if not is_valid_key(path):
        raise ConfigError(
            f"invalid storage key {path!r}: use a relative '/'-separated path without "
            "empty, '.' or '..' components, NUL or backslash"
        )
    return path


def is_valid_key(path: str) -> bool:
    """Whether :func:`validate_key` accepts ``path`` (listings leave out what it refuses)."""
    return (
        bool(path)
        and not path.startswith("/")
        and "\\" not in path
        and "\0" not in path
        and _BAD_PARTS.isdisjoint(path.split("/"))  # (in C: a read per record of a history)
    )


_BAD_PARTS = frozenset(("", ".", ".."))


def check_prefix(prefix: str) -> None:
    """Refuse a listing prefix that would leave the root (absolute, with ``..``, NUL or
    backslash)."""
    if prefix.startswith("/") or ".." in prefix.split("/") or "\0" in prefix or "\\" in prefix:
        raise ConfigError(f"invalid storage prefix {prefix!r}: use a relative '/'-path")


def get_bounded(storage: Storage, path: str, limit: int = MAX_RECORD_BYTES) -> bytes:
    """The whole object at ``path``, refused with :class:`CorruptCheckpointError` naming it when
    it holds more than ``limit`` bytes; never more than ``limit + 1`` bytes are read (one ranged
    read), so a huge, sparse or endless file costs nothing. Readers of records use it with
    :data:`MAX_RECORD_BYTES`, readers of files whose size a record declares with that size
    (then compare the length). Missing: :class:`NotFoundError`."""
    data = storage.get(path, 0, limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(
            f"{storage.describe(path)} is larger than {limit} bytes, more than it may hold; the "
            "file is damaged or was not written by deck: restore it from a copy or remove it"
        )
    return data


def check_folder(prefix: str) -> None:
    """Refuse (:class:`ConfigError`, like any invalid key) a :meth:`Storage.list_dir` prefix that
    does not name a folder under the root."""
    if prefix and not prefix.endswith("/"):
        raise ConfigError(f"list_dir wants a folder ('' or ending in '/'), got {prefix!r}")
    check_prefix(prefix)


def names_after(names: list[str], after: str) -> list[str]:
    """The names of a :meth:`Storage.list_dir` result that sort after ``after``."""
    return [n for n in names if n.rstrip("/") > after]
