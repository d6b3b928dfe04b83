import numpy as np
import pytest
import torch
from deck.kernels import native
from deck.kernels.gather import gather_into, gather_rows, row_sources
from hypothesis import given, settings
from hypothesis import strategies as st

STATE = st.tuples(
    st.sampled_from([(), (1,), (7,), (64,), (3, 5)]),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]),
)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 300),
    states=st.lists(STATE, min_size=1, max_size=4),
    picks=st.lists(st.integers(0, 10**6), max_size=120),
)
def test_gather_rows_equals_index_select(
    rows: int, states: list[tuple[tuple[int, ...], torch.dtype]], picks: list[int]
) -> None:
    """Every state of the rows in one pass (a table's weight and its optimizer states) equals
    an index_select per state."""
    srcs = [
        (torch.arange(rows * max(1, torch.Size(shape).numel())) % (251 - i))
        .to(dtype)
        .view(rows, *shape)
        for i, (shape, dtype) in enumerate(states)
    ]
    idx = torch.tensor([p % rows for p in picks], dtype=torch.int64)
    outs = [torch.full((len(picks), *src.shape[1:]), 7, dtype=src.dtype) for src in srcs]
    gather_rows(idx, list(zip(srcs, outs, strict=True)))
    for src, out in zip(srcs, outs, strict=True):
        assert torch.equal(out, torch.index_select(src, 0, idx))


def test_an_index_outside_the_table_copies_nothing() -> None:
    src = torch.arange(10.0)
    out = torch.full((3,), -1.0)
    with pytest.raises(IndexError):
        gather_rows(torch.tensor([1, 10, 2]), [(src, out)])
    assert out.tolist() == [-1.0, -1.0, -1.0]
    with pytest.raises(IndexError):
        gather_rows(torch.tensor([-1]), [(src, torch.empty(1))])
    # An index inside one state but outside a shorter one: nothing of either is copied
    first = torch.full((2,), -1.0)
    with pytest.raises(IndexError):
        gather_rows(torch.tensor([0, 9]), [(src, out[:2]), (torch.arange(5.0), first)])
    assert out.tolist() == [-1.0, -1.0, -1.0] and first.tolist() == [-1.0, -1.0]


def test_non_contiguous_tables_and_no_native_kernel_take_index_select(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = torch.arange(40.0).view(10, 4)
    idx = torch.tensor([9, 0, 3])
    out = torch.empty(3, 2)
    gather_rows(idx, [(src[:, ::2], out)])  # a strided view: no flat rows to copy
    assert torch.equal(out, src[:, ::2][idx])
    monkeypatch.setattr(native, "_native", None)
    out4 = torch.empty(3, 4)
    gather_rows(idx, [(src, out4)])
    assert torch.equal(out4, src[idx])


@pytest.mark.native_only
def test_sources_checked_once_copy_into_byte_ranges_or_refuse() -> None:
    """row_sources checks a shard's states once; gather_into then copies rows into byte ranges
    of a buffer (a chunk's segments). A strided state has no sources; an out shorter than the
    rows raises before anything is copied."""
    weight, mom = torch.arange(40.0).view(10, 4), torch.arange(10.0) * 2
    sources = row_sources([weight, mom])
    assert sources is not None and [b for _, b in sources] == [16, 4]
    assert row_sources([weight[:, ::2]]) is None
    buf = bytearray(64)
    view = memoryview(buf)
    rows = torch.tensor([9, 0, 3]).numpy()
    gather_into(rows, sources, [view[0:48], view[48:60]])
    got = torch.frombuffer(buf, dtype=torch.float32)
    assert torch.equal(got[:12].view(3, 4), weight[[9, 0, 3]])
    assert torch.equal(got[12:15], mom[[9, 0, 3]])
    before = bytes(buf)
    with pytest.raises(ValueError):
        gather_into(rows, sources, [view[0:48], view[48:56]])  # room for 2 of 3 rows
    assert bytes(buf) == before


@pytest.mark.native_only
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_positions_read_in_place_with_a_base(dtype: type) -> None:
    # A snapshot passes the claim's positions (a shard's rows plus its offset among the tracker's
    # positions, int32 below 2**31 rows) and that offset: the same copy as the relative rows, and
    # a position outside the shard (below the base or past its rows) copies nothing.
    weight, mom = torch.arange(40.0).view(10, 4), torch.arange(10.0) * 2
    sources = row_sources([weight, mom])
    assert sources is not None
    buf = bytearray(60)
    view = memoryview(buf)
    gather_into(np.array([109, 100, 103], dtype=dtype), sources, [view[0:48], view[48:60]], 100)
    got = torch.frombuffer(buf, dtype=torch.float32)
    assert torch.equal(got[:12].view(3, 4), weight[[9, 0, 3]])
    assert torch.equal(got[12:15], mom[[9, 0, 3]])
    for bad in ([99, 100], [100, 110]):
        with pytest.raises(IndexError):
            gather_into(np.array(bad, dtype=dtype), sources, [view[0:32], view[48:56]], 100)
    with pytest.raises(ValueError):
        gather_into(np.array([1, 2], dtype=np.uint32), sources, [view[0:32], view[48:56]])
    assert torch.equal(got[:12].view(3, 4), weight[[9, 0, 3]])


@pytest.mark.native_only
@pytest.mark.parametrize("offset", [0, 4, 8, 16, 20])
@pytest.mark.parametrize("dim", [1, 3, 4, 64])
def test_rows_land_whole_at_any_destination_alignment(offset: int, dim: int) -> None:
    """Rows land whole wherever a segment starts in a chunk buffer (aligned or not, rows of any
    width): the same bytes as index_select, nothing written outside the rows."""
    g = torch.Generator().manual_seed(dim)
    weight, mom = torch.randn(1000, dim, generator=g), torch.rand(1000, generator=g)
    sources = row_sources([weight, mom])
    assert sources is not None
    rows = np.array([999, 0, 17, 17, 500, 3], dtype=np.int64)
    wbytes, mbytes = len(rows) * dim * 4, len(rows) * 4
    # numpy allocates from a 16-byte aligned start: offsets 0 and 16 are aligned, the others not
    buf = np.full(offset + wbytes + mbytes + 64, 0xAB, dtype=np.uint8)
    view = memoryview(buf)
    gather_into(rows, sources, [view[offset : offset + wbytes], view[offset + wbytes :][:mbytes]])
    got_w = torch.from_numpy(buf[offset : offset + wbytes].copy()).view(torch.float32)
    got_m = torch.from_numpy(buf[offset + wbytes :][:mbytes].copy()).view(torch.float32)
    assert torch.equal(got_w.view(len(rows), dim), weight[torch.from_numpy(rows)])
    assert torch.equal(got_m, mom[torch.from_numpy(rows)])
    assert (buf[:offset] == 0xAB).all() and (buf[offset + wbytes + mbytes :] == 0xAB).all()
