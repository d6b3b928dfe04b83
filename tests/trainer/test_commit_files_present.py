"""A trainer's commit checks its files right before its commit record.

Between the rank parts and ``manifest.json`` something else may delete in the step's folder: a
GC run with a grace period shorter than the save takes an uncommitted attempt for abandoned (a
re-save after a rollback, with ``--grace 0`` while the trainer runs). Rank 0 lists the step's
folder right before the record: a file gone means no commit (``CheckpointError`` naming the
file; the stager fails the part and the next checkpoint is a full). Real files on a local store;
the deletion lands where a racing deleter's would, after the parts were written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deck.errors import CheckpointError
from deck.format.manifest import MANIFEST, step_dir
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph
from deck.storage import LocalStorage
from deck.testing.synth import SynthTrainer


class _DeletesAChunk(LocalStorage):
    """A local store that deletes the first chunk file of a part right after that part's
    manifest is written (once, when armed)."""

    armed = False

    def put(self, key: str, data: Any) -> None:
        super().put(key, data)
        if self.armed and "/rank-" in key and key.endswith(".json"):
            folder = key.rsplit("/", 1)[0]
            chunk = next(k for k in sorted(self.list(folder + "/")) if not k.endswith(".json"))
            self.armed = False
            self.delete(chunk)


def test_a_part_whose_file_went_is_not_committed(tmp_path: Path) -> None:
    storage = _DeletesAChunk(tmp_path)
    tr = SynthTrainer(storage, world_size=2)
    tr.save("full")
    tr.train()
    storage.armed = True
    with pytest.raises(CheckpointError, match=r"step 1 is not committed: .* is missing"):
        tr.save()
    assert not storage.exists(f"{step_dir(1)}/{MANIFEST}")
    # Nothing unrestorable is committed; the next checkpoint (a full) commits.
    assert build_graph(read_manifests(storage)).restorable_steps() == [0]
    tr.train()
    tr.parent = None
    tr.save("full")
    assert build_graph(read_manifests(storage)).restorable_steps() == [0, 2]
