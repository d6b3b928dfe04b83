"""``deck.cli.common.json_list`` writes exactly what ``json.dumps(items, indent=1)`` writes
(``deck ls --json``'s output), for rows of ``deck ls`` and for anything else JSON can hold."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from deck.cli.common import _flat, json_list
from deck.ops.listing import Row

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)
keys = st.one_of(
    st.text(max_size=10),
    st.sampled_from(["covers", "a_b", "k9", 'co"vers', "x y"]),
)
flat = st.dictionaries(
    keys,
    st.one_of(scalars, st.lists(st.integers(-(2**70), 2**70), max_size=4)),
    max_size=20,
)

rows = st.builds(
    Row,
    kind=st.sampled_from(["full", "delta", "merged", "?"]),
    step=st.integers(0, 2**62),
    layer=st.integers(0, 64),
    first_step=st.integers(0, 2**62),
    bytes=st.integers(0, 2**62),
    created_unix=st.one_of(st.none(), st.floats()),
    state=st.sampled_from(["committed", "pending", "damaged", "quarantined", "broken"]),
    ranks=st.integers(0, 1024),
    world_size=st.integers(0, 1024),
    merged=st.booleans(),
    parent=st.one_of(st.none(), st.integers(0, 2**62)),
    base=st.one_of(st.none(), st.integers(0, 2**62)),
    epoch=st.one_of(st.none(), st.integers(0, 2**62)),
    id=st.text(),
    folder=st.text(),
    problem=st.one_of(st.none(), st.text()),
)


def _same(items: list[Any]) -> None:
    assert json_list(items) == json.dumps(items, indent=1)


@settings(max_examples=300, deadline=None)
@given(st.lists(rows, max_size=5), st.floats(allow_nan=True))
def test_ls_rows(got: list[Row], now: float) -> None:
    _same([r.to_dict(now) for r in got])


@settings(max_examples=300, deadline=None)
@given(st.lists(flat, max_size=5))
def test_flat_dicts(items: list[dict[str, Any]]) -> None:
    _same(items)


@settings(max_examples=300, deadline=None)
@given(st.lists(values, max_size=5))
def test_anything(items: list[Any]) -> None:
    _same(items)


def test_tricky_strings_and_numbers() -> None:
    flat = [
        {
            "a": 'x"covers": [1,\n  2]',
            "covers": [1, 2],
            "b": "\\",
            "c": math.nan,
            "d": -math.inf,
            "e": True,
            "f": 10**30,
            "g": "\u2028\ud800é",
            "h": '"},\n  {"',
            "i": [-(2**70)],
            "j": [],
            "k": '\n  "x": [1]',
        },
        {"covers": [3, 4, 5], "x": None},
        {"a b": 1},
    ]
    assert all(_flat(x) for x in flat)  # (written at C speed)
    _same(flat)
    _same(
        [
            *flat,
            {"covers": [True, 1]},
            {"covers": []},
            {},
            {1: [1, 2], None: 3},
            [],
            "s",
        ]
    )
