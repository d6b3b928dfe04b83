"""A fault-injecting wrapper around a real store (zarr/fsspec-style test double, not a mock:
every call that is not failed goes to the real store)."""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable

from deck.errors import StorageError
from deck.storage import Storage


class FaultyStorage(Storage):
    """Delegates to ``inner``; ``fail_put(key, n)`` / ``fail_get(key, n)`` decide whether the
    n-th put / get fails. ``slow_put_s`` delays every put; ``short_read`` truncates every get by
    that many bytes.
    """

    def __init__(
        self,
        inner: Storage,
        fail_put: Callable[[str, int], bool] = lambda key, n: False,
        fail_get: Callable[[str, int], bool] = lambda key, n: False,
        slow_put_s: float = 0.0,
        short_read: int = 0,
    ):
        self.inner = inner
        self.fail_put = fail_put
        self.fail_get = fail_get
        self.gets = 0
        self.slow_put_s = slow_put_s
        self.short_read = short_read
        self.puts = 0
        self.failed_puts = 0
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return self.inner.uri

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        with self._lock:
            self.puts += 1
            n = self.puts
        if self.slow_put_s:
            time.sleep(self.slow_put_s)
        if self.fail_put(path, n):
            with self._lock:
                self.failed_puts += 1
            raise StorageError(f"injected failure of put #{n} ({self.describe(path)})")
        self.inner.put(path, data)

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        with self._lock:
            self.gets += 1
            n = self.gets
        if self.fail_get(path, n):
            raise StorageError(f"injected failure of get #{n} ({self.describe(path)})")
        data = self.inner.get(path, start, end)
        return data[: max(0, len(data) - self.short_read)] if self.short_read else data

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)
