"""Sizes as people read them: one format for every log line and every command's output.

A leaf (docs/architecture.md): the trainer's, merger's and follower's log lines and the ``deck``
command all import it, so an INFO line and ``deck ls`` say the same size the same way.
"""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit under 1024 of it, one decimal (``512 B``,
    ``41.2 KiB``, ``5.2 MiB``, ``1.0 GiB``, up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
