"""verify, check_files and the rank manifests' read overlap their requests on a remote store
(deck.read.catalog.overlapped) and report exactly what reading one file after the other
reports: the same problems and unreadable files in the same order, naming the same files, the
same counts and progress. Real files written by deck's writer (deck/testing/synth.py, chunk
files and bundles), damaged on disk and read through a fault-injecting wrapper that is a remote
store (no local path: reads overlap) or passes the local path on (reads one by one)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from deck.errors import CorruptCheckpointError, StorageError
from deck.format.manifest import CheckpointManifest, rank_manifest_name
from deck.format.stream import is_stream_file
from deck.read.catalog import overlapped, read_manifests, read_rank_manifests
from deck.read.verify import check_files, verify_checkpoint
from deck.storage import LocalStorage, Storage
from deck.testing.faulty_storage import FaultyStorage
from deck.testing.synth import SynthTrainer


class _Remote(FaultyStorage):
    """Faults on a local disk that reads like a remote store (no local path, reads worth
    overlapping); a plain wrapper keeps the inner store's one-at-a-time reads."""

    @property
    def overlap_reads(self) -> bool:
        return True


def _unnumbered(messages: list[str]) -> list[str]:
    """The injector numbers each get it fails; overlapped reads issue them in another order."""
    return [re.sub(r"get #\d+", "get #N", m) for m in messages]


class _Local(FaultyStorage):
    """The same faults, on a store that says it is local: every read one after the other."""

    def local_path(self, path: str = "") -> str | None:
        return self.inner.local_path(path)


def _data_files(folder: Path) -> list[Path]:
    """The chunk files or bundles under ``folder``."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and is_stream_file(str(p)))


def _damaged(root: Path, bundle_bytes: int) -> dict[int, CheckpointManifest]:
    """Five checkpoints; step 1's first chunk file zeroed, step 2's dense file cut short and one
    of its chunk files gone, step 4's rank 1 part manifest gone."""
    storage = LocalStorage(root)
    tr = SynthTrainer(storage, chunk_bytes=4096, bundle_bytes=bundle_bytes)
    tr.save("full")
    for _ in range(4):
        tr.train(rows=60)
        tr.save()
    manifests = read_manifests(storage)
    first = _data_files(root / manifests[1].folder)[0]
    first.write_bytes(b"\0" * first.stat().st_size)
    step2 = root / manifests[2].folder
    dense = sorted(step2.rglob("dense*"))[0]
    dense.write_bytes(dense.read_bytes()[:-3])
    os.remove(_data_files(step2)[-1])
    (root / manifests[4].folder / manifests[4].ranks[1].path).unlink()
    return dict(manifests)


@pytest.mark.parametrize("bundle_bytes", [0, 16384])
def test_overlapped_reads_report_what_serial_reads_report(
    tmp_path: Path, bundle_bytes: int
) -> None:
    manifests = _damaged(tmp_path / "ck", bundle_bytes)
    inner = LocalStorage(tmp_path / "ck")

    def unreadable(key: str, n: int) -> bool:  # step 3: a file that cannot be read (not damage)
        return key.startswith(manifests[3].folder) and key.endswith("extra.safetensors")

    remote = _Remote(inner, fail_get=unreadable)
    local = _Local(inner, fail_get=unreadable)
    assert remote.local_path() is None and local.local_path() is not None
    for step, m in sorted(manifests.items()):
        seen: dict[str, list[int]] = {"remote": [], "local": []}
        a = verify_checkpoint(remote, m, progress=seen["remote"].append)
        b = verify_checkpoint(local, m, progress=seen["local"].append)
        assert (a.problems, _unnumbered(a.unreadable), a.files, a.bytes) == (
            b.problems,
            _unnumbered(b.unreadable),
            b.files,
            b.bytes,
        ), step
        assert seen["remote"] == seen["local"], step
        assert check_files(remote, m) == check_files(local, m), step
        listing = set(inner.list(m.folder))
        assert check_files(remote, m, listing) == check_files(local, m, listing), step
    # What each damaged step reports names the file.
    assert not verify_checkpoint(remote, manifests[0]).problems
    one = verify_checkpoint(remote, manifests[1]).problems
    assert one and all(f"/{manifests[1].folder}/" in p for p in one), one
    two = verify_checkpoint(remote, manifests[2]).problems
    assert any("dense" in p for p in two) and any("does not exist" in p for p in two), two
    three = verify_checkpoint(remote, manifests[3])
    assert not three.problems and [u for u in three.unreadable if "extra.safetensors" in u]
    four = verify_checkpoint(remote, manifests[4])
    assert [p for p in four.problems if rank_manifest_name(1) in p and "missing" in p], four
    with pytest.raises(CorruptCheckpointError, match=rank_manifest_name(1)):
        read_rank_manifests(remote, manifests[4])


def test_read_errors_come_in_order_and_a_stopped_reader_reads_no_further(tmp_path: Path) -> None:
    """Each item's result or error in the items' order; a caller that stops early never
    starts the reads it did not get to (beyond those already in flight)."""
    inner = LocalStorage(tmp_path)
    keys = [f"k{i:03d}" for i in range(200)]
    for k in keys:
        inner.put(k, k.encode())
    store: Storage = _Remote(inner, fail_get=lambda key, n: key in ("k003", "k007"))
    got = list(overlapped(store, store.get, keys[:10]))
    assert [k for k, _ in got] == keys[:10]
    assert [k for k, v in got if isinstance(v, StorageError)] == ["k003", "k007"]
    assert all(v == k.encode() for k, v in got if not isinstance(v, Exception))
    reads = _Remote(inner)
    for i, _ in enumerate(overlapped(reads, reads.get, keys)):
        if i == 2:
            break
    assert reads.gets < len(keys)


class _Gate(_Remote):
    """A remote store whose read of ``first`` waits until a read of ``later`` has begun: it
    returns only if the reads overlap (else after a safety timeout, which the test reports)."""

    def __init__(self, inner: Storage, first: str, later: str) -> None:
        super().__init__(inner)
        self.first, self.later = first, later
        self.began: set[str] = set()
        self.changed = threading.Condition()
        self.overlapped: bool | None = None

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        with self.changed:
            self.began.add(path)
            self.changed.notify_all()
            if path == self.first:
                self.overlapped = self.changed.wait_for(lambda: self.later in self.began, 60)
        return super().get(path, start, end)


def test_verify_and_the_rank_manifests_read_ahead_on_a_remote_store(tmp_path: Path) -> None:
    """The first data file's read is still in flight when verify asks for a later file (the
    rank 0 extra state), and rank 0's part manifest's when rank 1's is asked for."""
    inner = LocalStorage(tmp_path)
    SynthTrainer(inner, chunk_bytes=4096).save("full")
    m = read_manifests(inner)[0]
    parts = read_rank_manifests(inner, m)
    first = f"{m.folder}/{parts[0].shards[0].chunks[0].path}"
    later = f"{m.folder}/{parts[0].extra.path}"
    files = _Gate(inner, first, later)
    assert verify_checkpoint(files, m).ok and files.overlapped is True
    rank0, rank1 = (f"{m.folder}/{r.path}" for r in m.ranks)
    ranks = _Gate(inner, rank0, rank1)
    assert len(read_rank_manifests(ranks, m)) == 2 and ranks.overlapped is True
