"""The native row index of a chunk (``bloom_fill``) against deck.format.rowindex's numpy one: the
same bytes on disk, whichever built them (in the fallback run, ``bloom_fill`` answers None and
numpy builds both)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deck.kernels import native
from deck.kernels.bloom import bloom_fill

from deck.format.rowindex import build_index, may_contain


@pytest.mark.parametrize("n", [1, 2, 7, 100, 15_649])
def test_native_index_is_the_numpy_index_bit_for_bit(n: int) -> None:
    rng = np.random.default_rng(n)
    for high in (2**20, 2**61):  # dense ids and ids spread over the whole range
        ids = torch.from_numpy(np.sort(rng.choice(high, n, replace=False)).astype(np.int64))
        numpy_index = build_index(ids)
        native_index = build_index(ids, fill=bloom_fill)
        assert native_index == numpy_index
        assert all(may_contain(native_index, int(i)) for i in ids[:: max(1, n // 50)])
    run = torch.arange(5, 5 + n)  # a full's chunk: its range, no filter
    assert build_index(run, fill=bloom_fill) == build_index(run)
    assert build_index(run, fill=bloom_fill).bloom is None


def test_without_the_native_kernel_numpy_builds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.tensor([3, 40, 41, 900])
    monkeypatch.setattr(native, "_native", None)
    assert bloom_fill(ids.numpy(), 64, 3) is None
    assert build_index(ids, fill=bloom_fill) == build_index(ids)


@pytest.mark.native_only
def test_bad_arguments_raise_before_any_write() -> None:
    kernel = native.native_module()
    ids = np.arange(4, dtype=np.int64)
    for args in [
        (np.empty(0, np.int64), bytearray(8), 64, 3),  # no ids
        (ids, bytearray(4), 64, 3),  # output shorter than bits / 8
        (ids, bytearray(8), 60, 3),  # bits not a multiple of 8
        (ids, bytearray(8), 64, 0),  # no hash
    ]:
        with pytest.raises(ValueError, match="bloom_fill"):
            kernel.bloom_fill(*args)


def test_ids_at_an_unaligned_address_give_the_same_index() -> None:
    raw = bytearray(8 * 64 + 1)
    ids = np.frombuffer(memoryview(raw)[1:], dtype=np.int64)  # int64 words one byte off
    assert not ids.flags.aligned
    ids[:] = np.arange(0, 64 * 37, 37)
    assert build_index(
        torch.from_numpy(ids.copy()), fill=lambda a, b, k: bloom_fill(ids, b, k)
    ) == (build_index(torch.from_numpy(ids.copy())))


def test_the_native_base64_of_every_filter_length_is_base64s() -> None:
    """The kernel writes the filter's base64 itself: every length modulo 3 (two, one or no
    '=' of padding) gives what base64.b64encode gives."""
    rng = np.random.default_rng(0)
    padding = set()
    for n in range(2, 120):  # (one id is its own range: no filter)
        ids = torch.from_numpy(np.sort(rng.choice(2**40, n, replace=False)).astype(np.int64))
        native_index = build_index(ids, fill=bloom_fill)
        assert native_index == build_index(ids)
        padding.add(native_index.bloom.count("="))  # type: ignore[union-attr]
    assert padding == {0, 1, 2}
