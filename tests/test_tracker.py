import torch

from deck.tracker import TrackerStore


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


def test_uncommitted_read_loses_nothing() -> None:
    store = TrackerStore(10, ("checkpoint",))
    store.record(torch.tensor([2]))
    tok = store.begin_read("checkpoint")
    assert store.touched(tok, 0, 10).tolist() == [2]
    # Not committed (the checkpoint failed): the next read still has row 2, plus newer rows.
    store.record(torch.tensor([3]))
    tok2 = store.begin_read("checkpoint")
    assert store.touched(tok2, 0, 10).tolist() == [2, 3]
    store.commit(tok2)
    assert store.touched(store.begin_read("checkpoint"), 0, 10).tolist() == []


def test_state_is_four_bytes_per_row_for_any_number_of_consumers() -> None:
    assert TrackerStore(1000, ("a", "b", "c")).nbytes() == 4000
