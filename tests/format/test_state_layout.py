"""The format's one spelling of a shard's scalar-state key, and the streamed safetensors writer:
round trips, and a malformed key fails with a typed error naming it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load as st_load

from deck.errors import CorruptCheckpointError, UnsupportedError
from deck.format.safetensors import check_dtypes, preamble, write_tensor
from deck.format.statefile import is_scalar_key, parse_scalar_key, scalar_key


@given(
    st.text(min_size=1).filter(lambda t: "\n" not in t),
    st.integers(min_value=0, max_value=2**40),
    st.integers(min_value=0, max_value=2**20),
)
def test_scalar_key_round_trips(table: str, row: int, col: int) -> None:
    # Table names may hold "|" themselves: the key is parsed from the right.
    key = scalar_key(table, row, col)
    assert is_scalar_key(key)
    assert parse_scalar_key(key) == (table, row, col)


def test_scalar_key_spelling() -> None:
    # The spelling docs/format.md gives; checkpoints on disk depend on it.
    assert scalar_key("emb.t0.weight", 200, 4) == "emb.t0.weight|200|4"


@pytest.mark.parametrize("bad", ["t|1", "t|a|2", "|1|2", "t|1|2|", "", "t|-1|2"])
def test_malformed_scalar_key_names_the_key(bad: str) -> None:
    assert not is_scalar_key(bad)
    with pytest.raises(CorruptCheckpointError, match="scalar state key") as e:
        parse_scalar_key(bad)
    assert repr(bad) in str(e.value)


def test_non_string_scalar_key_is_refused() -> None:
    assert not is_scalar_key(5) and not is_scalar_key(("t", 1, 2))
    with pytest.raises(CorruptCheckpointError, match="5"):
        parse_scalar_key(5)  # type: ignore[arg-type]


def test_streamed_safetensors_file_reads_back() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.t.weight": torch.randn(7, 5, generator=g),
        "ids": torch.arange(11),
        "half": torch.randn(3, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "mask": torch.tensor([True, False, True]),
        "column": torch.randn(4, 4, generator=g)[:, 1],  # not contiguous
        "empty": torch.zeros(0, 3),
    }
    layout = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    check_dtypes(layout)
    f = io.BytesIO()
    head = preamble({"format": "deck-export", "step": "4"}, layout)
    assert len(head) % 8 == 0  # 8-byte length + header padded to 8 bytes
    f.write(head)
    for v in tensors.values():
        write_tensor(f, v)
    data = f.getvalue()
    got = st_load(data)
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_unsupported_dtype_is_refused_before_writing() -> None:
    with pytest.raises(UnsupportedError, match="c64: dtype"):
        check_dtypes([("ok", (1,), torch.float32), ("c64", (2,), torch.complex64)])


def test_safe_open_reads_the_metadata(tmp_path: Path) -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    p = tmp_path / "x.safetensors"
    with open(p, "wb") as f:
        f.write(preamble({"a": "b"}, [("t", (2, 3), torch.float32)]))
        write_tensor(f, t)
    with safe_open(str(p), framework="pt") as r:
        assert r.metadata() == {"a": "b"}
        assert torch.equal(r.get_tensor("t"), t)
