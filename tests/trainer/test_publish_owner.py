"""Which job a publish URI belongs to (``_job.json``): the decisions of ``claim`` and
``refuse_publish_uri`` on what a URI holds, one store state at a time (the multi-rank flows are
in test_lease.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deck.errors import ConfigError
from deck.format.epochs import witness_body, witness_key
from deck.storage import Storage, open_storage
from deck.trainer.publish_owner import JOB_RECORD, claim, refuse_publish_uri


def _store(tmp_path: Path, name: str = "pub") -> Storage:
    return open_storage(str(tmp_path / name))


def test_a_fresh_uri_is_claimed_and_its_record_says_so(tmp_path: Path) -> None:
    store = _store(tmp_path)
    claim(store, str(tmp_path / "ck"), take_over=False, lease_epoch=1)
    assert f"{tmp_path}/ck" in store.get(JOB_RECORD).decode()
    claim(store, f"file://{tmp_path}/ck", take_over=False, lease_epoch=2)  # its restart
    with pytest.raises(ConfigError, match="another job"):
        claim(store, str(tmp_path / "other"), take_over=False)
    # A publish URI refuses to be a checkpoint URI; a fresh one does not
    with pytest.raises(ConfigError, match=r"is a publish URI .*checkpoints at file://.*/ck\)"):
        refuse_publish_uri(store)
    refuse_publish_uri(_store(tmp_path, "fresh"))


@pytest.mark.parametrize("take_over", [False, True])
def test_a_uri_with_commits_but_no_record_is_a_checkpoint_uri(
    tmp_path: Path, take_over: bool
) -> None:
    """Commits (an epoch witness) and no record: another job's checkpoint URI, never taken
    over (a break-it finding: take_over replaced that job's checkpoints with publishes)."""
    store = _store(tmp_path)
    store.put(witness_key(3), witness_body(3, 10))
    for epoch in (None, 1, 4):
        with pytest.raises(ConfigError, match="holds a trainer's commits but no"):
            claim(store, str(tmp_path / "ck"), take_over=take_over, lease_epoch=epoch)
    assert not store.exists(JOB_RECORD)


def test_earlier_leases_alone_refuse_unless_taken_over(tmp_path: Path) -> None:
    """Leases before this job's and nothing committed: maybe this job's own enable that failed
    before writing its record, so take_over may claim it."""
    store = _store(tmp_path)
    with pytest.raises(ConfigError, match="writer lease records of a trainer before this job"):
        claim(store, str(tmp_path / "ck"), take_over=False, lease_epoch=2)
    assert not store.exists(JOB_RECORD)
    claim(store, str(tmp_path / "ck"), take_over=True, lease_epoch=2)
    assert store.exists(JOB_RECORD)


def test_an_unreadable_record_is_never_taken_for_none(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put(witness_key(1), witness_body(1, 0))  # its job published
    store.put(JOB_RECORD, b"{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        claim(store, str(tmp_path / "ck"), take_over=False)
    with pytest.raises(ConfigError, match=r"is a publish URI .*does not say"):
        refuse_publish_uri(store)
    # Taken over, it is this job's (the commits are that publish URI's)
    claim(store, str(tmp_path / "ck"), take_over=True)
    refuse_publish_uri(_store(tmp_path, "ck"))
    claim(store, str(tmp_path / "ck"), take_over=False)
