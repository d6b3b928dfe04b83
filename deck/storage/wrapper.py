"""A :class:`Storage` that forwards every call to another one (like zarr's ``WrapperStore``).

Subclass it to change a few methods of a real store (count, delay or fail calls, log them) and
keep everything else, capabilities included: a wrapped local store still reports its
:meth:`~Storage.local_path`, so readers still map its files. A wrapper that changes what
:meth:`get` or :meth:`put` do must also stop the paths around them: have :meth:`local_path`
return None (then nobody writes or maps files behind its back) and take the base class's
generic :meth:`iter_get` / :meth:`get_many` / :meth:`get_or_none` / :meth:`map_file`, which
call its own :meth:`get` (``iter_get = Storage.iter_get``, ...), and :meth:`prune_temps`, which
then prunes nothing, like a remote store's.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator

from deck.storage.base import Storage

__all__ = ["StorageWrapper"]


class StorageWrapper(Storage):
    """Forwards every :class:`Storage` method and capability to ``inner``."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def uri(self) -> str:
        """The wrapped store's root URI."""
        return self.inner.uri

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.inner.put(path, data)

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.get(path, start, end)

    def put_if_absent(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        return self.inner.put_if_absent(path, data)

    @property
    def atomic_create(self) -> bool:
        return self.inner.atomic_create

    def delete_if(self, path: str, data: bytes) -> bool:
        return self.inner.delete_if(path, data)

    @property
    def atomic_delete_if(self) -> bool:
        return self.inner.atomic_delete_if

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list_dir(prefix)

    def list_dir_after(self, prefix: str, after: str) -> builtins.list[str]:
        return self.inner.list_dir_after(prefix, after)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def iter_get(self, paths: builtins.list[str]) -> Iterator[tuple[str, bytes]]:
        return self.inner.iter_get(paths)

    def get_many(
        self, paths: builtins.list[str], limit: int | None = None
    ) -> Iterator[tuple[str, bytes | None]]:
        return self.inner.get_many(paths, limit)

    def get_or_none(self, path: str, limit: int | None = None) -> bytes | None:
        return self.inner.get_or_none(path, limit)

    def local_path(self, path: str = "") -> str | None:
        return self.inner.local_path(path)

    @property
    def lists_table_files(self) -> bool:
        return self.inner.lists_table_files

    @property
    def overlap_reads(self) -> bool:
        # The store's latency, not the wrapper's: a wrapper that hides a local store's path
        # (faults, counts) still reads a local disk, and its tests want one request at a time.
        return self.inner.overlap_reads

    def modified(self, path: str) -> float | None:
        return self.inner.modified(path)

    def list_modified(self, prefix: str = "") -> builtins.list[tuple[str, float | None]]:
        # A subclass that changes list() or modified() (faults, counts) must see this call
        # through them; otherwise the inner store's one listing is as good.
        if (
            type(self).list is StorageWrapper.list
            and type(self).modified is StorageWrapper.modified
        ):
            return self.inner.list_modified(prefix)
        return Storage.list_modified(self, prefix)

    def map_file(self, path: str) -> memoryview:
        return self.inner.map_file(path)

    def prefetch(self, path: str) -> None:
        self.inner.prefetch(path)

    def prune_temps(
        self,
        prefix: str = "",
        older_than_s: float = 0.0,
        *,
        now: float | None = None,
        folders_older_than_s: float | None = None,
    ) -> builtins.list[str]:
        return self.inner.prune_temps(
            prefix, older_than_s, now=now, folders_older_than_s=folders_older_than_s
        )
