"""One size format for log lines and the deck command (deck.units.human_bytes)."""

from __future__ import annotations

import pytest

from deck.cli.common import human
from deck.units import human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (42_190, "41.2 KiB"),
        (5.2 * 2**20, "5.2 MiB"),
        (2**30, "1.0 GiB"),
        (3 * 2**40, "3.0 TiB"),
        (2**50, "1024.0 TiB"),
    ],
)
def test_sizes_read_the_same_everywhere(n: float, text: str) -> None:
    assert human_bytes(n) == text
    assert human(n) == text  # deck ls, show, verify, export, follow
