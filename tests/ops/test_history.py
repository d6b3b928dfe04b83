"""Point queries over history (``deck history``): the per-chunk row index and the row values it
reports, against full restores of every step of a 2-rank job."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.errors import CorruptCheckpointError
from deck.format.chunks import encode_chunk
from deck.format.manifest import ChunkRecord, RankManifest, RowIndex, dump_model, load_model
from deck.format.rowindex import TARGET_FP, bits_for, build_index, may_contain
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32)
ROWS = (0, 1, 2, 7, 150, 399)
STEPS = 8  # full 0, deltas 2, 4, 6, 8


def test_bloom_has_no_false_negatives_and_about_the_target_false_positive_rate() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.unique(torch.randint(0, 10_000_000, (5000,), generator=g))
    idx = build_index(ids)
    assert idx is not None and idx.bloom is not None and idx.k == 3
    assert (idx.min_id, idx.max_id) == (int(ids[0]), int(ids[-1]))
    assert idx.bits == bits_for(ids.numel()) and idx.bits < 13 * ids.numel()
    assert all(may_contain(idx, int(i)) for i in ids)
    present = set(ids.tolist())
    probes = [i for i in range(idx.min_id, idx.max_id, 997) if i not in present][:20_000]
    fp = sum(may_contain(idx, i) for i in probes) / len(probes)
    assert 0.002 < fp < 2.5 * TARGET_FP, fp
    assert not may_contain(idx, idx.max_id + 1) and not may_contain(idx, idx.min_id - 1)
    # A contiguous run needs no filter; an empty chunk no index; no index means "may hold".
    run = build_index(torch.arange(10, 20))
    assert run == RowIndex(min_id=10, max_id=19)
    assert may_contain(run, 15) and not may_contain(run, 20)
    assert build_index(torch.empty(0, dtype=torch.int64)) is None
    assert may_contain(None, 123)
    # Deterministic: the same ids give the same filter (hashing is no per-process seed).
    assert build_index(ids) == idx


def test_old_records_without_index_load_and_bad_indexes_are_rejected() -> None:
    _, rec = encode_chunk("t/c0-r0-000000.chunk", [("ids", torch.arange(3))])
    assert rec.index is None
    raw = json.loads(rec.model_dump_json())
    assert "index" not in raw  # unchanged JSON for chunks without an index
    assert ChunkRecord.model_validate(raw) == rec
    good = build_index(torch.tensor([1, 5, 9, 100]))
    assert good is not None and good.bloom is not None
    with_index = rec.model_copy(update={"index": good})
    assert ChunkRecord.model_validate_json(with_index.model_dump_json()) == with_index
    for bad in (
        {"min_id": 5, "max_id": 1},
        {**good.model_dump(), "bloom": good.bloom[:-4]},
        {**good.model_dump(), "bits": good.bits + 1},
        {"min_id": 1, "max_id": 5, "bits": 64, "k": 3},
        {**good.model_dump(), "k": 0},
        {**good.model_dump(), "extra": 1},
    ):
        with pytest.raises(ValueError):
            RowIndex.model_validate(bad)
    part = RankManifest.model_validate(
        {
            "format_version": 1,
            "step": 0,
            "ckpt_id": "0" * 16,
            "rank": 0,
            "world_size": 1,
            "shards": [],
            "dense": None,
            "extra": {"path": "x/extra.safetensors", "nbytes": 1, "checksum": "ab"},
        }
    )
    assert load_model(RankManifest, dump_model(part), "p") == part
    broken = json.loads(with_index.model_dump_json())
    broken["index"]["min_id"] = -1
    with pytest.raises(CorruptCheckpointError):
        load_model(ChunkRecord, json.dumps(broken).encode(), "chunk record")


def _write(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=uri, delta_every_steps=2, staging=deck.StagingConfig(chunk_bytes=4096)
    )
    with deck.enable(model, [opt], config) as ck:
        for step in range(STEPS + 1):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)


def _restore_rows(rank: int, world_size: int, uri: str, out: str) -> None:
    """Restore every step into a fresh model; record ROWS of every local shard, every state."""
    config = deck.DeckConfig(uri=uri, staging=deck.StagingConfig(chunk_bytes=4096))
    found = []
    for step in range(0, STEPS + 1, 2):
        model, opt = build_model(SPEC, seed=1000 + step)
        with deck.DeltaCheckpointer(model, [opt], config) as ck:
            assert ck.restore(step) == step
            for s in ck.adapter.table_shards():
                for row in ROWS:
                    if s.row_offset <= row < s.row_offset + s.rows:
                        found.append(
                            {
                                "step": step,
                                "table": s.table,
                                "row": row,
                                "columns": [s.col_offset, s.cols],
                                "states": {
                                    k: v[row - s.row_offset].reshape(-1).tolist()
                                    for k, v in s.states.items()
                                },
                            }
                        )
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))


EXE = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"


@pytest.mark.slow
def test_deck_history_matches_full_restores_and_reads_fewer_chunks(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_write, uri)
    # A merged delta (and merged chunks with their own index) in the chains of later steps.
    r = subprocess.run(
        [EXE, "merge", uri, "--once", "--stride", "2", "--full-live-fraction", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    storage = open_storage(uri)
    manifests = read_manifests(storage)
    assert sorted(manifests) == list(range(0, STEPS + 1, 2))
    assert manifests.merged, "the merge produced nothing"
    for m in [*manifests.values(), *manifests.merged.values()]:
        for part in read_rank_manifests(storage, m):
            for rec in part.shards:
                assert all(c.index is not None for c in rec.chunks if c.rows), m.folder
    run_ranks(_restore_rows, uri, str(tmp_path))
    truth = [x for rank in (0, 1) for x in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    tables = sorted({x["table"] for x in truth})
    assert len(tables) == SPEC.num_tables
    queries = [(t, row) for t in tables for row in ROWS]
    procs = [
        subprocess.Popen(
            [EXE, "history", uri, "--table", t, "--row", str(row), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for t, row in queries
    ]
    results = {}
    for q, p in zip(queries, procs, strict=True):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        results[q] = json.loads(stdout)
    changed = 0
    for (t, row), h in results.items():
        assert [s["step"] for s in h["steps"]] == list(range(0, STEPS + 1, 2))
        assert 0 < h["chunks_read"] < h["chunks_present"], h
        by_step = {s["step"]: s for s in h["steps"]}
        mine = [x for x in truth if (x["table"], x["row"]) == (t, row)]
        assert {x["step"] for x in mine} == set(by_step)
        for x in mine:
            s = by_step[x["step"]]
            c0, n = x["columns"]
            pos = [list(c) for c in s["columns"]].index([c0, n])
            base = sum(c[1] for c in s["columns"][:pos])
            for name, want in x["states"].items():
                got = s["values"][name]
                part = got[base : base + n] if len(want) == n else got[pos : pos + 1]
                # Bitwise: compare as the table's dtype (JSON floats round-trip float32 exactly).
                assert torch.equal(
                    torch.tensor(part, dtype=torch.float32).view(torch.int32),
                    torch.tensor(want, dtype=torch.float32).view(torch.int32),
                ), (t, row, x["step"], name)
        steps = h["steps"]
        changed += any(a["values"] != b["values"] for a, b in itertools.pairwise(steps))
    assert changed, "no queried row changed over the history: the test would prove nothing"

    # The text form prints the counts; an unknown table is a usage error naming it.
    t, row = queries[0]
    txt = subprocess.run(
        [EXE, "history", uri, "--table", t, "--row", str(row)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert txt.returncode == 0 and f"row {row}:" in txt.stdout and "of" in txt.stdout, txt.stdout
    assert txt.stdout.count("\nstep ") == STEPS // 2 + 1
    bad = subprocess.run(
        [EXE, "history", uri, "--table", "nope", "--row", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no table 'nope'" in bad.stderr, bad.stderr
    assert "a data_parallel table is saved with the dense state" in bad.stderr, bad.stderr
