"""Chunk codec, state codec and manifest validation: exact round trips, and hostile input fails
with a DeckError (never executes code, never crashes otherwise)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from deck.errors import CorruptCheckpointError, DeckError, UnsupportedError
from deck.format import treecodec
from deck.format.chunks import decode_chunk, encode_chunk
from deck.format.manifest import (
    CheckpointManifest,
    ChunkRecord,
    Kind,
    RankManifest,
    RowIndex,
    dump_model,
    encode_body,
    load_model,
)
from deck.format.pending import PendingPart
from deck.format.rowindex import build_index


def _chunk(rows: int = 5, dim: int = 8):
    arrays = [
        ("ids", torch.arange(rows, dtype=torch.int64) * 3),
        ("weight", torch.randn(rows, dim)),
        ("momentum1", torch.rand(rows)),
    ]
    buf, rec = encode_chunk("t/c0-r0-000000.chunk", arrays)
    return arrays, bytes(buf), rec


@pytest.mark.parametrize("rows", [0, 1, 5, 3000])
def test_chunk_round_trip_is_exact_and_page_sized(rows: int) -> None:
    arrays, data, rec = _chunk(rows)
    assert len(data) % 4096 == 0 and len(data) >= 4096
    assert all(s.offset % 64 == 0 for s in rec.segments)
    out = decode_chunk(data, rec, "f")
    for name, t in arrays:
        assert torch.equal(out[name], t)


@given(pos=st.integers(min_value=0, max_value=4095), bit=st.integers(min_value=0, max_value=7))
@settings(max_examples=200, deadline=None)
def test_any_flipped_bit_is_detected(pos: int, bit: int) -> None:
    _, data, rec = _chunk()
    bad = bytearray(data)
    bad[pos] ^= 1 << bit
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        decode_chunk(bytes(bad), rec, "the/file")


def test_truncation_is_detected() -> None:
    _, data, rec = _chunk()
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        decode_chunk(data[:-1], rec, "the/file")


def test_record_that_lies_about_layout_is_rejected() -> None:
    _, data, rec = _chunk()
    seg = rec.segments[1].model_copy(update={"shape": (5, 9999)})
    lying = rec.model_copy(update={"segments": (rec.segments[0], seg, rec.segments[2])})
    with pytest.raises(CorruptCheckpointError, match="does not fit"):
        decode_chunk(data, lying, "f")


def test_tree_round_trip() -> None:
    obj = {
        "step": 7,
        "lr": 0.1 + 1e-17,
        "betas": (0.9, 0.999),
        "rng": torch.get_rng_state(),
        "state": {0: {"sum": torch.randn(3, 2), "step": torch.tensor(4.0)}},
        "blob": b"\x00\x01",
        "none": None,
        "nested": [[1, 2], {"a": "b"}],
    }
    back = treecodec.decode(treecodec.encode(obj, "x"), "f")
    assert back["betas"] == (0.9, 0.999) and back["lr"] == obj["lr"] and back["blob"] == b"\x00\x01"
    assert torch.equal(back["rng"], obj["rng"]) and torch.equal(
        back["state"][0]["sum"], obj["state"][0]["sum"]
    )
    assert back["nested"] == [[1, 2], {"a": "b"}] and back["none"] is None


_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))  # [] is a 0-dim tensor
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    raw = torch.randint(
        0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), generator=gen
    )
    flat = raw.to(torch.uint8).view(dtype) if dtype != torch.bool else raw % 2 == 1
    return flat[: torch.Size(shape).numel()].reshape(shape)


@given(st.lists(_tensors(), max_size=12), st.text(max_size=8))
@settings(max_examples=200, deadline=None)
def test_state_files_are_the_bytes_safetensors_writes(tensors: list, name: str) -> None:
    """The state file's own safetensors writer (off safetensors' slow Python path) gives the
    bytes ``safetensors.torch.save`` gives, and they read back bitwise (NaN payloads too)."""
    from safetensors.torch import load, save

    tree = {"xs": tensors, name: [t.clone() for t in tensors[:2]]}
    captured = treecodec.capture(tree, "x")
    data = captured.encode()
    want = save(captured.tensors, metadata={"deck_tree": json.dumps(captured.tree)})
    assert data == want
    back = load(data)
    assert back.keys() == captured.tensors.keys()
    for k, t in captured.tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert back[k].view(-1).view(torch.uint8).tolist() == t.view(-1).view(torch.uint8).tolist()
    decoded = treecodec.decode(data, "f")
    assert len(decoded["xs"]) == len(tensors)


def test_a_dtype_safetensors_alone_writes_still_goes_through_it() -> None:
    data = treecodec.encode({"c": torch.ones(2, dtype=torch.complex64)}, "x")
    assert torch.equal(treecodec.decode(data, "f")["c"], torch.ones(2, dtype=torch.complex64))


def test_tree_refuses_unknown_types() -> None:
    with pytest.raises(UnsupportedError, match="object"):
        treecodec.encode({"x": object()}, "user state")


def test_tree_refuses_a_sparse_tensor_naming_it() -> None:
    with pytest.raises(UnsupportedError, match=r"user state\.x\.y.*sparse"):
        treecodec.encode({"x": {"y": torch.eye(3).to_sparse()}}, "user state")


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_tree_decode_of_garbage_is_a_deck_error(data: bytes) -> None:
    with contextlib.suppress(DeckError):
        treecodec.decode(data, "f")


def _manifest_dict() -> dict:
    return {
        "format_version": 1,
        "id": "0123456789abcdef",
        "step": 10,
        "kind": "delta",
        "parent": 5,
        "parent_id": "fedcba9876543210",
        "base": 0,
        "epoch": 0,
        "world_size": 1,
        "ranks": [
            {
                "rank": 0,
                "path": "0123456789abcdef/rank-00000.json",
                "nbytes": 10,
                "checksum": "ab",
                "data_bytes": 5,
            }
        ],
        "created_unix": 0.0,
        "deck_version": "0.1.0",
    }


def test_manifest_round_trip() -> None:
    m = CheckpointManifest.model_validate(_manifest_dict())
    assert load_model(CheckpointManifest, dump_model(m), "f") == m


@pytest.mark.parametrize(
    "patch",
    [
        {"format_version": 99},
        {"step": -1},
        {"kind": "merged-by-aliens"},
        {"parent": None},
        {"parent": 10},
        {
            "ranks": [
                {
                    "rank": 0,
                    "path": "../../etc/passwd",
                    "nbytes": 1,
                    "checksum": "a",
                    "data_bytes": 1,
                }
            ]
        },
        {
            "ranks": [
                {"rank": 0, "path": "/abs/path", "nbytes": 1, "checksum": "a", "data_bytes": 1}
            ]
        },
        {"ranks": [{"rank": 0, "path": "ok.json", "nbytes": -5, "checksum": "a", "data_bytes": 1}]},
        {"world_size": 2},
        {"surprise": True},
    ],
)
def test_hostile_manifests_are_rejected(patch: dict) -> None:
    d = {**_manifest_dict(), **patch}
    with pytest.raises(CorruptCheckpointError, match=r"the/manifest\.json"):
        load_model(CheckpointManifest, json.dumps(d).encode(), "the/manifest.json")


@given(st.binary(max_size=256))
@settings(max_examples=200, deadline=None)
def test_manifest_garbage_is_a_deck_error(data: bytes) -> None:
    for cls in (CheckpointManifest, RankManifest, ChunkRecord):
        with pytest.raises(CorruptCheckpointError):
            load_model(cls, data, "f")


def test_manifest_self_checksum_is_the_last_key_over_the_sorted_form_without_it() -> None:
    _, _, rec = _chunk(7)
    data = dump_model(rec)
    d = json.loads(data)
    assert list(d)[-1] == "self_checksum"
    want = d.pop("self_checksum")
    assert want == xxhash.xxh3_64_hexdigest(
        json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    )
    # Readers take the keys in any order (a record another writer sorted differently loads).
    shuffled = dict(reversed(list(d.items())), self_checksum=want)
    assert load_model(ChunkRecord, json.dumps(shuffled).encode(), "c.json") == rec
    # A loaded record dumped again is the same bytes.
    assert dump_model(load_model(ChunkRecord, data, "c.json")) == data


def test_manifest_self_checksum_detects_changes_and_accepts_the_indented_form() -> None:
    _, _, rec = _chunk(7)
    data = dump_model(rec)
    assert load_model(ChunkRecord, data, "c.json") == rec
    d = json.loads(data)
    # What earlier builds wrote: the same content, indent 1, checksum over that form.
    d.pop("self_checksum")
    old = json.dumps(d, sort_keys=True, indent=1)

    d["self_checksum"] = xxhash.xxh3_64_hexdigest(old.encode())
    assert load_model(ChunkRecord, json.dumps(d, indent=1).encode(), "old.json") == rec
    d["rows"] += 1
    with pytest.raises(CorruptCheckpointError, match=r"old\.json.*own checksum"):
        load_model(ChunkRecord, json.dumps(d).encode(), "old.json")


def _in_place(model: RankManifest) -> bytes:
    """The record encoded the plain way (filters and all in one ``json.dumps``), as
    :func:`dump_model` must write it byte for byte."""
    d = model.model_dump(mode="json")
    body = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return body[:-1] + f',"self_checksum":"{xxhash.xxh3_64_hexdigest(body)}"}}'.encode()


def _part_with_filters(id_sets: list[list[int]], table: str = "t") -> RankManifest:
    chunks = []
    for n, ids in enumerate(id_sets):
        _, _, rec = _chunk(3)
        index = build_index(torch.tensor(sorted(set(ids)), dtype=torch.int64))
        chunks.append(rec.model_copy(update={"path": f"{PART}/{table}/c{n}.chunk", "index": index}))
    shard = {
        "table": table,
        "num_rows": 1 << 20,
        "num_cols": 8,
        "row_offset": 0,
        "rows": 1 << 20,
        "col_offset": 0,
        "cols": 8,
        "full": False,
        "states": ["weight"],
        "chunks": [c.model_dump(mode="json") for c in chunks],
    }
    return RankManifest.model_validate(
        {
            "format_version": 1,
            "step": 5,
            "ckpt_id": "0" * 16,
            "rank": 0,
            "world_size": 1,
            "shards": [shard],
            "dense": None,
            "extra": {"path": f"{PART}/extra.safetensors", "nbytes": 1, "checksum": "ab"},
        }
    )


PART = f"{'0' * 16}/rank-00000"


@given(
    st.lists(
        st.lists(st.integers(min_value=0, max_value=(1 << 20) - 1), min_size=1, max_size=300),
        max_size=6,
    )
)
@settings(max_examples=60, deadline=None)
def test_rank_manifests_with_row_index_filters_are_the_bytes_encoded_in_place(
    id_sets: list[list[int]],
) -> None:
    """dump_model encodes the filters beside the record and splices them in: the bytes are
    those of encoding everything in place, and they load back to the same record (also read
    the slow way, through the canonical form, once the body is reformatted)."""
    part = _part_with_filters(id_sets)
    data = dump_model(part)
    assert data == _in_place(part)
    assert load_model(RankManifest, data, "p.json") == part
    reformatted = json.loads(data)
    assert load_model(RankManifest, json.dumps(reformatted, indent=2).encode(), "p.json") == part
    # A pending record holding the part, with the part's encoding put in as it is: the same
    # bytes as encoding the pending record whole.
    pending = PendingPart(
        uri="/ck", step=5, ckpt_id="0" * 16, rank=0, world_size=1, kind=Kind.DELTA,
        parent=0, parent_id="1" * 16, base=0, epoch=0, part=part,
    )  # fmt: skip
    whole = dump_model(pending)
    assert dump_model(pending, {"part": encode_body(part)}) == whole
    assert load_model(PendingPart, whole, "pending.json") == pending


def test_a_placeholder_found_elsewhere_in_the_record_falls_back_to_encoding_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A string of the record holding the placeholders' random prefix (here forced) must not
    be taken for a placeholder: the record is then encoded the plain way."""
    from deck.format import manifest

    monkeypatch.setattr(manifest.os, "urandom", lambda n: b"\0" * n)
    part = _part_with_filters([[1, 7, 300], [5, 9]], table="0" * 16 + "00000001")
    data = dump_model(part)
    assert data == _in_place(part)
    assert load_model(RankManifest, data, "p.json") == part


def test_a_changed_filter_byte_fails_the_checksum() -> None:
    part = _part_with_filters([[1, 7, 300, 4000, 4096]])
    data = dump_model(part)
    bloom = part.shards[0].chunks[0].index.bloom  # type: ignore[union-attr]
    assert bloom is not None
    at = data.index(bloom.encode()) + 3
    flipped = data[:at] + (b"B" if data[at : at + 1] != b"B" else b"C") + data[at + 1 :]
    with pytest.raises(CorruptCheckpointError, match=r"p\.json.*own checksum"):
        load_model(RankManifest, flipped, "p.json")


@pytest.mark.parametrize("bloom", ["AB=C", "AB\nC", "ABé=", 'AB"C', "A===", "AB-_", " ABC"])
def test_a_filter_that_is_not_base64_is_refused(bloom: str) -> None:
    with pytest.raises(ValueError, match="not base64"):
        RowIndex(min_id=0, max_id=9, bits=24, k=1, bloom=bloom)


@pytest.mark.parametrize("bloom", ["ABC=", "AB==", "a+/9"])
def test_a_base64_filter_is_accepted(bloom: str) -> None:
    assert RowIndex(min_id=0, max_id=9, bits=24, k=1, bloom=bloom).bloom == bloom


def test_the_torch_free_item_sizes_are_torchs() -> None:
    """chunk_io checks layouts without torch: its sizes per dtype name are the torch dtypes'."""
    from deck.format.chunk_io import ITEMSIZE
    from deck.format.chunks import DTYPES

    assert {k: v.itemsize for k, v in DTYPES.items()} == ITEMSIZE


def test_every_table_key_has_a_folder_of_its_own() -> None:
    """A break-it finding: tables `user_id` and `user/id` (TorchRec accepts both) shared one
    chunk folder, each overwriting the other's chunks: every checkpoint committed, none
    restorable ("checksum mismatch"). A key with unsafe characters gets its hash appended."""
    import re

    from deck.format.manifest import table_dir

    safe = "sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
    assert table_dir(safe) == safe  # (the folders of every checkpoint written so far)
    keys = [
        "e.user_id.weight",
        "e.user/id.weight",
        "e.user:id.weight",
        "e.user id.weight",
        "e.café.weight",
        "e.caf_.weight",
        "e.user_id.weight-",
    ]
    dirs = [table_dir(k) for k in keys]
    assert len(set(dirs)) == len(keys), dirs
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+", d) for d in dirs), dirs
    assert table_dir("e.user/id.weight") == table_dir("e.user/id.weight")  # stable
