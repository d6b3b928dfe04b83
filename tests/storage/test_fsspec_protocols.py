"""FsspecStorage opens only protocols whose single-object put is atomic (a reader never sees a
prefix of a file); the others are refused at open with an error naming the URI and protocol."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from deck.errors import ConfigError
from deck.storage import FsspecStorage, open_storage

# Filesystems whose put writes the target file in place (or whose atomicity deck cannot vouch
# for): a reader could see a prefix of a chunk or manifest while it is written.
REFUSED = [
    "sftp://host/run1",
    "ssh://host/run1",
    "ftp://host/run1",
    "smb://host/share/run1",
    "hdfs://namenode/run1",
    "webhdfs://namenode/run1",
    "http://host/run1",
    "webdav://host/run1",
    "simplecache::s3://bucket/run1",  # a caching wrapper writes locally, then uploads
]


@pytest.mark.parametrize("uri", REFUSED)
def test_non_atomic_protocols_are_refused_at_open(uri: str) -> None:
    protocol = uri.split("://", 1)[0]
    for open_it in (lambda: open_storage(uri), lambda: FsspecStorage(uri)):
        with pytest.raises(ConfigError) as info:
            open_it()
        text = str(info.value)
        assert uri in text and repr(protocol) in text, text
        assert "local path" in text and "s3" in text, text  # says what to do instead


def _round_trip(store: Any) -> None:
    store.put("a/b.bin", b"payload")
    assert store.get("a/b.bin") == b"payload"
    assert store.list("a/") == ["a/b.bin"]
    store.delete("a/b.bin")
    assert not store.exists("a/b.bin")


def test_memory_still_opens() -> None:
    store = open_storage(f"memory://deck-proto-{uuid.uuid4().hex}")
    assert isinstance(store, FsspecStorage)
    _round_trip(store)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "s3a"])
def test_s3_still_opens(s3_server: Any, s3_uri: str, scheme: str) -> None:
    """Both spellings of S3 reach a real SeaweedFS server."""
    uri = scheme + s3_uri[len("s3") :]
    store = open_storage(uri, s3_server.storage_options)
    assert isinstance(store, FsspecStorage) and store.uri == uri
    _round_trip(store)
