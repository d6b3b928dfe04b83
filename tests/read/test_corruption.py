"""Any flipped bit or truncation in any file of a committed checkpoint (row chunks, rank part
manifests, commit records, dense and extra state) is detected by verify and by restore, and the
error names the file (whose path holds the step folder). Real files written by deck's writer
(deck/testing/synth.py: 2 ranks, 4 tables, a full and two deltas), damaged at hypothesis-chosen places.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deck.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from deck.format.commit_log import LOG_ROOT
from deck.format.epochs import EPOCH_ROOT
from deck.format.manifest import MANIFEST, parse_step_dir
from deck.read.catalog import damaged_records, read_manifests, read_rank_manifests
from deck.read.lineage import latest_restorable
from deck.read.restore import read_state_file
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage
from deck.testing.faulty_storage import FaultyStorage
from deck.testing.synth import SynthTrainer, restore_step

EXAMPLES = 150


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "ck"
    tr = SynthTrainer(LocalStorage(root), chunk_bytes=4096)
    tr.save("full")
    for _ in range(2):
        tr.train(rows=40)
        tr.save()
    return root


def _files(root: Path) -> list[str]:
    """The checkpoints' files (the commit log's have their own tests: tests/read/test_indexed.py;
    the epoch witnesses', whose content no reader reads: tests/read/test_epoch_witness.py)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file()
        and not str(p.relative_to(root)).startswith((f"{LOG_ROOT}/", f"{EPOCH_ROOT}/"))
    )


def _check(root: Path, rel: str) -> None:
    storage = LocalStorage(root)
    step = parse_step_dir(rel.split("/")[0])
    assert step is not None
    manifests = read_manifests(storage)
    if rel.endswith(f"/{MANIFEST}") and rel.count("/") == 1:
        # A commit record: the step is listed as damaged, and a restore of the latest says so.
        assert step in manifests.damaged and rel in manifests.damaged[step]
        why = damaged_records(manifests, latest_restorable(manifests), latest=True)
        assert why is not None and rel in why
        return
    report = verify_checkpoint(storage, manifests[step])
    assert report.problems and any(rel in p for p in report.problems), report.problems
    if rel.endswith(".safetensors"):  # dense / extra state: restores read it with read_state_file
        recs = [
            f for p in read_rank_manifests(storage, manifests[step]) for f in (p.dense, p.extra)
        ]
        (rec,) = [f for f in recs if f is not None and rel.endswith(f.path)]
        with pytest.raises(CorruptCheckpointError, match=rel.replace(".", r"\.")):
            read_state_file(storage, manifests[step], rec)
        return
    with pytest.raises((CorruptCheckpointError, CheckpointNotFoundError)) as info:
        restore_step(storage, 2)  # every step's files are in the chain of step 2
    assert rel in str(info.value) or rel.rsplit("/", 1)[-1] in str(info.value), str(info.value)


@given(data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_any_damaged_byte_is_detected(pristine: Path, data: st.DataObject) -> None:
    rel = data.draw(st.sampled_from(_files(pristine)), label="file")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        shutil.copytree(pristine, root)
        path = root / rel
        raw = bytearray(path.read_bytes())
        if data.draw(st.booleans(), label="truncate"):
            cut = data.draw(st.integers(0, len(raw) - 1), label="new size")
            path.write_bytes(bytes(raw[:cut]))
        else:
            pos = data.draw(st.integers(0, len(raw) - 1), label="byte")
            raw[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
            path.write_bytes(bytes(raw))
        _check(root, rel)


def test_the_pristine_copy_restores(pristine: Path) -> None:
    storage = LocalStorage(pristine)
    manifests = read_manifests(storage)
    assert sorted(manifests) == [0, 1, 2] and not manifests.damaged
    assert all(not verify_checkpoint(storage, m).problems for m in manifests.values())
    restore_step(storage, 2)
    kinds = {f.rsplit(".", 1)[-1] for f in _files(pristine)}
    assert {"chunk", "json", "safetensors"} <= kinds


def test_short_and_failed_reads_are_errors_naming_the_file(pristine: Path) -> None:
    """A store that returns short reads, or fails a read, never yields a silently wrong restore."""
    short = FaultyStorage(LocalStorage(pristine), short_read=1)
    with pytest.raises(CorruptCheckpointError, match=r"step-0000000000\d\d/"):
        restore_step(short, 2)
    chunk = next(f for f in _files(pristine) if f.endswith(".chunk"))
    failing = FaultyStorage(LocalStorage(pristine), fail_get=lambda key, n: key == chunk)
    with pytest.raises(StorageError, match=chunk.replace(".", r"\.")):
        restore_step(failing, 2)
    assert failing.gets > 1


def test_a_read_error_is_not_damage_and_damage_is_quarantined_only_when_it_reads_back(
    tmp_path: Path, pristine: Path
) -> None:
    """A chunk unreadable for a moment (a permission error, EIO or a timeout: a StorageError)
    makes the checkpoint unknown, never damaged: verify reports it as unreadable, and the
    fallback's verification raises instead of quarantining (the playbook's `verify --all
    --quarantine` then GC used to delete the intact step and every one after it). Damage seen
    once but not when read again is not quarantined either; damage that reads back is."""
    from deck.read.lineage import best_valid_chain
    from deck.read.verify import confirmed_damage

    root = tmp_path / "ck"
    shutil.copytree(pristine, root)
    m = read_manifests(LocalStorage(root))[2]
    chunk = next(f for f in _files(root) if f.endswith(".chunk") and m.folder in f)

    glitch = FaultyStorage(LocalStorage(root), fail_get=lambda key, n: key == chunk)
    report = verify_checkpoint(glitch, m)
    assert not report.ok and report.problems == [] and chunk in report.unreadable[0]
    with pytest.raises(StorageError, match=r"(?i)a read error is not damage"):
        best_valid_chain(glitch, 2, record=True)
    assert not read_manifests(LocalStorage(root)).quarantined
    assert verify_checkpoint(LocalStorage(root), m).ok  # after the glitch: intact

    # A short read of the first get only: damage once, not on the second read.
    once = FaultyStorage(LocalStorage(root))
    once.get = _short_first_read(once.get, chunk)  # type: ignore[method-assign]
    first = verify_checkpoint(once, m)
    assert first.problems and not confirmed_damage(once, m, first).problems

    # A flipped byte reads back: proven, and the fallback quarantines it.
    data = bytearray((root / chunk).read_bytes())
    data[len(data) // 2] ^= 0x5A
    (root / chunk).write_bytes(bytes(data))
    storage = LocalStorage(root)
    assert confirmed_damage(storage, m, verify_checkpoint(storage, m)).problems
    with pytest.raises(CheckpointNotFoundError):
        best_valid_chain(storage, 2, record=True)
    assert list(read_manifests(storage).quarantined) == [m.id]


def _short_first_read(get, key: str):  # type: ignore[no-untyped-def]
    seen = []

    def short(path: str, start: int = 0, end: int | None = None) -> bytes:
        data = get(path, start, end)
        if path == key and not seen:
            seen.append(path)
            return data[:-1]
        return data

    return short


def test_verify_reads_a_state_file_no_further_than_its_record(
    tmp_path: Path, pristine: Path
) -> None:
    """A dense state file replaced by a huge (sparse) one is damage found after reading its
    record's size + 1 bytes, not the whole file (3 GiB took 3.4 GB and died under a 2 GiB
    limit)."""
    root = tmp_path / "ck"
    shutil.copytree(pristine, root)
    storage = LocalStorage(root)
    m = read_manifests(storage)[2]
    dense = next(root.glob(f"{m.folder}/**/dense.safetensors"))
    with open(dense, "r+b") as f:
        f.truncate(3 * 2**30)  # sparse: no disk used
    asked: list[tuple[int, int | None]] = []
    spy = FaultyStorage(storage)
    inner_get = spy.get

    def get(path: str, start: int = 0, end: int | None = None) -> bytes:
        if path.endswith("dense.safetensors"):
            asked.append((start, end))
        return inner_get(path, start, end)

    spy.get = get  # type: ignore[method-assign]
    report = verify_checkpoint(spy, m)
    assert any("dense.safetensors" in p for p in report.problems), report.problems
    assert asked and all(end is not None and end < 2**20 for _, end in asked), asked
