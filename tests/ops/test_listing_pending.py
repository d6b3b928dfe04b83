"""``deck ls``'s row of a pending checkpoint (rank parts, no commit record) whose parts cannot
be read yet (a part being written): its job's size is not known, and the row says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from deck.cli import main
from deck.ops.listing import list_rows
from deck.storage import LocalStorage
from deck.testing.synth_lineage import LineageSim


def test_a_pending_attempt_whose_part_is_being_written_shows_an_unknown_world_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = LineageSim(world_size=2, seed=3)
    sim.save("full")
    sim.train()
    sim.save("delta")
    storage = LocalStorage(str(tmp_path / "uri"))
    sim.write(storage, durable=False)
    (part,) = [k for k in storage.list("step-000000000000/") if k.endswith("rank-00000.json")]
    # rank 1's part of an attempt at step 9, half written (a store whose puts are not atomic)
    data = storage.get(part)
    storage.put("step-000000000009/00000000deadbeef/rank-00001.json", data[: len(data) // 2])
    _, rows = list_rows(storage)
    (row,) = [r for r in rows if r.state == "pending"]
    assert (row.step, row.ranks, row.world_size) == (9, 1, 0)
    assert row.ranks_text == "1/?"
    assert row.problem is not None and "rank-00001.json not readable" in row.problem
    assert main(["ls", storage.uri]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "pending" in ln and "deadbeef" in ln]
    assert " 1/? " in line and "1/0" not in line and "not readable" in line, line
