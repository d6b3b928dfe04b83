"""What a URI's files hold, however hostile, is decoded into DeckErrors naming the file: no
unbounded recursion, no index outside a table, no allocation of what a forged record claims, no
silent skip (the hostile-storage review's findings 8, 9, 11 and 12).

Real checkpoints in the exact on-disk format (deck/testing/synth.py: 2 ranks, 4 tables, the real
writer; a full at step 0, deltas at 1-3), edited the way a compromised job or a careless
colleague could, with every checksum recomputed so that only the new validation stands between
the edit and the reader. Each case is replayed through the CLI (``python -m deck.cli``: ls,
ls --tree, verify, export, follow --once; a 4 GiB address-space limit makes any allocation of a
forged claim fail loudly) and the library (``deck.list_checkpoints``, restores of every step
through ``apply_chain``, the fallback's ``best_valid_chain``).
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import save as st_save

import deck
from deck.errors import CheckpointNotFoundError, CorruptCheckpointError, DeckError
from deck.format import treecodec
from deck.format.checksum import checksum
from deck.format.jsonio import load_json
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    SELF_CHECKSUM,
    CheckpointManifest,
    Kind,
    RankRef,
    dump_model,
    step_dir,
)
from deck.ops.listing import list_rows, tree_lines
from deck.read.lineage import best_valid_chain
from deck.storage import LocalStorage
from deck.testing.cli_runs import run_at_once
from deck.testing.synth import State, SynthTrainer, restore_step, same

STEPS = [0, 1, 2, 3]
DEEP = 100_000  # levels of a hostile manifest
# Address space of every CLI run: about 5x what an export of these checkpoints peaks at (0.7 GiB
# here), far below any forged claim below (2**31 rows: tens of GiB).
ADDRESS_SPACE = 4 * 2**30
Json = dict[str, Any]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, State]]:
    root = tmp_path_factory.mktemp("pristine") / "ck"
    tr = SynthTrainer(LocalStorage(root))
    tr.save("full")
    for _ in range(3):
        tr.train(rows=40)
        tr.save()
    assert sorted(tr.saved) == STEPS
    return root, {step: s.state for step, s in tr.saved.items()}


# ---- editing records with their checksums recomputed ---------------------------------------


def _seal(d: Json) -> bytes:
    """``d`` as deck writes a record: canonical JSON with its own checksum."""
    d.pop(SELF_CHECKSUM, None)
    body = json.dumps(d, sort_keys=True, separators=(",", ":"))
    d[SELF_CHECKSUM] = xxhash.xxh3_64_hexdigest(body.encode())
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def _commit_path(root: Path, step: int) -> Path:
    return root / step_dir(step) / MANIFEST


def _part_rel(root: Path, step: int, rank: int) -> str:
    commit = json.loads(_commit_path(root, step).read_bytes())
    (ref,) = [r for r in commit["ranks"] if r["rank"] == rank]
    return f"{step_dir(step)}/{ref['path']}"


def _write_part(root: Path, step: int, rank: int, data: bytes) -> str:
    """Replace rank ``rank``'s part manifest of ``step`` and re-seal the commit record."""
    rel = _part_rel(root, step, rank)
    (root / rel).write_bytes(data)
    commit = json.loads(_commit_path(root, step).read_bytes())
    for ref in commit["ranks"]:
        if ref["rank"] == rank:
            ref["nbytes"], ref["checksum"] = len(data), checksum(data)
    _commit_path(root, step).write_bytes(_seal(commit))
    return rel


def _edit_part(root: Path, step: int, rank: int, edit: Callable[[Json], None]) -> str:
    part = json.loads((root / _part_rel(root, step, rank)).read_bytes())
    edit(part)
    return _write_part(root, step, rank, _seal(part))


def _shard(part: Json, table: str) -> Json:
    return next(s for s in part["shards"] if s["table"] == table)


def _edit_ids(root: Path, step: int, rank: int, table: str, edit: Callable[[Any], None]) -> str:
    """Change the ids of the first chunk of ``table`` in that part; recompute its checksum."""
    hit: list[str] = []

    def go(part: Json) -> None:
        chunk = _shard(part, table)["chunks"][0]
        path = root / step_dir(step) / chunk["path"]
        raw = bytearray(path.read_bytes())
        (seg,) = [s for s in chunk["segments"] if s["name"] == "ids"]
        ids = np.frombuffer(raw, dtype=np.int64, count=seg["shape"][0], offset=seg["offset"])
        assert ids.size >= 4, ids  # the cases below edit ids that are neither first nor last
        edit(ids)
        path.write_bytes(bytes(raw))
        chunk["checksum"] = checksum(bytes(raw))
        hit.append(f"{step_dir(step)}/{chunk['path']}")

    _edit_part(root, step, rank, go)
    return hit[0]


def _edit_state_file(root: Path, step: int, rank: int, tree_json: str) -> str:
    """Replace rank ``rank``'s extra state file by a valid safetensors file whose deck tree is
    ``tree_json``; its record is updated (size, checksum)."""
    data = st_save({"t0": torch.zeros(2)}, metadata={"deck_tree": tree_json})
    rel: list[str] = []

    def go(part: Json) -> None:
        extra = part["extra"]
        (root / step_dir(step) / extra["path"]).write_bytes(data)
        extra["nbytes"], extra["checksum"] = len(data), checksum(data)
        rel.append(f"{step_dir(step)}/{extra['path']}")

    _edit_part(root, step, rank, go)
    return rel[0]


def _deep_list(levels: int) -> str:
    return "[" * levels + "]" * levels


# ---- the hostile cases ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    attack: Callable[[Path], str]  # edits the copy; returns the file errors must name
    damaged: int  # the oldest step whose restore must fail (every later one fails too)
    fails: frozenset[str]  # CLI commands that must fail (exit 1 or 2) naming the file
    why: str = ""  # what the restore's error says
    restore_names_file: bool = True  # False: a restore refuses the model's tables first


def _deep_commit(root: Path) -> str:
    _commit_path(root, 3).write_text('{"format_version":' + _deep_list(DEEP) + "}")
    return f"{step_dir(3)}/{MANIFEST}"


def _commit_time(value: float) -> Callable[[Path], str]:
    """Step 3's commit record, re-sealed, says it was made at ``value`` (NaN, 1e308, -1e18: a
    traceback in `deck show`, NaN in `ls --json`, before they were refused as damage)."""

    def attack(root: Path) -> str:
        commit = json.loads(_commit_path(root, 3).read_bytes())
        commit["created_unix"] = value
        _commit_path(root, 3).write_bytes(_seal(commit))
        return f"{step_dir(3)}/{MANIFEST}"

    return attack


def _deep_part(root: Path) -> str:
    return _write_part(root, 2, 0, ('{"shards":' + _deep_list(DEEP) + "}").encode())


def _deep_quarantine(root: Path) -> str:
    (root / "quarantine").mkdir()
    (root / "quarantine" / "0123456789abcdef.json").write_text(_deep_list(DEEP))
    return "quarantine/0123456789abcdef.json"


def _middle_id(value: int) -> Callable[[Path], str]:
    def attack(root: Path) -> str:
        def edit(ids: Any) -> None:
            ids[len(ids) // 2] = value

        return _edit_ids(root, 3, 0, "t0.weight", edit)

    return attack


def _duplicate_ids(root: Path) -> str:
    def edit(ids: Any) -> None:
        ids[2] = ids[1]

    return _edit_ids(root, 3, 0, "t0.weight", edit)


def _unsorted_ids(root: Path) -> str:
    def edit(ids: Any) -> None:
        ids[1], ids[2] = int(ids[2]), int(ids[1])

    return _edit_ids(root, 3, 0, "t0.weight", edit)


def _chunk_record(edit: Callable[[Json], None]) -> Callable[[Path], str]:
    """Edit the record of the first t0 chunk of step 3; errors name the chunk it describes."""

    def attack(root: Path) -> str:
        chunk: list[Json] = []

        def go(part: Json) -> None:
            chunk.append(_shard(part, "t0.weight")["chunks"][0])
            edit(chunk[0])

        _edit_part(root, 3, 0, go)
        return f"{step_dir(3)}/{chunk[0]['path']}"

    return attack


def _overlap(chunk: Json) -> None:
    by_name = {s["name"]: s for s in chunk["segments"]}
    by_name["momentum1"]["offset"] = by_name["weight"]["offset"]


def _lose_state(chunk: Json) -> None:
    for s in chunk["segments"]:
        if s["name"] == "momentum1":
            s["name"] = "momentum2"


def _narrow_weight(root: Path) -> str:
    """The first t0 chunk of step 3 says its weight has half the shard's columns (its bytes
    halved, so the layout fits the file): a reader took the first half of each row as the row."""

    def edit(part: Json) -> None:
        (weight,) = [
            s for s in _shard(part, "t0.weight")["chunks"][0]["segments"] if s["name"] == "weight"
        ]
        rows, cols = weight["shape"]
        weight["shape"], weight["nbytes"] = [rows, cols // 2], weight["nbytes"] // 2

    return _edit_part(root, 3, 0, edit)


def _shard_record(table: str, edit: Callable[[Json], None], rank: int = 1) -> Callable[[Path], str]:
    def attack(root: Path) -> str:
        return _edit_part(root, 3, rank, lambda p: edit(_shard(p, table)))

    return attack


def _set(**values: Any) -> Callable[[Json], None]:
    return lambda rec: rec.update(values)


def _claim_rows(root: Path) -> str:
    """t1 (rank 1's only table) claims 2**31 rows in the full and at step 3, consistently: the
    full's chunk says it holds them in 2**40 bytes; the file holds 4 KiB, and its weight
    segment the rows it held. Errors name the full's rank manifest, whose chunk record
    contradicts itself (before that check, the chunk, whose size contradicts its record)."""
    big = 2**31

    def full(rec: Json) -> None:
        rec.update(num_rows=big, rows=big)
        rec["chunks"][0].update(rows=big - sum(c["rows"] for c in rec["chunks"][1:]), nbytes=2**40)

    _edit_part(root, 0, 1, lambda p: full(_shard(p, "t1.weight")))
    _edit_part(root, 3, 1, lambda p: _shard(p, "t1.weight").update(num_rows=big, rows=big))
    return _part_rel(root, 0, 1)


ALL = frozenset({"verify", "export", "follow"})
CASES: dict[str, Case] = {
    # Finding 8: JSON and state trees nested without bound.
    # A damaged commit record is damage to every command that meets it (exit 1): ls lists it
    # as damaged, export refuses to pass it by for an older step; follow serves the step
    # before it and says why it may not be the newest.
    "deep-commit-record": Case(
        _deep_commit, 3, frozenset({"verify", "ls", "tree", "export", "follow"}), "nests deeper"
    ),
    "deep-rank-manifest": Case(_deep_part, 2, ALL, "nests deeper"),
    **{
        f"commit-time-{v}": Case(
            _commit_time(v), 3, frozenset({"verify", "ls", "tree", "export", "follow"}), "created"
        )
        for v in (float("nan"), 1e308, -1e18)
    },
    "deep-quarantine-record": Case(_deep_quarantine, 4, frozenset()),
    "state-tree-800-deep": Case(
        lambda r: _edit_state_file(r, 3, 0, _deep_list(800)), 3, ALL, "nests deeper"
    ),
    "state-tree-100000-deep": Case(
        lambda r: _edit_state_file(r, 3, 0, _deep_list(DEEP)), 3, ALL, "nests deeper"
    ),
    "state-tree-root-is-a-list": Case(
        lambda r: _edit_state_file(r, 3, 0, '[{"__tensor__": "t0"}]'), 3, ALL, "not a dict"
    ),
    "state-entries-of-other-types": Case(
        lambda r: _edit_state_file(r, 3, 0, '{"user": 1, "scalars": [1]}'), 3, ALL, "types"
    ),
    # Finding 9: chunk contents that contradict their shard's record.
    "middle-id-outside-the-table": Case(_middle_id(10**9), 3, ALL, "strictly ascending"),
    "middle-id-negative": Case(_middle_id(-5), 3, ALL, "strictly ascending"),
    "duplicate-ids": Case(_duplicate_ids, 3, ALL, "strictly ascending"),
    "unsorted-ids": Case(_unsorted_ids, 3, ALL, "strictly ascending"),
    "overlapping-segments": Case(_chunk_record(_overlap), 3, ALL, "overlaps"),
    "state-without-a-segment": Case(_chunk_record(_lose_state), 3, ALL, "no segment"),
    "weight-of-half-the-columns": Case(_narrow_weight, 3, ALL, "of the shard's 4 columns"),
    "row-offset-past-the-table": Case(
        _shard_record("t0.weight", _set(row_offset=300)), 3, ALL, "outside the"
    ),
    "full-shard-missing-rows": Case(
        lambda r: _edit_part(r, 0, 1, lambda p: _shard(p, "t1.weight").update(rows=299)),
        0,
        ALL,
        "chunks hold",
    ),
    # Finding 12: table names a restore would silently skip.
    "table-named-dot-dot": Case(
        _shard_record("t1.weight", _set(table="../../x")), 3, ALL, "invalid table name"
    ),
    # (verify finds these too, as restore does: a break-it finding saw it pass them)
    "table-not-in-the-chain": Case(
        _shard_record("t1.weight", _set(table="t9.weight")), 3, ALL, "not one of the tables"
    ),
    # Finding 11: claims larger than the files (2**31 rows x 4 columns: 40 GiB with momentum).
    "claims-2**31-rows": Case(
        _shard_record("t1.weight", _set(num_rows=2**31, rows=2**31)), 3, ALL, "not one of"
    ),
    "claims-2**31-rows-consistently": Case(_claim_rows, 0, ALL, "rows of the shard's"),
}


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _decks(calls: dict[str, tuple[str, ...]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Independent read-only ``deck`` runs at once, by name (one after another, their torch
    imports were most of this file's time)."""
    argvs = {name: (sys.executable, "-m", "deck.cli", *args) for name, args in calls.items()}
    return run_at_once(argvs, preexec_fn=_limit)


def _deck(*args: str) -> subprocess.CompletedProcess[str]:
    return _decks({"": args})[""]


def _replay_cli(root: Path, out: Path, named: str, fails: frozenset[str]) -> None:
    uri = str(root)
    runs = _decks(
        {
            "ls": ("ls", uri),
            "tree": ("ls", uri, "--tree"),
            "verify": ("verify", uri, "--all"),
            "export": ("export", uri, "--out", str(out / "exp"), "--format", "safetensors"),
            "follow": ("follow", uri, "--out", str(out / "follow"), "--once"),
        }
    )
    for cmd, r in runs.items():
        said = r.stdout + r.stderr
        assert "Traceback" not in said and r.returncode in (0, 1, 2), (cmd, said[-3000:])
        if cmd in fails:
            assert r.returncode in (1, 2) and named in said, (cmd, r.returncode, said[-3000:])
        else:
            assert r.returncode == 0, (cmd, said[-3000:])


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_content_is_a_deck_error_naming_the_file(
    name: str, pristine: tuple[Path, dict[int, State]], tmp_path: Path
) -> None:
    source, saved = pristine
    root = tmp_path / "ck"
    shutil.copytree(source, root)
    case = CASES[name]
    named = case.attack(root)
    storage = LocalStorage(root)

    # The library: listing never fails; steps before the damage restore bitwise, the damaged
    # ones raise a DeckError naming the file.
    listed = [c.step for c in deck.list_checkpoints(str(root))]
    assert set(listed) >= {s for s in STEPS if s < case.damaged}, listed
    for step in STEPS:
        if step < case.damaged:
            state, user = restore_step(storage, step)
            assert not same(state, saved[step]) and user == step, (name, step)
            continue
        with pytest.raises(DeckError) as info:
            restore_step(storage, step)
        said = str(info.value)
        assert case.why in said, (step, said)
        assert named in said or step not in listed or not case.restore_names_file, (step, said)
    # restore(allow_fallback=True) goes around what verify rejects: the damaged step has no
    # valid chain, the step before it does (nothing is quarantined here).
    if 0 < case.damaged < 4 and case.damaged in listed and "verify" in case.fails:
        with pytest.raises(CheckpointNotFoundError, match=re.escape(named.rsplit("/", 1)[-1])):
            best_valid_chain(storage, case.damaged, record=False)
        assert best_valid_chain(storage, case.damaged - 1, record=False).chain

    _replay_cli(root, tmp_path, named, case.fails)


def test_a_chain_of_3000_deltas_lists_as_a_tree(tmp_path: Path) -> None:
    """``deck ls --tree`` walks the lineage without recursion: a full and 3,000 chained deltas
    (commit records only: listing reads nothing else) give 3,001 lines, each delta one level
    below its parent."""
    root = tmp_path / "ck"
    parent: tuple[int, str] | None = None
    for step in range(3001):
        ckpt_id = f"{step + 1:016x}"
        ref = RankRef(
            rank=0, path=f"{ckpt_id}/rank-00000.json", nbytes=1, checksum="0", data_bytes=1
        )
        m = CheckpointManifest(
            format_version=FORMAT_VERSION,
            id=ckpt_id,
            step=step,
            kind=Kind.FULL if parent is None else Kind.DELTA,
            parent=None if parent is None else parent[0],
            parent_id=None if parent is None else parent[1],
            base=0,
            epoch=0,
            world_size=1,
            ranks=(ref,),
            created_unix=0.0,
            deck_version="test",
        )
        (root / step_dir(step)).mkdir(parents=True)
        (root / step_dir(step) / MANIFEST).write_bytes(dump_model(m))
        parent = (step, ckpt_id)
    graph, rows = list_rows(LocalStorage(root))
    lines = tree_lines(graph, rows, lambda r: r.folder)
    assert len(lines) == 3001 and lines[0] == step_dir(0)
    assert lines[3000] == "   " * 2999 + "`- " + step_dir(3000)
    r = _deck("ls", str(root), "--tree", "--all")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stdout.splitlines()) == 3001


def test_json_records_are_decoded_with_a_depth_limit() -> None:
    """One decoder for every record: deep nesting, bad UTF-8 and invalid JSON are
    CorruptCheckpointError naming the file; records of normal depth decode."""
    for bad in (_deep_list(DEEP), "[" * DEEP, '{"a":' * 40 + "1" + "}" * 40, b"\xff", "{"):
        with pytest.raises(CorruptCheckpointError, match=r"some/file\.json"):
            load_json(bad, "some/file.json")
    assert load_json('{"a": [[1]]}', "f") == {"a": [[1]]}


def test_state_trees_have_a_depth_limit_on_both_sides() -> None:
    """The writer refuses a state deeper than a restore accepts (it could not be restored);
    one at the limit round-trips."""
    limit = treecodec.MAX_TREE_DEPTH
    nested: Any = 1
    for _ in range(limit):
        nested = [nested]
    assert treecodec.decode(treecodec.encode(nested, "user state"), "f") == nested
    with pytest.raises(DeckError, match="deeper than deck stores"):
        treecodec.encode([nested], "user state")
    deep: Any = 1
    for _ in range(5000):  # past Python's recursion limit: refused, not a RecursionError
        deep = {"k": deep}
    with pytest.raises(DeckError, match="deeper than deck stores"):
        treecodec.encode(deep, "user state")
    with pytest.raises(CorruptCheckpointError, match=r"f\.safetensors: state tree is a list"):
        treecodec.decode(treecodec.encode([1], "user state"), "f.safetensors", expect=dict)
