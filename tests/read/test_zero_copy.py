"""Zero-copy restore (memory-mapped chunk files) against the plain bytes restore."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from deck.errors import CorruptCheckpointError
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain
from deck.storage.local import LocalStorage
from deck.testing.faulty_storage import FaultyStorage
from deck.testing.synth import SynthTrainer, make_shards, restore_state, same, snapshot, tables


class CountingLocal(LocalStorage):
    """A real LocalStorage that counts how chunk files were read (whole reads vs mappings)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self.chunk_gets = 0
        self.chunk_maps = 0

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self.chunk_gets += path.endswith(".chunk")
        return super().get(path, start, end)

    def map_file(self, path: str) -> memoryview:
        self.chunk_maps += 1
        return super().map_file(path)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A full, three deltas, a rollback and two more deltas (a second epoch), 4 KiB chunks."""
    root = tmp_path_factory.mktemp("zc")
    t = SynthTrainer(LocalStorage(root))
    t.train(2)
    t.save("full")
    for _ in range(3):
        t.train(2, rows=40)
        t.save()
    t.rollback(4)
    for _ in range(2):
        t.train(1, rows=40)
        t.save()
    return root, sorted(t.saved)  # the restorable steps (step 8 is on the abandoned timeline)


@pytest.fixture(scope="module")
def chain_dir(chain: tuple[Path, list[int]]) -> Path:
    return chain[0]


def _maps_under(root: Path) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if str(root) in line)


def _fds_under(root: Path) -> list[str]:
    """Open descriptors of this process that point into root (other tests' descriptors, closed
    by a garbage collection at any moment, do not count)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed since
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


def test_mmap_restore_equals_bytes_restore_at_every_step(chain: tuple[Path, list[int]]) -> None:
    chain_dir, steps = chain
    local = CountingLocal(chain_dir)
    plain = FaultyStorage(LocalStorage(chain_dir))  # no local path: the bytes path
    manifests = read_manifests(local)
    assert steps == [2, 4, 5, 6]
    for step in steps:
        links = chain_for(manifests, step)
        mapped, user = restore_state(local, links)
        read, user_b = restore_state(plain, links)
        assert same(mapped, read) == [], step
        assert user == user_b == step
    # Every chunk went through a mapping, none through a whole-file read...
    assert local.chunk_maps > 20 and local.chunk_gets == 0
    # ...and neither a descriptor nor a mapping of a chunk file outlives the restores.
    assert _fds_under(chain_dir) == []
    assert _maps_under(chain_dir) == 0


def test_zero_copy_false_reads_bytes(chain_dir: Path) -> None:
    local = CountingLocal(chain_dir)
    links = chain_for(read_manifests(local), 6)
    shards = make_shards(2, fill=float("nan"))
    stats, _ = apply_chain(local, links, shards, tables(), zero_copy=False)
    assert local.chunk_maps == 0 and local.chunk_gets == stats.chunks > 0
    again = make_shards(2, fill=float("nan"))
    stats_m, _ = apply_chain(local, links, again, tables())
    assert (stats_m.chunks, stats_m.bytes, stats_m.rows) == (stats.chunks, stats.bytes, stats.rows)
    assert same(snapshot(shards), snapshot(again)) == []


def _copy_with_damage(src: Path, dst: Path) -> tuple[LocalStorage, str]:
    shutil.copytree(src, dst)
    storage = LocalStorage(dst)
    full = chain_for(read_manifests(storage), 2)[0]
    chunk = sorted(k for k in storage.list(f"{full.folder}/") if k.endswith(".chunk"))[3]
    return storage, chunk


def test_damaged_chunk_raises_naming_the_file(chain_dir: Path, tmp_path: Path) -> None:
    storage, chunk = _copy_with_damage(chain_dir, tmp_path / "flip")
    path = storage.local_path(chunk)
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch") as info:
        restore_state(storage, chain_for(read_manifests(storage), 2))
    assert chunk in str(info.value) and "step 2" in str(info.value)
    del info  # the traceback holds the frames (and the mapping); drop it before counting maps
    assert _maps_under(tmp_path / "flip") == 0


def test_truncated_and_missing_chunks_name_the_file(chain_dir: Path, tmp_path: Path) -> None:
    storage, chunk = _copy_with_damage(chain_dir, tmp_path / "cut")
    os.truncate(storage.local_path(chunk), 1000)
    with pytest.raises(CorruptCheckpointError, match=r"size 1000 bytes") as info:
        restore_state(storage, chain_for(read_manifests(storage), 2))
    assert chunk in str(info.value)
    os.truncate(storage.local_path(chunk), 0)
    with pytest.raises(CorruptCheckpointError, match=r"size 0 bytes") as info:
        restore_state(storage, chain_for(read_manifests(storage), 2))
    os.unlink(storage.local_path(chunk))
    # A missing file of a committed checkpoint is damage (so fallback goes around it), not absence.
    with pytest.raises(CorruptCheckpointError, match=chunk.replace(".", r"\.") + " does not exist"):
        restore_state(storage, chain_for(read_manifests(storage), 2))
