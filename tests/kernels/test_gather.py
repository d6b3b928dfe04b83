import pytest
import torch
from deck.kernels import native
from deck.kernels.gather import gather_rows
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 300),
    shape=st.sampled_from([(), (1,), (7,), (64,), (3, 5)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]),
    picks=st.lists(st.integers(0, 10**6), max_size=120),
)
def test_gather_rows_equals_index_select(
    rows: int, shape: tuple[int, ...], dtype: torch.dtype, picks: list[int]
) -> None:
    src = (torch.arange(rows * max(1, torch.Size(shape).numel())) % 251).to(dtype)
    src = src.view(rows, *shape)
    idx = torch.tensor([p % rows for p in picks], dtype=torch.int64)
    out = torch.full((len(picks), *shape), 7, dtype=dtype)
    gather_rows(src, idx, out)
    assert torch.equal(out, torch.index_select(src, 0, idx))


def test_an_index_outside_the_table_copies_nothing() -> None:
    src = torch.arange(10.0)
    out = torch.full((3,), -1.0)
    with pytest.raises(IndexError):
        gather_rows(src, torch.tensor([1, 10, 2]), out)
    assert out.tolist() == [-1.0, -1.0, -1.0]
    with pytest.raises(IndexError):
        gather_rows(src, torch.tensor([-1]), torch.empty(1))


def test_non_contiguous_tables_and_no_native_kernel_take_index_select(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = torch.arange(40.0).view(10, 4)
    idx = torch.tensor([9, 0, 3])
    out = torch.empty(3, 2)
    gather_rows(src[:, ::2], idx, out)  # a strided view: no flat rows to copy
    assert torch.equal(out, src[:, ::2][idx])
    monkeypatch.setattr(native, "_native", None)
    out4 = torch.empty(3, 4)
    gather_rows(src, idx, out4)
    assert torch.equal(out4, src[idx])
