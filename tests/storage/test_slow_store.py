"""The slow store of tests and benchmarks (deck.testing.slow_store) and the round trips deck's S3
calls cost through it: real SeaweedFS behind the latency proxy, every request counted at the
client."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from deck.storage import FsspecStorage, open_storage
from deck.testing.s3_server import SeaweedS3
from deck.testing.slow_store import LatencyProxy, S3Requests


@pytest.fixture
def slow(s3_server: SeaweedS3) -> Iterator[tuple[FsspecStorage, S3Requests, LatencyProxy]]:
    with LatencyProxy(s3_server.ports["s3"], 0.002) as proxy:
        store = open_storage(
            s3_server.uri(f"test-{uuid.uuid4().hex[:12]}"),
            proxy.s3_options(s3_server.storage_options),
        )
        assert isinstance(store, FsspecStorage)
        yield store, S3Requests(store.fs), proxy


def test_the_proxy_passes_every_byte_both_ways(
    slow: tuple[FsspecStorage, S3Requests, LatencyProxy],
) -> None:
    """Objects larger than the proxy's read size go up and come back whole, in order, over
    the proxy's connections (one per client connection)."""
    store, _, proxy = slow
    data = os.urandom(3 * 2**20 + 17)
    store.put("big", data)
    store.put("empty", b"")
    assert store.get("big") == data and store.get("big", 5, 2**20 + 9) == data[5 : 2**20 + 9]
    assert store.get("empty") == b""
    assert proxy.connections >= 1


def test_exists_and_an_empty_listing_are_one_request_each(
    slow: tuple[FsspecStorage, S3Requests, LatencyProxy],
) -> None:
    """exists() of a missing key, of an object and of a folder-like prefix is one request
    (s3fs's stat of a missing key lists it as a folder too: two); list() of a prefix that
    holds nothing is one request (s3fs adds a stat and a listing of the prefix's name)."""
    store, requests, _ = slow
    store.put("a/b/c.json", b"{}")
    store.put("a/empty", b"")
    for key, there in (("a/b/c.json", True), ("a/b/missing", False), ("a/b", False)):
        requests.clear()
        assert store.exists(key) is there, key
        assert sum(requests.taken().values()) == 1, key
    assert store.exists("a/empty")  # a range of an empty object is refused: a stat says
    for prefix, keys in (("quarantine/", []), ("a/b/", ["a/b/c.json"]), ("a/b", ["a/b/c.json"])):
        requests.clear()
        assert store.list(prefix) == keys, prefix
        assert requests.taken() == {"list_objects_v2": 1}, prefix
    assert store.list("a/") == ["a/b/c.json", "a/empty"] and store.list("a/e") == ["a/empty"]
