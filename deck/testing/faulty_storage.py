"""A fault-injecting wrapper around a real store (zarr/fsspec-style test double, not a mock:
every call that is not failed goes to the real store)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from deck.errors import StorageError
from deck.storage import Storage
from deck.storage.wrapper import StorageWrapper


class FaultyStorage(StorageWrapper):
    """Delegates to ``inner``; ``fail_put(key, n)`` / ``fail_get(key, n)`` decide whether the
    n-th put / get fails, ``fail_delete(key)`` whether a delete (of a key or a prefix) does.
    ``slow_put_s`` delays every put; ``short_read`` truncates every get by that many bytes.

    Every read and write goes through the faulty :meth:`put` / :meth:`get`: it reports no local
    path (so nothing maps or writes the inner store's files around them, and a local store
    behind it is staged and read like a remote one), whole-object reads take the generic
    versions of :class:`Storage`, which call :meth:`get`, and it prunes no temps (like a remote
    store).
    """

    iter_get = Storage.iter_get
    get_many = Storage.get_many
    get_or_none = Storage.get_or_none
    map_file = Storage.map_file
    prune_temps = Storage.prune_temps

    def __init__(
        self,
        inner: Storage,
        fail_put: Callable[[str, int], bool] = lambda key, n: False,
        fail_get: Callable[[str, int], bool] = lambda key, n: False,
        slow_put_s: float = 0.0,
        short_read: int = 0,
        fail_delete: Callable[[str], bool] = lambda key: False,
    ):
        super().__init__(inner)
        self.fail_put = fail_put
        self.fail_get = fail_get
        self.fail_delete = fail_delete
        self.gets = 0
        self.slow_put_s = slow_put_s
        self.short_read = short_read
        self.puts = 0
        self.failed_puts = 0
        self._lock = threading.Lock()

    def local_path(self, path: str = "") -> str | None:
        return None

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self._before_put(path)
        self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes | bytearray | memoryview) -> bool:
        self._before_put(path)
        return self.inner.put_if_absent(path, data)

    def _before_put(self, path: str) -> None:
        """Count the put, delay it by ``slow_put_s`` and fail it where ``fail_put`` says so."""
        with self._lock:
            self.puts += 1
            n = self.puts
        if self.slow_put_s:
            time.sleep(self.slow_put_s)
        if self.fail_put(path, n):
            with self._lock:
                self.failed_puts += 1
            raise StorageError(f"injected failure of put #{n} ({self.describe(path)})")

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        with self._lock:
            self.gets += 1
            n = self.gets
        if self.fail_get(path, n):
            raise StorageError(f"injected failure of get #{n} ({self.describe(path)})")
        data = self.inner.get(path, start, end)
        return data[: max(0, len(data) - self.short_read)] if self.short_read else data

    def delete(self, path: str) -> None:
        if self.fail_delete(path):
            raise StorageError(f"injected failure of delete ({self.describe(path)})")
        self.inner.delete(path)

    def delete_if(self, path: str, data: bytes) -> bool:
        if self.fail_delete(path):
            raise StorageError(f"injected failure of delete ({self.describe(path)})")
        return self.inner.delete_if(path, data)

    def delete_prefix(self, prefix: str) -> None:
        if self.fail_delete(prefix):
            raise StorageError(f"injected failure of delete ({self.describe(prefix)})")
        self.inner.delete_prefix(prefix)
