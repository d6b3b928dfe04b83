"""The stream start record (``step-N/<id>/stream-<r>.json``, deck.format.stream.StepStart): what
the sink writes decodes back, and a record that is not exactly the one of the step and rank read
is refused (the reader then reads the partition from its oldest message)."""

from __future__ import annotations

import json

import pytest

from deck.format.stream import (
    StepStart,
    decode_start,
    file_attempt,
    is_stream_file,
    part_manifest_of,
    start_key,
)

ID = "0123456789abcdef"


def test_a_record_decodes_back_and_is_no_stream_file() -> None:
    rec = StepStart(40, ID, 3, 1234)
    assert rec.key() == start_key(40, ID, 3) == f"step-000000000040/{ID}/stream-00003.json"
    assert not is_stream_file(rec.key())  # it goes to the state URI, beside the rank manifest
    assert decode_start(rec.encode(), 40, ID, 3) == rec


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"step": 39}, "not of step 40"),
        ({"id": "fedcba9876543210"}, "not of step 40"),
        ({"rank": 2}, "not of step 40"),
        ({"offset": -1}, "not an offset"),
        ({"offset": True}, "not an offset"),
        ({"offset": 1.5}, "not an offset"),
        ({"offset": "12"}, "not an offset"),
        ({"format_version": 2}, "not a version 1"),
    ],
)
def test_a_record_of_another_step_or_with_a_bad_offset_is_refused(
    change: dict[str, object], why: str
) -> None:
    raw = json.dumps({**json.loads(StepStart(40, ID, 3, 1234).encode()), **change}).encode()
    with pytest.raises(ValueError, match=why):
        decode_start(raw, 40, ID, 3)


@pytest.mark.parametrize("raw", [b"", b"\x00{", b"[]", b"12", b'{"offset": 1}'])
def test_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_start(raw, 40, ID, 3)


def test_the_sink_tells_rank_manifests_and_file_attempts_from_other_keys() -> None:
    assert part_manifest_of(f"step-000000000040/{ID}/rank-00003.json") == (40, ID, 3)
    assert part_manifest_of(f"step-000000000040/{ID}/rank-00003.failed") is None
    assert part_manifest_of(f"step-000000000040/{ID}/stream-00003.json") is None
    assert part_manifest_of("step-000000000040/manifest.json") is None
    key = f"step-000000000040/{ID}/rank-00003/t0/000000.chunk"
    assert file_attempt(key) == (40, ID)
    assert file_attempt("step-000000000040/manifest.json") is None
