"""The tracker's claim kernel: native and torch fallback give the same rows and the same map."""

import pytest
import torch
from deck.kernels import native
from deck.kernels.claim import claim_rows


def _map(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Every combination of 3 consumers' bits, sparse like a map between checkpoints, plus the
    # edges: first and last rows, a length that is not a multiple of 8.
    m = torch.zeros(n, dtype=torch.uint8)
    hit = torch.randint(0, n, (n // 20 + 1,), generator=g)
    m[hit] = torch.randint(1, 8, (hit.numel(),), generator=g, dtype=torch.uint8)
    m[0], m[-1] = 7, 5
    return m


@pytest.mark.skipif(not native.native_available(), reason="the C kernel was not built")
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


def test_claim_rejects_a_byte_that_is_not_one_bit() -> None:
    if not native.native_available():
        pytest.skip("the C kernel was not built")
    with pytest.raises(ValueError, match="bit must be"):
        claim_rows(torch.zeros(16, dtype=torch.uint8), 3)


@pytest.mark.skipif(not native.native_available(), reason="the C kernel was not built")
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
