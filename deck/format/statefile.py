"""The layout of a checkpoint's extra state file (docs/format.md, "Dense and extra state"): the
top-level mappings its readers index, and the key of a table shard's scalar states.

The scalar key is ``table|row_offset|col_offset``; table names may themselves hold ``|``, so it
is parsed from the right. The writer (the trainer's checkpointer), the readers (restore, export)
and the test helpers all go through these functions.
"""

from __future__ import annotations

import re

from deck.errors import CorruptCheckpointError

# Keys of an extra state file that hold a mapping whenever they are present; readers index them
# by key.
EXTRA_MAPPINGS = (
    "optimizers",
    "wrappers",
    "fused_hyperparameters",
    "scalars",
    "rank_local",
    "rng",
    "modules",
)

_SCALAR_KEY = re.compile(r"^(.+)\|(\d+)\|(\d+)$")


def scalar_key(table: str, row_offset: int, col_offset: int) -> str:
    """The key, in an extra file's ``scalars``, of the scalar states of the shard of ``table``
    that starts at row ``row_offset``, column ``col_offset``; :func:`parse_scalar_key` gives the
    three back."""
    return f"{table}|{row_offset}|{col_offset}"


def is_scalar_key(key: object) -> bool:
    """Whether ``key`` is a string of the form :func:`scalar_key` writes."""
    return isinstance(key, str) and _SCALAR_KEY.match(key) is not None


def parse_scalar_key(key: str) -> tuple[str, int, int]:
    """``(table, row_offset, col_offset)`` of a :func:`scalar_key`; anything else raises
    :class:`CorruptCheckpointError` naming the key."""
    m = _SCALAR_KEY.match(key) if isinstance(key, str) else None
    if m is None:
        raise CorruptCheckpointError(
            f"scalar state key {key!r} is not table|row_offset|col_offset; the extra state file "
            "is damaged or was not written by deck"
        )
    return m.group(1), int(m.group(2)), int(m.group(3))
