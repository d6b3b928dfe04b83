"""The conformance suite (:class:`deck.testing.storage.StorageTests`) run against each Storage
implementation, plus local-, retry- and S3-specific tests.

The S3 cases run against a real SeaweedFS server (``s3_server`` fixture) and are marked slow.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from deck.errors import ConfigError, NotFoundError, StorageError
from deck.storage import (
    FsspecStorage,
    LocalStorage,
    RetryPolicy,
    Storage,
    check_writable,
    open_storage,
)
from deck.storage.local import TEMP_PREFIX
from deck.storage.retry import call_with_retry, is_transient
from deck.storage.wrapper import StorageWrapper
from deck.testing.faulty_storage import FaultyStorage
from deck.testing.storage import (
    LocalFiles,
    MemoryObjects,
    RawObjects,
    S3Objects,
    StorageTests,
)

FAST_RETRY = RetryPolicy(attempts=3, initial_delay=0.001, max_delay=0.01)


def _temps(root: Any) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if TEMP_PREFIX in f]


class TestLocalStorage(StorageTests):
    @pytest.fixture
    def store(self, tmp_path: Any) -> Storage:
        return LocalStorage(tmp_path / "store")

    @pytest.fixture
    def raw(self, tmp_path: Any) -> RawObjects:
        return LocalFiles(tmp_path / "store")


class TestMemoryStorage(StorageTests):
    @pytest.fixture
    def store(self) -> Storage:
        return FsspecStorage(f"memory://deck-test-{uuid.uuid4().hex}")

    @pytest.fixture
    def raw(self, store: Storage) -> RawObjects:
        return MemoryObjects(store.uri)


@pytest.mark.slow
class TestS3Storage(StorageTests):
    """FsspecStorage over s3fs against a real SeaweedFS server."""

    @pytest.fixture
    def store(self, s3_server: Any, s3_uri: str) -> Storage:
        return FsspecStorage(s3_uri, s3_server.storage_options)

    @pytest.fixture
    def raw(self, s3_server: Any, s3_uri: str) -> RawObjects:
        return S3Objects(s3_uri, s3_server.storage_options)


class TestWrappedStorage(StorageTests):
    """StorageWrapper forwards everything, capabilities included."""

    @pytest.fixture
    def store(self, tmp_path: Any) -> Storage:
        return StorageWrapper(LocalStorage(tmp_path / "store"))

    @pytest.fixture
    def raw(self, tmp_path: Any) -> RawObjects:
        return LocalFiles(tmp_path / "store")

    def test_capabilities_are_forwarded(self, tmp_path: Any) -> None:
        inner = LocalStorage(tmp_path / "store")
        inner.put("a/b", b"1")
        wrapped = StorageWrapper(inner)
        assert wrapped.local_path() == inner.root
        assert wrapped.local_path("a/b") == inner.local_path("a/b")
        assert wrapped.modified("a/b") == inner.modified("a/b") is not None
        assert wrapped.uri == inner.uri and wrapped.describe("x") == inner.describe("x")


class TestFaultyStorageWithoutFaults(StorageTests):
    """The tests' fault-injecting wrapper is a conforming store while it injects nothing, and
    hides the local path of the store it wraps."""

    @pytest.fixture
    def store(self, tmp_path: Any) -> Storage:
        return FaultyStorage(LocalStorage(tmp_path / "store"))

    @pytest.fixture
    def raw(self, tmp_path: Any) -> RawObjects:
        return LocalFiles(tmp_path / "store")

    def test_hides_the_local_path(self, store: Storage) -> None:
        store.put("k", b"v")
        assert store.local_path() is None and store.local_path("k") is None


class TestOpenStorage:
    def test_plain_path(self, tmp_path: Any) -> None:
        s = open_storage(str(tmp_path / "a"))
        assert isinstance(s, LocalStorage)
        assert s.uri == str(tmp_path / "a")

    def test_relative_and_home(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        rel = open_storage("rel/dir")
        assert isinstance(rel, LocalStorage) and rel.uri == str(tmp_path / "rel" / "dir")
        home = open_storage("~/ckpt")
        assert isinstance(home, LocalStorage) and home.uri == str(tmp_path / "home" / "ckpt")

    def test_file_uri(self, tmp_path: Any) -> None:
        s = open_storage(f"file://{tmp_path}/f")
        assert isinstance(s, LocalStorage) and s.uri == f"{tmp_path}/f"

    def test_memory(self) -> None:
        s = open_storage("memory://deck-open-test")
        assert isinstance(s, FsspecStorage) and s.uri == "memory://deck-open-test"

    def test_s3_options_reach_s3fs(self) -> None:
        pytest.importorskip("s3fs")
        opts = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:1", "region_name": "us-east-1"},
        }
        s = open_storage("s3://bucket/prefix/", opts)
        assert isinstance(s, FsspecStorage)
        assert s.uri == "s3://bucket/prefix"
        assert s.describe("x/y") == "s3://bucket/prefix/x/y"
        assert s.fs.client_kwargs["endpoint_url"] == "http://127.0.0.1:1"

    def test_empty_uri(self) -> None:
        with pytest.raises(ConfigError):
            open_storage("")

    def test_fsspec_refuses_local(self, tmp_path: Any) -> None:
        with pytest.raises(ConfigError, match="LocalStorage"):
            FsspecStorage(f"file://{tmp_path}")

    def test_unknown_protocol(self) -> None:
        with pytest.raises(ConfigError, match="nosuchproto"):
            open_storage("nosuchproto://x/y")


class TestLocal:
    def test_unwritable_root(self, tmp_path: Any) -> None:
        # Root can write anywhere, so make the root unusable: its parent is a regular file.
        blocker = tmp_path / "file"
        blocker.write_bytes(b"not a directory")
        s = LocalStorage(blocker / "sub")
        with pytest.raises(StorageError, match="not writable") as info:
            check_writable(s)
        assert str(blocker / "sub") in str(info.value)
        assert "pass a directory/bucket you can write to" in str(info.value)

    def test_local_path_and_layout(self, tmp_path: Any) -> None:
        s = LocalStorage(tmp_path)
        s.put("a/b/c.bin", b"data")
        assert s.local_path("a/b/c.bin") == str(tmp_path / "a" / "b" / "c.bin")
        assert (tmp_path / "a" / "b" / "c.bin").read_bytes() == b"data"
        assert _temps(tmp_path) == []

    def test_list_skips_temps_and_delete_prefix_removes_them(self, tmp_path: Any) -> None:
        s = LocalStorage(tmp_path)
        s.put("ck/1/a", b"1")
        stray = tmp_path / "ck" / "1" / f"{TEMP_PREFIX}a.deadbeef"
        stray.write_bytes(b"half")
        assert s.list() == ["ck/1/a"]
        s.delete_prefix("ck/1/")
        assert not (tmp_path / "ck" / "1").exists()  # emptied directories are pruned
        assert (tmp_path / "ck").is_dir()

    def test_failed_fsync_leaves_old_object_and_no_temp(
        self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        s = LocalStorage(tmp_path)
        s.put("k", b"old")

        def no_space(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("deck.storage.local.os.fsync", no_space)
        with pytest.raises(StorageError, match="free space") as info:
            s.put("k", b"new")
        assert str(tmp_path / "k") in str(info.value)
        monkeypatch.undo()
        assert s.get("k") == b"old"
        assert _temps(tmp_path) == []

    def test_partial_write_leaves_no_temp(
        self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        s = LocalStorage(tmp_path)
        real_write = os.write
        calls = {"n": 0}

        def flaky_write(fd: int, data: Any) -> int:
            calls["n"] += 1
            if calls["n"] == 1:
                return real_write(fd, bytes(data[:10]))  # short write: put must continue
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("deck.storage.local.os.write", flaky_write)
        with pytest.raises(StorageError):
            s.put("d/k", b"x" * 100)
        monkeypatch.undo()
        assert not s.exists("d/k")
        assert _temps(tmp_path) == []

    def test_short_writes_are_completed(
        self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        s = LocalStorage(tmp_path)
        real_write = os.write
        monkeypatch.setattr(
            "deck.storage.local.os.write", lambda fd, data: real_write(fd, bytes(data[:7]))
        )
        payload = bytes(range(256))
        s.put("k", payload)
        monkeypatch.undo()
        assert s.get("k") == payload

    def test_directory_replaced_by_file(self, tmp_path: Any) -> None:
        s = LocalStorage(tmp_path)
        s.put("d/a", b"1")
        s.delete("d/a")
        os.rmdir(tmp_path / "d")
        (tmp_path / "d").write_bytes(b"now a file")
        with pytest.raises(StorageError, match="could not write"):
            s.put("d/b", b"2")
        assert _temps(tmp_path) == []

    def test_prune_temps_removes_old_temps_and_emptied_folders(self, tmp_path: Any) -> None:
        """Every temp file under the folder once old enough, then the folders left empty (the
        root and folders holding objects stay); objects are never touched."""
        s, raw = LocalStorage(tmp_path / "ck"), LocalFiles(tmp_path / "ck")
        s.put("1/a", b"1")
        temps = [f"1/{TEMP_PREFIX}a.0", f"1/x/y/{TEMP_PREFIX}b.0", f"2/{TEMP_PREFIX}c.0"]
        for t in temps:
            raw.put(t, b"half")
        assert s.prune_temps("1/", 60) == []  # fresh
        assert s.prune_temps("1/", 60, now=time.time() + 120) == sorted(temps[:2])
        assert raw.keys() == ["1/a", temps[2]] and not (tmp_path / "ck/1/x").exists()
        assert s.prune_temps() == [temps[2]]  # no grace: whatever its age
        assert raw.keys() == ["1/a"] and not (tmp_path / "ck/2").exists()
        assert s.list() == ["1/a"] and s.prune_temps() == [] and (tmp_path / "ck").is_dir()
        assert s.prune_temps("absent/") == []

    def test_prune_temps_removes_an_old_empty_tree_in_one_call(self, tmp_path: Any) -> None:
        """A failed checkpoint's empty folders (step / attempt / rank / table), all older than
        the grace period, go in one call: removing a child touches its parent's mtime, which must
        not make the parent look fresh. A fresh folder, and an old one holding it, stay."""
        s, root = LocalStorage(tmp_path / "ck"), tmp_path / "ck"
        s.put("keep/a", b"1")
        tree = root / "step-7" / "0123456789abcdef" / "rank-00000" / "t0"
        tree.mkdir(parents=True)
        (tree / f"{TEMP_PREFIX}half.0").write_bytes(b"half")
        (root / "old" / "fresh").mkdir(parents=True)
        two_days_ago = time.time() - 2 * 86400
        for p in [tree / f"{TEMP_PREFIX}half.0", tree, *tree.parents, root / "old"]:
            if p == root:
                break
            os.utime(p, (two_days_ago, two_days_ago))
        assert s.prune_temps("", 3600) == [
            f"step-7/0123456789abcdef/rank-00000/t0/{TEMP_PREFIX}half.0"
        ]
        assert not (root / "step-7").exists()
        assert (root / "old" / "fresh").is_dir()  # fresh, and so its old parent is not empty
        assert s.list() == ["keep/a"]

    def test_prune_temps_never_follows_a_link(
        self, tmp_path: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A link below the root is never entered, a prefix through a link is refused (logged);
        a temp-named link is removed itself, not what it points to."""
        outside = tmp_path / "outside"
        (outside / "sub").mkdir(parents=True)
        (outside / f"{TEMP_PREFIX}victim.0").write_bytes(b"not ours")
        s = LocalStorage(tmp_path / "ck")
        s.put("d/a", b"1")
        os.symlink(outside, tmp_path / "ck" / "d" / "linked")
        os.symlink(outside / f"{TEMP_PREFIX}victim.0", tmp_path / "ck" / "d" / f"{TEMP_PREFIX}l")
        with caplog.at_level(logging.WARNING, logger="deck.storage.local"):
            assert s.prune_temps("d/linked/") == []
        assert "symbolic link" in caplog.text
        assert s.prune_temps() == [f"d/{TEMP_PREFIX}l"]
        assert not os.path.lexists(tmp_path / "ck" / "d" / f"{TEMP_PREFIX}l")
        assert (outside / f"{TEMP_PREFIX}victim.0").read_bytes() == b"not ours"
        assert (outside / "sub").is_dir() and os.path.islink(tmp_path / "ck" / "d" / "linked")

    def test_non_buffer_data_is_rejected_before_writing(self, tmp_path: Any) -> None:
        s = LocalStorage(tmp_path)
        with pytest.raises(TypeError):
            s.put("k", "not bytes")  # type: ignore[arg-type]
        assert os.listdir(tmp_path) == []

    def test_non_byte_memoryview(self, tmp_path: Any) -> None:
        import array

        s = LocalStorage(tmp_path)
        arr = array.array("i", [1, 2, 3])
        s.put("ints", memoryview(arr))
        assert s.get("ints") == arr.tobytes()

    def test_missing_names_full_path(self, tmp_path: Any) -> None:
        s = LocalStorage(tmp_path)
        with pytest.raises(NotFoundError, match=str(tmp_path / "x" / "y")):
            s.get("x/y")


class TestRetry:
    def test_retries_connection_errors_then_succeeds(self, caplog: Any) -> None:
        calls = {"n": 0}

        def flaky() -> str:
            calls["n"] += 1
            if calls["n"] <= 2:
                raise ConnectionError("connection reset by peer")
            return "ok"

        with caplog.at_level(logging.WARNING, logger="deck.storage.retry"):
            assert call_with_retry(flaky, FAST_RETRY, "get s3://b/k") == "ok"
        assert calls["n"] == 3
        assert sum("get s3://b/k failed" in r.getMessage() for r in caplog.records) == 2

    def test_does_not_retry_file_not_found(self) -> None:
        calls = {"n": 0}

        def missing() -> None:
            calls["n"] += 1
            raise FileNotFoundError("nope")

        with pytest.raises(FileNotFoundError):
            call_with_retry(missing, FAST_RETRY, "get x")
        assert calls["n"] == 1

    def test_gives_up_after_attempts(self) -> None:
        calls = {"n": 0}

        def down() -> None:
            calls["n"] += 1
            raise TimeoutError("timed out")

        with pytest.raises(TimeoutError):
            call_with_retry(down, FAST_RETRY, "put x")
        assert calls["n"] == FAST_RETRY.attempts

    def test_deadline_instead_of_attempts(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """attempts=None: retried until the next wait would end past deadline_s (the stager's
        upload retries), with the policy's own choice of errors."""
        clock = {"now": 0.0}
        monkeypatch.setattr("deck.storage.retry.time.monotonic", lambda: clock["now"])

        def sleep(seconds: float) -> None:
            clock["now"] += seconds

        monkeypatch.setattr("deck.storage.retry.time.sleep", sleep)
        policy = RetryPolicy(
            attempts=None,
            deadline_s=10.0,
            initial_delay=1.0,
            max_delay=4.0,
            jitter=0.0,
            retry_on=lambda e: isinstance(e, StorageError),
        )
        calls = {"n": 0}

        def down() -> None:
            calls["n"] += 1
            raise StorageError("store unreachable")

        with pytest.raises(StorageError, match="unreachable"):
            call_with_retry(down, policy, "upload x")
        # Waits 1, 2, 4 (7 s in all); the next 4 s wait would end at 11 s > 10 s.
        assert calls["n"] == 4 and clock["now"] == 7.0

        def wrong() -> None:
            raise KeyError("not a storage error")

        with pytest.raises(KeyError):
            call_with_retry(wrong, policy, "upload x")

    def test_backoff_is_bounded(self) -> None:
        p = RetryPolicy(attempts=10, initial_delay=0.2, max_delay=5.0)
        delays = [p.delay(i) for i in range(10)]
        assert all(0 <= d <= 5.0 for d in delays)
        assert 0.1 <= delays[0] <= 0.2
        assert delays[9] >= 2.5

    def test_invalid_policy(self) -> None:
        with pytest.raises(ConfigError):
            RetryPolicy(attempts=0)
        with pytest.raises(ConfigError):
            RetryPolicy(initial_delay=2, max_delay=1)
        with pytest.raises(ConfigError, match=r"RetryPolicy\.jitter"):
            RetryPolicy(jitter=1.5)
        with pytest.raises(ConfigError, match="retries forever"):
            RetryPolicy(attempts=None)
        with pytest.raises(ConfigError, match=r"RetryPolicy\.tries"):
            RetryPolicy(tries=3)  # type: ignore[call-arg]
        policy = RetryPolicy()
        with pytest.raises(ConfigError, match="frozen"):  # deck's error, not pydantic's
            policy.attempts = 3  # type: ignore[misc]

    def test_classification(self) -> None:
        assert is_transient(ConnectionResetError())
        assert is_transient(OSError(errno.EBUSY, "SlowDown"))
        assert not is_transient(PermissionError("Forbidden"))
        assert not is_transient(NotFoundError("x"))
        assert not is_transient(ValueError("bad"))
        # A permanent error raised from a network error stays permanent.
        try:
            try:
                raise ConnectionError("x")
            except ConnectionError as inner:
                raise FileNotFoundError("y") from inner
        except FileNotFoundError as outer:
            assert not is_transient(outer)

    def test_classification_botocore(self) -> None:
        botocore = pytest.importorskip("botocore.exceptions")
        assert is_transient(botocore.EndpointConnectionError(endpoint_url="http://x"))
        assert is_transient(botocore.ReadTimeoutError(endpoint_url="http://x"))

        def client_error(status: int) -> Exception:
            return botocore.ClientError(
                {"Error": {"Code": str(status)}, "ResponseMetadata": {"HTTPStatusCode": status}},
                "GetObject",
            )

        assert is_transient(client_error(503))
        assert is_transient(client_error(500))
        assert is_transient(client_error(429))
        assert not is_transient(client_error(400))
        wrapped = OSError(errno.EIO, "wrapped")
        wrapped.__cause__ = client_error(400)
        assert not is_transient(wrapped)

    def test_fsspec_storage_retries_and_maps_errors(self, monkeypatch: pytest.MonkeyPatch) -> None:
        s = FsspecStorage(f"memory://deck-retry-{uuid.uuid4().hex}", retry=FAST_RETRY)
        s.put("k", b"value")
        real = s.fs.cat_file
        calls = {"n": 0}

        def flaky(path: str, *args: Any, **kwargs: Any) -> bytes:
            calls["n"] += 1
            if calls["n"] <= 2:
                raise ConnectionResetError("reset")
            return real(path, *args, **kwargs)

        monkeypatch.setattr(s.fs, "cat_file", flaky)
        assert s.get("k") == b"value"
        assert calls["n"] == 3

        def always_down(path: str, *args: Any, **kwargs: Any) -> bytes:
            raise ConnectionRefusedError("refused")

        monkeypatch.setattr(s.fs, "cat_file", always_down)
        with pytest.raises(StorageError, match="gave up after 3 attempts") as info:
            s.get("k")
        assert s.describe("k") in str(info.value)


@pytest.mark.slow
class TestS3:
    def test_a_bounded_listing_reads_the_pages_above_its_bound(
        self, s3_server: Any, s3_uri: str
    ) -> None:
        """Over 1,000 folders (more than one page of S3's answer): ``list_dir_after`` gives
        what the whole listing gives above the bound, from ``StartAfter`` (one request for the
        few names above it, as many pages as names / 1,000 from the start)."""
        s = FsspecStorage(s3_uri, s3_server.storage_options)
        names = [f"step-{i:012d}" for i in range(1_010)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: s.put(f"{n}/manifest.json", b"{}"), names))
        s.put("merged/F-000000000001-x/manifest.json", b"{}")
        every = s.list_dir("")
        assert every == ["merged/", *[f"{n}/" for n in names]]
        for after in ["", "step-", names[3], names[1_000], names[-2], names[-1]]:
            assert s.list_dir_after("", after) == [n for n in every if n.rstrip("/") > after]
        calls: list[dict[str, Any]] = []
        fs = s._fs
        real = fs.call_s3

        def counted(method: str, **kw: Any) -> Any:
            calls.append({"method": method, **kw})
            return real(method, **kw)

        fs.call_s3 = counted
        try:
            assert s.list_dir_after("", names[-3]) == [f"{n}/" for n in names[-2:]]
        finally:
            del fs.call_s3
        assert [c["method"] for c in calls] == ["list_objects_v2"], calls
        assert calls[0]["StartAfter"].endswith(f"/{names[-3]}"), calls

    def test_bad_credentials_not_writable(self, s3_server: Any, s3_uri: str) -> None:
        opts = dict(s3_server.storage_options, secret="wrong")
        s = FsspecStorage(s3_uri, opts, retry=FAST_RETRY)
        with pytest.raises(StorageError, match="not writable") as info:
            check_writable(s)
        assert s3_uri in str(info.value)

    def test_survives_pause_resume(self, s3_server: Any, s3_uri: str) -> None:
        s = FsspecStorage(s3_uri, s3_server.storage_options)
        before = os.urandom(256 * 1024)
        s.put("before", before)
        s3_server.pause()
        try:
            # During the outage a call with a short policy fails with a typed error naming the URI.
            quick = FsspecStorage(s3_uri, s3_server.storage_options, retry=FAST_RETRY)
            with pytest.raises(StorageError, match="gave up after 3 attempts") as info:
                quick.get("before")
            assert quick.describe("before") in str(info.value)
            # A put issued during the outage succeeds once the server is back (retries). The
            # server comes back only after the put has failed once (seen by the policy's own
            # retry_on), so the put does run into the outage; the attempts outlast any restart.
            failed_once = threading.Event()

            def retry_on(exc: BaseException) -> bool:
                failed_once.set()
                return is_transient(exc)

            patient = FsspecStorage(
                s3_uri,
                s3_server.storage_options,
                retry=RetryPolicy(
                    attempts=600, initial_delay=0.1, max_delay=1.0, retry_on=retry_on
                ),
            )
            errors: list[BaseException] = []

            def put_during_outage() -> None:
                try:
                    patient.put("during", b"written while down")
                except BaseException as exc:
                    errors.append(exc)

            writer = threading.Thread(target=put_during_outage)
            writer.start()
            assert failed_once.wait(timeout=300), errors
        finally:
            s3_server.resume()
        writer.join(timeout=600)
        assert not writer.is_alive() and errors == []
        assert s.get("before") == before
        assert s.get("during") == b"written while down"
        s.put("after", b"ok")
        assert s.list() == ["after", "before", "during"]
