"""Bundled chunks (IncrCP concatenation): small chunks of one rank's part share bundle files.

Bundled checkpoints must restore bitwise like unbundled ones of the same data (bytes and mmap
paths), verify must name the bundle and the chunk of a flipped byte, the merger must read bundled
inputs, crash recovery of the spool must check each bundled chunk, and the file count must drop.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deck.config import StagingConfig
from deck.errors import ConfigError, CorruptCheckpointError
from deck.format.chunk_io import read_chunks
from deck.format.manifest import ChunkRecord, Kind, RankManifest, load_model
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage, Storage
from deck.testing.staging import full_part_info
from deck.testing.synth import SynthTrainer, make_shards, restore_state, same, snapshot, tables
from deck.trainer.staging.recovery import check_recovered
from deck.trainer.staging.spool import SpoolDir

CHUNK = 4096
BUNDLE = 4 * 4096


def _train(storage: Storage, bundle_bytes: int) -> SynthTrainer:
    tr = SynthTrainer(storage, chunk_bytes=CHUNK, bundle_bytes=bundle_bytes)
    tr.save("full")
    for _ in range(3):
        tr.train(2, rows=40)
        tr.save()
    return tr


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[SynthTrainer, SynthTrainer]:
    """The same training run saved unbundled and bundled."""
    root = tmp_path_factory.mktemp("bundle")
    plain = _train(LocalStorage(str(root / "plain")), 0)
    bundled = _train(LocalStorage(str(root / "bundled")), BUNDLE)
    return plain, bundled


def _data_files(root: str) -> list[str]:
    return [
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith((".chunk", ".bin"))
    ]


def _chunks(storage: Storage, step: int) -> list[tuple[RankManifest, ChunkRecord]]:
    m = read_manifests(storage)[step]
    out = []
    for ref in m.ranks:
        key = f"{m.folder}/{ref.path}"
        part = load_model(RankManifest, storage.get(key), key)
        out += [(part, c) for s in part.shards for c in s.chunks]
    return out


@pytest.mark.parametrize("zero_copy", [True, False])
def test_bundled_restores_bitwise_like_unbundled(
    pair: tuple[SynthTrainer, SynthTrainer], zero_copy: bool
) -> None:
    plain, bundled = pair
    for step, saved in bundled.saved.items():
        results = []
        for tr in (plain, bundled):
            shards = make_shards(2, fill=float("nan"))
            chain = chain_for(read_manifests(tr.storage), step)
            apply_chain(tr.storage, chain, shards, tables(), zero_copy=zero_copy)
            results.append(snapshot(shards))
        assert not same(results[1], saved.state), step
        assert not same(results[0], results[1]), step


def test_file_count_drops_and_unbundled_records_are_unchanged(
    pair: tuple[SynthTrainer, SynthTrainer],
) -> None:
    plain, bundled = pair
    assert isinstance(plain.storage, LocalStorage) and isinstance(bundled.storage, LocalStorage)
    n_plain = len(_data_files(plain.storage.root))
    n_bundled = len(_data_files(bundled.storage.root))
    # Every chunk here is CHUNK bytes, so each bundle holds BUNDLE // CHUNK of them, except the
    # last bundle of each part: ceil(chunks / 4) files per part.
    expected = 0
    for step in bundled.saved:
        per_part: dict[int, int] = {}
        for part, c in _chunks(bundled.storage, step):
            assert c.bundled and c.path.endswith(".bin") and c.offset is not None
            per_part[part.rank] = per_part.get(part.rank, 0) + 1
        expected += sum(-(-n // (BUNDLE // CHUNK)) for n in per_part.values())
    assert n_bundled == expected
    assert n_plain == sum(len(_chunks(plain.storage, s)) for s in plain.saved)
    assert n_bundled * 2 < n_plain, (n_bundled, n_plain)
    assert any(
        c.path.endswith("bundle-000001.bin")
        for s in bundled.saved
        for _, c in _chunks(bundled.storage, s)
    ), "no part spilled into a second bundle"

    # Unbundled records keep the JSON they always had (no "offset" key); bundled ones say it.
    part_json = next(Path(plain.storage.root).rglob("rank-00000.json")).read_text()
    plain_chunks = [c for s in json.loads(part_json)["shards"] for c in s["chunks"]]
    assert plain_chunks and not any("offset" in c for c in plain_chunks)
    bundled_json = json.loads(next(Path(bundled.storage.root).rglob("rank-00000.json")).read_text())
    assert all("offset" in c for s in bundled_json["shards"] for c in s["chunks"])


def test_adjacent_bundled_chunks_coalesce_into_one_read(
    pair: tuple[SynthTrainer, SynthTrainer],
) -> None:
    _, bundled = pair
    m = read_manifests(bundled.storage)[0]
    part, _ = _chunks(bundled.storage, 0)[0]
    chunks = [c for s in part.shards for c in s.chunks]
    gets: list[tuple[str, int, int | None]] = []

    class Counting(LocalStorage):
        def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
            gets.append((path, start, end))
            return super().get(path, start, end)

    assert isinstance(bundled.storage, LocalStorage)
    got = list(read_chunks(Counting(bundled.storage.root), m.folder, chunks))
    assert [c for c, _, _ in got] == chunks
    assert len(gets) == len({c.path for c in chunks}) < len(chunks)
    for c, where, data in got:
        assert len(data) == c.nbytes and f"bytes {c.offset}.." in where


def test_verify_names_bundle_and_chunk_of_a_flipped_byte(
    pair: tuple[SynthTrainer, SynthTrainer], tmp_path: Path
) -> None:
    _, bundled = pair
    assert isinstance(bundled.storage, LocalStorage)
    import shutil

    shutil.copytree(bundled.storage.root, tmp_path / "ck")
    storage = LocalStorage(str(tmp_path / "ck"))
    m = read_manifests(storage)[0]
    assert not verify_checkpoint(storage, m).problems
    # The third chunk of the first bundle of rank 1: flip one byte in its middle.
    part, _ = next(pc for pc in _chunks(storage, 0) if pc[0].rank == 1)
    target = [c for s in part.shards for c in s.chunks][2]
    assert target.offset is not None and target.offset > 0
    path = Path(storage.root) / m.folder / target.path
    raw = bytearray(path.read_bytes())
    raw[target.offset + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    report = verify_checkpoint(storage, m)
    assert len(report.problems) == 1, report.problems
    msg = report.problems[0]
    assert target.path in msg and f"bytes {target.offset}..{target.offset + target.nbytes}" in msg
    shard = next(s for s in part.shards if target in s.chunks)
    assert "checksum mismatch" in msg
    assert f"table {shard.table}, chunk {shard.chunks.index(target)}," in msg
    with pytest.raises(CorruptCheckpointError, match=r"bundle-000000\.bin"):
        restore_state(storage, chain_for(read_manifests(storage), 0))
    # A truncated bundle: every chunk past the end is reported, restore refuses.
    path.write_bytes(bytes(raw[: target.offset]))
    report = verify_checkpoint(storage, m)
    assert report.problems and all("bundle-000000.bin" in p for p in report.problems)


def test_merger_merges_bundled_inputs(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "ck"))
    tr = SynthTrainer(storage, chunk_bytes=CHUNK, bundle_bytes=BUNDLE)
    tr.save("full")
    for _ in range(4):
        tr.train(2, rows=40)
        tr.save()
    worker = MergeWorker(
        storage, MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None))
    )
    committed = 0
    while True:
        r = worker.run_pass()
        assert not r.stats.failed and not worker.failures, worker.failures
        committed += r.stats.items_committed
        if not r.progressed:
            break
    assert committed >= 2
    manifests = read_manifests(storage)
    chain = chain_for(manifests, tr.step)
    assert any(m.kind is Kind.MERGED for m in chain)
    got, _ = restore_state(storage, chain)
    assert not same(got, tr.saved[tr.step].state)


def test_spool_recovery_checks_each_bundled_chunk(
    pair: tuple[SynthTrainer, SynthTrainer], tmp_path: Path
) -> None:
    """Crash recovery re-verifies spooled files from the part record: a bundle holds several
    chunk ranges and must pass as a whole, and a damaged byte in one of them must fail it."""
    _, bundled = pair
    assert isinstance(bundled.storage, LocalStorage)
    import shutil

    shutil.copytree(bundled.storage.root, tmp_path / "ck")
    storage = LocalStorage(str(tmp_path / "ck"))
    m = read_manifests(storage)[0]
    part, _ = _chunks(storage, 0)[0]
    with ThreadPoolExecutor(1) as syncer:
        # The local tier's spool is the destination folder itself.
        spool = SpoolDir(storage.root, StagingConfig(tiers="local"), scratch=False, syncer=syncer)
        info = full_part_info(storage.uri, 0, m.id, world_size=2, part=part)
        check_recovered(spool, info)
        target = [c for s in part.shards for c in s.chunks][-1]
        path = Path(storage.root) / m.folder / target.path
        raw = bytearray(path.read_bytes())
        raw[(target.offset or 0) + 8] ^= 1
        path.write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpointError, match="damaged"):
            check_recovered(spool, info)


def test_bundle_bytes_is_validated() -> None:
    with pytest.raises(ValueError, match="bundle_bytes"):
        StagingConfig(chunk_bytes=8192, bundle_bytes=4096)
    with pytest.raises(ValueError, match="bundle_bytes"):
        StagingConfig(bundle_bytes=4 * 1024 * 1024 + 100)
    assert StagingConfig(chunk_bytes=65536, bundle_bytes=2**20).bundle_bytes == 2**20
    with pytest.raises(ValueError, match="offset"):
        ChunkRecord(path="a.bin", rows=0, nbytes=4096, checksum="0", segments=(), offset=100)
    from deck.trainer.writer import RankPartWriter

    with pytest.raises(ConfigError, match="bundle_bytes"):
        RankPartWriter(LocalStorage("/tmp"), 0, "0" * 16, 0, 1, 8192, bundle_bytes=4096)


def _dmp_bundled(rank: int, world_size: int, uri: str, spool: str, mode: str) -> None:
    import torch.distributed as dist

    import deck
    from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step

    spec = ModelSpec(num_tables=4, rows=3000, dim=16, batch=128, pooling=2)
    config = deck.DeckConfig(
        uri=uri,
        delta_every_steps=5,
        # Through the spool and the upload (the tier that moves files by name), bundled.
        staging=deck.StagingConfig(
            chunk_bytes=16 * 1024,
            bundle_bytes=128 * 1024,
            tiers="cpu-ssd-remote",
            spool_dir=spool,
            mode=mode,  # type: ignore[arg-type]
        ),
    )
    model, opt = build_model(spec)
    user = TrainState()
    captured = {}
    with deck.enable(model, [opt], config, state=user) as ck:
        for step in range(11):
            if step:
                train_step(model, opt, spec, step)
                user.step = step
            if ck.step(step) is not None:
                captured[step] = capture_state(model, opt, user)
    dist.barrier()
    assert sorted(captured) == [0, 5, 10]
    for step in sorted(captured):
        model2, opt2 = build_model(spec, seed=spec.seed + 100 + step)
        user2 = TrainState()
        with deck.DeltaCheckpointer(model2, [opt2], config, state=user2) as ck2:
            assert ck2.restore(step) == step
        bad = diff_states(captured[step], capture_state(model2, opt2, user2))
        assert not bad, f"rank {rank} step {step}: {bad[:5]}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["threads", "process"])
def test_dmp_bundled_checkpoints_restore_bitwise(tmp_path: Path, mode: str) -> None:
    """Both staging modes. In a staging process a bundled chunk's record was made from the
    bytes at the start of its bundle, not at its offset: every chunk but a bundle's first
    failed its checksum at restore (the checkpoint was committed, and unreadable)."""
    from deck.testing.dist_harness import run_ranks

    uri = str(tmp_path / "ckpt")
    run_ranks(_dmp_bundled, uri, str(tmp_path / "spool"), mode)
    storage = LocalStorage(uri)
    names = [k.rsplit("/", 1)[-1] for k in storage.list("")]
    assert not [n for n in names if n.endswith(".chunk")]
    bundles = [n for n in names if n.endswith(".bin")]
    manifests = read_manifests(storage)
    chunks = [c for s in manifests for _, c in _chunks(storage, s)]
    assert chunks and all(c.bundled for c in chunks) and len(bundles) < len(chunks)
    for m in manifests.values():
        assert not verify_checkpoint(storage, m).problems
    # The upload tier cleaned its spool copies of the bundles up.
    assert not [p for p in (tmp_path / "spool").rglob("*.bin")]
