"""deck.kernels.jagged_unique against the per-table torch.unique reference, plus input validation."""

from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
from typing import Any

import numpy as np
import pytest
import torch
from deck.kernels import (
    KernelInputError,
    concat_jagged,
    free_cached_buffers,
    gpu,
    jagged_unique,
    jagged_unique_reference,
    unique_per_table,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deck.errors import DeckError

# The module that loads the C kernel; the fixture below switches it off for the numpy fallback.
native_module = importlib.import_module("deck.kernels.native")

MAX_ID = 2**63 - 1
METHODS = ("auto", "bitmap", "sort")


@pytest.fixture(autouse=True, scope="module", params=["native", "numpy"])
def cpu_bitmap_kernel(request: pytest.FixtureRequest) -> Any:
    """Every test runs with the native CPU bitmap kernel and with its numpy fallback (used where
    no C compiler built the extension)."""
    if request.param == "native" and native_module._native is None:
        pytest.fail(
            "the native kernel deck.kernels._jagged is not built (pip install -e . needs gcc)"
        )
    saved = native_module._native
    if request.param == "numpy":
        native_module._native = None
    yield request.param
    native_module._native = saved


# Ids drawn per example from one regime: a small range (many duplicates, bitmap-friendly), the
# whole int64 range, or right below 2**63 - 1 (no room for a composite key: lexsort).
ID_REGIMES = {
    "small": st.integers(0, 12),
    "wide": st.integers(0, MAX_ID),
    "near_max": st.integers(MAX_ID - 6, MAX_ID),
    "int32": st.integers(0, 2**31 - 1),
}


@st.composite
def jagged_inputs(draw: st.DrawFn, regime: str | None = None) -> dict[str, Any]:
    """Tables of ids, their flat values/lengths tensors and (maybe) per-table row bounds."""
    regime = regime or draw(st.sampled_from(sorted(ID_REGIMES)))
    ids = ID_REGIMES[regime]
    tables = draw(st.lists(st.lists(ids, max_size=25), max_size=7))
    if draw(st.booleans()) and tables:
        # Copy one table's ids into another: duplicates across tables must stay separate.
        src, dst = draw(st.integers(0, len(tables) - 1)), draw(st.integers(0, len(tables) - 1))
        tables[dst] = tables[dst] + tables[src]
    dtype = torch.int32 if regime == "int32" and draw(st.booleans()) else torch.int64
    flat = [x for table in tables for x in table]
    values = torch.tensor(flat, dtype=dtype)
    lengths_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    lengths = torch.tensor([len(t) for t in tables], dtype=lengths_dtype)
    num_rows: list[int] | torch.Tensor | None = None
    # Row bounds only where the ids are row-like; a bound near 2**63 would be a 2**63-byte map.
    if regime == "small" and draw(st.booleans()):
        slack = draw(st.integers(0, 5))
        bounds = [max(t, default=-1) + 1 + slack for t in tables]
        num_rows = torch.tensor(bounds, dtype=torch.int64) if draw(st.booleans()) else bounds
    return {"tables": tables, "values": values, "lengths": lengths, "num_rows": num_rows}


def check_result(
    inp: dict[str, Any], out: tuple[torch.Tensor, ...], inverse: bool, first: bool
) -> None:
    """Compare with the reference and check the documented properties directly."""
    tables: list[list[int]] = inp["tables"]
    values: torch.Tensor = inp["values"]
    lengths: torch.Tensor = inp["lengths"]
    assert len(out) == 2 + inverse + first
    unique_values, unique_lengths = out[0], out[1]
    assert unique_values.dtype == values.dtype
    assert unique_lengths.dtype == lengths.dtype
    assert unique_lengths.shape == (len(tables),)

    expected = jagged_unique_reference(values, lengths, return_inverse=True, return_first=True)
    assert torch.equal(unique_values, expected[0])
    assert torch.equal(unique_lengths, expected[1])

    # Independent of the reference: sorted distinct ids per table, from plain Python.
    assert unique_values.tolist() == [x for t in tables for x in sorted(set(t))]
    assert unique_lengths.tolist() == [len(set(t)) for t in tables]

    out_starts = [0]
    for count in unique_lengths.tolist():
        out_starts.append(out_starts[-1] + count)
    in_starts = [0]
    for table in tables:
        in_starts.append(in_starts[-1] + len(table))
    uniq = unique_values.tolist()
    flat = values.tolist()
    k = 2
    if inverse:
        inv = out[k]
        k += 1
        assert inv.dtype == torch.int64 and inv.shape == values.shape
        assert torch.equal(inv, expected[2])
        inv_list = inv.tolist()
        for t in range(len(tables)):
            for i in range(in_starts[t], in_starts[t + 1]):
                # Points into this table's part of the output, at the same id.
                assert out_starts[t] <= inv_list[i] < out_starts[t + 1]
                assert uniq[inv_list[i]] == flat[i]
    if first:
        fst = out[k]
        assert fst.dtype == torch.int64 and fst.shape == unique_values.shape
        assert torch.equal(fst, expected[3])
        fst_list = fst.tolist()
        for t in range(len(tables)):
            segment = flat[in_starts[t] : in_starts[t + 1]]
            for j in range(out_starts[t], out_starts[t + 1]):
                assert fst_list[j] == in_starts[t] + segment.index(uniq[j])


hyp = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@hyp
@given(
    inp=jagged_inputs(),
    method=st.sampled_from(METHODS),
    inverse=st.booleans(),
    first=st.booleans(),
    validate=st.booleans(),
)
def test_matches_reference(
    inp: dict[str, Any], method: str, inverse: bool, first: bool, validate: bool
) -> None:
    if method == "bitmap" and inp["num_rows"] is None and inp["values"].numel():
        top = int(inp["values"].max())
        if top >= 2**41:
            # A map over ids near 2**63 is refused with a clear error rather than attempted.
            with pytest.raises(KernelInputError, match="bitmap"):
                jagged_unique(inp["values"], inp["lengths"], method="bitmap")
            return
        # Forcing a map over ids this sparse is legal but costs time and memory per id value.
        assume(top < 2**24)
    out = jagged_unique(
        inp["values"],
        inp["lengths"],
        inp["num_rows"],
        return_inverse=inverse,
        return_first=first,
        method=method,  # type: ignore[arg-type]
        validate=validate,
    )
    check_result(inp, out, inverse, first)


@hyp
@given(inp=jagged_inputs(), inverse=st.booleans(), first=st.booleans())
def test_torch_kernels_on_cpu_match_reference(
    inp: dict[str, Any], inverse: bool, first: bool
) -> None:
    """The device kernels are plain torch; running them on CPU tensors checks their logic."""
    values, lengths, tables = inp["values"], inp["lengths"], inp["tables"]
    lengths64 = lengths.to(torch.int64)
    max_id = max((x for t in tables for x in t), default=-1)
    outs = []
    id_bits = max(max_id, 0).bit_length()
    if len(tables).bit_length() + id_bits <= 63:
        outs.append(
            gpu.sort_unique(
                values,
                lengths64,
                len(tables),
                id_bits=id_bits,
                return_inverse=inverse,
                return_first=first,
            )
        )
    outs.append(
        gpu.sort_unique(
            values, lengths64, len(tables), id_bits=None, return_inverse=inverse, return_first=first
        )
    )
    if max_id < 2**20:
        bounds = [max(t, default=-1) + 1 for t in tables]
        outs.append(
            gpu.bitmap_unique(values, lengths64, bounds, return_inverse=inverse, return_first=first)
        )
    for res in outs:
        out = [res.values, res.lengths.to(lengths.dtype)]
        if inverse:
            out.append(res.inverse)
        if first:
            out.append(res.first)
        check_result(inp, tuple(out), inverse, first)


@hyp
@given(inp=jagged_inputs())
def test_device_stats(inp: dict[str, Any]) -> None:
    stats = gpu.device_stats(inp["values"], inp["lengths"], table_max=True)
    assert stats.lengths == [len(t) for t in inp["tables"]]
    flat = [x for t in inp["tables"] for x in t]
    assert stats.min_id == (min(flat) if flat else None)
    assert stats.table_max == [max(t, default=-1) for t in inp["tables"]]


# --- explicit edge cases ------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "tables",
    [
        [],  # T = 0
        [[]],
        [[], [], []],
        [[7]],
        [[5, 5, 5, 5]],  # all equal
        [[3, 1, 2, 3, 1], [], [1, 1], [0]],
        [[9, 8, 7, 6], [6, 7, 8, 9]],
        [[MAX_ID, 0, MAX_ID], [MAX_ID - 1, MAX_ID]],
    ],
)
def test_edge_cases(tables: list[list[int]], method: str) -> None:
    values = torch.tensor([x for t in tables for x in t], dtype=torch.int64)
    lengths = torch.tensor([len(t) for t in tables], dtype=torch.int64)
    inp = {"tables": tables, "values": values, "lengths": lengths}
    if method == "bitmap" and any(x >= 2**41 for t in tables for x in t):
        with pytest.raises(KernelInputError):
            jagged_unique(values, lengths, method="bitmap")
        return
    out = jagged_unique(values, lengths, return_inverse=True, return_first=True, method=method)  # type: ignore[call-overload]
    check_result(inp, out, True, True)
    plain = jagged_unique(values, lengths, method=method)  # type: ignore[call-overload]
    assert len(plain) == 2


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("with_bound", [False, True])
def test_large_input_uses_worker_threads(threads: int, method: str, with_bound: bool) -> None:
    """Inputs big enough to be split across worker threads give the reference's answer."""
    gen = torch.Generator().manual_seed(threads * 7 + len(method))
    lengths_list = [0, 120_000, 90_000, 1, 0, 200_000, 37]
    n = sum(lengths_list)
    rows = 50_000
    # Squaring a uniform skews towards small ids, like hot rows in real traffic.
    values = (torch.rand(n, generator=gen) ** 2 * rows).to(torch.int64)
    lengths = torch.tensor(lengths_list)
    num_rows = [rows] * len(lengths_list) if with_bound else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = jagged_unique(
            values,
            lengths,
            num_rows,
            return_inverse=True,
            return_first=True,
            method=method,  # type: ignore[arg-type]
        )
    finally:
        torch.set_num_threads(old)
    expected = jagged_unique_reference(values, lengths, return_inverse=True, return_first=True)
    for got, want in zip(out, expected, strict=True):
        assert torch.equal(got, want)


def _unique_count_in_child(queue: Any) -> None:
    # numpy builds the input: torch's own OpenMP pool is not usable in a forked child either.
    values = torch.from_numpy(np.arange(600_000, dtype=np.int64) % 1000)
    uv, _ = jagged_unique(values, torch.tensor([300_000, 300_000]), [1000, 1000])
    queue.put(uv.numel())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_worker_threads_work_in_a_forked_child() -> None:
    """A child forked after the worker pool started must not wait on the parent's dead threads."""
    values = torch.arange(600_000) % 1000
    jagged_unique(values, torch.tensor([300_000, 300_000]), [1000, 1000])  # starts the pool
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_unique_count_in_child, args=(queue,))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail("jagged_unique hung in a forked child")
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 2000


def test_kept_bitmap_is_clean_across_calls_and_errors() -> None:
    """The CPU bitmap kernel reuses its map: stale marks must never leak into a later result."""
    free_cached_buffers()
    # Table 0's ids are marked, then table 1's out-of-range id fails the call half-way.
    with pytest.raises(KernelInputError, match="table 1"):
        jagged_unique(torch.tensor([1, 2, 3, 50]), torch.tensor([3, 1]), [10, 10])
    uv, ul = jagged_unique(torch.tensor([5, 7]), torch.tensor([1, 1]), [10, 10])
    assert uv.tolist() == [5, 7] and ul.tolist() == [1, 1]
    gen = torch.Generator().manual_seed(3)
    for rows in (1000, 10, 5000, 3, 5000):
        lengths = torch.tensor([40, 0, 25])
        values = torch.randint(0, rows, (65,), generator=gen)
        got = jagged_unique(values, lengths, [rows] * 3, method="bitmap")
        want = jagged_unique_reference(values, lengths)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    free_cached_buffers()


def test_split_tables_balances_and_covers() -> None:
    split = importlib.import_module("deck.kernels.cpu_pool").split_tables
    assert split([5, 5, 5, 5], 2) == [(0, 2), (2, 4)]
    assert split([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert split([3], 4) == [(0, 1)]
    assert split([], 2) == [(0, 0)] or split([], 2) == []
    for parts in (1, 2, 3, 8):
        ranges = split([1, 0, 7, 2, 2, 9, 0, 0, 4], parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == 9
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert len(ranges) <= parts


def test_auto_prefers_bitmap_only_when_dense() -> None:
    choose = importlib.import_module("deck.kernels.dispatch").choose_method
    assert choose("auto", 1_000_000, [1_000_000] * 8) == "bitmap"
    assert choose("auto", 1_000, [1_000_000_000] * 8) == "sort"
    assert choose("sort", 1_000_000, [10] * 8) == "sort"
    assert choose("bitmap", 1, [10**9]) == "bitmap"


# --- validation ---------------------------------------------------------------------------------


def test_error_type_is_a_deck_value_error() -> None:
    assert issubclass(KernelInputError, DeckError)
    assert issubclass(KernelInputError, ValueError)


L3 = torch.tensor([2, 1])


@pytest.mark.parametrize(
    ("values", "lengths", "kwargs", "match"),
    [
        (torch.tensor([1, -2, 3]), L3, {}, "negative id"),
        (torch.tensor([1, 2, 3]), torch.tensor([2, 2]), {}, "sum to 4"),
        (torch.tensor([1, 2, 3]), torch.tensor([3, 1, -1]), {}, r"lengths\[2\] is negative"),
        (torch.tensor([1.0, 2.0, 3.0]), L3, {}, "int64 or int32"),
        (torch.tensor([1, 2, 3], dtype=torch.int16), L3, {}, "int64 or int32"),
        (torch.tensor([[1, 2, 3]]), L3, {}, "1-D"),
        (torch.tensor([1, 2, 3]), torch.tensor([2.0, 1.0]), {}, "integer tensor"),
        (torch.tensor([1, 2, 3]), torch.tensor([[2, 1]]), {}, "1-D"),
        (torch.tensor([1, 2, 3]), [2, 1], {}, "torch.Tensor"),
        ([1, 2, 3], L3, {}, "torch.Tensor"),
        (torch.tensor([1, 2, 3]), L3, {"num_rows": [2, 4]}, "table 0 holds id 2"),
        (torch.tensor([1, 2, 3]), L3, {"num_rows": [4, 3]}, "table 1 holds id 3"),
        (torch.tensor([1, 2, 3]), L3, {"num_rows": [4]}, "1 entries but lengths has 2"),
        (torch.tensor([1, 2, 3]), L3, {"num_rows": [4, -1]}, "negative"),
        (torch.tensor([1, 2, 3]), L3, {"num_rows": [4, True]}, "ints"),
        (torch.tensor([1, 2, 3]), L3, {"num_rows": [4.0, 5.0]}, "ints"),
        (torch.tensor([1, 2, 3]), L3, {"num_rows": torch.tensor([4.0, 5.0])}, "integer"),
        (torch.tensor([1, 2, 3]), L3, {"method": "hash"}, "method"),
        (torch.tensor([5]), torch.tensor([], dtype=torch.int64), {}, "sum to 0"),
    ],
)
def test_validation_errors(values: Any, lengths: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(KernelInputError, match=match):
        jagged_unique(values, lengths, **kwargs)


@pytest.mark.parametrize("method", METHODS)
def test_validation_applies_to_every_method(method: str) -> None:
    with pytest.raises(KernelInputError, match="negative id"):
        jagged_unique(torch.tensor([0, -1]), torch.tensor([2]), method=method)  # type: ignore[call-overload]
    with pytest.raises(KernelInputError, match="num_rows"):
        jagged_unique(torch.tensor([0, 9]), torch.tensor([2]), [9], method=method)  # type: ignore[call-overload]


def test_lengths_are_checked_even_without_validate() -> None:
    with pytest.raises(KernelInputError, match="sum to"):
        jagged_unique(torch.tensor([1, 2, 3]), torch.tensor([1, 1]), validate=False)


def test_int32_and_small_length_dtypes() -> None:
    values = torch.tensor([4, 4, 1, 2**31 - 1, 0], dtype=torch.int32)
    lengths = torch.tensor([3, 2], dtype=torch.int16)
    for method in METHODS:
        uv, ul = jagged_unique(values, lengths, method=method)  # type: ignore[call-overload]
        assert uv.dtype == torch.int32 and ul.dtype == torch.int16
        assert uv.tolist() == [1, 4, 0, 2**31 - 1] and ul.tolist() == [2, 2]


def test_non_contiguous_values() -> None:
    base = torch.tensor([3, 0, 3, 0, 1, 0, 1, 0, 2, 0])
    values = base[::2]  # [3, 3, 1, 1, 2]
    uv, ul = jagged_unique(values, torch.tensor([2, 3]))
    assert uv.tolist() == [3, 1, 2] and ul.tolist() == [1, 2]


def test_concat_jagged_lays_out_tables_back_to_back() -> None:
    per_table = [
        [torch.tensor([3, 1]), torch.tensor([], dtype=torch.int64), torch.tensor([1])],
        [],
        [torch.tensor([7])],
    ]
    values, lengths = concat_jagged(per_table)
    assert values.tolist() == [3, 1, 1, 7]
    assert lengths.tolist() == [3, 0, 1] and lengths.dtype == torch.int64
    uv, ul = jagged_unique(values, lengths)
    assert uv.tolist() == [1, 3, 7] and ul.tolist() == [2, 0, 1]
    empty_values, empty_lengths = concat_jagged([])
    assert empty_values.numel() == 0 and empty_lengths.shape == (0,)
    with pytest.raises(KernelInputError, match="one dtype"):
        concat_jagged([[torch.tensor([1])], [torch.tensor([1], dtype=torch.int32)]])


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("with_bound", [False, True])
def test_cuda_matches_cpu(method: str, with_bound: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 5000, 1, 70_000, 0, 3])
    n = int(lengths.sum())
    rows = 20_000
    values = (torch.rand(n, generator=gen) ** 3 * rows).to(torch.int64)
    num_rows = [rows] * lengths.numel() if with_bound else None
    want = jagged_unique_reference(values, lengths, return_inverse=True, return_first=True)
    got = jagged_unique(
        values.cuda(),
        lengths.cuda(),
        num_rows,
        return_inverse=True,
        return_first=True,
        method=method,  # type: ignore[arg-type]
    )
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cuda"
        assert torch.equal(g.cpu(), w)
    # Ids too large for a composite key take the lexsort path on the device too.
    big = torch.tensor([MAX_ID, 1, MAX_ID, 0], device="cuda")
    uv, ul = jagged_unique(big, torch.tensor([3, 1], device="cuda"), method="sort")
    assert uv.tolist() == [1, MAX_ID, 0] and ul.tolist() == [2, 1]
    with pytest.raises(KernelInputError, match="negative id"):
        jagged_unique(torch.tensor([1, -1], device="cuda"), torch.tensor([2], device="cuda"))


@hyp
@given(
    tables=st.lists(st.lists(st.integers(0, 200), max_size=40), max_size=6),
    cuts_seed=st.integers(0, 2**32 - 1),
    slack=st.integers(0, 70),
    dtype=st.sampled_from([torch.int64, torch.int32]),
    strided=st.booleans(),
)
def test_unique_per_table_matches_jagged_unique(
    tables: list[list[int]], cuts_seed: int, slack: int, dtype: torch.dtype, strided: bool
) -> None:
    """Per-table lists of per-batch tensors (empty batches, strided views, int32) give exactly
    ``jagged_unique`` of their concatenation, with the native kernel and without it."""
    rng = np.random.default_rng(cuts_seed)
    per_table: list[list[torch.Tensor]] = []
    for ids in tables:
        cuts = np.sort(rng.integers(0, len(ids) + 1, size=rng.integers(0, 4)))
        parts = np.split(np.asarray(ids, dtype=np.int64), cuts)
        batches = []
        for part in parts:
            t = torch.tensor(part.tolist(), dtype=dtype)
            if strided:  # every other element of a twice-as-long tensor: not contiguous
                t = torch.stack([t, torch.full_like(t, -1)], dim=1).reshape(-1)[::2]
            batches.append(t)
        per_table.append(batches)
    num_rows = [max(ids, default=-1) + 1 + slack for ids in tables]
    got = unique_per_table(per_table, num_rows)
    values, lengths = concat_jagged(per_table)
    want = jagged_unique(values, lengths, num_rows)
    assert torch.equal(got[0], want[0]) and got[0].dtype == want[0].dtype
    assert got[0].dtype == dtype or not tables  # no tensor at all: int64, as concat_jagged
    assert got[1].tolist() == want[1].tolist() == [len(set(ids)) for ids in tables]
    # Without a bound it is the concatenate-then-unique path.
    assert torch.equal(unique_per_table(per_table)[0], want[0])


def test_unique_per_table_names_the_table_of_a_bad_id() -> None:
    per_table = [[torch.tensor([0, 3]), torch.tensor([1])], [torch.tensor([2]), torch.tensor([9])]]
    with pytest.raises(KernelInputError, match=r"table 1 holds id 9 but num_rows\[1\] is 5"):
        unique_per_table(per_table, [4, 5])
    with pytest.raises(KernelInputError, match="negative id"):
        unique_per_table([[torch.tensor([0, -2])]], [4])
    with pytest.raises(KernelInputError, match="1-D tensors of one dtype"):
        unique_per_table([[torch.tensor([0]), torch.tensor([1], dtype=torch.int32)]], [4])
    # The map is clean after an error: the next call is exact.
    out = unique_per_table([[torch.tensor([3, 1, 3])], [torch.tensor([0])]], [4, 5])
    assert out[0].tolist() == [1, 3, 0] and out[1].tolist() == [2, 1]


def test_private_mark_scan_checks_its_own_arguments(cpu_bitmap_kernel: str) -> None:
    """The C entry point refuses what would overflow its word count or reach past a buffer,
    however it is called (issue 20): a bound near 2**63 (``(bound + 63) >> 6`` overflowed),
    lengths larger than ``out``, a bits buffer smaller than the bounds; and still works."""
    kernel = importlib.import_module("deck.kernels._jagged")
    ids = np.array([5, 1, 5], dtype=np.int64)

    def call(bound: int, length: int = 3, words: int = 2, room: int = 3) -> tuple[int, int]:
        def i64(*v: int) -> np.ndarray:
            return np.array(v, dtype=np.int64)

        bits = np.zeros(words, dtype=np.uint64)
        out, counts = np.zeros(room, dtype=np.int64), np.zeros(1, dtype=np.int64)
        got = kernel.mark_scan(
            i64(ids.ctypes.data), i64(length), i64(0, 1), 8, i64(bound), bits, out, counts
        )
        assert not bits.any()  # the map is clean whatever happened
        return tuple(got)

    assert call(100) == (2, -1)
    for bound in (2**63 - 1, 2**63 - 63, 2**62, 129):
        with pytest.raises(ValueError, match="bits buffer too small"):
            call(bound)
    for length, room in ((2**62, 3), (2**63 - 1, 3), (3, 2)):
        with pytest.raises(ValueError, match="out buffer too small"):
            call(100, length, room=room)
    with pytest.raises(ValueError, match="bad bound"):
        call(-1)
