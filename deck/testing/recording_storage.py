"""A wrapper around a real store that records every request and the thread it came from (a test
double, not a mock: every call goes to the real store, unchanged).

Tests ask it which requests a piece of work issued: e.g. that a checkpoint's stall issued none
(``calls`` between two moments of the training thread, by thread name).
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from deck.storage import Storage
from deck.storage.wrapper import StorageWrapper


@dataclass(frozen=True)
class Call:
    """One request: the method, its path (or prefix, or the first of several paths), the name
    of the thread that made it, and when (``time.perf_counter()``, when the call began)."""

    op: str
    path: str
    thread: str
    at: float


class RecordingStorage(StorageWrapper):
    """Forwards every call to ``inner`` (capabilities included: a wrapped local store is still
    written and mapped as one) and appends a :class:`Call` to :attr:`calls` for each that
    reaches the store; :meth:`describe`, :attr:`uri` and the capabilities ask nothing."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.calls: builtins.list[Call] = []
        self._lock = threading.Lock()

    def _note(self, op: str, path: str) -> None:
        call = Call(op, path, threading.current_thread().name, time.perf_counter())
        with self._lock:
            self.calls.append(call)

    def between(self, start: float, end: float) -> builtins.list[Call]:
        """The calls made from ``start`` to ``end`` (``time.perf_counter()`` values)."""
        with self._lock:
            return [c for c in self.calls if start <= c.at <= end]

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self._note("put", path)
        self.inner.put(path, data)

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self._note("get", path)
        return self.inner.get(path, start, end)

    def put_if_absent(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        self._note("put_if_absent", path)
        return self.inner.put_if_absent(path, data)

    def size(self, path: str) -> int:
        self._note("size", path)
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        self._note("exists", path)
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self._note("delete", path)
        self.inner.delete(path)

    def delete_if(self, path: str, data: bytes) -> bool:
        self._note("delete", path)
        return self.inner.delete_if(path, data)

    def list(self, prefix: str = "") -> builtins.list[str]:
        self._note("list", prefix)
        return self.inner.list(prefix)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        self._note("list_dir", prefix)
        return self.inner.list_dir(prefix)

    def list_dir_after(self, prefix: str, after: str) -> builtins.list[str]:
        self._note("list_dir", prefix)
        return self.inner.list_dir_after(prefix, after)

    def list_modified(self, prefix: str = "") -> builtins.list[tuple[str, float | None]]:
        self._note("list_modified", prefix)
        return self.inner.list_modified(prefix)

    def delete_prefix(self, prefix: str) -> None:
        self._note("delete_prefix", prefix)
        self.inner.delete_prefix(prefix)

    def iter_get(self, paths: builtins.list[str]) -> Iterator[tuple[str, bytes]]:
        for p in paths:
            self._note("iter_get", p)
        return self.inner.iter_get(paths)

    def get_many(
        self, paths: builtins.list[str], limit: int | None = None
    ) -> Iterator[tuple[str, bytes | None]]:
        for p in paths:
            self._note("get_many", p)
        return self.inner.get_many(paths, limit)

    def get_or_none(self, path: str, limit: int | None = None) -> bytes | None:
        self._note("get_or_none", path)
        return self.inner.get_or_none(path, limit)

    def modified(self, path: str) -> float | None:
        self._note("modified", path)
        return self.inner.modified(path)

    def map_file(self, path: str) -> memoryview:
        self._note("map_file", path)
        return self.inner.map_file(path)

    def prefetch(self, path: str) -> None:
        self._note("prefetch", path)
        self.inner.prefetch(path)

    def prune_temps(
        self,
        prefix: str = "",
        older_than_s: float = 0.0,
        *,
        now: float | None = None,
        folders_older_than_s: float | None = None,
    ) -> builtins.list[str]:
        self._note("prune_temps", prefix)
        return self.inner.prune_temps(
            prefix, older_than_s, now=now, folders_older_than_s=folders_older_than_s
        )
