"""The tests' recording wrapper is a conforming store (capabilities forwarded), and records each
request once, with the thread that made it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from deck.storage import LocalStorage, Storage
from deck.testing.recording_storage import RecordingStorage
from deck.testing.storage import LocalFiles, RawObjects, StorageTests


class TestRecordingStorage(StorageTests):
    @pytest.fixture
    def store(self, tmp_path: Any) -> Storage:
        return RecordingStorage(LocalStorage(tmp_path / "store"))

    @pytest.fixture
    def raw(self, tmp_path: Any) -> RawObjects:
        return LocalFiles(tmp_path / "store")


def test_records_each_request_with_its_thread(tmp_path: Any) -> None:
    inner = LocalStorage(tmp_path / "store")
    store = RecordingStorage(inner)
    assert store.local_path() == inner.root and store.calls == []  # capabilities ask nothing
    start = time.perf_counter()
    store.put("a/b", b"1")
    worker = threading.Thread(target=lambda: store.list("a/"), name="reader")
    worker.start()
    worker.join()
    assert dict(store.get_many(["a/b", "a/c"])) == {"a/b": b"1", "a/c": None}
    end = time.perf_counter()
    main = threading.current_thread().name
    assert [(c.op, c.path, c.thread) for c in store.between(start, end)] == [
        ("put", "a/b", main),
        ("list", "a/", "reader"),
        ("get_many", "a/b", main),
        ("get_many", "a/c", main),
    ]
    assert store.between(end + 1, end + 2) == []
