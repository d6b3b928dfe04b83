"""`deck export`: a DCP directory that dcp.load restores bitwise into a fresh DMP, and a
safetensors file of unsharded tables, both through the real console script."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import deck
from deck.demo import ModelSpec, build_model, capture_state, diff_states, train_step
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks
from deck.testing.safetensors_checks import assert_holds_model

pytestmark = pytest.mark.slow
# Column-wise tables (row-wise optimizer state in TorchRec's per-column-shard layout) and a
# data-parallel table (dense state); small enough to write in a few seconds. Adam: a dense
# optimizer whose state is made at its first step (a break-it finding: the documented DCP
# recipe, tested with Adagrad only, loaded none of Adam's state into a fresh one)
SPEC = ModelSpec(
    num_tables=3,
    rows=300,
    dim=16,
    batch=32,
    sharding="column_wise",
    data_parallel_tables=(2,),
    dense_optimizer="adam",
)
STEP = 15


def _deck(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def _write(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=uri, delta_every_steps=5, staging=deck.StagingConfig(chunk_bytes=16 * 1024)
    )
    with deck.enable(model, [opt], config) as ck:
        for step in range(0, STEP + 1):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Full 0, deltas 5, 10, 15, and a merged delta of 5..10: the chain of 15 is
    full + merged + delta."""
    uri = str(tmp_path_factory.mktemp("export") / "ck")
    run_ranks(_write, uri)
    r = _deck("merge", uri, "--once", "--stride", "2", "--full-live-fraction", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    return uri


def _compare(rank: int, world_size: int, uri: str, dcp_dir: str, st_file: str) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torchrec.optim.keyed import CombinedOptimizer

    # What deck's own restore produces.
    model_a, opt_a = build_model(SPEC, seed=101)
    with deck.DeltaCheckpointer(model_a, [opt_a], deck.DeckConfig(uri=uri)) as ck:
        assert ck.restore(STEP) == STEP
    want = capture_state(model_a, opt_a)

    # The DCP export loaded into another fresh model, the way a TorchRec user loads DCP.
    model_b, opt_b = build_model(SPEC, seed=202)
    assert diff_states(want, capture_state(model_b, opt_b))  # the fresh model differs
    opt_b.init_state()  # (TorchRec's way to make lazily made state before an in-place load)
    optim = CombinedOptimizer([model_b.fused_optimizer, opt_b])
    sd = {"model": model_b.state_dict(), "optim": optim.state_dict()}
    dcp.load(sd, checkpoint_id=dcp_dir)
    model_b.load_state_dict(sd["model"])
    optim.load_state_dict(sd["optim"])
    bad = diff_states(want, capture_state(model_b, opt_b))
    assert not bad, f"rank {rank}: {len(bad)} entries differ after dcp.load, e.g. {bad[:5]}"

    # The safetensors file holds every table unsharded: each local shard is its slice.
    with safe_open(st_file, "pt") as f:
        names = set(f.keys())
        assert_holds_model(f, model_a, (rank,))
        assert any(n.startswith("optim.state.dense_arch") for n in names)
    dist.barrier()


def test_export_dcp_and_safetensors_match_restore(ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    r = _deck("export", ckpt, "--step", str(STEP), "--out", str(out), "--format", "dcp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / ".metadata").is_file()
    # (the checkpoint id it records is where it is, not the folder it was written in first)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(out)).read_metadata().storage_meta
    assert meta is not None and str(meta.checkpoint_id) == str(out), meta
    st_dir = tmp_path / "st"
    r = _deck("export", ckpt, "--step", str(STEP), "--out", str(st_dir), "--format", "safetensors")
    assert r.returncode == 0, r.stdout + r.stderr
    (st_file,) = st_dir.glob("*.safetensors")
    run_ranks(_compare, ckpt, str(out), str(st_file))


def test_export_holds_one_shard_at_a_time(ckpt: str, tmp_path: Path) -> None:
    """The memory bound: DCP export holds one table shard, safetensors one table."""
    from deck.errors import ConfigError
    from deck.ops.export import StepState, export_dcp, export_safetensors

    # a step no folder name holds is refused, named (was a ValueError of the folder's name)
    with pytest.raises(ConfigError, match=r"export\(step=1000000000000\)"):
        StepState(open_storage(ckpt), 10**12)
    state = StepState(open_storage(ckpt), STEP)
    shards = [s.nbytes for s in state.shards]
    tables: dict[str, int] = {}
    for s in state.shards:
        tables[s.table] = tables.get(s.table, 0) + s.nbytes
    assert len(shards) == 4 and len(tables) == 2  # two column-wise tables, two shards each

    rep = export_dcp(state, str(tmp_path / "dcp"))
    assert rep.max_held_bytes == max(shards) < sum(shards)
    # One file per table shard, one for the dense state.
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == len(shards) + 1
    rep = export_safetensors(state, str(tmp_path / "x.safetensors"))
    assert rep.max_held_bytes == max(tables.values()) < sum(shards)
    with pytest.raises(ConfigError, match="exists"):
        export_safetensors(state, str(tmp_path / "x.safetensors"))


def test_export_reads_the_real_store_memory_mapped(
    ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Export reads chunks through the store's own fast path (a local directory: memory-mapped
    files, not ``get``), and each rank manifest of the chain once however many shards it
    exports."""
    from deck.ops.export import StepState, export_dcp
    from deck.storage import LocalStorage

    reads: dict[str, list[str]] = {"map_file": [], "get": [], "iter_get": []}
    real_map, real_get, real_iter = (
        LocalStorage.map_file,
        LocalStorage.get,
        LocalStorage.iter_get,
    )

    def map_file(self: LocalStorage, path: str) -> memoryview:
        reads["map_file"].append(path)
        return real_map(self, path)

    def get(self: LocalStorage, path: str, start: int = 0, end: int | None = None) -> bytes:
        reads["get"].append(path)
        return real_get(self, path, start, end)

    def iter_get(self: LocalStorage, paths: list[str]):  # type: ignore[no-untyped-def]
        reads["iter_get"].extend(paths)
        return real_iter(self, paths)

    monkeypatch.setattr(LocalStorage, "map_file", map_file)
    monkeypatch.setattr(LocalStorage, "get", get)
    monkeypatch.setattr(LocalStorage, "iter_get", iter_get)
    state = StepState(open_storage(ckpt), STEP)
    # The store itself: its listing and batched reads stay reachable.
    assert type(state.storage) is LocalStorage
    assert state.storage.list_dir("")
    assert len(state.chain) == 3 and state.chain[1].is_merged  # full + merged + delta
    opened = list(reads["get"])
    rank_manifests = [f"{m.folder}/{r.path}" for m in state.chain for r in m.ranks]
    assert sorted(p for p in opened if p in rank_manifests) == sorted(rank_manifests)
    export_dcp(state, str(tmp_path / "dcp"))
    later = reads["get"][len(opened) :] + reads["iter_get"]
    chunks = {
        f"{m.folder}/{c.path}"
        for m in state.chain
        for part in state.rank_parts[m.folder]
        for rec in part.shards
        for c in rec.chunks
    }
    assert chunks and chunks <= set(reads["map_file"])
    assert not chunks & set(later), later  # no chunk file read into bytes
    assert not [p for p in later if p in rank_manifests], later  # read once, at open


@pytest.mark.parametrize("fmt", ["dcp", "parquet", "safetensors"])
def test_a_failed_export_leaves_its_target_as_it_found_it(
    ckpt: str, tmp_path: Path, fmt: str
) -> None:
    # A break-it finding: a damaged chunk failed the DCP export (exit 1, named) but left
    # __0_*.distcp files and no .metadata, so the rerun was refused ("not empty").
    uri = tmp_path / "ck"
    shutil.copytree(ckpt, uri)
    chunks = sorted((uri / f"step-{STEP:012d}").rglob("*.chunk"))
    assert chunks
    data = bytearray(chunks[-1].read_bytes())
    data[100] ^= 0xFF
    chunks[-1].write_bytes(bytes(data))
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for out in (new, empty):
        r = _deck("export", str(uri), "--step", str(STEP), "--out", str(out), "--format", fmt)
        assert r.returncode == 1, r.stdout + r.stderr
        assert chunks[-1].name in r.stdout + r.stderr  # the damaged file is named
        # in a line, not at the end of DCP's 60-line wrapped traceback (a break-it finding)
        assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 3, r.stderr
    assert not new.exists()
    assert empty.is_dir() and not list(empty.iterdir())


@pytest.mark.parametrize("fmt", ["dcp", "parquet"])
def test_an_export_killed_before_it_finished_leaves_nothing_a_rerun_refuses(
    ckpt: str, tmp_path: Path, fmt: str
) -> None:
    """A break-it finding: an export killed with -9 left its files in the target, and every
    rerun was refused ("not an empty directory"). An export writes into a folder of its own
    there and moves its files out once all are written; the rerun removes what a killed one
    left."""
    from deck.ops.export.run import PARTIAL

    out = tmp_path / "out"
    args = ("export", ckpt, "--step", str(STEP), "--out", str(out), "--format", fmt)
    exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    env = {**os.environ, "DECK_FAILPOINTS": "export.before_publish"}
    killed = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert [p.name for p in out.iterdir()] == [PARTIAL]
    assert list((out / PARTIAL).iterdir())  # (its files, all written)
    r = _deck(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "killed before it finished" in r.stderr, r.stderr
    names = sorted(p.name for p in out.iterdir())
    assert PARTIAL not in names and names, names
    if fmt == "dcp":
        assert ".metadata" in names
    # A killed export's folder beside other files is not taken for an empty target
    (out / PARTIAL).mkdir()
    r = _deck(*args)
    assert r.returncode != 0 and "killed there as it finished" in r.stderr, r.stderr


def test_a_killed_safetensors_export_leaves_nothing_beside_the_file_after_a_rerun(
    ckpt: str, tmp_path: Path
) -> None:
    """A break-it finding: each safetensors export killed before its rename left a temp file
    as large as the export beside the target, which no rerun removed."""
    out = tmp_path / "model.safetensors"
    args = ("export", ckpt, "--step", str(STEP), "--out", str(out), "--format", "safetensors")
    exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    env = {**os.environ, "DECK_FAILPOINTS": "export.before_publish"}
    killed = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".tmp-model.safetensors."), left
    r = _deck(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "killed before it finished" in r.stderr, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_full_file_that_cannot_be_sized_is_a_read_error_not_damage(
    ckpt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export's check of its full's file sizes (claims above a bound, or a later record
    naming another table) took a file it could not size for damage (CorruptCheckpointError:
    exit 1, "run deck verify"): a read error is StorageError, naming the file."""
    from deck.errors import StorageError
    from deck.ops.export import StepState, layout
    from deck.testing.faulty_storage import FaultyStorage

    class Unsized(FaultyStorage):
        def size(self, path: str) -> int:
            raise StorageError(f"injected: {self.describe(path)} timed out")

    monkeypatch.setattr(layout, "_CHECK_FILES_ABOVE", 0)  # (every claim checked)
    with pytest.raises(StorageError, match=r"timed out.*a read error, not damage"):
        StepState(Unsized(open_storage(ckpt)), STEP)


def test_a_step_gc_deletes_while_it_is_exported_is_not_found_not_damage(
    ckpt: str, tmp_path: Path
) -> None:
    """A break-it finding: `deck export` racing a GC that deleted the step's chain said
    "a file of this committed checkpoint is missing; next: deck verify --quarantine": as for a
    restore, a checkpoint uncommitted under the reader is not damage."""
    from deck.errors import CheckpointNotFoundError
    from deck.ops.export import StepState

    uri = tmp_path / "ck"
    shutil.copytree(ckpt, uri)
    state = StepState(open_storage(str(uri)), STEP)
    folder = uri / f"step-{STEP:012d}"
    (folder / "manifest.json").unlink()  # (as GC deletes: the record first, then the files)
    for chunk in folder.rglob("*.chunk"):
        chunk.unlink()
    with pytest.raises(
        CheckpointNotFoundError, match="was deleted or replaced while it was exported"
    ):
        for i in range(len(state.shards)):
            state.read_shard(i)
