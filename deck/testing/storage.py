"""The conformance tests every :class:`deck.storage.Storage` backend must pass.

A backend's tests subclass :class:`StorageTests` and provide a ``store`` fixture that returns a
fresh, empty store::

    class TestMyStorage(StorageTests):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStorage(tmp_path)

Every test then runs against that store: the contract of the :class:`Storage` methods (atomic
replace, ordering and prefix rules of listings, errors naming the URI, invalid keys refused) and
of its capabilities (:meth:`~Storage.local_path`, :meth:`~Storage.modified`,
:meth:`~Storage.map_file`, :meth:`~Storage.prefetch`, :meth:`~Storage.prune_temps`), whatever the
store answers for them.

A subclass also provides a ``raw`` fixture: the backend's objects reached *without* the store
under test (:class:`RawObjects`, like zarr's ``StoreTests.get`` / ``set``), so that what a put or
a delete did is checked where the bytes are (the files on disk, the memory filesystem's dict, the
bucket through its own client), not read back through the code that wrote them; and reads are
checked on objects the store did not write. :class:`LocalFiles`, :class:`MemoryObjects` and
:class:`S3Objects` are the ones for deck's backends. Needs pytest; deck itself never imports this
module.
"""

from __future__ import annotations

import abc
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from deck.errors import (
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
    StorageError,
    UnsafePathError,
)
from deck.storage import Storage, check_writable
from deck.storage.atomic import TEMP_PREFIX
from deck.storage.base import get_bounded

__all__ = ["LocalFiles", "MemoryObjects", "RawObjects", "S3Objects", "StorageTests"]


class RawObjects(abc.ABC):
    """A backend's objects under one store's root, reached without the :class:`Storage` under
    test: the conformance tests' independent view of what a store wrote."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes the backend holds at ``key``, or None when it holds no object there."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace the object at ``key`` as the backend holds objects."""

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Sorted names (relative to the root) of everything the backend holds there: objects,
        and whatever a store hides from its listings (temp files of a local store)."""


class LocalFiles(RawObjects):
    """A local store's files under ``root``, read and written with ``open()``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        if not os.path.isfile(path) or os.path.islink(path):
            return None
        with open(path, "rb") as f:
            return f.read()

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def keys(self) -> list[str]:
        return sorted(
            os.path.relpath(os.path.join(d, f), self.root).replace(os.sep, "/")
            for d, _, files in os.walk(self.root)
            for f in files
        )


class MemoryObjects(RawObjects):
    """The objects of a ``memory://name`` store, in fsspec's ``MemoryFileSystem.store`` dict."""

    def __init__(self, uri: str) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        self.objects = MemoryFileSystem.store  # one dict for every memory:// URI of the process
        self.root = "/" + uri.removeprefix("memory://").strip("/")

    def get(self, key: str) -> bytes | None:
        f = self.objects.get(f"{self.root}/{key}")
        return None if f is None else bytes(f.getvalue())

    def put(self, key: str, data: bytes) -> None:
        from fsspec.implementations.memory import MemoryFile

        path = f"{self.root}/{key}"
        self.objects[path] = MemoryFile(None, path, data)

    def keys(self) -> list[str]:
        return sorted(
            k[len(self.root) + 1 :] for k in self.objects if k.startswith(self.root + "/")
        )


class S3Objects(RawObjects):
    """The objects under an ``s3://bucket/prefix`` root through a botocore client of its own
    (not s3fs: nothing of the store under test, its caches included, is on the way)."""

    def __init__(self, uri: str, storage_options: dict[str, Any]) -> None:
        import botocore.session

        self.bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        client_kwargs = storage_options.get("client_kwargs", {})
        self.client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=client_kwargs.get("endpoint_url"),
            region_name=client_kwargs.get("region_name"),
            aws_access_key_id=storage_options.get("key"),
            aws_secret_access_key=storage_options.get("secret"),
        )

    def get(self, key: str) -> bytes | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        except self.client.exceptions.NoSuchKey:
            return None
        return bytes(answer["Body"].read())

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def keys(self) -> list[str]:
        found: list[str] = []
        pages = self.client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix):
            found += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
        return sorted(found)


class StorageTests:
    """The contract of :class:`deck.storage.base.Storage`; subclass it with a ``store`` fixture
    (a fresh, empty store) to run it against a backend."""

    @pytest.fixture
    def store(self) -> Storage:
        """A fresh, empty store of the backend under test: subclasses override this."""
        raise NotImplementedError("a StorageTests subclass must define the `store` fixture")

    @pytest.fixture
    def raw(self, store: Storage) -> RawObjects:
        """The objects under ``store``'s root reached without it: subclasses override this."""
        raise NotImplementedError("a StorageTests subclass must define the `raw` fixture")

    def test_roundtrip_bytes_like(self, store: Storage, raw: RawObjects) -> None:
        store.put("a.bin", b"hello")
        store.put("b.bin", bytearray(b"world"))
        store.put("c.bin", memoryview(b"xxabcxx")[2:5])
        assert [raw.get(k) for k in ("a.bin", "b.bin", "c.bin")] == [b"hello", b"world", b"abc"]
        assert store.get("a.bin") == b"hello"
        assert store.get("b.bin") == b"world"
        assert store.get("c.bin") == b"abc"
        assert isinstance(store.get("a.bin"), bytes)

    def test_page_aligned_buffers(self, store: Storage, raw: RawObjects) -> None:
        """Chunks come in page-aligned whole-page buffers (local stores write them with O_DIRECT),
        views of such buffers too; a put replaces the object and leaves nothing else behind."""
        buf = memoryview(mmap.mmap(-1, 3 * 4096))  # page-aligned, as chunk buffers are
        buf[:] = bytes(range(256)) * 48
        store.put("k/aligned", buf)
        store.put("k/partial", buf[: 4096 + 7])  # aligned start, not whole pages
        store.put("k/aligned", buf[4096:])  # replaces it with a shorter aligned view
        assert store.get("k/aligned") == bytes(buf[4096:])
        assert store.get("k/partial") == bytes(buf[: 4096 + 7])
        assert sorted(store.list("k")) == ["k/aligned", "k/partial"]
        assert raw.keys() == ["k/aligned", "k/partial"]  # no temp file either
        assert raw.get("k/aligned") == bytes(buf[4096:])

    def test_ranged_get(self, store: Storage) -> None:
        data = bytes(range(256)) * 4
        store.put("r", data)
        assert store.get("r", 10, 20) == data[10:20]
        assert store.get("r", 1000) == data[1000:]
        assert store.get("r", 0, 1) == data[:1]
        assert store.get("r", 1020, 5000) == data[1020:]  # past the end: truncated
        assert store.get("r", 5, 5) == b""
        with pytest.raises(ConfigError):
            store.get("r", 10, 5)

    def test_overwrite(self, store: Storage, raw: RawObjects) -> None:
        store.put("k", b"first version, longer")
        store.put("k", b"second")
        assert raw.get("k") == b"second" and raw.keys() == ["k"]
        assert store.get("k") == b"second"
        assert store.size("k") == 6
        assert store.list() == ["k"]

    def test_reads_what_the_backend_holds(self, store: Storage, raw: RawObjects) -> None:
        """Reads, sizes and listings of objects the store did not write itself."""
        data = bytes(range(256)) * 3
        raw.put("r/obj", data)
        raw.put("r/sub/empty", b"")
        raw.put("top", b"t")
        assert store.get("r/obj") == data and store.get("r/obj", 10, 20) == data[10:20]
        assert store.size("r/obj") == len(data) and store.size("r/sub/empty") == 0
        assert store.get("r/sub/empty") == b"" and store.exists("top")
        assert store.list() == ["r/obj", "r/sub/empty", "top"]
        assert store.list_dir("r/") == ["obj", "sub/"]
        assert bytes(store.map_file("r/obj")) == data
        store.delete("r/obj")
        assert raw.get("r/obj") is None and raw.get("top") == b"t"

    def test_missing(self, store: Storage) -> None:
        with pytest.raises(NotFoundError) as info:
            store.get("no/such/key")
        assert store.describe("no/such/key") in str(info.value)
        assert isinstance(info.value, FileNotFoundError)
        assert isinstance(info.value, StorageError)
        with pytest.raises(NotFoundError):
            store.get("no/such/key", 3, 7)
        with pytest.raises(NotFoundError):
            store.get("no/such/key", 3, 3)
        with pytest.raises(NotFoundError, match="no/such/key"):
            store.size("no/such/key")
        assert not store.exists("no/such/key")

    def test_list_prefixes(self, store: Storage, raw: RawObjects) -> None:
        keys = ["a/b/c", "a/b/d", "a/b/e/f", "a/bb", "ab", "z"]
        for k in reversed(keys):
            store.put(k, k.encode())
        assert raw.keys() == keys
        assert store.list() == keys
        assert store.list("") == keys
        assert store.list("a/") == ["a/b/c", "a/b/d", "a/b/e/f", "a/bb"]
        assert store.list("a/b") == ["a/b/c", "a/b/d", "a/b/e/f", "a/bb"]
        assert store.list("a/b/") == ["a/b/c", "a/b/d", "a/b/e/f"]
        assert store.list("a/b/c") == ["a/b/c"]
        assert store.list("a") == ["a/b/c", "a/b/d", "a/b/e/f", "a/bb", "ab"]
        assert store.list("nothing/") == []
        assert store.list("nothing/deeper/") == []

    def test_get_many_keeps_order_and_reports_missing_as_none(self, store: Storage) -> None:
        keys = [f"m/{i:03d}.json" for i in range(40)]
        for k in keys[::2]:
            store.put(k, k.encode())
        got = list(store.get_many(keys))
        assert [k for k, _ in got] == keys
        assert all(v == (k.encode() if i % 2 == 0 else None) for i, (k, v) in enumerate(got))

    def test_list_dir_reads_one_level(self, store: Storage) -> None:
        for k in ["a/b/c", "a/b/d", "a/b/e/f", "a/bb", "ab", "z"]:
            store.put(k, k.encode())
        want = {
            "": ["a/", "ab", "z"],
            "a/": ["b/", "bb"],
            "a/b/": ["c", "d", "e/"],
            "a/b/e/": ["f"],
            "nothing/": [],
        }
        for prefix, names in want.items():
            assert store.list_dir(prefix) == names, prefix
            # The backend's one-level read agrees with the default derived from list().
            assert Storage.list_dir(store, prefix) == names, prefix
        with pytest.raises(ValueError, match="folder"):
            store.list_dir("a")

    def test_list_dir_after_lists_the_names_above_a_bound(self, store: Storage) -> None:
        keys = ["a/b/c", "a/bb", "a/ba/x", "ab", "z", "step-000000000005/m"]
        keys += ["step-000000000010/m", "step-000000000010/n", "step-000000000011"]
        for k in keys:
            store.put(k, k.encode())
        bounds = ["", "a", "a/", "ab", "b", "step-", "step-000000000005", "step-000000000009"]
        bounds += ["step-000000000010", "step-000000000011", "zz", "a/b", "bb"]
        for prefix in ["", "a/", "step-000000000010/", "nothing/"]:
            every = store.list_dir(prefix)
            for after in bounds:
                want = [n for n in every if n.rstrip("/") > after]
                assert store.list_dir_after(prefix, after) == want, (prefix, after)
                assert Storage.list_dir_after(store, prefix, after) == want, (prefix, after)
        assert store.list_dir_after("", "step-000000000005") == [
            "step-000000000010/",
            "step-000000000011",
            "z",
        ]

    def test_exists_and_directories(self, store: Storage) -> None:
        store.put("dir/obj", b"1")
        assert store.exists("dir/obj")
        assert not store.exists("dir")  # a directory-like prefix is not an object
        assert not store.exists("dir/ob")

    def test_put_if_absent(self, store: Storage, raw: RawObjects) -> None:
        """Creates only what is not there; an existing object (also one made by ``put``) is
        left untouched and reported False."""
        assert store.put_if_absent("c/one", b"first") is True
        assert store.put_if_absent("c/one", b"second") is False
        assert raw.get("c/one") == b"first"
        store.put("c/two", b"put")
        assert store.put_if_absent("c/two", b"later") is False
        assert store.get("c/two") == b"put"
        assert store.list("c/") == ["c/one", "c/two"]  # no temp file left behind

    def test_put_if_absent_has_one_winner(self, store: Storage) -> None:
        """Where creation is atomic, of 8 threads creating one key at once exactly one wins, and
        the object holds the winner's bytes."""
        if not store.atomic_create:
            return  # the default checks, then writes: documented as not atomic
        barrier = threading.Barrier(8)

        def create(i: int) -> bool:
            barrier.wait()
            return store.put_if_absent("race", f"writer {i}".encode())

        with ThreadPoolExecutor(8) as pool:
            won = list(pool.map(create, range(8)))
        assert won.count(True) == 1
        assert store.get("race") == f"writer {won.index(True)}".encode()

    def test_delete_if(self, store: Storage, raw: RawObjects) -> None:
        """Deletes only the bytes given: another object there is left as it is (False); a
        missing one counts as deleted."""
        store.put("r/one", b"ours")
        assert store.delete_if("r/one", b"theirs") is False
        assert raw.get("r/one") == b"ours"
        assert store.delete_if("r/one", b"ours") is True
        assert raw.get("r/one") is None
        assert store.delete_if("r/one", b"ours") is True
        assert store.list() == []  # nothing taken aside is left behind

    def test_delete_if_never_deletes_a_write_landing_meanwhile(self, store: Storage) -> None:
        """Where :attr:`~Storage.atomic_delete_if` holds: a write racing a delete of the old
        bytes always survives it, whichever comes first (200 races)."""
        if not store.atomic_delete_if:
            return  # the default reads, then deletes: documented as not atomic
        for i in range(200):
            store.put("race", b"old")
            barrier = threading.Barrier(2)

            def write(i: int = i, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                store.put("race", f"new {i}".encode())

            t = threading.Thread(target=write)
            t.start()
            barrier.wait()
            store.delete_if("race", b"old")
            t.join()
            assert store.get("race") == f"new {i}".encode()

    def test_delete_idempotent(self, store: Storage, raw: RawObjects) -> None:
        store.delete("never/existed")
        store.put("x/y", b"1")
        store.delete("x/y")
        assert raw.get("x/y") is None
        assert not store.exists("x/y")
        assert store.list() == []
        store.delete("x/y")

    def test_delete_prefix(self, store: Storage, raw: RawObjects) -> None:
        for k in ["ck/1/a", "ck/1/b/c", "ck/10/a", "ck/2/a", "other"]:
            store.put(k, b"v")
        store.delete_prefix("ck/1/")
        assert raw.keys() == ["ck/10/a", "ck/2/a", "other"]
        assert store.list() == ["ck/10/a", "ck/2/a", "other"]
        store.delete_prefix("ck/")
        assert raw.keys() == ["other"]
        assert store.list() == ["other"]
        store.delete_prefix("nothing/")

    def test_size(self, store: Storage) -> None:
        store.put("s", b"12345")
        assert store.size("s") == 5

    def test_empty_object(self, store: Storage, raw: RawObjects) -> None:
        store.put("empty", b"")
        assert raw.get("empty") == b""
        assert store.get("empty") == b""
        assert store.size("empty") == 0
        assert store.exists("empty")
        assert store.list() == ["empty"]

    def test_large_object(self, store: Storage, raw: RawObjects) -> None:
        data = os.urandom(5 * 2**20)
        store.put("big/obj", data)
        assert raw.get("big/obj") == data
        assert store.size("big/obj") == len(data)
        assert store.get("big/obj") == data
        assert store.get("big/obj", 2**20, 3 * 2**20 + 7) == data[2**20 : 3 * 2**20 + 7]

    def test_iter_get_preserves_order(self, store: Storage) -> None:
        keys = [f"it/{i:03d}" for i in range(25)]
        for k in keys:
            store.put(k, k.encode() * 3)
        order = list(reversed(keys))
        assert list(store.iter_get(order)) == [(k, k.encode() * 3) for k in order]
        assert list(store.iter_get([])) == []
        with pytest.raises(NotFoundError):
            list(store.iter_get([*keys[:3], "it/missing", *keys[3:]]))

    @pytest.mark.parametrize("bad", ["", "/abs", "../up", "a/../b", "a//b", "a/./b", "a/"])
    def test_invalid_keys(self, store: Storage, bad: str) -> None:
        with pytest.raises(ConfigError):
            store.put(bad, b"x")

    @pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "a\0b", "a\\b", "a//b"])
    def test_keys_never_leave_the_root(self, store: Storage, bad: str) -> None:
        """The one containment rule, for every call: a key that could resolve outside the root
        is refused before anything is read, written or deleted."""
        for call in (store.get, store.size, store.delete, store.exists, store.map_file):
            with pytest.raises(ConfigError):
                call(bad)
        if "//" not in bad:  # an empty component in a listing prefix cannot escape
            with pytest.raises(ConfigError):
                store.list(bad + "/")

    def test_bounded_reads(self, store: Storage) -> None:
        """Ranges that start at or past the end of an object (any range of an empty one) are
        empty, so :func:`get_bounded` reads at most ``limit + 1`` bytes of anything."""
        store.put("b/empty", b"")
        store.put("b/ten", b"0123456789")
        assert store.get("b/empty", 0, 10) == b"" and store.get("b/ten", 10, 20) == b""
        assert get_bounded(store, "b/ten", 10) == b"0123456789"
        assert get_bounded(store, "b/empty", 10) == b""
        with pytest.raises(CorruptCheckpointError, match="larger than 9 bytes"):
            get_bounded(store, "b/ten", 9)
        assert list(store.get_many(["b/ten", "b/none"], limit=10)) == [
            ("b/ten", b"0123456789"),
            ("b/none", None),
        ]
        with pytest.raises(CorruptCheckpointError, match="b/ten"):
            list(store.get_many(["b/ten"], limit=4))

    def test_links_below_the_root_are_never_followed(self, store: Storage, tmp_path: Any) -> None:
        """Local stores: a link below the root (to a folder or a file elsewhere) is never read,
        written, listed or deleted through; deleting removes the link itself."""
        root = store.local_path()
        if root is None:
            pytest.skip("not a local filesystem: there are no links below the root")
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "f").write_bytes(b"outside")
        store.put("d/real", b"in")
        os.symlink(outside, os.path.join(root, "d", "linked"))
        os.symlink(outside / "f", os.path.join(root, "d", "file"))
        os.symlink(outside, os.path.join(root, "top"))
        for key in ("d/linked/f", "d/file", "top/f"):
            for call in (store.get, store.size, store.map_file):
                with pytest.raises(UnsafePathError, match="symbolic link"):
                    call(key)
            assert not store.exists(key) and store.modified(key) is None
        for key in ("d/linked/new", "top/new", "d/file"):
            with pytest.raises(UnsafePathError, match="symbolic link"):
                store.put(key if key != "d/file" else "d/file/x", b"x")
        with pytest.raises(UnsafePathError):
            store.delete("d/linked/f")
        assert store.list() == ["d/real"] and store.list("top/") == []
        assert store.list_dir("") == ["d/"] and store.list_dir("d/") == ["real"]
        assert store.list_dir("top/") == [] and store.list_dir("d/linked/") == []
        store.delete("d/file")  # the link goes, not the file it points to
        store.delete_prefix("top/")  # the link goes, not the folder
        store.delete_prefix("d/")
        assert store.list() == [] and not os.path.lexists(os.path.join(root, "top"))
        assert not os.path.lexists(os.path.join(root, "d"))
        assert sorted(os.listdir(outside)) == ["f"] and (outside / "f").read_bytes() == b"outside"

    def test_only_regular_files_are_read(self, store: Storage) -> None:
        """Local stores: a FIFO or a folder where a file is expected is refused at once (no
        read blocks), and is not listed."""
        root = store.local_path()
        if root is None:
            pytest.skip("not a local filesystem: every object is a regular object")
        store.put("s/ok", b"1")
        os.mkfifo(os.path.join(root, "s", "fifo"))
        os.mkdir(os.path.join(root, "s", "dir"))
        for call in (store.get, store.size, store.map_file):
            with pytest.raises(UnsafePathError, match="FIFO"):
                call("s/fifo")
            with pytest.raises(NotFoundError, match="folder"):
                call("s/dir")
        assert not store.exists("s/fifo") and store.list() == ["s/ok"]
        store.put("s/fifo", b"replaced")  # a put replaces the entry, it never opens it
        assert store.get("s/fifo") == b"replaced"

    def test_check_writable(self, store: Storage, raw: RawObjects) -> None:
        check_writable(store)
        assert store.list() == []  # the probe is gone
        assert raw.keys() == []

    # -- capabilities ------------------------------------------------------------------------

    def test_local_path(self, store: Storage) -> None:
        """None (not a local filesystem), or the file that holds exactly the object's bytes."""
        store.put("lp/a.bin", b"on disk")
        root = store.local_path()
        path = store.local_path("lp/a.bin")
        if root is None:
            assert path is None
            return
        assert path is not None and os.path.isabs(path) and os.path.isabs(root)
        assert path.startswith(root.rstrip(os.sep) + os.sep)
        with open(path, "rb") as f:
            assert f.read() == b"on disk"

    def test_modified(self, store: Storage) -> None:
        """None (unknown) or the time of the last write, give or take clock granularity."""
        before = time.time()
        store.put("mod/a", b"1")
        after = time.time()
        when = store.modified("mod/a")
        assert when is None or before - 2.0 <= when <= after + 2.0
        assert store.modified("mod/missing") is None

    def test_list_modified_is_the_listing_with_its_times(self, store: Storage) -> None:
        """The same keys as :meth:`list`, each with the time :meth:`modified` reports (or None
        for both): what GC ages files by, in one listing."""
        for k in ["t/a", "t/b/c", "t/bb", "u"]:
            store.put(k, k.encode())
        for prefix in ("", "t/", "t/b", "nothing/"):
            got = store.list_modified(prefix)
            assert [k for k, _ in got] == store.list(prefix), prefix
            for k, when in got:
                assert when == store.modified(k), k

    def test_map_file(self, store: Storage) -> None:
        data = bytes(range(256)) * 33
        store.put("map/a", data)
        store.put("map/empty", b"")
        view = store.map_file("map/a")
        assert view.nbytes == len(data) and bytes(view) == data
        assert bytes(store.map_file("map/empty")) == b""
        del view
        with pytest.raises(NotFoundError):
            store.map_file("map/missing")

    def test_prune_temps(self, store: Storage, raw: RawObjects) -> None:
        """Removes only what listings hide (temp files of interrupted puts), and only once they
        are old enough; never an object. A ``.tmp-`` name is an object where the store lists it
        (object stores): then it stays."""
        store.put("p/a", b"1")
        raw.put(f"p/{TEMP_PREFIX}a.0123", b"half")
        raw.put(f"p/d/{TEMP_PREFIX}b.0123", b"half")
        held, listed = raw.keys(), store.list()
        hidden = sorted(set(held) - set(listed))
        assert store.prune_temps("p/", 3600) == []  # young: a writer may still be using them
        assert raw.keys() == held
        removed = store.prune_temps("p/", 3600, now=time.time() + 7200)
        assert set(removed) <= set(hidden)
        assert raw.keys() == sorted(set(held) - set(removed)) and store.list() == listed
        assert store.get("p/a") == b"1"
        with pytest.raises(ValueError, match="folder"):
            store.prune_temps("p")

    def test_prefetch_is_only_a_hint(self, store: Storage) -> None:
        store.put("pf/a", b"x")
        store.prefetch("pf/a")
        store.prefetch("pf/missing")  # never fails
        assert store.get("pf/a") == b"x"
