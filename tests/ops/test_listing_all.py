"""``deck ls --all``'s rows (``list_rows``) from the folders' listings are the rows the listing of
every file gave (the way it was done before: tests keep it here as the reference), on a store
holding every odd thing a folder can hold: pending attempts, damaged and oversized records,
records that are links, FIFOs or folders, folders with nothing but such a record, empty
folders, quarantine records good and bad. A damaged record is a damaged row naming its file,
and ``deck ls --all --json`` prints the rows as ``json.dumps(..., indent=1)`` did."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from deck.cli import main
from deck.format.manifest import MANIFEST, MERGED_ROOT, step_dir
from deck.ops import listing
from deck.ops.listing import Row, list_rows
from deck.read.catalog import get_records, read_manifests
from deck.read.indexed import read_indexed
from deck.read.lineage import LineageGraph, build_graph
from deck.storage import LocalStorage
from deck.storage.base import MAX_RECORD_BYTES
from deck.testing.synth_lineage import LineageSim, writer_checkpoint


def reference_list_rows(storage: LocalStorage) -> tuple[LineageGraph, list[Row]]:
    """``list_rows`` as it was: a listing of every file, the records of the folders it names."""
    keys = storage.list("")
    depth = {True: 2, False: 1}
    folders = {"/".join(k.split("/")[: depth[k.startswith(f"{MERGED_ROOT}/")]]) for k in keys}
    # and the folders whose record is there but no regular file (which the listing leaves out):
    # damage, whatever else the folder holds
    root = Path(storage.root)
    for folder in [*root.glob("step-*"), *root.glob(f"{MERGED_ROOT}/*")]:
        record = folder / MANIFEST
        if record.is_symlink() or (record.exists() and not record.is_file()):
            folders.add(str(folder.relative_to(root)))
    manifests = read_manifests(storage, sorted(set(keys) | {f"{f}/{MANIFEST}" for f in folders}))
    graph = build_graph(manifests, storage.uri)
    rows = [listing._row(n) for n in graph.nodes.values()]
    restorable, left = set(graph.restorable_steps()), graph.abandoned()
    rows = [
        replace(r, state="abandoned" if r.step in left else "broken")
        if not r.merged and r.state == "committed" and r.step not in restorable
        else r
        for r in listing._left_merged_abandoned(graph, rows)
    ]
    rows.extend(listing._unreadable_rows(manifests, keys))
    rows.extend(listing._pending_rows(storage, keys))
    rows.sort(key=listing._row_order)
    return graph, rows


def _timeless(rows: list[Row]) -> list[Row]:
    """(A pending row's time is its parts' age, read at the call.)"""
    return [replace(r, created_unix=None) if r.state == "pending" else r for r in rows]


@pytest.fixture(scope="module")
def files() -> object:
    return writer_checkpoint()


def _store(tmp_path: Path, files: object, *, log: bool = False) -> LocalStorage:
    sim = LineageSim(files=files, seed=5)  # type: ignore[arg-type]
    last = sim.save("full")
    for i in range(30):
        if i == 20:
            sim.rollback(sim.step - 4)
        sim.train()
        last = sim.save("full" if i % 11 == 10 else "delta")
        sim.merge_blocks(last, stride=2, full_every=6, lag=1)
    sim.quarantine(sim.trainer[sim.step - 1].id)
    storage = LocalStorage(str(tmp_path / "uri"))
    sim.write(storage, durable=False)
    if log:  # (a commit log and catalogs, the newest 5 commits before the log's end)
        sim.write_log(storage, 5)
    return storage


def _vandalise(storage: LocalStorage) -> dict[str, str]:
    """Every odd thing, each in a folder of its own; what it did, by folder."""
    root = Path(storage.root)
    steps = sorted(p for p in root.iterdir() if p.name.startswith("step-"))
    merged = sorted((root / MERGED_ROOT).iterdir())
    done: dict[str, str] = {}

    def part_of(step: Path) -> Path:
        return next(p for p in step.rglob("rank-00000.json"))

    # damaged records: garbage, cut short, another step's, too large
    (steps[3] / MANIFEST).write_bytes(b"garbage")
    (steps[4] / MANIFEST).write_bytes((steps[4] / MANIFEST).read_bytes()[:50])
    (steps[5] / MANIFEST).write_bytes((steps[6] / MANIFEST).read_bytes())
    (steps[7] / MANIFEST).write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    # records that are not regular files: with the folder's other files, and alone
    target = steps[8] / MANIFEST
    os.replace(target, root / "elsewhere.json")
    target.symlink_to(root / "elsewhere.json")
    (steps[9] / MANIFEST).unlink()
    os.mkfifo(steps[9] / MANIFEST)
    (steps[10] / MANIFEST).unlink()
    (steps[10] / MANIFEST).mkdir()
    (steps[10] / MANIFEST / "x").write_bytes(b"{}")
    lonely = root / "step-000000009000"
    lonely.mkdir()
    (lonely / MANIFEST).symlink_to(root / "elsewhere.json")
    fifo_alone = root / "step-000000009001"
    fifo_alone.mkdir()
    os.mkfifo(fifo_alone / MANIFEST)
    (root / "step-000000009002").mkdir()  # empty
    (root / "step-000000009003" / "sub").mkdir(parents=True)  # nothing but a folder
    # pending attempts: a step without a record, and a new attempt beside a committed one
    pending = root / "step-000000009004" / "00000000deadbeef"
    pending.mkdir(parents=True)
    (pending / "rank-00000.json").write_bytes(part_of(steps[11]).read_bytes())
    beside = steps[12] / "00000000feedbeef"
    beside.mkdir()
    (beside / "rank-00000.json").write_bytes(part_of(steps[12]).read_bytes())
    # a pending attempt in the folder whose record is a link
    other = steps[8] / "00000000abcdabcd"
    other.mkdir()
    (other / "rank-00000.json").write_bytes(part_of(steps[12]).read_bytes())
    # merger records: garbage, a link (with the folder's files), a link alone, gone
    (merged[0] / MANIFEST).write_bytes(b"[")
    os.replace(merged[1] / MANIFEST, root / "elsewhere-merged.json")
    (merged[1] / MANIFEST).symlink_to(root / "elsewhere-merged.json")
    alone = root / MERGED_ROOT / (merged[2].name[:-16] + "0123456789abcdef")
    alone.mkdir()
    (alone / MANIFEST).symlink_to(root / "elsewhere-merged.json")
    (merged[3] / MANIFEST).unlink()
    (root / MERGED_ROOT / "not-a-merger-folder").mkdir()
    (root / MERGED_ROOT / "not-a-merger-folder" / MANIFEST).write_bytes(b"{}")
    # quarantine records: a good one (the simulator's), garbage, one in a sub-folder
    (root / "quarantine" / "0123456789abcdef.json").write_bytes(b"garbage")
    (root / "quarantine" / "sub").mkdir()
    (root / "quarantine" / "sub" / "fedcba9876543210.json").write_bytes(b"garbage")
    # files at the top that look like folders
    (root / "step-000000009005").write_bytes(b"")
    done["steps"] = ",".join(p.name for p in steps[3:13])
    return done


def test_the_rows_are_those_of_a_listing_of_every_file(tmp_path: Path, files: object) -> None:
    storage = _store(tmp_path, files)
    graph_a, clean = list_rows(storage)
    graph_b, want = reference_list_rows(storage)
    assert clean == want and list(graph_a.nodes) == list(graph_b.nodes)
    _vandalise(storage)
    graph_a, got = list_rows(storage)
    graph_b, want = reference_list_rows(storage)
    assert _timeless(got) == _timeless(want)
    assert list(graph_a.nodes) == list(graph_b.nodes)
    states = {r.state for r in got}
    assert {"damaged", "pending", "quarantined", "committed"} <= states
    damaged = {r.folder: r.problem for r in got if r.state == "damaged"}
    # Each damaged record is reported as such, naming its file
    for folder, problem in damaged.items():
        assert problem is not None and f"{folder}/{MANIFEST}" in problem, (folder, problem)
    # steps 3, 4, 5, 7, 8, 9, a merger folder, and the folders holding a link or a FIFO alone
    assert len(damaged) == 9, damaged


def test_ls_all_json_prints_what_json_dumps_printed(
    tmp_path: Path,
    files: object,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = _store(tmp_path, files)
    _vandalise(storage)
    monkeypatch.setattr("time.time", lambda: 1e9)  # the rows' ages: one clock for both
    assert main(["ls", storage.uri, "--all", "--json"]) == 1  # (damaged records)
    out = capsys.readouterr().out
    _, rows = reference_list_rows(storage)
    assert out == json.dumps([r.to_dict(1e9) for r in rows], indent=1) + "\n"


def test_through_the_catalog_the_rows_are_those_of_a_listing_of_every_file(
    tmp_path: Path, files: object
) -> None:
    """With a catalog ``ls --all`` gives the rows a listing of every file gives: the pending
    attempts, records a catalog left out, odd files."""
    storage = _store(tmp_path, files, log=True)
    assert read_indexed(storage, lambda ks: get_records(storage, ks)) is not None
    _, got = list_rows(storage)
    _, want = reference_list_rows(storage)
    assert got == want
    root = Path(storage.root)
    step = next(p for p in sorted(root.iterdir()) if p.name.startswith("step-"))
    part = next(step.rglob("rank-00000.json")).read_bytes()
    pending = root / "step-000000009004" / "00000000deadbeef"
    pending.mkdir(parents=True)
    (pending / "rank-00000.json").write_bytes(part)
    (root / "step-000000009000").mkdir()
    (root / "step-000000009000" / MANIFEST).symlink_to(step / MANIFEST)
    os.mkfifo(root / "step-000000009001")
    (root / "step-000000009002").mkdir()
    (root / "step-000000009003").mkdir()
    (root / "step-000000009003" / MANIFEST).write_bytes(b"garbage")  # written without the log
    _, got = list_rows(storage)
    _, want = reference_list_rows(storage)
    assert _timeless(got) == _timeless(want)
    assert {"pending", "damaged"} <= {r.state for r in got}


def test_a_record_damaged_behind_the_catalogs_back_is_reported_as_it_is(
    tmp_path: Path, files: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Break-it finding: once a merger pass had written a catalog, a commit record damaged (or
    replaced) behind the commit log's back was shown as the catalog held it: ``ls`` (every
    view), ``show``, ``lineage`` and ``history`` exited 0 calling it committed, while
    ``verify`` and ``export`` refused it. What they report is each record's file."""
    storage = _store(tmp_path, files, log=True)
    assert read_indexed(storage, lambda ks: get_records(storage, ks)) is not None
    step = sorted(read_manifests(storage))[-3]
    record = Path(storage.root) / step_dir(step) / MANIFEST
    record.write_bytes(b"{")
    _, rows = list_rows(storage)
    assert [r.state for r in rows if r.folder == step_dir(step)] == ["damaged"]
    for argv in (["ls"], ["ls", "--all"], ["show", str(step)], ["lineage", "--step", str(step)]):
        capsys.readouterr()
        assert main([argv[0], storage.uri, *argv[1:]]) == 1, argv
        assert str(record) in capsys.readouterr().err, argv
    # Another step's record in its place: show says what the file says
    other = sorted(read_manifests(storage))[-4]
    record.write_bytes((Path(storage.root) / step_dir(other) / MANIFEST).read_bytes())
    assert main(["show", storage.uri, str(step)]) == 1
    assert "not found" not in capsys.readouterr().err
