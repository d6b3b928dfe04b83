"""Quantised deltas (Check-N-Run): error bounds, bytes saved, never mixed silently with exact
state (restore opt-in, merger refusal), exact state untouched, damage still detected."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from deck.errors import ConfigError, CorruptCheckpointError, IncompatibleModelError
from deck.format.chunks import decode_chunk
from deck.format.manifest import ChunkRecord, RankManifest, Segment, load_model
from deck.format.quantize import QuantizedStateError, decode_rows, encode_rows
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.model import TableShard
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage, Storage
from deck.testing import synth
from deck.testing.synth import SynthTrainer, make_shards, restore_state, same, snapshot, tables
from deck.trainer.writer import RankPartWriter

ENCODINGS = ["fp16", "bf16", "int8"]


def bound(x: torch.Tensor, enc: str) -> torch.Tensor:
    """The documented per-element error bound (deck/format/quantize.py) for source values ``x``."""
    if enc == "fp16":
        return torch.clamp(x.abs() * 2**-11, min=2**-25)
    if enc == "bf16":
        return torch.clamp(x.abs() * 2**-8, min=2**-133)
    absmax = x.abs().amax(dim=1, keepdim=True).expand_as(x)
    return absmax / 254 + absmax * 2**-22


def rows(kind: str, n: int = 4000, d: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 0.05
    if kind == "outliers":
        # One value per row 200x the others: the case where a per-row int8 scale loses most.
        col = torch.randint(0, d, (n,), generator=g)
        x[torch.arange(n), col] = torch.randn(n, generator=g) * 10
        x[:5] = 0  # all-zero rows decode exactly
    return x


@pytest.mark.parametrize("kind", ["normal", "outliers"])
@pytest.mark.parametrize("enc", ENCODINGS)
def test_round_trip_within_documented_bound(enc: str, kind: str) -> None:
    x = rows(kind)
    values, scale = encode_rows(x, enc, "t")  # type: ignore[arg-type]
    y = decode_rows(values, scale, enc, torch.float32)  # type: ignore[arg-type]
    err = (y - x).abs()
    assert bool((err <= bound(x, enc)).all()), float((err - bound(x, enc)).max())
    assert y.dtype == torch.float32 and float(err.max()) > 0  # it is lossy, and measured
    if enc == "int8":
        assert scale is not None and bool((y[:5] == 0).all()) if kind == "outliers" else True
        # The bound is tight: a real step of absmax/127 shows in the error.
        assert float((err / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)).max()) > 1 / 300
    if enc in ("fp16", "bf16"):
        # Round to nearest: the mean relative error is about half the worst case.
        mantissa = 11 if enc == "fp16" else 8
        assert float(err.sum() / x.abs().sum()) < 2.0**-mantissa * 0.75


def test_encoding_refuses_values_it_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="fp16 range"):
        encode_rows(torch.tensor([[1e6, 0.0]]), "fp16", "table t")
    with pytest.raises(ConfigError, match="NaN or infinity"):
        encode_rows(torch.tensor([[float("nan"), 0.0]]), "int8", "table t")
    with pytest.raises(ConfigError, match="quantize='int4'"):
        RankPartWriter(LocalStorage("/tmp/unused-deck-q"), 1, "0" * 16, 0, 1, 4096, quantize="int4")


def one_shard(x: torch.Tensor) -> TableShard:
    return TableShard.whole("emb.weight", {"weight": x, "momentum1": torch.rand(x.shape[0])})


def write_one(storage: Storage, shard: TableShard, enc: str | None, step: int) -> RankManifest:
    ckpt_id = f"{step:016x}"
    w = RankPartWriter(storage, step, ckpt_id, 0, 1, 1 << 16, quantize=enc)
    touched = torch.arange(0, shard.rows, 3)
    return w.write_part([shard], lambda s: touched, None, {"user": {}})


def read_rows(storage: Storage, part: RankManifest, allow: bool) -> dict[str, torch.Tensor]:
    out: dict[str, list[torch.Tensor]] = {}
    for c in part.shards[0].chunks:
        key = f"step-{part.step:012d}/{c.path}"
        for k, v in decode_chunk(storage.get(key), c, key, allow_quantized=allow).items():
            out.setdefault(k, []).append(v.clone())
    return {k: torch.cat(v) for k, v in out.items()}


def test_writer_bytes_saved_bounds_and_exact_states(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ck")
    x = rows("outliers", n=6000, d=64)
    shard = one_shard(x)
    exact = write_one(storage, shard, None, 1)
    sizes = {"exact": sum(c.nbytes for c in exact.shards[0].chunks)}
    ref = read_rows(storage, exact, allow=False)
    assert exact.encoding is None and "encoding" not in json.dumps(exact.model_dump(mode="json"))
    for i, enc in enumerate(ENCODINGS, start=2):
        part = write_one(storage, shard, enc, i)
        assert part.encoding == enc
        assert all(c.encoding == enc for c in part.shards[0].chunks)
        sizes[enc] = sum(c.nbytes for c in part.shards[0].chunks)
        with pytest.raises(QuantizedStateError, match=f"{enc}-quantised"):
            read_rows(storage, part, allow=False)
        got = read_rows(storage, part, allow=True)
        assert set(got) == set(ref)  # scale segments are not states
        # Ids and optimizer state: bitwise the exact ones.
        assert torch.equal(got["ids"], ref["ids"])
        assert torch.equal(got["momentum1"].view(torch.int32), ref["momentum1"].view(torch.int32))
        w = ref["weight"]
        assert got["weight"].dtype == torch.float32
        assert bool(((got["weight"] - w).abs() <= bound(w, enc)).all())
    # Per row: 8 (id) + 4 (momentum) + 256 (fp32 weight) -> 136 (fp16/bf16) -> 76 (int8 + scale);
    # files are page-padded, so compare with a little slack.
    assert sizes["fp16"] == sizes["bf16"]
    assert 0.50 < sizes["fp16"] / sizes["exact"] < 0.55, sizes
    assert 0.27 < sizes["int8"] / sizes["exact"] < 0.31, sizes


@contextmanager
def quantized_saves(enc: str | None) -> Iterator[None]:
    """SynthTrainer.save writing with ``quantize=enc`` (a writer option, not a fake)."""
    orig = synth.RankPartWriter
    synth.RankPartWriter = functools.partial(RankPartWriter, quantize=enc)  # type: ignore[misc]
    try:
        yield
    finally:
        synth.RankPartWriter = orig  # type: ignore[misc]


def mixed_chain(storage: Storage, enc: str) -> SynthTrainer:
    """Exact full at step 1, then deltas 2 and 3 quantised, then an exact delta 4."""
    t = SynthTrainer(storage)
    t.train(1)
    t.save("full")
    with quantized_saves(enc):
        for _ in range(2):
            t.train(1)
            t.save("delta")
    t.train(1)
    t.save("delta")
    return t


@pytest.mark.parametrize("enc", ENCODINGS)
def test_mixed_chain_needs_opt_in_and_restores_within_bound(tmp_path: Path, enc: str) -> None:
    storage = LocalStorage(tmp_path / "ck")
    t = mixed_chain(storage, enc)
    ms = read_manifests(storage)
    assert [ms[s].encoding for s in sorted(ms)] == [None, enc, enc, None]
    chain = chain_for(ms, 4)
    # Without the opt-in: a typed error naming the checkpoint and the encoding, model untouched.
    shards = make_shards(2, fill=float("nan"))
    before = snapshot(shards)
    with pytest.raises(IncompatibleModelError, match=f"step 2 .*{enc}-quantised"):
        apply_chain(storage, chain, shards, tables())
    assert same(before, snapshot(shards)) == []  # bitwise the same NaNs: nothing was written
    # With it: optimizer state bitwise, weights within the bound of the values saved.
    shards = make_shards(2, fill=float("nan"))
    apply_chain(storage, chain, shards, tables(), allow_quantized=True)
    got, want = snapshot(shards), t.saved[4].state
    for k in want:
        if k.endswith("|momentum1"):
            assert torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)), k
        else:
            assert bool(((got[k] - want[k]).abs() <= bound(want[k], enc)).all()), k
    # The quantised deltas changed some rows: the restore is not (silently) exact.
    assert any(not torch.equal(got[k], want[k]) for k in want if k.endswith("|weight"))
    # An exact chain of the same store still restores bitwise (exact tenants unaffected).
    state, _ = restore_state(storage, chain_for(ms, 1))
    assert same(state, t.saved[1].state) == []


def test_records_say_the_encoding_and_checksums_catch_damage(tmp_path: Path) -> None:
    """Exact checkpoints' records carry no encoding keys (they dump as before the feature),
    quantised ones say their encoding at every level, all verify, and damage in quantised
    chunks (values or scales) is detected."""
    storage = LocalStorage(tmp_path / "ck")
    mixed_chain(storage, "int8")
    ms = read_manifests(storage)
    for m in ms.values():
        assert verify_checkpoint(storage, m).problems == []
        raw = storage.get(f"{m.folder}/manifest.json").decode()
        assert ('"encoding"' in raw) == (m.encoding is not None)
        for part in read_rank_manifests(storage, m):
            text = json.dumps(part.model_dump(mode="json"))
            assert ("encoding" in text) == (m.encoding is not None)
    # Damage a weight byte, and a scale byte, of a quantised chunk: the checksum catches both.
    q = ms[2]
    part = read_rank_manifests(storage, q)[0]
    chunk = part.shards[0].chunks[0]
    segs = {s.name: s for s in chunk.segments}
    path = Path(tmp_path / "ck" / q.folder / chunk.path)
    good = path.read_bytes()
    for seg in ("weight", "weight.scale"):
        bad = bytearray(good)
        bad[segs[seg].offset] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            apply_chain(storage, chain_for(ms, 3), make_shards(2), tables(), allow_quantized=True)
        assert verify_checkpoint(storage, q).problems
    path.write_bytes(good)


def test_merger_refuses_to_merge_quantised_deltas(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ck")
    mixed_chain(storage, "int8")
    before = sorted(storage.list(""))
    w = MergeWorker(
        storage, MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None))
    )
    r = w.run_pass()
    # Deltas 2+3 (quantised) cannot become an "exact" merged delta: the item fails, nothing is
    # committed or quarantined, and the trainer's checkpoints are all still there.
    assert r.stats.items_committed == 0
    assert w.failures and r.stats.failed
    assert all("quantised" in why for why in r.stats.failed.values()), r.stats.failed
    ms = read_manifests(storage)
    assert sorted(ms) == [1, 2, 3, 4] and not ms.merged
    assert not [k for k in storage.list("") if k.startswith("quarantine/")]
    assert all(k in storage.list("") for k in before)


def test_records_are_validated_strictly() -> None:
    seg = {"name": "weight", "dtype": "int8", "shape": [4, 8], "offset": 64, "nbytes": 32}
    with pytest.raises(ValueError, match="source_dtype"):
        Segment(**seg, encoding="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stored as float16"):
        Segment(**{**seg, "dtype": "float32"}, encoding="fp16", source_dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source_dtype without"):
        Segment(**seg, source_dtype="float32")  # type: ignore[arg-type]
    ids = Segment(name="ids", dtype="int64", shape=(4,), offset=0, nbytes=32)
    w8 = Segment(**seg, encoding="int8", source_dtype="float32")  # type: ignore[arg-type]
    rec = {"path": "a/b.chunk", "rows": 4, "nbytes": 4096, "checksum": "0"}
    data = json.dumps({**rec, "segments": [ids.model_dump(), w8.model_dump()]}).encode()
    with pytest.raises(CorruptCheckpointError, match=r"weight\.scale"):
        load_model(ChunkRecord, data, "chunk record")
    scale = Segment(name="weight.scale", dtype="float32", shape=(4,), offset=128, nbytes=16)
    ok = ChunkRecord(**rec, segments=(ids, w8, scale))  # type: ignore[arg-type]
    assert ok.encoding == "int8"
    plain = Segment(name="weight", dtype="float32", shape=(4, 8), offset=64, nbytes=128)
    assert "encoding" not in plain.model_dump(mode="json")
