import itertools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deck.errors import ConfigError
from deck.trainer.tracker import TrackerStore


def test_two_consumers_each_see_rows_since_their_own_read() -> None:
    store = TrackerStore(100, ("checkpoint", "publish"))
    store.record(torch.tensor([1, 5, 5, 7]))
    store.compact()
    tok_p = store.begin_read("publish")
    assert store.touched(tok_p, 0, 100).tolist() == [1, 5, 7]
    store.commit(tok_p)
    store.record(torch.tensor([9, 1]))
    tok_c = store.begin_read("checkpoint")
    assert store.touched(tok_c, 0, 100).tolist() == [1, 5, 7, 9]
    store.commit(tok_c)
    tok_p = store.begin_read("publish")
    assert store.touched(tok_p, 0, 100).tolist() == [1, 9]
    # Slices are relative to their start (one slice per table shard).
    assert store.touched(tok_p, 5, 10).tolist() == [4]
    # Views of the claim, not relative (a snapshot reads them in place).
    spans = store.claimed_in(tok_p, [(0, 5), (5, 10), (10, 100), (0, 100)])
    assert [t.tolist() for t in spans] == [[1], [9], [], [1, 9]]
    assert all(
        t.untyped_storage().data_ptr() == tok_p.rows.untyped_storage().data_ptr() for t in spans
    )
    assert store.claimed_in(tok_p, []) == []


def test_aborted_read_loses_nothing() -> None:
    store = TrackerStore(10, ("checkpoint", "publish"))
    store.record(torch.tensor([2]))
    tok = store.begin_read("checkpoint")
    assert store.touched(tok, 0, 10).tolist() == [2]
    # Rows touched while a read is open belong to the next read.
    store.record(torch.tensor([3]))
    store.abort(tok)  # the checkpoint failed: row 2 is pending again
    tok2 = store.begin_read("checkpoint")
    assert store.touched(tok2, 0, 10).tolist() == [2, 3]
    store.commit(tok2)
    assert store.touched(store.begin_read("checkpoint"), 0, 10).tolist() == []


def test_state_is_one_bit_per_row_per_consumer() -> None:
    # Eight consumers share one byte per row, plus one summary byte per block of 64 rows.
    assert TrackerStore(1000, tuple("abcdefgh")).nbytes() == 1000 + 16
    with pytest.raises(ConfigError):
        TrackerStore(10, tuple("abcdefghi"))


def test_many_reads_match_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    store = TrackerStore(500, ("a", "b"))
    truth: dict[str, set[int]] = {"a": set(), "b": set()}
    for step in range(60):
        ids = torch.randint(0, 500, (40,), generator=g)
        store.record(ids)
        for c in truth:
            truth[c] |= set(ids.tolist())
        if step % 3 == 0:
            store.compact()
        for c, every in (("a", 4), ("b", 7)):
            if step % every == 0:
                tok = store.begin_read(c)
                got = set(store.touched(tok, 0, 250).tolist()) | {
                    250 + x for x in store.touched(tok, 250, 500).tolist()
                }
                assert got == truth[c]
                if step % 5 == 0:
                    store.abort(tok)  # failed: stays pending
                else:
                    store.commit(tok)
                    truth[c] = set()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    cap=st.sampled_from([None, 0, 3]),  # journal: default, always dropped, dropped now and then
    n=st.integers(1, 64 * 12 + 5),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 10**6), max_size=6),  # rows touched (mod n)
            st.sampled_from(["a", "b", None]),  # who reads after them
            st.booleans(),  # whether that read fails
        ),
        max_size=25,
    ),
)
def test_sparse_reads_through_the_block_summary_match_brute_force(
    cap: int | None, n: int, steps: list[tuple[list[int], str | None, bool]]
) -> None:
    _sparse_reads(cap, n, steps, starts=None)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    cap=st.sampled_from([None, 0, 3]),
    n=st.integers(2, 64 * 12 + 5),
    cuts=st.lists(st.integers(0, 10**6), max_size=5),  # where spans start (mod n)
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 10**6), max_size=6),
            st.sampled_from(["a", "b", None]),
            st.booleans(),
        ),
        max_size=25,
    ),
)
def test_span_counts_and_background_clears_match_brute_force(
    cap: int | None, n: int, cuts: list[int], steps: list[tuple[list[int], str | None, bool]]
) -> None:
    # A claim answers how many rows each span holds from the journal's counts (no sort in the
    # stall) and sorts only when asked; a committed claim's bits are cleared from another
    # thread (as a checkpoint's background does), racing nothing here but checked the same.
    _sparse_reads(cap, n, steps, starts=sorted({c % n for c in cuts}))


def _sparse_reads(
    cap: int | None,
    n: int,
    steps: list[tuple[list[int], str | None, bool]],
    starts: list[int] | None,
) -> None:
    # Few rows over many 64-row blocks: a claim reads only the summary's marked blocks, so a
    # block left unmarked by record, compact or abort would lose its rows here. A claim from a
    # journal reads neither map nor summary: a row missing from it (or journaled twice, or left
    # marked) would show here too, and so would a summary left stale by a journal claim once a
    # consumer's journal is dropped (cap) and its claim reads the map again.
    store = TrackerStore(n, ("a", "b"), journal_cap=cap, starts=starts)
    edges = [0, *(starts or []), n]
    # The tracker's own spans, runs of them, empty ones, and some across their edges
    spans = [*itertools.pairwise(edges), (0, n), (edges[1], n), (n, n), (1, n - 1), (0, n + 7)]
    truth: dict[str, set[int]] = {"a": set(), "b": set()}
    for ids, reader, fails in steps:
        rows = [i % n for i in ids]
        store.record(torch.tensor(rows, dtype=torch.int64))
        for c in truth:
            truth[c] |= set(rows)
        if reader is None:
            continue
        tok = store.begin_read(reader)
        if starts is not None:
            assert tok.counts_in(spans) == [
                sum(a <= r < b for r in truth[reader]) for a, b in spans
            ]
        assert store.touched(tok, 0, n).tolist() == sorted(truth[reader])
        if fails:
            store.abort(tok)
        else:
            store.commit(tok)
            truth[reader] = set()
            if starts is not None:
                clear = threading.Thread(target=store.clear_claimed)
                clear.start()
                clear.join()
    for c in truth:
        assert store.touched(store.begin_read(c), 0, n).tolist() == sorted(truth[c])


def test_claims_from_the_journal_and_from_the_map_agree() -> None:
    # The same workload on a journaling store, one whose journals are always dropped (reads the
    # map), and one without the native kernel (torch marking, no journal).
    from deck.kernels import native

    g = torch.Generator().manual_seed(3)
    saved = native._native
    native._native = None
    try:
        plain = TrackerStore(5000, ("a", "b"))
    finally:
        native._native = saved
    stores = [TrackerStore(5000, ("a", "b")), TrackerStore(5000, ("a", "b"), journal_cap=0), plain]
    for step in range(40):
        ids = torch.randint(0, 5000, (int(torch.randint(0, 300, (1,), generator=g)),), generator=g)
        for s in stores:
            s.record(ids)
        reader = "ab"[step % 2]
        got = []
        for s in stores:
            tok = s.begin_read(reader)
            got.append(s.touched(tok, 0, 5000))
            (s.abort if step % 7 == 0 else s.commit)(tok)
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    journaling = stores[0]
    assert journaling.nbytes() > 5000 + 79  # it holds the pending rows of its journals


def test_out_of_range_rows_change_nothing() -> None:
    store = TrackerStore(100, ("a",))
    store.record(torch.tensor([3]))
    store.compact()
    store.record(torch.tensor([5, 100]))
    with pytest.raises(IndexError):
        store.compact()
    assert store.touched(store.begin_read("a"), 0, 100).tolist() == [3]


def test_a_journal_grows_in_place_and_claims_sorted_int32_rows() -> None:
    # 1M rows: the journal is int32 and starts small; 100k rows in 50 compactions make it grow.
    g = torch.Generator().manual_seed(5)
    store = TrackerStore(1 << 20, ("a",))
    truth: set[int] = set()
    for _ in range(50):
        ids = torch.randint(0, 1 << 20, (2000,), generator=g)
        store.record(ids)
        store.compact()
        truth |= set(ids.tolist())
    assert store.nbytes() == (1 << 20) + (1 << 14) + 4 * len(truth)
    tok = store.begin_read("a")
    assert tok.rows.dtype == torch.int32
    assert tok.rows.tolist() == sorted(truth)
    lo = store.touched(tok, 1000, 1 << 20)
    assert lo.dtype == torch.int64 and lo.tolist() == [r - 1000 for r in sorted(truth) if r >= 1000]
    store.abort(tok)  # back in the journal: claimed again, the same rows
    assert store.begin_read("a").rows.tolist() == sorted(truth)


def test_claimed_rows_touched_again_before_the_next_compaction_stay_pending() -> None:
    # A journal's claim leaves its rows' bits to the next compaction: rows touched again after
    # the claim (recorded, not yet compacted) must be pending for the next read once, whether
    # the read commits or aborts, before or after that compaction.
    for abort_after_compaction in (None, False, True):
        store = TrackerStore(1000, ("a", "b"))
        store.record(torch.tensor([4, 8, 500]))
        tok = store.begin_read("a")
        assert tok.rows.tolist() == [4, 8, 500]
        store.record(torch.tensor([8, 9]))  # a training step after the claim
        if abort_after_compaction is None:
            store.commit(tok)
            expect = [8, 9]
        elif abort_after_compaction:
            store.compact()
            store.abort(tok)
            expect = [4, 8, 9, 500]
        else:
            store.abort(tok)
            expect = [4, 8, 9, 500]
        tok2 = store.begin_read("a")
        assert tok2.rows.tolist() == expect
        store.commit(tok2)
        assert store.begin_read("a").rows.tolist() == []
        # The other consumer's rows were never claimed: all of them, once.
        assert store.begin_read("b").rows.tolist() == [4, 8, 9, 500]


def test_a_claim_from_the_journal_is_sorted_on_first_use_not_in_place() -> None:
    # The stall takes the journal as it is; ReadToken.rows sorts a copy once (any thread), so
    # a clear or an abort reading the claim meanwhile sees every row exactly once.
    store = TrackerStore(1000, ("a",), starts=[0, 100, 600])
    store.record(torch.tensor([700, 3, 650, 150, 3, 999]))
    tok = store.begin_read("a")
    assert tok.claimed.tolist() == [700, 3, 650, 150, 999]  # as journaled: not sorted
    assert tok.counts_in([(0, 100), (100, 600), (600, 1000), (100, 1000)]) == [1, 1, 3, 4]
    assert tok.claimed.tolist() == [700, 3, 650, 150, 999]  # counting sorted nothing
    assert tok.rows.tolist() == [3, 150, 650, 700, 999]
    assert tok.rows is tok.rows and tok.claimed.tolist() == [700, 3, 650, 150, 999]
    assert tok.rows_as_ready().tolist() == [3, 150, 650, 700, 999]
    assert tok.counts_in([(50, 700)]) == [2]  # not a run of spans: from the sorted rows
    store.abort(tok)
    assert store.begin_read("a").rows.tolist() == [3, 150, 650, 700, 999]
