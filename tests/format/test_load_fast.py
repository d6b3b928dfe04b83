"""``load_model``'s fast path (a record exactly as ``dump_model`` wrote it, decoded once) gives
exactly what the slow path (``json.loads`` for the embedded checksum and the nesting bound,
then pydantic) gives: the same record for every record a writer commits, and for any record
edited, damaged or forged (its checksum made right again, or not) the same record or the same
error, naming the file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from deck.errors import CorruptCheckpointError
from deck.format import manifest as manifest_module
from deck.format.commit_log import Hint, LogEntry, Segment
from deck.format.manifest import (
    FORMAT_VERSION,
    CheckpointManifest,
    QuarantineRecord,
    dump_model,
    load_model,
    with_checksum,
)
from deck.testing.synth_lineage import LineageSim

WHERE = "file:///uri/step-000000000007/manifest.json"


def _records() -> list[tuple[type[BaseModel], bytes]]:
    """Every record a job of trainer and merger commits (a rollback, quarantine, 1 and 3
    ranks), and the other records load_model reads: a log entry, a catalog segment."""
    out: list[tuple[type[BaseModel], bytes]] = []
    for world_size in (1, 3):
        sim = LineageSim(world_size=world_size, seed=world_size)
        last = sim.save("full")
        for i in range(60):
            if i == 25:
                sim.rollback(sim.step - 6)
            sim.train()
            last = sim.save("full" if i % 17 == 16 else "delta")
            sim.merge_blocks(last, stride=2, full_every=8, lag=1)
        sim.quarantine(next(iter(sim.merged.values())).id)
        out += [
            (CheckpointManifest, dump_model(m))
            for m in [*sim.trainer.values(), *sim.merged.values()]
        ]
        out += [
            (
                QuarantineRecord,
                dump_model(
                    QuarantineRecord(
                        format_version=FORMAT_VERSION,
                        id=cid,
                        folder="merged/F-000000000001-0123456789abcdef",
                        reason=why,
                        created_unix=1.5,
                    )
                ),
            )
            for cid, why in sim.quarantined.items()
        ]
    hint = Hint(key="step-000000000001/manifest.json", op="commit", id="0123456789abcdef")
    out.append(
        (LogEntry, dump_model(LogEntry(format_version=FORMAT_VERSION, seq=3, hints=(hint,))))
    )
    seg = Segment(
        format_version=FORMAT_VERSION, records=(("step-000000000001/manifest.json", "{}"),)
    )
    out.append((Segment, dump_model(seg)))
    return out


RECORDS = _records()
MERGED = next(d for c, d in RECORDS if c is CheckpointManifest and b'"state_id"' in d)
TRAINER = next(d for c, d in RECORDS if c is CheckpointManifest and b'"state_id"' not in d)


@contextmanager
def _slow() -> Iterator[None]:
    """load_model as it was: no fast path."""
    fast = manifest_module._load_written
    manifest_module._load_written = lambda cls, data: None  # type: ignore[assignment]
    try:
        yield
    finally:
        manifest_module._load_written = fast


def _outcome(cls: type[BaseModel], data: bytes) -> tuple[str, object]:
    try:
        return "ok", load_model(cls, data, WHERE)
    except CorruptCheckpointError as e:
        return "error", str(e)


def _same_both_ways(cls: type[BaseModel], data: bytes) -> tuple[str, object]:
    fast = _outcome(cls, data)
    with _slow():
        slow = _outcome(cls, data)
    assert fast == slow
    if fast[0] == "error":
        assert WHERE in str(fast[1])  # the damage names its file
    return fast


def test_every_record_a_job_writes_takes_the_fast_path_to_the_same_record() -> None:
    assert len(RECORDS) > 150
    for cls, data in RECORDS:
        fast = manifest_module._load_written(cls, data)
        assert fast is not None, data[:200]
        with _slow():
            assert load_model(cls, data, WHERE) == fast


def _resealed(body: bytes) -> bytes:
    """``body`` (the record's canonical JSON, edited) with its own checksum made right."""
    return with_checksum(body)


def _body(data: bytes) -> bytes:
    cut = data.rfind(b',"self_checksum":"')
    return data[:cut] + b"}"


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b.replace(b'"deck_version":"', b'"deck_version":"\xff'),  # invalid UTF-8
        lambda b: b.replace(b'"deck_version":"', b'"deck_version":"\x01'),  # a control character
        lambda b: b.replace(b'"deck_version":"', b'"deck_version":"\\ud800'),  # lone surrogate
        lambda b: b"\xef\xbb\xbf" + b,  # a byte-order mark
        lambda b: b.replace(b'"created_unix":', b'"created_unix":NaN,"x":'),  # unknown key
        lambda b: b.replace(b'"created_unix":', b'"created_unix":NaN,"created_unix":'),
        lambda b: b.replace(b'"created_unix":', b'"created_unix":Infinity,"created_unix":'),
        lambda b: b.replace(b'"step":', b'"step":1e400,"step":'),
        lambda b: b.replace(b'"step":', b'"step":"7","step":'),
        lambda b: b.replace(
            b'"deck_version":"', b'"deck_version":' + b"[" * 40 + b"]" * 40 + b',"y":"'
        ),
        lambda b: b.replace(b'"epoch":', b'"epoch":' + b"[" * 20 + b"]" * 20 + b',"epoch":'),
        lambda b: b[:-1] + b" }",
        lambda b: b" " + b,
        lambda b: b.replace(b"}", b"", 1),  # cut short
        lambda b: b.replace(b'"world_size":', b'"world_size":0,"world_size":'),
        lambda b: b.replace(b'"self_checksum', b'"self_checksumX'),
        lambda b: b + b"\n",
    ],
)
@pytest.mark.parametrize("which", ["trainer", "merged"])
def test_forged_records_with_a_right_checksum_fare_alike(edit: object, which: str) -> None:
    data = TRAINER if which == "trainer" else MERGED
    body = edit(_body(data))  # type: ignore[operator]
    _same_both_ways(CheckpointManifest, _resealed(body))
    _same_both_ways(CheckpointManifest, body)  # without a checksum at all
    _same_both_ways(CheckpointManifest, _resealed(body) + b" ")  # the checksum not last


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pick=st.integers(0, len(RECORDS) - 1),
    at=st.floats(0, 1),
    how=st.sampled_from(["flip", "cut", "insert", "delete", "reseal-flip", "reseal-insert"]),
    byte=st.integers(0, 255),
)
@example(pick=0, at=0.0, how="insert", byte=13)  # a carriage return before the record
def test_damaged_records_fare_alike(pick: int, at: float, how: str, byte: int) -> None:
    cls, data = RECORDS[pick]
    body = _body(data)
    target = body if how.startswith("reseal") else data
    i = min(int(at * len(target)), len(target) - 1)
    if how.endswith("flip"):
        edited = target[:i] + bytes([target[i] ^ (byte or 1)]) + target[i + 1 :]
    elif how == "cut":
        edited = target[:i]
    elif how.endswith("insert"):
        edited = target[:i] + bytes([byte]) + target[i:]
    else:
        edited = target[:i] + target[i + 1 :]
    if how.startswith("reseal"):
        edited = _resealed(edited)
    kind, got = _same_both_ways(cls, edited)
    if how in ("flip", "insert", "delete") and edited != data:
        # A byte changed behind the checksum's back is found, or changed nothing the record
        # says (JSON whitespace inserted between tokens).
        assert kind == "error" or got == load_model(cls, data, WHERE), edited


def test_a_record_without_its_checksum_or_in_another_layout_is_still_read() -> None:
    d = json.loads(TRAINER)
    for data in (
        json.dumps(d, sort_keys=True, indent=1).encode(),  # an earlier build's layout
        json.dumps({k: v for k, v in d.items() if k != "self_checksum"}).encode(),  # by hand
    ):
        kind, got = _same_both_ways(CheckpointManifest, data)
        assert kind == "ok" and got == load_model(CheckpointManifest, TRAINER, WHERE)
