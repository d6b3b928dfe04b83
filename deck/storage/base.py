"""The one storage interface every part of deck talks to.

Paths are relative, '/'-separated keys under the store's root URI. Implementations:
:class:`deck.storage.local.LocalStorage` (a local directory, atomic rename commit) and
:class:`deck.storage.fsspec_store.FsspecStorage` (any fsspec URI: s3://, gs://, memory://).
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Iterator

from deck.errors import ConfigError, NotFoundError


class Storage(abc.ABC):
    """A flat key -> bytes store rooted at one URI.

    Guarantees every implementation gives (checked by tests/storage/test_conformance.py):
    - ``put`` is all-or-nothing: a reader sees either no object or the complete bytes, never a
      prefix. A successful return means the bytes are durable at the destination (fsynced locally,
      acknowledged by the object store remotely).
    - ``get`` of a missing key raises :class:`deck.errors.NotFoundError` naming the full URI.
    - ``list`` returns the keys (relative paths) under a prefix, sorted, without temp files.
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
        """Write ``data`` at ``path`` atomically and durably, replacing any previous object."""

    @abc.abstractmethod
    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (to the end when ``end`` is None)."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of the object at ``path``."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether an object exists at ``path``."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete ``path`` if it exists (no error when it does not)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Keys of all objects whose path starts with ``prefix`` (a directory-like prefix)."""

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

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``."""
        for key in self.list(prefix):
            self.delete(key)

    def iter_get(self, paths: builtins.list[str]) -> Iterator[tuple[str, bytes]]:
        """Fetch several whole objects; implementations may overlap the requests."""
        for p in paths:
            yield p, self.get(p)

    def get_many(self, paths: builtins.list[str]) -> Iterator[tuple[str, bytes | None]]:
        """Like :meth:`iter_get` (whole objects, in the order of ``paths``), with None for an
        object that does not exist instead of :class:`NotFoundError`."""
        for p in paths:
            yield p, self.get_or_none(p)

    def get_or_none(self, path: str) -> bytes | None:
        """The whole object at ``path``, or None if there is none."""
        try:
            return self.get(path)
        except NotFoundError:
            return None


def check_prefix(prefix: str) -> None:
    """Refuse a listing prefix that would leave the root (absolute, or with ``..``)."""
    if prefix.startswith("/") or ".." in prefix.split("/"):
        raise ConfigError(f"invalid storage prefix {prefix!r}: use a relative '/'-path")


def check_folder(prefix: str) -> None:
    """Refuse a :meth:`Storage.list_dir` prefix that does not name a folder under the root."""
    if prefix and not prefix.endswith("/"):
        raise ValueError(f"list_dir wants a folder ('' or ending in '/'), got {prefix!r}")
    check_prefix(prefix)
