"""The tracker's claim kernel: native and torch fallback give the same rows and the same map
(each test runs against both: tests/kernels/conftest.py)."""

import numpy as np
import pytest
import torch
from deck.kernels import native
from deck.kernels.claim import (
    BLOCK_SHIFT,
    block_count,
    claim_marked_rows,
    claim_rows,
    clear_rows,
    fill_rows,
    journaling_available,
    mark_rows,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deck.trainer.tracker import TrackerStore


def _map(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Every combination of 3 consumers' bits, sparse like a map between checkpoints, plus the
    # edges: first and last rows, a length that is not a multiple of 8.
    m = torch.zeros(n, dtype=torch.uint8)
    hit = torch.randint(0, n, (n // 20 + 1,), generator=g)
    m[hit] = torch.randint(1, 8, (hit.numel(),), generator=g, dtype=torch.uint8)
    m[0], m[-1] = 7, 5
    return m


@pytest.mark.native_only
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4099, 100_003])
@pytest.mark.parametrize("bit", [1, 2, 4, 128])
def test_native_claim_equals_fallback(monkeypatch: pytest.MonkeyPatch, n: int, bit: int) -> None:
    a = _map(n, seed=n)
    b = a.clone()
    got = claim_rows(a, bit)
    monkeypatch.setattr(native, "_native", None)
    want = claim_rows(b, bit)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(a, b)  # the bit is cleared in the same rows, other bits kept
    assert not bool((a & bit).any())
    assert claim_rows(a, bit).numel() == 0  # nothing left to claim


@pytest.mark.parametrize("bit", [0, 3, 256, -1])
def test_claim_rejects_a_byte_that_is_not_one_bit(bit: int) -> None:
    m = torch.full((16,), 0xFF, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bit must be"):
        claim_rows(m, bit)
    with pytest.raises(ValueError, match="bit must be"):
        claim_marked_rows(m, torch.full((1,), 0xFF, dtype=torch.uint8), bit)
    assert bool((m == 0xFF).all())


@pytest.mark.native_only
@pytest.mark.parametrize("n", [7, 4099])
def test_native_claim_with_too_little_room_changes_nothing(n: int) -> None:
    # Rows marked between the count and the take: the take gives back what it cleared.
    m = _map(n, seed=n)
    before = m.clone()
    count = native._native.claim_bit(m.numpy(), 1, bytearray())
    assert count > 1
    short = torch.empty(count - 1, dtype=torch.int64)
    assert native._native.claim_bit(m.numpy(), 1, short.numpy()) == -1
    assert torch.equal(m, before)


# The summary claim (claim_blocks) against the whole-map claim it replaces.

native_only = pytest.mark.native_only
hyp = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _summary(m: torch.Tensor) -> torch.Tensor:
    """The exact summary of a map: per block, the OR of its rows' bytes."""
    blocks = torch.zeros(block_count(m.numel()), dtype=torch.uint8)
    rows = torch.nonzero(m).view(-1)
    for r in rows.tolist():
        blocks[r >> BLOCK_SHIFT] |= int(m[r])
    return blocks


@st.composite
def marked_maps(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    # Lengths around block and 8-block edges; rows clustered or spread; a summary that is exact
    # or has extra bits in blocks without such rows (allowed: they only cost a scan).
    n = draw(st.integers(1, 64 * 40 + 9))
    edge = st.builds(  # first and last rows of blocks
        lambda b, e: min(n - 1, (b << BLOCK_SHIFT) + e),
        st.integers(0, n >> BLOCK_SHIFT),
        st.sampled_from([0, 1, 7, 8, 62, 63]),
    )
    rows = draw(st.lists(st.integers(0, n - 1) | edge, max_size=60))
    m = torch.zeros(n, dtype=torch.uint8)
    for r in rows:
        m[r] |= draw(st.integers(1, 255))
    blocks = _summary(m)
    for b in draw(st.lists(st.integers(0, blocks.numel() - 1), max_size=5)):
        blocks[b] |= draw(st.integers(0, 255))
    return m, blocks


@hyp
@given(mb=marked_maps(), bit=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
def test_summary_claim_equals_the_whole_map_claim(
    mb: tuple[torch.Tensor, torch.Tensor], bit: int
) -> None:
    m, blocks = mb
    whole = m.clone()
    other_bits = blocks & (~bit & 0xFF)
    got = claim_marked_rows(m, blocks, bit)
    assert torch.equal(got, claim_rows(whole, bit))
    assert torch.equal(m, whole)  # same bit cleared in the same rows, every other bit kept
    assert torch.equal(blocks, other_bits)  # no row has the bit: no block keeps it
    assert claim_marked_rows(m, blocks, bit).numel() == 0


@native_only
@hyp
@given(mb=marked_maps(), bit=st.sampled_from([1, 4, 128]))
def test_summary_claim_native_equals_fallback(
    mb: tuple[torch.Tensor, torch.Tensor], bit: int
) -> None:
    m, blocks = mb
    m2, blocks2 = m.clone(), blocks.clone()
    got = claim_marked_rows(m, blocks, bit)
    saved = native._native
    try:
        native._native = None  # the torch fallback (no hypothesis-safe monkeypatch fixture)
        want = claim_marked_rows(m2, blocks2, bit)
    finally:
        native._native = saved
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(m, m2) and torch.equal(blocks, blocks2)


@native_only
@pytest.mark.parametrize("n", [7, 64 * 9 + 3, 100_003])
@pytest.mark.parametrize("sparse", [False, True])
def test_summary_claim_with_too_little_room_changes_nothing(n: int, sparse: bool) -> None:
    # Dense: most blocks marked, the kernel reads the whole map; sparse: only the marked blocks.
    m = _map(n, seed=n)
    if sparse:
        m[1:-1] = 0  # rows 0 and n - 1 stay: two marked blocks (one when n < 64)
        m[n // 2] = 3
    blocks = _summary(m)
    before, blocks_before = m.clone(), blocks.clone()
    take = native._native.claim_blocks
    count = take(m.numpy(), blocks.numpy(), BLOCK_SHIFT, 1, bytearray())
    assert count > 1 and count == int((m & 1).count_nonzero())
    short = torch.empty(count - 1, dtype=torch.int64)
    assert take(m.numpy(), blocks.numpy(), BLOCK_SHIFT, 1, short.numpy()) == -1
    assert torch.equal(m, before) and torch.equal(blocks, blocks_before)


@native_only
def test_summary_of_the_wrong_size_is_refused() -> None:
    m = torch.zeros(130, dtype=torch.uint8)  # three blocks of 64
    with pytest.raises(ValueError, match="one byte per 2\\*\\*shift rows"):
        native._native.claim_blocks(m.numpy(), bytearray(2), BLOCK_SHIFT, 1, bytearray())
    with pytest.raises(ValueError, match="bit must be"):
        native._native.claim_blocks(m.numpy(), bytearray(3), BLOCK_SHIFT, 3, bytearray())


@native_only
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_journal_clear_takes_both_widths_and_checks_every_row(dtype: type) -> None:
    # A journal of a map under 2**31 rows is int32 (half the bytes to sort in the stall): the
    # clear must treat it exactly as int64, and refuse an out-of-map row before changing any.
    n = 1000
    dirty = torch.zeros(n, dtype=torch.uint8)
    blocks = torch.zeros(block_count(n), dtype=torch.uint8)
    rows = np.array([3, 64, 65, 999], dtype=dtype)
    dirty[torch.from_numpy(rows.astype(np.int64))] = 0b11
    blocks[torch.from_numpy(rows.astype(np.int64) >> BLOCK_SHIFT)] = 0b11
    before = dirty.clone(), blocks.clone()
    with pytest.raises(IndexError):
        clear_rows(dirty, blocks, np.array([3, n], dtype=dtype), 0b01)
    assert torch.equal(dirty, before[0]) and torch.equal(blocks, before[1])
    assert clear_rows(dirty, blocks, rows, 0b01) == 0
    assert dirty[torch.from_numpy(rows.astype(np.int64))].tolist() == [0b10] * 4
    assert int(dirty.sum()) == 4 * 0b10 and set(blocks.tolist()) <= {0, 0b10}
    assert clear_rows(dirty, blocks, np.array([5, 64], dtype=dtype), 0b10) == 1  # 5 lacked it


# The tracker's compaction: mark_rows (native, journaling) and fill_rows (its path without the
# native kernel) set the same bits, and a row outside the map changes nothing in either.


def test_fill_rows_marks_what_mark_rows_marks() -> None:
    n = 64 * 5 + 3
    rows = torch.tensor([0, 5, 5, 64, 63, n - 1, 200, 5])
    dirty, blocks = (
        torch.zeros(n, dtype=torch.uint8),
        torch.zeros(block_count(n), dtype=torch.uint8),
    )
    dirty[7] = 0b100
    blocks[0] = 0b100
    fill_rows(dirty, blocks, rows, 0b011)
    assert dirty[rows].tolist() == [0b011] * len(rows) and int(dirty[7]) == 0b100
    assert int((dirty != 0).sum()) == len(set(rows.tolist())) + 1
    assert torch.equal(blocks, _summary(dirty))
    if journaling_available(dirty):
        d2, b2 = torch.zeros_like(dirty), torch.zeros_like(blocks)
        d2[7], b2[0] = 0b100, 0b100
        new, _ = mark_rows(d2, b2, rows, 0b011)
        assert new.tolist() == [0, 5, 64, 63, n - 1, 200]  # first appearances, in order
        assert torch.equal(d2, dirty) and torch.equal(b2, blocks)


@pytest.mark.parametrize("bad", [[5, 100], [100], [-1], [5, -1, 7], [2**40]])
def test_rows_outside_the_map_change_nothing(bad: list[int]) -> None:
    """torch's ``index_fill_`` wrote row 5 before it refused row 100, and took row -1 as the
    last row: the fallback checks every row first, as the native kernel does."""
    n = 100
    dirty, blocks = (
        torch.zeros(n, dtype=torch.uint8),
        torch.zeros(block_count(n), dtype=torch.uint8),
    )
    dirty[3], blocks[0] = 1, 1
    before = dirty.clone(), blocks.clone()
    markers = [fill_rows]
    if journaling_available(dirty):
        markers.append(lambda d, b, r, bits: mark_rows(d, b, r, bits))
    for mark in markers:
        with pytest.raises(IndexError, match="outside the map of 100 rows"):
            mark(dirty, blocks, torch.tensor(bad), 1)
        assert torch.equal(dirty, before[0]) and torch.equal(blocks, before[1])


def test_the_tracker_refuses_rows_outside_the_map_on_either_path() -> None:
    """The tracker (deck.trainer.tracker) on this run's kernels: a compaction with a row outside
    the map raises and marks none of its rows (the fallback used to leave row 5 marked)."""
    store = TrackerStore(100, ("a",))
    store.record(torch.tensor([3]))
    store.compact()
    store.record(torch.tensor([5, 100]))
    with pytest.raises(IndexError):
        store.compact()
    store.record(torch.tensor([-1]))
    with pytest.raises(IndexError):
        store.compact()
    assert store.touched(store.begin_read("a"), 0, 100).tolist() == [3]
