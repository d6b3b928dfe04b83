"""Which keys are commit and quarantine records: the one-regex `record_key_kind` every reader
of the whole history calls per record decides as the rules it replaced (step_dir,
merged_dir and a quarantine record's name, each a whole key), on drawn keys near every form."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deck.format.commit_log import record_key_kind
from deck.format.manifest import (
    MANIFEST,
    MERGED_ROOT,
    QUARANTINE_ROOT,
    merged_dir,
    parse_merged_dir,
    parse_step_dir,
    step_dir,
)


def _reference(key: str) -> tuple[int | None, str | None] | None:
    head, _, tail = key.partition("/")
    name, _, rest = tail.partition("/")
    step = parse_step_dir(head)
    if step is not None and tail == MANIFEST:
        return step, None
    if head == MERGED_ROOT and parse_merged_dir(name) is not None and rest == MANIFEST:
        return None, name
    if head == QUARANTINE_ROOT and "/" not in tail and tail.endswith(".json") and tail != ".json":
        return None, None
    return None


_ids = st.text("0123456789abcdefAB", min_size=15, max_size=17)
_steps = st.integers(0, 10**12 - 1)


@st.composite
def _keys(draw: st.DrawFn) -> str:
    form = draw(st.sampled_from(["step", "full", "layer", "quarantine", "text"]))
    if form == "step":
        key = f"{step_dir(draw(_steps))}/{MANIFEST}"
    elif form == "full":
        key = f"{merged_dir(draw(_ids), draw(_steps))}/{MANIFEST}"
    elif form == "layer":
        first, step = sorted((draw(_steps), draw(_steps)))
        layer = draw(st.integers(0, 120))
        key = f"{merged_dir(draw(_ids), step, layer=layer, first_step=first)}/{MANIFEST}"
    elif form == "quarantine":
        key = f"{QUARANTINE_ROOT}/{draw(st.text(min_size=0, max_size=20))}.json"
    else:
        return draw(st.text("stepmrgdquain-/.json0123456789FL\n", max_size=60))
    # Mutations where a rule could be looser or stricter than it was
    cut = draw(st.integers(0, len(key)))
    return draw(
        st.sampled_from(
            [
                key,
                key[:cut],
                key[:cut] + draw(st.sampled_from(["/", "x", "0", "\n", "٣", ".json"])) + key[cut:],
                key + draw(st.sampled_from(["", "\n", "/", "x"])),
                draw(st.sampled_from(["", "/", "a/"])) + key,
            ]
        )
    )


@settings(max_examples=1000, deadline=None)
@given(_keys())
def test_record_key_kind_decides_as_the_rules_it_replaced(key: str) -> None:
    assert record_key_kind(key) == _reference(key)


def test_each_form_is_told_apart() -> None:
    ident = "0123456789abcdef"
    assert record_key_kind(f"{step_dir(40)}/{MANIFEST}") == (40, None)
    full = merged_dir(ident, 60).split("/", 1)[1]
    assert record_key_kind(f"{MERGED_ROOT}/{full}/{MANIFEST}") == (None, full)
    assert record_key_kind(f"{QUARANTINE_ROOT}/{ident}.json") == (None, None)
    assert record_key_kind(f"{step_dir(40)}/{ident}/rank-00000.json") is None
    assert record_key_kind(f"{QUARANTINE_ROOT}/.json") is None
