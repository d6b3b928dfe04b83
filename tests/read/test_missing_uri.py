"""``deck.list_checkpoints`` / ``deck.lineage_graph`` of a URI that does not exist raise
CheckpointNotFoundError naming it, as ``deck ls`` / ``deck lineage`` exit 2 for it; a URI that
exists but holds nothing is an empty list / graph."""

from __future__ import annotations

from pathlib import Path

import pytest

import deck
from deck.storage import open_storage


@pytest.mark.parametrize("api", [deck.list_checkpoints, deck.lineage_graph])
def test_a_missing_uri_is_not_an_empty_run(api: object, tmp_path: Path) -> None:
    typo = tmp_path / "typo" / "run1"
    with pytest.raises(deck.CheckpointNotFoundError, match=rf"URI {typo} does not exist"):
        api(str(typo))  # type: ignore[operator]
    with pytest.raises(deck.CheckpointNotFoundError, match="does not exist"):
        api(typo)  # type: ignore[operator]  # a pathlib.Path
    with pytest.raises(deck.CheckpointNotFoundError, match="does not exist"):
        api(open_storage(str(typo)))  # type: ignore[operator]  # an open Storage
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(deck.CheckpointNotFoundError, match="is not a directory"):
        api(str(a_file))  # type: ignore[operator]
    remote = "memory://deck-test-missing-uri/run1"
    with pytest.raises(deck.CheckpointNotFoundError, match=rf"{remote} does not exist.*prefix"):
        api(remote)  # type: ignore[operator]
    (tmp_path / "empty").mkdir()
    found = api(str(tmp_path / "empty"))  # type: ignore[operator]
    assert found == [] if api is deck.list_checkpoints else not found.nodes
